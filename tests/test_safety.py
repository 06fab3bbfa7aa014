"""Constructs that would train silently wrong after the rewrite (issue 14): each is
either converted (a fixture with an execution test covers it) or refused with its
code, on the line that causes it, the file untouched."""
from __future__ import annotations

import json
import textwrap

import pytest

from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.pipeline import rewrite_source

HEAD = '''\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


'''


def _script(body: str) -> str:
    return HEAD + textwrap.dedent(body)


def _refusals(source: str):
    result = rewrite_source(source.encode(), "train.py")
    return [(r.code, r.line) for r in result.refusals], result


def _line_of(source: str, fragment: str) -> int:
    return next(n for n, line in enumerate(source.splitlines(), 1) if fragment in line)


LOOP = '''\
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 4)), batch_size=4)
    for x, y in loader:
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save(model.state_dict(), "out.pt")
'''


# --- item 2: structural changes after the build --------------------------------




def test_a_model_rebound_to_a_module_wrapper_shards_the_wrapper():
    """`model = Scaled(model)`, Scaled an nn.Module, before the optimizer: the wrapper is what the
    optimizer trains and what fully_shard sees, as for `model = Scaled(Net())` (was refused FSR620;
    fixtures/rewrite/module_wrapper_rebound runs it)."""
    source = _script('''\
    class Scaled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.inner(x) * self.scale


    def main():
        model = Net()
        model = Scaled(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ''' + LOOP)
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    assert code.index("model = Scaled(model)") < code.index("fully_shard(model") < code.index("optimizer = ")


def test_a_model_rebound_to_a_wrapper_that_is_no_module_is_refused(tmp_path, monkeypatch):
    source = _script('''\
    class Scaled:
        def __init__(self, inner):
            self.inner = inner

        def parameters(self):
            return self.inner.parameters()

        def state_dict(self):
            return self.inner.state_dict()

        def __call__(self, x):
            return self.inner(x) * 2


    def main():
        model = Net()
        model = Scaled(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ''' + LOOP)
    found, _ = _refusals(source)
    assert found[:1] == [("FSR620", _line_of(source, "model = Scaled(model)"))]
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "train.py"
    path.write_text(source)
    result = CliRunner().invoke(cli.main, ["rewrite", str(path)])
    assert result.exit_code == 2
    line = _line_of(source, "model = Scaled(model)")
    assert result.stderr.splitlines()[0].startswith(f"{path}:{line}: FSR620 ")
    assert "is not an nn.Module" in result.stderr.splitlines()[0]
    assert path.read_text() == source


def test_torch_compile_after_the_build_is_not_a_wrapper():
    source = _script('''\
    def main():
        model = Net()
        model = torch.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ''' + LOOP)
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    assert code.index("fully_shard(model") < code.index("model = torch.compile(model)")


def test_a_new_head_goes_before_fully_shard_but_a_checkpoint_load_after_it():
    source = _script('''\
    def main():
        model = Net()
        model.fc = nn.Linear(4, 4)
        model.load_state_dict(torch.load("init.pt"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ''' + LOOP)
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    # the resume stage loads the file into the sharded model (broadcast from rank 0)
    assert code.index("model.fc = nn.Linear(4, 4)") < code.index("fully_shard(model") < code.index(
        "set_model_state_dict(model")


def test_a_wrapper_with_its_own_name_is_converted():
    source = _script('''\
    class Scaled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 2


    def main():
        model = Net()
        wrapped = Scaled(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ''' + LOOP)
    found, _ = _refusals(source)
    assert found == []


# --- item 4: data not split across ranks ----------------------------------------

TRAIN = '''\
    for x, y in {loader}:
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save(model.state_dict(), "out.pt")
'''
BUILD = '''\
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 4))
'''


def _main(lines: str, loader: str = "loader", before: str = "") -> str:
    return _script(before + "def main():\n" + BUILD + textwrap.indent(textwrap.dedent(lines), "    ")
                   + TRAIN.format(loader=loader))


def test_a_subset_sampler_on_a_training_loader_is_refused():
    source = _main('''\
    from torch.utils.data import SubsetRandomSampler
    loader = DataLoader(data, batch_size=4, sampler=SubsetRandomSampler(range(4)))
    ''')
    assert _refusals(source)[0][:1] == [("FSR901", _line_of(source, "SubsetRandomSampler(range"))]


def test_a_batch_sampler_on_a_training_loader_is_refused():
    source = _main('''\
    loader = DataLoader(data, batch_sampler=my_batches)
    ''')
    assert _refusals(source)[0][:1] == [("FSR901", _line_of(source, "batch_sampler="))]


def test_a_sampler_bound_to_a_name_becomes_a_distributed_sampler():
    source = _main('''\
    from torch.utils.data import SequentialSampler
    order = SequentialSampler(data)
    loader = DataLoader(data, batch_size=4, sampler=order)
    ''')
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    assert "order = DistributedSampler(data, shuffle=False)" in code
    assert "loader = DataLoader(data, batch_size=4, sampler=order)" in code


def test_a_sampler_drawing_with_replacement_draws_per_rank():
    """minGPT's `RandomSampler(data, replacement=True, num_samples=N)`: no DistributedSampler
    draws with replacement; each rank draws its share of N from a generator of its own, and
    the report says the run cannot match the single one (differs)."""
    source = _main('''\
    from torch.utils.data import RandomSampler
    loader = DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True, num_samples=1000))
    ''')
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    assert ("    rank_samples = len(range(dist.get_rank(), 1000, dist.get_world_size()))\n"
            "    rank_generator = torch.Generator().manual_seed(torch.initial_seed() + dist.get_rank())\n"
            "    loader = DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True, "
            "num_samples=rank_samples, generator=rank_generator))\n") in code
    assert "DistributedSampler(" not in code and "set_epoch" not in code
    flagged = [a for a in result.attention if a.differs and "draws with replacement" in a.what]
    assert [a.line for a in flagged] == [_line_of(source, "RandomSampler(data")]
    assert "number of samples per epoch (1000, summed over the ranks)" in flagged[0].why
    again = rewrite_source(code.encode(), "train.py")
    assert again.code == result.code and not again.refusals


def test_a_bound_sampler_with_replacement_draws_len_data_per_rank_by_default():
    source = _main('''\
    from torch.utils.data import RandomSampler
    draws = RandomSampler(data, True)
    loader = DataLoader(data, batch_size=4, sampler=draws)
    ''')
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    assert "rank_samples = len(range(dist.get_rank(), len(data), dist.get_world_size()))" in code
    assert "draws = RandomSampler(data, replacement=True, num_samples=rank_samples, generator=rank_generator)" in code


def test_the_per_rank_shares_add_up_and_the_ranks_draw_apart():
    """What the rewrite writes, run for ranks 0..2 of 3 (a stand-in for torch.distributed):
    the shares add up to N, and the ranks' generators draw different samples."""
    torch = pytest.importorskip("torch")
    draws = []
    for rank in range(3):
        dist = type("Dist", (), {"get_rank": staticmethod(lambda r=rank: r), "get_world_size": staticmethod(lambda: 3)})
        scope = {"dist": dist, "torch": torch}
        torch.manual_seed(0)  # every rank seeded alike, as the script does
        exec("rank_samples = len(range(dist.get_rank(), 1000, dist.get_world_size()))\n"
             "rank_generator = torch.Generator().manual_seed(torch.initial_seed() + dist.get_rank())\n"
             "sampler = torch.utils.data.RandomSampler(range(50), replacement=True, num_samples=rank_samples, "
             "generator=rank_generator)\n", scope)
        draws.append(list(scope["sampler"]))
    assert [len(d) for d in draws] == [334, 333, 333]
    assert draws[0] != draws[1] != draws[2] and draws[0] != draws[2]


def test_a_sampler_with_replacement_and_its_own_generator_is_refused():
    source = _main('''\
    from torch.utils.data import RandomSampler
    loader = DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True, generator=g))
    ''')
    assert _refusals(source)[0][:1] == [("FSR901", _line_of(source, "RandomSampler(data"))]


def test_a_loader_already_distributed_is_left_alone():
    source = _main('''\
    from torch.utils.data.distributed import DistributedSampler
    order = DistributedSampler(data)
    loader = DataLoader(data, batch_size=4, sampler=order)
    ''')
    found, result = _refusals(source)
    assert found == []
    assert result.code.decode().count("DistributedSampler(") == 1


def test_a_loader_built_inline_in_the_training_for_is_refused():
    source = _main("", loader="DataLoader(data, batch_size=4)")
    assert _refusals(source)[0][:1] == [("FSR902", _line_of(source, "in DataLoader(data"))]


def test_a_loader_returned_by_a_helper_is_followed_by_value():
    """The caller's `loader` is the helper's `dl` (was FSR902: the names differ)."""
    helper = '''\
def make_loader(data):
    dl = DataLoader(data, batch_size=4, shuffle=True)
    return dl


'''
    source = _main("loader = make_loader(data)\n", before=helper)
    found, result = _refusals(source)
    assert found == []
    assert "    dl = DataLoader(data, batch_size=4, sampler=sampler)\n" in result.code.decode()


def test_a_loader_returned_directly_by_a_helper_is_named_and_followed():
    """`return DataLoader(...)` is bound to a name first (stage returns), then followed (was FSR902)."""
    helper = '''\
def make_loader(data):
    return DataLoader(data, batch_size=4, shuffle=True)


'''
    source = _main("loader = make_loader(data)\n", before=helper)
    found, result = _refusals(source)
    assert found == []
    out = result.code.decode()
    assert "    loader = DataLoader(data, batch_size=4, sampler=sampler)\n    return loader\n" in out


def test_a_loader_stored_on_an_attribute_is_refused():
    source = _main('''\
    import types
    holder = types.SimpleNamespace()
    holder.loader = DataLoader(data, batch_size=4, shuffle=True)
    ''', loader="holder.loader")
    assert _refusals(source)[0][:1] == [("FSR902", _line_of(source, "holder.loader = DataLoader"))]


def test_an_unfollowed_loader_beside_a_training_loader_is_reported_not_called_evaluation():
    source = _main('''\
    loader = DataLoader(data, batch_size=4, shuffle=True)
    checks = [b for b in DataLoader(data, batch_size=8)]
    ''')
    found, result = _refusals(source)
    assert found == []
    notes = [a.what for a in result.attention]
    assert any("not followed" in n for n in notes), notes
    assert not any("evaluation" in n for n in notes)


# --- item 8: names bound only on rank 0 ---------------------------------------------

RANK_ZERO = '''\
import os

import torch
import torch.nn as nn


def main():
    rank = int(os.environ.get("RANK", 0))
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
{gate}
    for step in range(3):
        loss = model(torch.randn(2, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(run_dir, "model.pt"))


if __name__ == "__main__":
    main()
'''


def test_a_name_bound_only_under_a_rank_gate_with_an_else_is_broadcast_after_the_if_else():
    """The `else` binds nothing: rank 0's value goes to every rank after the whole if/else (was FSR704)."""
    source = RANK_ZERO.format(gate='''\
    if rank == 0:
        run_dir = "runs/a"
    else:
        print("waiting")''')
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    assert code.index('print("waiting")') < code.index("run_dir_shared = [run_dir] if rank == 0 else [None]")


def test_a_name_the_other_ranks_bind_and_read_themselves_is_refused_saying_where():
    """`else: run_dir = None`, and the other ranks read their None (`if run_dir is None:`): rank 0's value
    would change what they do there; refused at the `if`, naming both lines (was converted into a save
    each rank pointed at a path of its own)."""
    source = RANK_ZERO.format(gate='''\
    if rank == 0:
        run_dir = "runs/a"
    else:
        run_dir = None
    if run_dir is None:
        print("not saving here")''')
    found, result = _refusals(source)
    assert found[:1] == [("FSR704", _line_of(source, "if rank == 0:"))]
    why = result.refusals[0].why
    assert (f"the other ranks bind it to a value of their own (line {_line_of(source, 'run_dir = None')}) and read "
            f"that value on line {_line_of(source, 'if run_dir is None:')}") in why


def test_a_name_bound_only_on_rank_zero_is_broadcast_outside_the_gate():
    source = RANK_ZERO.format(gate='''\
    if rank == 0:
        run_dir = "runs/a"''')
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    lines = code.splitlines()
    broadcast = next(i for i, line in enumerate(lines) if "broadcast_object_list(run_dir_shared" in line)
    assert lines[broadcast].startswith("    dist.")  # the function's own block: every rank runs it
    assert lines[broadcast - 1] == "    run_dir_shared = [run_dir] if rank == 0 else [None]"
    assert lines[broadcast + 1] == "    run_dir = run_dir_shared[0]"
    assert code.index("init_process_group") < code.index("broadcast_object_list")
    assert rewrite_source(result.code, "train.py").changes == []  # a second rewrite adds nothing


# --- item 6: optimizers that cannot work on DTensor shards ------------------------------


def test_lbfgs_is_refused():
    source = _main("loader = DataLoader(data, batch_size=4)\n").replace(
        "torch.optim.SGD(model.parameters(), lr=0.1)", "torch.optim.LBFGS(model.parameters())")
    assert _refusals(source)[0][:1] == [("FSR621", _line_of(source, "torch.optim.LBFGS("))]


def test_a_forward_after_a_gradient_penalty_is_refused_at_the_forward():
    """The model the penalty differentiates runs again before the next backward (tests/test_penalties.py)."""
    source = _main('''\
    x = torch.randn(8, 4, requires_grad=True)
    (penalty,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    loader = DataLoader(data, batch_size=4)
    ''')
    assert _refusals(source)[0][:1] == [("FSR624", _line_of(source, "loss = ((model(x)"))]
    plain = source.replace("create_graph=True", "create_graph=False")
    assert [c for c, _ in _refusals(plain)[0]] == []


MUON = '''\
class Orthogonal(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                x = p.grad / (p.grad.norm() + 1e-7)
                for _ in range(5):
                    x = 1.5 * x - 0.5 * x @ x.mT @ x
                p.add_(x, alpha=-group["lr"])


'''


def test_an_optimizer_class_that_multiplies_whole_matrices_is_refused_on_its_line():
    source = _main("loader = DataLoader(data, batch_size=4)\n", before=MUON).replace(
        "torch.optim.SGD(model.parameters(), lr=0.1)", "Orthogonal(model.parameters())")
    assert _refusals(source)[0][:1] == [("FSR622", _line_of(source, "x = 1.5 * x - 0.5 * x @ x.mT @ x"))]


def test_an_element_wise_optimizer_class_is_followed():
    source = _main("loader = DataLoader(data, batch_size=4)\n", before=MUON.replace(
        "                for _ in range(5):\n                    x = 1.5 * x - 0.5 * x @ x.mT @ x\n", "")).replace(
        "torch.optim.SGD(model.parameters(), lr=0.1)", "Orthogonal(model.parameters())")
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    assert code.index("fully_shard(model") < code.index("optimizer = Orthogonal(")


# --- item 5: tensors built from parameters outside forward ------------------------------

RNN = '''\
import torch
import torch.nn as nn


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.cells = nn.ModuleList([nn.GRUCell(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 2)

    def init_hidden(self, batch):
        return [next(self.parameters()).new_zeros(batch, 4) for _ in self.cells]

    def forward(self, x, hidden):
        for i, cell in enumerate(self.cells):
            hidden[i] = x = cell(x, hidden[i])
        return self.head(x)


def main():
    model = Stack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(2, 4)
        loss = model(x, model.init_hidden(2)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
'''


def test_a_method_reading_a_block_unit_parameter_outside_forward_is_refused():
    assert _refusals(RNN)[0][:1] == [("FSR623", _line_of(RNN, "next(self.parameters()).new_zeros"))]


@pytest.mark.parametrize("attr", ["device", "dtype"])
def test_a_method_reading_only_the_device_of_a_block_unit_parameter_is_not_refused(attr):
    """`next(self.parameters()).device` (llm.c's LLaMA.generate): a DTensor shard has the
    parameter's device and dtype, so nothing sharded leaks out of it (was FSR623); the method
    reads no parameter's values, so it needs no registration either."""
    source = RNN.replace("next(self.parameters()).new_zeros(batch, 4)",
                         f"torch.zeros(batch, 4, {attr}=next(self.parameters()).{attr})")
    found, result = _refusals(source)
    assert found == []
    assert "register_fsdp_forward_method" not in result.code.decode()


def test_a_method_reading_a_root_parameter_outside_forward_is_registered():
    source = RNN.replace("next(self.parameters())", "self.head.weight")
    found, result = _refusals(source)
    assert found == []
    assert 'register_fsdp_forward_method(model, "init_hidden")' in result.code.decode()


# --- a module shared by two sharded models --------------------------------------------

SHARED = '''\
class Encoder(nn.Module):
    def __init__(self, shared_block, width=4):
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.shared = shared_block

    def forward(self, x):
        return self.shared(self.inp(x))


def main():
    shared = nn.Linear(4, 4)
    enc_a = Encoder(shared)
    enc_b = Encoder(shared_block=shared)
    optimizer = torch.optim.SGD([*enc_a.parameters(), *enc_b.parameters()], lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 4)), batch_size=4)
    for x, y in loader:
        loss = ((enc_a(x) - y) ** 2).mean() + ((enc_b(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
'''


def test_a_module_shared_by_two_sharded_models_is_refused(tmp_path, monkeypatch):
    # fully_shard(enc_a) shards `shared`; enc_b's broadcast and fully_shard would then meet
    # DTensors (the UNIT GAN's shared encoder layers crashed at that broadcast)
    source = _script(SHARED)
    found, _ = _refusals(source)
    line = _line_of(source, "enc_b = Encoder(shared_block=shared)")
    assert found[:1] == [("FSR626", line)]
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "train.py"
    path.write_text(source)
    result = CliRunner().invoke(cli.main, ["rewrite", str(path)])
    assert result.exit_code == 2 and path.read_text() == source
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"{path}:{line}: FSR626 ") and "`shared`" in first and "`enc_a`" in first


def test_a_model_handed_to_another_sharded_model_is_refused():
    source = _script(SHARED.replace("enc_b = Encoder(shared_block=shared)", "enc_b = Encoder(shared_block=enc_a)"))
    assert _refusals(source)[0][:1] == [("FSR626", _line_of(source, "enc_b = Encoder(shared_block=enc_a)"))]


def test_separate_modules_and_shared_plain_values_are_not_refused():
    # each model gets its own block; a plain value (a width) handed to both is not a module
    source = _script(SHARED.replace("    shared = nn.Linear(4, 4)\n", "    width = 4\n")
                     .replace("Encoder(shared)", "Encoder(nn.Linear(4, 4), width)")
                     .replace("Encoder(shared_block=shared)", "Encoder(shared_block=nn.Linear(4, 4), width=width)"))
    found, result = _refusals(source)
    assert found == []
    code = result.code.decode()
    assert code.index("fully_shard(enc_a") < code.index("fully_shard(enc_b")


def test_an_image_optimised_through_a_transform_pipeline_has_no_model():
    # neural style transfer: the optimizer trains an image tensor made by a torchvision
    # transform; the transform is not a module to shard (it was taken for one, and the
    # rank-0 broadcast called .parameters() on a Compose)
    source = _script('''\
    import torchvision.transforms as transforms


    def load(path, transform):
        return transform(torch.rand(3, 8, 8)).unsqueeze(0)


    def main():
        transform = transforms.Compose([transforms.Normalize(mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2))])
        content = load("content.png", transform)
        target = content.clone().requires_grad_(True)
        optimizer = torch.optim.Adam([target], lr=0.01)
        features = Net().eval()  # a frozen feature extractor, as VGG there
        for step in range(3):
            loss = ((features(target.reshape(-1, 4)) - features(content.reshape(-1, 4))) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    ''')
    assert _refusals(source)[0][:1] == [("FSR612", _line_of(source, "torch.optim.Adam([target]"))]
