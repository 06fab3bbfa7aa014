"""The launch stage on scripts that start their own process group (torchrun style):
the group is reused, never started twice; set_device comes before it; the mesh after it;
later stages use the script's own rank name."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = '''
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main():
{setup}
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 4))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("loss", loss.item())
    if rank == 0:
        torch.save(model.state_dict(), "m.pt")
{teardown}

if __name__ == "__main__":
    main()
'''

ENV = '''    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = dist.get_world_size()'''


def rewrite(setup: str = ENV, teardown: str = "    dist.destroy_process_group()\n", prefix: str = "", **options):
    source = prefix + SCRIPT.replace("{setup}", setup).replace("{teardown}", teardown)
    return rewrite_source(dedent(source).encode(), "train.py", RetrofitOptions(**options))


def lines(result) -> list:
    assert not result.refusals, result.refusals
    return [l.strip() for l in result.code.decode().splitlines()]


def test_one_group_one_sampler_one_teardown_and_the_scripts_rank_name():
    out = lines(rewrite())
    assert sum("init_process_group" in l for l in out) == 1
    assert sum("DistributedSampler(" in l for l in out) == 1
    assert sum("destroy_process_group" in l for l in out) == 1
    init = out.index('dist.init_process_group("gloo")')
    assert out[init - 1] == "torch.cuda.set_device(local_rank)"
    # the mesh reads the script's own world size, after it is bound
    mesh = out.index('mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world_size,))')
    assert mesh > out.index("world_size = dist.get_world_size()")
    assert out.index("fully_shard(model, mesh=mesh)") > mesh
    assert "if rank == 0:" in out and 'print("loss", loss_avg.item())' in out
    # the collective save left the rank-0 branch
    save = out.index('dcp.save(get_model_state_dict(model), checkpoint_id="m.pt")')
    assert out[save - 1] != "if rank == 0:"


def test_a_late_set_device_moves_before_the_group_and_a_missing_teardown_is_added():
    setup = '''    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(0)
    rank = dist.get_rank()'''
    out = lines(rewrite(setup, teardown=""))
    assert out.index("torch.cuda.set_device(0)") < out.index('dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")')
    # set_device(local_rank) reads a name bound from the environment after the init: both move, guarded
    out = lines(rewrite(setup.replace("set_device(0)", "set_device(local_rank)"), teardown=""))
    init = out.index('dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")')
    assert out[init - 3 : init] == [
        'local_rank = int(os.environ["LOCAL_RANK"])', "if torch.cuda.is_available():", "torch.cuda.set_device(local_rank)"
    ]
    # a name computed from the group stays after it: a guarded set_device of its own goes first
    out = lines(rewrite(setup.replace("set_device(0)", "set_device(dist.get_rank() % 8)"), teardown=""))
    init = out.index('dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")')
    assert out[init - 1] == "torch.cuda.set_device(local_rank_1)"
    # a literal "nccl" falls back to gloo without CUDA
    out = lines(rewrite(setup.replace('"nccl" if torch.cuda.is_available() else "gloo"', '"nccl"'), teardown=""))
    assert 'dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")' in out
    assert out.count("dist.destroy_process_group()") == 1
    assert "mesh = init_device_mesh(\"cuda\" if torch.cuda.is_available() else \"cpu\", (dist.get_world_size(),))" in out


def test_a_group_started_by_a_set_up_function_gets_its_mesh_after_the_call():
    prefix = '''
def setup():
    from torch.distributed import init_process_group
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="gloo")
'''
    out = lines(rewrite("    setup()\n    rank = dist.get_rank()", prefix=prefix))
    assert out[out.index("setup()") + 1].startswith("mesh = init_device_mesh(")
    assert sum("init_process_group(" in l for l in out) == 1
    assert "if rank == 0:" in out


OPTIONAL = '''    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", 0))'''


def test_an_optional_group_gets_a_one_process_group_in_the_other_branch():
    """`if ddp: init_process_group(...)`: the run without torchrun starts a group of its one
    process, so fully_shard has a mesh either way; `if ddp: destroy` loses its `if`."""
    out = lines(rewrite(OPTIONAL, teardown="    if ddp:\n        dist.destroy_process_group()\n"))
    start = out.index("if ddp:")
    assert out[start : start + 11] == [
        "if ddp:",
        'local_rank = int(os.environ["LOCAL_RANK"])',  # set_device before the init, under torchrun only
        "if torch.cuda.is_available():",
        "torch.cuda.set_device(local_rank)",
        'dist.init_process_group("gloo")',
        "else:",
        "# plain `python train.py`: a process group of this one process",
        "dist.init_process_group(",
        '"gloo", store=dist.HashStore(), rank=0, world_size=1',
        ")",
        'mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))',
    ]
    end = [l for l in out if l]
    assert end[end.index('if __name__ == "__main__":') - 1] == "dist.destroy_process_group()"
    assert "if ddp:" not in out[start + 1 :]
    # an existing else branch gets the group first
    out = lines(rewrite(OPTIONAL.replace("    rank =", "    else:\n        print('one process')\n    rank =")))
    assert out[out.index("else:") + 1 : out.index("else:") + 3] == [
        "# plain `python train.py`: a process group of this one process", "dist.init_process_group("
    ]


def test_a_conditional_group_of_another_shape_is_refused():
    # the script sets up its own rendezvous (init_method=...): no second group of ours
    for setup in (
        OPTIONAL.replace('("gloo")', '("gloo", init_method="tcp://10.0.0.1:23456", rank=0, world_size=2)'),
        OPTIONAL.replace("    if ddp:\n", "    if ddp:\n        if True:\n    ").replace("        dist.init", "            dist.init"),
        OPTIONAL.replace("    if ddp:\n", "    if not ddp:\n        pass\n    elif ddp:\n"),
    ):
        result = rewrite(setup)
        assert result.refusals and "under a condition" in result.refusals[0].what, setup
        assert result.code == result.original


def test_a_model_built_before_the_group_is_refused():
    result = rewrite("    model = Net()\n" + ENV)
    assert result.refusals and "built before the script starts its process group" in result.refusals[0].what


def test_a_rank_name_bound_in_one_branch_of_an_optional_launch_is_not_used():
    """fixtures/rewrite/optional_ddp binds `ddp_rank` only under `if ddp:`; the plain `python` mode
    never binds it, so a generated rank-0 test reads `dist.get_rank()` (was: `ddp_rank == 0` before
    the final DCP save, an UnboundLocalError when run as plain python)."""
    from pathlib import Path

    case = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite" / "optional_ddp"
    out = rewrite_source((case / "input.py").read_bytes(), str(case / "input.py")).code.decode()
    generated = out.replace((case / "input.py").read_text(), "")
    assert "if dist.get_rank() == 0 and os.path.isfile(args.out):" in out
    assert "ddp_rank == 0 and" not in generated


def test_set_device_reads_the_local_rank_number_not_the_environment_dict_naming_it():
    """`env = {k: os.environ[k] for k in (..., "LOCAL_RANK", ...)}`; `local_rank = int(env["LOCAL_RANK"])`:
    the device is set from `local_rank`, never from the dict (`torch.cuda.set_device(env)` was written)."""
    setup = '''    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    local_rank = int(env["LOCAL_RANK"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()'''
    out = lines(rewrite(setup))
    init = out.index('dist.init_process_group("gloo")')
    assert out[init - 2: init] == ["if torch.cuda.is_available():", "torch.cuda.set_device(local_rank)"]
    assert not any("set_device(env)" in line for line in out)


def test_an_accelerator_device_index_set_before_the_group_is_a_set_device():
    setup = '''    local_rank = int(os.environ["LOCAL_RANK"])
    torch.accelerator.set_device_index(local_rank)
    dist.init_process_group("gloo")
    rank = dist.get_rank()'''
    out = lines(rewrite(setup))
    assert not any(line.startswith("torch.cuda.set_device(") for line in out)
