"""DDP, DataParallel and mp.spawn scripts migrate to FSDP2 (migrate_ddp and
migrate_spawn stages, through the whole rewrite), or are refused with the line."""
from __future__ import annotations

import subprocess
import sys
from textwrap import dedent

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

HEAD = '''
import os
import contextlib
import torch
import torch.distributed as dist
import torch.nn as nn
{imports}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.fc(x)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
{body}
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

LOOP = '''
    for i in range(8):
        x = torch.randn(4, 4)
        loss = model(x).sum()
{accum}
        if (i + 1) % 2 == 0:
            opt.step()
            opt.zero_grad()
'''


def script(body: str, imports: str = "from torch.nn.parallel import DistributedDataParallel as DDP", accum: str = "        loss.backward()") -> str:
    return HEAD.replace("{imports}", imports).replace("{body}", body.replace("{loop}", LOOP.replace("{accum}", accum)))


def rewrite(source: str, **options):
    return rewrite_source(dedent(source).encode(), "train.py", RetrofitOptions(**options))


def out(source: str, **options) -> str:
    result = rewrite(source, **options)
    assert not result.refusals, result.refusals
    return result.code.decode()


def assert_no_ddp_api(code: str) -> None:
    for word in ("DistributedDataParallel", "DDP(", "no_sync", ".module", "require_backward_grad_sync", "DataParallel"):
        assert word not in code, word


def test_nested_ddp_with_an_optimizer_built_before_it_and_dropped_arguments_reported():
    body = '''    opt = torch.optim.SGD(Net().parameters(), lr=0.1)
    torch.manual_seed(0)
    model = DDP(Net().to("cpu"), device_ids=None, find_unused_parameters=True, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
{loop}
    print(model.module.fc.weight.sum())'''
    result = rewrite(script(body))
    code = result.code.decode()
    assert_no_ddp_api(code)
    lines = [l.strip() for l in code.splitlines()]
    build = lines.index('model = Net().to("cpu")')
    assert lines[build + 3] == "fully_shard(model, mesh=mesh)"
    assert lines.index("opt = torch.optim.SGD(model.parameters(), lr=0.1)") > build + 3
    assert "model.fc.weight.sum()" in code
    dropped = [c.what for c in result.changes if c.what.startswith("dropped")]
    assert dropped == [
        "dropped `device_ids=None` of DistributedDataParallel",
        "dropped `find_unused_parameters=True` of DistributedDataParallel",
        "dropped `gradient_as_bucket_view=True` of DistributedDataParallel",
    ]
    assert sum("init_process_group" in l for l in lines) == 1


@pytest.mark.parametrize("imports, ctor", [
    ("import torch.nn.parallel as par", "par.DistributedDataParallel"),
    ("", "torch.nn.parallel.DistributedDataParallel"),
    ("from torch.nn.parallel import DistributedDataParallel", "DistributedDataParallel"),
])
def test_every_import_spelling(imports, ctor):
    body = f'''    model = Net()
    model = {ctor}(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
{{loop}}'''
    code = out(script(body, imports=imports))
    assert_no_ddp_api(code)
    assert "fully_shard(model, mesh=mesh)" in code


BASE = '''    model = Net()
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
{loop}'''


def test_no_sync_in_one_branch_of_identical_branches_becomes_one_sync_call():
    accum = '''        if (i + 1) % 2 != 0:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()'''
    code = out(script(BASE, accum=accum))
    assert_no_ddp_api(code)
    assert ("        model.set_requires_gradient_sync((i + 1) % 2 == 0)\n"
            "        model.set_reshard_after_backward((i + 1) % 2 == 0)\n        loss.backward()\n") in code
    assert code.count("set_requires_gradient_sync") == 1


def test_no_sync_and_module_through_a_trainers_attribute():
    """`self.model.no_sync()` and `self.model.module` in the methods of a trainer class of the script that
    holds the DDP model: migrated like `model.no_sync()` (no_sync was left in place, an AttributeError on
    the FSDP2 module; fixtures/rewrite/ddp_no_sync_trainer_flag runs it)."""
    trainer = '''

class Trainer:
    def __init__(self, model, opt):
        self.model = model
        self.opt = opt

    def step(self, x, sync):
        if sync:
            self.model(x).sum().backward()
            self.opt.step()
        else:
            with self.model.no_sync():
                self.model(x).sum().backward()

    def save(self):
        return self.model.module.state_dict()
'''
    body = '''    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, opt)
    for i in range(4):
        trainer.step(torch.randn(4, 4), i % 2 == 1)
    state = trainer.save()
'''
    source = script(body).replace("\n\ndef main():", trainer + "\n\ndef main():")
    code = out(source)
    assert_no_ddp_api(code)
    assert ("        self.model.set_requires_gradient_sync(sync)\n"
            "        self.model.set_reshard_after_backward(sync)\n"
            "        self.model(x).sum().backward()\n"
            "        if sync:\n            self.opt.step()\n") in code
    assert "return self.model.state_dict()" in code


def test_a_context_chosen_by_a_conditional_expression():
    accum = '''        ctx = model.no_sync() if (i + 1) % 2 != 0 else contextlib.nullcontext()
        with ctx:
            loss = loss * 1.0
            loss.backward()'''
    code = out(script(BASE, accum=accum))
    assert_no_ddp_api(code)
    assert ("model.set_requires_gradient_sync((i + 1) % 2 == 0)\n        model.set_reshard_after_backward((i + 1) % 2 == 0)\n"
            "        loss = loss * 1.0\n        loss.backward()") in code
    assert code.count("set_requires_gradient_sync") == 1
    assert "contextlib" not in code  # the unused import goes


def test_require_backward_grad_sync_and_a_with_holding_another_context():
    accum = '''        model.require_backward_grad_sync = (i + 1) % 2 == 0
        loss.backward()'''
    code = out(script(BASE, accum=accum))
    assert ("model.set_requires_gradient_sync((i + 1) % 2 == 0)\n        model.set_reshard_after_backward((i + 1) % 2 == 0)\n"
            "        loss.backward()") in code
    accum = '''        with model.no_sync(), torch.autograd.set_detect_anomaly(False):
            loss.backward()'''
    code = out(script(BASE, accum=accum))
    assert_no_ddp_api(code)
    assert ("model.set_requires_gradient_sync(False)\n        model.set_reshard_after_backward(False)\n"
            "        with torch.autograd.set_detect_anomaly(False):\n"
            "            loss.backward()\n        model.set_requires_gradient_sync(True)\n"
            "        model.set_reshard_after_backward(True)\n") in code


def test_rank0_save_of_module_state_becomes_a_collective_dcp_save():
    body = BASE + '''
    if rank == 0:
        torch.save(model.module.state_dict(), "final.pt")'''
    code = out(script(body))
    assert_no_ddp_api(code)
    lines = [l.strip() for l in code.splitlines()]
    save = lines.index('dcp.save(get_model_state_dict(model), checkpoint_id="final.pt")')
    assert lines[save - 1] != "if rank == 0:"


def test_dataparallel_under_a_device_count_test_goes_with_its_if():
    source = '''
import torch
import torch.nn as nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)

def main():
    model = Net()
    if torch.cuda.device_count() > 1:
        model = nn.DataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    torch.save(getattr(model, "module", model).state_dict(), "m.pt")

main()
'''
    code = out(source)
    assert_no_ddp_api(code)
    assert "device_count" not in code
    assert "init_process_group" in code and "fully_shard(model, mesh=mesh)" in code


SPAWN = '''
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    n = 2
    {launch}
'''


def test_spawn_becomes_one_call_per_torchrun_process():
    result = rewrite(SPAWN.replace("{launch}", "mp.spawn(worker, args=(n, None), nprocs=n, join=True)"))
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert 'worker(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]), None)' in code
    assert 'dist.init_process_group("gloo")' in code
    assert "MASTER_" not in code and "mp." not in code and "torch.multiprocessing" not in code


@pytest.mark.parametrize("launch, what", [
    ("q = mp.Queue()\n    mp.spawn(worker, args=(n, q), nprocs=n)", "`q` is handed to the workers"),
    ("ctx = mp.spawn(worker, args=(n, None), nprocs=n, join=False)", "the result of mp.spawn is used"),
    ("mp.spawn(worker, args=(n, None), nprocs=n, join=False)", "`join=` of mp.spawn"),
    ("mp.spawn(worker, args=make_args(), nprocs=n)", "are not a tuple written in the call"),
])
def test_unsafe_spawns_are_refused(launch, what):
    result = rewrite(SPAWN.replace("{launch}", launch))
    assert result.refusals and what in result.refusals[0].what
    assert result.code == result.original


@pytest.mark.parametrize("body, line, what", [
    ("    torch.manual_seed(rank)\n" + BASE, 40, "the random seed depends on the rank"),
    (BASE.replace("DDP(model)", "DDP(model, process_group=group)"), 42, "`process_group=` of DistributedDataParallel"),
    (BASE + "\n    ctx = model.no_sync()", 42, "`no_sync()` is used outside a `with` statement"),
])
def test_unsafe_ddp_shapes_are_refused_by_the_cli(tmp_path, body, line, what):
    path = tmp_path / "train.py"
    source = dedent(script(body))
    path.write_text(source)
    proc = subprocess.run([sys.executable, "-m", "fsdp2_retrofit.cli", "rewrite", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{path}:" in proc.stdout + proc.stderr and what in proc.stdout + proc.stderr
    assert path.read_text() == source


def test_a_wrapper_under_a_new_name_becomes_an_alias_of_the_sharded_model():
    body = BASE.replace("model = DDP(model)", "ddp_model = DDP(model)").replace(
        "model.parameters()", "ddp_model.parameters()") + """
    if rank == 0:
        torch.save(ddp_model.module.state_dict(), "m.pt")"""
    code = out(script(body))
    assert_no_ddp_api(code)
    lines = [l.strip() for l in code.splitlines()]
    shard = lines.index("fully_shard(model, mesh=mesh)")
    assert lines[shard + 1] == "ddp_model = model"
    assert 'dcp.save(get_model_state_dict(ddp_model), checkpoint_id="m.pt")' in lines


def test_no_sync_in_an_elif_branch_takes_the_generic_form():
    accum = '''        if i == 100:
            pass
        elif (i + 1) % 2 != 0:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()'''
    code = out(script(BASE, accum=accum))
    assert_no_ddp_api(code)
    assert ("            model.set_requires_gradient_sync(False)\n            model.set_reshard_after_backward(False)\n"
            "            loss.backward()\n"
            "            model.set_requires_gradient_sync(True)\n            model.set_reshard_after_backward(True)\n") in code
    reshard = out(script(BASE, accum=accum), accumulation_params="reshard")
    assert "set_reshard_after_backward" not in reshard
    assert ("            model.set_requires_gradient_sync(False)\n            loss.backward()\n"
            "            model.set_requires_gradient_sync(True)\n") in reshard


TUTORIAL_TRAINER = '''
import os
import torch
from torch.distributed import init_process_group, destroy_process_group
from torch.nn.parallel import DistributedDataParallel as DDP


def ddp_setup():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl")


class Trainer:
    def __init__(self, model, optimizer, path):
        self.gpu_id = {gpu_id}
        self.model = model.to(self.gpu_id)
        self.optimizer = optimizer
        self.path = path
        self.model = DDP(self.model, device_ids=[self.gpu_id])

    def _save_snapshot(self, epoch):
        torch.save({{"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}}, self.path)
        print(f"epoch {{epoch}} saved")

    def train(self, epochs):
        for epoch in range(epochs):
            self.optimizer.zero_grad()
            self.model(torch.randn(4, 8, device="cuda")).sum().backward()
            self.optimizer.step()
            if self.gpu_id == 0 and epoch % 2 == 0:
                self._save_snapshot(epoch)


def main():
    ddp_setup()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    Trainer(model, optimizer, "snapshot.pt").train(4)
    destroy_process_group()


if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize("gpu_id", ['int(os.environ["LOCAL_RANK"])', 'int(os.environ.get("RANK", 0))',
                                    "torch.distributed.get_rank()"])
def test_a_tutorial_trainer_wrapping_its_attribute_and_saving_under_its_rank_read_by_value(gpu_id):
    """`self.model = DDP(self.model, ...)` (was FSR201) goes, the model is sharded before its optimizer,
    ddp_setup()'s process group is the only one, and `if self.gpu_id == 0 and ...:` around the method
    that now saves with DCP loses its rank test: `self.gpu_id` holds a rank by its value (kept, the
    other ranks would never join the save). fixtures/rewrite/ddp_trainer_attribute runs this shape."""
    result = rewrite(TUTORIAL_TRAINER.format(gpu_id=gpu_id))
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert_no_ddp_api(code)
    lines = [l.strip() for l in code.splitlines()]
    assert lines.index("fully_shard(model, mesh=mesh)") < lines.index(
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)")
    assert sum("init_process_group(" in l for l in lines) == 1
    assert "            if epoch % 2 == 0:\n                self._save_snapshot(epoch)\n" in code
    assert "dcp.save(" in code and "get_model_state_dict(self.model)" in code
    assert "        if dist.get_rank() == 0:\n            print(f\"epoch {epoch} saved\")" in code


def test_an_attribute_that_is_not_only_a_rank_does_not_gate_like_one():
    """`self.gpu_id` bound to LOCAL_RANK and to something else: no rank by value, so its `if` is no
    rank-0 gate (a save under it is not moved), and the analysis says so."""
    from fsdp2_retrofit.analysis.facts import analyse
    from fsdp2_retrofit.analysis.rank_values import rank_aliases
    import libcst as cst

    source = TUTORIAL_TRAINER.format(gpu_id='int(os.environ["LOCAL_RANK"])')
    facts = analyse(cst.parse_module(source))
    train = next(f for f in facts.resolver.nodes(cst.FunctionDef) if f.name.value == "train")
    assert rank_aliases(train, facts) == {"self.gpu_id"}
    twice = source.replace("        self.path = path\n", "        self.path = path\n        self.gpu_id = 0\n")
    facts = analyse(cst.parse_module(twice))
    train = next(f for f in facts.resolver.nodes(cst.FunctionDef) if f.name.value == "train")
    assert rank_aliases(train, facts) == frozenset()


HANDED_RANK = TUTORIAL_TRAINER.replace(
    "def __init__(self, model, optimizer, path):\n        self.gpu_id = {gpu_id}\n        self.model = model.to(self.gpu_id)",
    "def __init__(self, model, optimizer, gpu_id, path):\n        self.gpu_id = gpu_id\n        self.model = model.to(gpu_id)",
).replace("self.model = DDP(self.model, device_ids=[self.gpu_id])", "self.model = DDP(model, device_ids=[gpu_id])").replace(
    'Trainer(model, optimizer, "snapshot.pt")', 'Trainer(model, optimizer, {rank}, "snapshot.pt")').replace(
    "    ddp_setup()\n", '    ddp_setup()\n    local_rank = int(os.environ["LOCAL_RANK"])\n')


@pytest.mark.parametrize("rank, gates", [
    ("local_rank", True),  # local_rank = int(os.environ["LOCAL_RANK"]) in main(): handed by value
    ("0", False),  # a constant, not a rank
])
def test_a_rank_handed_to_the_trainer_as_a_parameter_is_read_by_value(rank, gates):
    """`Trainer(model, optimizer, local_rank, ...)` with `self.gpu_id = gpu_id`: every construction hands the
    parameter a rank, so `if self.gpu_id == 0 and ...:` around the method that saves loses its rank test. The
    model held twice in __init__ (`self.model = model.to(gpu_id)`, then `self.model = DDP(model, ...)`) is one
    holder of the sharded model: its save becomes DCP (it was left a torch.save of the shards under rank 0)."""
    result = rewrite(HANDED_RANK.format(rank=rank))
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "dcp.save(" in code and "get_model_state_dict(self.model)" in code
    moved = "            if epoch % 2 == 0:\n                self._save_snapshot(epoch)\n" in code
    assert moved is gates
    if not gates:  # a constant 0 is the same on every rank: every rank calls the method alike
        assert "            if self.gpu_id == 0 and epoch % 2 == 0:\n" in code


def test_a_parameter_one_call_hands_something_else_is_no_rank():
    from fsdp2_retrofit.analysis.facts import analyse
    from fsdp2_retrofit.analysis.rank_values import rank_aliases
    import libcst as cst

    def aliases(source):
        facts = analyse(cst.parse_module(source))
        train = next(f for f in facts.resolver.nodes(cst.FunctionDef) if f.name.value == "train")
        return rank_aliases(train, facts)

    source = HANDED_RANK.format(rank="local_rank")
    assert aliases(source) == {"self.gpu_id"}
    assert aliases(source + '\n\ndef evaluate(model, optimizer):\n    return Trainer(model, optimizer, 3, "e.pt")\n') == frozenset()


SPAWN_HELPER = SPAWN.replace('''def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)''', '''def setup(r, n):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=RANK, world_size=n)


def worker(rank, world_size, args):
    setup(rank, world_size)''')


def test_a_spawn_worker_starting_its_group_through_a_helper_becomes_a_torchrun_worker():
    """The worker calls `setup(rank, world_size)`, which starts the group (was FSR108 'starts no process
    group'): rank=/world_size= go in the helper, the rendezvous lines too, and the group is not started twice."""
    result = rewrite(SPAWN_HELPER.replace("RANK", "r").replace("{launch}", "mp.spawn(worker, args=(n, None), nprocs=n)"))
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert 'worker(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]), None)' in code
    assert code.count("init_process_group(") == 1 and 'dist.init_process_group("gloo")' in code
    assert "MASTER_" not in code and "mp." not in code


def test_a_rank_computed_in_the_spawn_workers_helper_is_refused_there():
    source = SPAWN_HELPER.replace("RANK", "r * 2").replace("{launch}", "mp.spawn(worker, args=(n, None), nprocs=n)")
    result = rewrite(source)
    assert [r.code for r in result.refusals] == ["FSR110"]
    assert result.refusals[0].line == source.splitlines().index(
        '    dist.init_process_group("gloo", rank=r * 2, world_size=n)') + 1


def test_a_wrap_stored_in_another_objects_attribute_is_refused_at_its_line():
    body = '''    model = Net()
    holder = types.SimpleNamespace()
    holder.model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
{loop}'''
    result = rewrite(script(body, imports="import types\nfrom torch.nn.parallel import DistributedDataParallel as DDP"))
    assert [(r.code, r.line) for r in result.refusals] == [("FSR201", 38)]  # the `holder.model = DDP(model)` line
    assert "`holder.model`" in result.refusals[0].what
