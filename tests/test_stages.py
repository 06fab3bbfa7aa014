"""Each stage on the scenarios it must handle, and the refusals, on small scripts.

The stage tests use libcst's CodemodTest (before/after pairs, named for the scenario);
the pipeline tests check what the whole rewrite does or refuses.
"""
from __future__ import annotations

from textwrap import dedent

import pytest
from libcst.codemod import CodemodTest

from codemods.checkpoint import ConvertSavesCommand
from codemods.data import DistributeDataCommand
from codemods.forward_calls import ReplaceForwardCallsCommand
from codemods.launch import LaunchDistributedCommand
from codemods.shard import ShardModelCommand
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

pytestmark = pytest.mark.smoke  # the smoke loop: README, "Running the tests"

MODEL = '''
import torch
from torch import nn, optim


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks(x))
'''


def rewrite(code: str, **options):
    return rewrite_source(dedent(code).encode(), "train.py", RetrofitOptions(**options))


def out(code: str, **options) -> str:
    result = rewrite(code, **options)
    assert not result.refusals, result.refusals
    return result.code.decode()


class TestShard(CodemodTest):
    TRANSFORM = ShardModelCommand

    def test_sequential_blocks_then_root_with_import_aliases(self) -> None:
        before = MODEL + '''
torch.manual_seed(0)
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
'''
        after = MODEL.replace(
            "from torch import nn, optim\n", "from torch import nn, optim\nfrom torch.distributed.fsdp import fully_shard\n"
        ) + '''
torch.manual_seed(0)
model = Net()
for index, block in enumerate(model.blocks):
    fully_shard(block, reshard_after_forward=index < len(model.blocks) - 1)
fully_shard(model)
opt = optim.SGD(model.parameters(), lr=0.1)
'''
        self.assertCodemod(before, after)

    def test_already_sharded_model_is_left_alone(self) -> None:
        code = MODEL.replace("import torch\n", "import torch\nfrom torch.distributed.fsdp import fully_shard\n") + '''
model = Net()
fully_shard(model)
opt = optim.SGD(model.parameters(), lr=0.1)
'''
        self.assertCodemod(code, code)


class TestLaunch(CodemodTest):
    TRANSFORM = LaunchDistributedCommand

    def test_the_scripts_process_group_is_reused_not_added_twice(self) -> None:
        before = MODEL + '''
import torch.distributed as dist
dist.init_process_group("gloo")
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
'''
        # the stage's imports go to their groups, sorted (stdlib first), as in the full rewrite
        after = MODEL.replace("import torch\nfrom torch import nn, optim\n", "import os\n\nimport torch\n"
                              "from torch import nn, optim\nfrom torch.distributed.device_mesh import init_device_mesh\n", 1) + '''
import torch.distributed as dist
local_rank = int(os.environ["LOCAL_RANK"])
if torch.cuda.is_available():
    torch.cuda.set_device(local_rank)
dist.init_process_group("gloo")
mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
dist.destroy_process_group()
'''
        self.assertCodemod(before, after)
        self.assertCodemod(after, after)  # a mesh exists: nothing added twice


class TestForwardCalls(CodemodTest):
    TRANSFORM = ReplaceForwardCallsCommand

    def test_plain_class_with_forward_method_and_super_forward_untouched(self) -> None:
        code = MODEL + '''
class Helper:
    def forward(self, x):
        return x


class Sub(Net):
    def forward(self, x):
        return super().forward(x)


helper = Helper()
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
y = helper.forward(1)
'''
        self.assertCodemod(code, code)

    def test_module_forward_call_in_a_function_receiving_the_model(self) -> None:
        before = MODEL + '''
def evaluate(net, x):
    return net.forward(x)


model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
evaluate(model, torch.ones(4))
'''
        self.assertCodemod(before, before.replace("net.forward(x)", "net(x)"))


class TestData(CodemodTest):
    TRANSFORM = DistributeDataCommand

    def test_shuffle_moves_out_of_a_dict_literal_and_set_epoch_is_added(self) -> None:
        before = '''
from torch.utils.data import DataLoader

cfg = {"batch_size": 8, "shuffle": True}
loader = DataLoader(ds, **cfg)
for epoch in range(3):
    for x in loader:
        x.sum().backward()
'''
        after = '''
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

cfg = {"batch_size": 8}
sampler = DistributedSampler(ds, shuffle=True)
# The per-rank batch stays as written: the global batch is now world_size x larger.
loader = DataLoader(ds, sampler=sampler, **cfg)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x in loader:
        x.sum().backward()
'''
        self.assertCodemod(before, after)


class TestCheckpoint(CodemodTest):
    TRANSFORM = ConvertSavesCommand

    def test_state_through_a_variable_and_metrics_untouched(self) -> None:
        before = MODEL + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": 3}
torch.save(state, "ckpt.pt")
torch.save({"loss": [1.0, 0.5]}, "metrics.pt")
'''
        after = MODEL.replace(
            "import torch\nfrom torch import nn, optim\n",
            "import os\n\nimport torch\nimport torch.distributed as dist\nimport torch.distributed.checkpoint as dcp\n"
            "from torch import nn, optim\n"
            "from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict\n",
        ) + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
state = {"model": get_model_state_dict(model), "opt": get_optimizer_state_dict(model, opt), "step": 3}
if dist.get_rank() == 0 and os.path.isfile("ckpt.pt"):  # a single-GPU run's file: moved aside, DCP saves a directory
    os.replace("ckpt.pt", "ckpt.pt.single-gpu")
dist.barrier()  # the path is free on every rank
dcp.save(state, checkpoint_id="ckpt.pt")
torch.save({"loss": [1.0, 0.5]}, "metrics.pt")
'''
        self.assertCodemod(before, after)


# --- the whole pipeline -------------------------------------------------------------


def test_optimizer_and_scheduler_built_before_cuda_move_after_sharding():
    code = out(MODEL + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
sched = optim.lr_scheduler.StepLR(opt, 1)
model.cuda()
for x in range(3):
    model(torch.ones(4)).sum().backward()
    opt.step()
''')
    tail = code[code.index("model = Net()"):]
    assert tail.index("model.cuda()") < tail.index("fully_shard(model") < tail.index("opt = ") < tail.index("sched = ")


def test_shard_option_names_the_units():
    code = out(MODEL + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
''', shard=("Block",))
    assert 'if type(module).__name__ in ("Block",) and module is not model:' in code
    assert "enumerate(model.blocks)" not in code


def test_blocks_sharing_a_tied_weight_stay_in_the_root_unit():
    result = rewrite(MODEL.replace(
        "self.head = nn.Linear(4, 2)", "self.head = nn.Linear(4, 4)\n        self.head.weight = self.blocks[0].fc.weight"
    ).replace("self.head.weight = self.blocks[0].fc.weight", "self.blocks.tie = self.head.weight") + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
''')
    code = result.code.decode()
    assert "enumerate(model.blocks)" not in code and "fully_shard(model" in code
    assert any("shares a parameter" in a.what for a in result.attention)


def test_a_print_that_runs_the_model_runs_it_on_every_rank_and_prints_on_rank_zero():
    result = rewrite(MODEL + '''
def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    for x in range(2):
        model(torch.ones(4)).sum().backward()
        opt.step()
        print("loss", x)
    print("eval", model(torch.ones(4)))

main()
''')
    code = result.code.decode()
    assert '    if rank == 0:\n            print("loss", x)' in code
    assert ('    logged_value = model(torch.ones(4))\n'
            '    if rank == 0:\n'
            '        print("eval", logged_value)') in code  # the forward is a collective: never under the gate
    assert not any("left on every rank" in a.what for a in result.attention)


@pytest.mark.parametrize(
    "script, where, what",
    [
        ("import torch\nx = torch.ones(3)\nprint(x)\n", 1, "no nn.Module is built in this script"),
        (  # the model's own line (it was line 1)
            MODEL + "\nmodel = Net()\n", 24,
            "no optimizer trains a model built in this script: `model` is built here, and no torch.optim optimizer "
            "is built from its parameters",
        ),
        (
            MODEL.replace(
                "self.blocks = nn.Sequential(*[Block() for _ in range(3)])",
                "self.blocks = [Block() for _ in range(3)]",
            ) + "\nmodel = Net()\nopt = optim.SGD(model.parameters(), lr=0.1)\n",
            18,
            "`self.blocks` keeps layers in a plain Python list",
        ),
        (
            MODEL.replace("self.head = nn.Linear(4, 2)", "self.head = nn.Linear(4, 2)\n        self.opt = optim.SGD(self.parameters(), lr=0.1)")
            + "\nmodel = Net()\nopt = optim.SGD(model.parameters(), lr=0.1)\n",
            20,
            "an optimizer is built inside Net.__init__",
        ),
        (
            MODEL + "\nmodel = torch.nn.parallel.DistributedDataParallel(Net())\nisinstance(model, torch.nn.parallel.DistributedDataParallel)\nopt = optim.SGD(model.parameters(), lr=0.1)\n",
            25,
            "`isinstance(model, torch.nn.parallel.DistributedDataParallel)` uses the wrapper class itself",
        ),
    ],
    ids=["no-module", "no-optimizer", "plain-list", "optimizer-in-init", "ddp-isinstance"],
)
def test_refusals_name_the_line_and_leave_the_code(script, where, what):
    result = rewrite(script)
    assert result.refusals, "expected a refusal"
    refusal = result.refusals[0]
    assert (refusal.line, refusal.what) == (where, what)
    assert refusal.why and refusal.hint
    assert result.code == dedent(script).encode()


@pytest.mark.integration
def test_stages_run_from_libcst_tool(tmp_path):
    """.libcst.codemod.yaml makes the composite a libcst codemod command."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    case = repo / "fixtures" / "rewrite" / "main_modulelist"
    script = tmp_path / "train.py"
    shutil.copy(case / "input.py", script)
    proc = subprocess.run(
        [sys.executable, "-m", "libcst.tool", "codemod", "--no-format", "retrofit.RetrofitCommand", str(script)],
        cwd=repo, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert script.read_bytes() == (case / "expected.py").read_bytes()


def test_other_entry_points_of_a_sharded_model_are_registered():
    code = out(MODEL.replace(
        "    def forward(self, x):\n        return self.head(self.blocks(x))",
        "    def forward(self, x):\n        return self.head(self.blocks(x))\n\n"
        "    def generate(self, x, steps):\n        for _ in range(steps):\n            x = self.blocks(x)\n        return x",
    ) + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
for i in range(2):
    model(torch.ones(4)).sum().backward()
    opt.step()
sample = model.generate(torch.ones(4), 3)
''')
    assert 'fully_shard(model, mesh=mesh)\nregister_fsdp_forward_method(model, "generate")\n' in code
    assert "from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method" in code


def test_no_set_epoch_on_a_step_loop_that_recreates_the_iterator():
    result = rewrite(MODEL + '''
from torch.utils.data import DataLoader

def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(ds, batch_size=4, shuffle=True)
    data_iter = iter(loader)
    for step in range(10):
        try:
            (x,) = next(data_iter)
        except StopIteration:
            data_iter = iter(loader)
            (x,) = next(data_iter)
        model(x).sum().backward()
        opt.step()

main()
''')
    code = result.code.decode()
    assert "set_epoch" not in code and "sampler=sampler" in code
    assert any("iter()/next()" in a.what for a in result.attention)


def test_model_built_by_a_conditional_expression():
    code = out(MODEL + '''
use_cuda = torch.cuda.is_available()
torch.manual_seed(0)
model = Net().cuda() if use_cuda else Net()
opt = optim.SGD(model.parameters(), lr=0.1)
''')
    assert "model = Net().cuda() if use_cuda else Net()\nfor index, block in enumerate(model.blocks):" in code


def test_a_trainer_class_that_builds_its_model_and_optimizer_is_converted_in_its_method():
    # was FSR610 (the optimizer's model not followed); a Solver that owns the run is a common project shape
    code = out(MODEL + '''

class Trainer:
    def __init__(self):
        self.model = Net()
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.1)
''')
    init = code[code.index("class Trainer:"):]
    assert init.index("dist.init_process_group(") < init.index("mesh = init_device_mesh(") < init.index(
        "self.model = Net()") < init.index("fully_shard(self.model, mesh=mesh)") < init.index("self.optimizer = optim")
    assert "destroy_process_group" not in code  # the group outlives __init__


def test_a_trainer_class_optimizer_of_a_model_it_cannot_follow_is_refused_with_the_reason():
    result = rewrite(MODEL + '''

class Trainer:
    def __init__(self, make):
        self.model = make()
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.1)
''')
    assert result.refusals[0].what == ("the optimizer is built inside class Trainer from parameters the rewrite "
                                       "cannot follow to a model the script builds")
    assert result.refusals[0].line == 28


def test_sequential_of_an_ordered_dict_of_one_block_class_is_a_container():
    code = out(MODEL.replace(
        "self.blocks = nn.Sequential(*[Block() for _ in range(3)])",
        'self.blocks = nn.Sequential(OrderedDict([("b1", Block()), ("b2", Block()), ("b3", Block())]))',
    ).replace("import torch\n", "from collections import OrderedDict\n\nimport torch\n") + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
''')
    assert "for index, block in enumerate(model.blocks):\n    fully_shard(block, mesh=mesh, reshard_after_forward=" in code


def test_a_method_that_only_reads_parameters_is_not_registered_as_forward():
    code = out(MODEL.replace(
        "    def forward(self, x):\n        return self.head(self.blocks(x))",
        "    def forward(self, x):\n        return self.head(self.blocks(x))\n\n"
        "    def configure_optimizers(self, lr):\n        return optim.AdamW(self.parameters(), lr=lr)",
    ) + '''
model = Net()
opt = model.configure_optimizers(0.1)
''')
    assert "register_fsdp_forward_method" not in code
    assert code.index("fully_shard(model, mesh=mesh)") < code.index("opt = model.configure_optimizers")


def test_init_applied_after_building_runs_before_sharding_and_getattr_optimizers_count():
    code = out(MODEL + '''
def init(m):
    pass

torch.manual_seed(0)
model = Net()
model.apply(init)
opt = getattr(torch.optim, "SGD")(model.parameters(), lr=0.1)
''')
    assert "model.apply(init)\nfor index, block in enumerate(model.blocks):" in code
    assert code.index("fully_shard(model, mesh=mesh)") < code.index("opt = getattr(")


def test_reading_a_converted_checkpoint_path_is_flagged():
    result = rewrite(MODEL + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
torch.save(model.state_dict(), "best.pt")
size = open("best.pt", "rb").read()
''')
    assert any(a.what.startswith('reads `"best.pt"`') and a.line == 27 for a in result.attention)


@pytest.mark.parametrize(
    "tail, what",
    [
        ("model = [torch.compile(Net())][0]\nopt = optim.SGD(model.parameters(), lr=0.1)\n",
         "the model is compiled in the expression that builds it"),
        # (a copy right after the build is sharded like the model: tests/test_multi_models.py)
        ("import copy\nmodel = Net()\nopt = optim.SGD(model.parameters(), lr=0.1)\nif opt:\n    ema = copy.deepcopy(model)\n",
         "`copy.deepcopy(model)` copies a model that gets sharded"),
        # (a trainer class of the script is converted in its methods; one of a sibling module is
        # refused: tests/test_trainer_classes.py)
    ],
    ids=["compile-in-build", "deepcopy"],
)
def test_constructs_that_would_crash_are_refused(tail, what):
    result = rewrite(MODEL + "\n" + tail)
    assert result.refusals and result.refusals[0].what == what
    assert result.code == dedent(MODEL + "\n" + tail).encode()


def test_a_grad_norm_read_later_becomes_a_full_tensor_on_every_rank():
    code = out(MODEL + '''
def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    for i in range(2):
        model(torch.ones(4)).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        print(f"norm {norm:.3f}")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

main()
''')
    assert "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n        norm = norm.full_tensor()\n" in code
    assert code.count("full_tensor") == 1
    assert '        if rank == 0:\n            print(f"norm {norm:.3f}")' in code


def test_reloading_a_converted_checkpoint_uses_dcp_load_and_a_copy_is_a_copytree():
    code = out(MODEL + '''
import shutil

def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    best = "best.pt"
    torch.save(model.state_dict(), best)
    shutil.copyfile(best, "copy.pt")
    model.load_state_dict(torch.load(best, map_location="cpu"))
    torch.load("pretrained.pt")

main()
''')
    assert (
        "    state_dict = get_model_state_dict(model)\n"
        "    dcp.load(state_dict, checkpoint_id=best)\n"
        "    for module in model.modules():\n        if isinstance(module, FSDPModule):\n            module.reshard()\n"
        "    set_model_state_dict(model, state_dict)\n"
    ) in code
    assert '    if dist.get_rank() == 0:\n        shutil.copytree(best, "copy.pt", dirs_exist_ok=True)\n' in code
    assert 'torch.load("pretrained.pt")' in code


def test_a_print_that_is_the_whole_body_of_an_if_joins_its_condition():
    code = out(MODEL + '''
def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model(torch.ones(4)).sum().backward()
        opt.step()
        if step == 0 or step == 3:
            print("step", step)
        if step == 1:
            print("one")
        else:
            print("other")

main()
''')
    assert '        if (step == 0 or step == 3) and rank == 0:\n            print("step", step)\n' in code
    assert '        if step == 1:\n            if rank == 0:\n                print("one")\n' in code


def test_a_loop_that_trains_through_a_per_step_helper_gets_a_sampler():
    code = out(MODEL + '''
from torch.utils.data import DataLoader

def train_step(model, batch, optimizer):
    model(batch).sum().backward()
    optimizer.step()

model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(ds, batch_size=4, shuffle=True)
for b in loader:
    train_step(model=model, batch=b, optimizer=opt)
''')
    assert "loader = DataLoader(ds, batch_size=4, sampler=sampler)" in code


def test_a_model_built_as_a_global_in_a_setup_function_is_refused():
    result = rewrite(MODEL + '''
def setup():
    global model, opt
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)

setup()
''')
    assert result.refusals[0].what == "`model` is a global built inside setup()"


ACCUMULATION = MODEL + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
for i, x in enumerate(batches):
    loss = model(x).sum() / 4
    loss.backward()
    if (i + 1) % 4 == 0:
        opt.step()
        opt.zero_grad()
'''


def test_accumulation_syncs_on_the_last_micro_batch_by_default_and_every_one_on_request():
    default = out(ACCUMULATION, accumulation_params="reshard")
    assert "    model.set_requires_gradient_sync((i + 1) % 4 == 0)\n    loss.backward()\n" in default
    every = rewrite(ACCUMULATION, accumulation_sync="every")
    assert "set_requires_gradient_sync" not in every.code.decode()
    assert any(c.code == "accumulation" and "--accumulation-sync every" in c.what for c in every.changes)


def test_accumulation_holds_gathered_parameters_until_the_last_micro_batch_unless_asked_to_reshard():
    default = out(ACCUMULATION)
    assert ("    model.set_requires_gradient_sync((i + 1) % 4 == 0)\n"
            "    model.set_reshard_after_backward((i + 1) % 4 == 0)\n    loss.backward()\n") in default
    assert out(default) == default  # a second rewrite adds nothing
    every = rewrite(ACCUMULATION, accumulation_sync="every").code.decode()
    assert "set_requires_gradient_sync" not in every
    assert "    model.set_reshard_after_backward((i + 1) % 4 == 0)\n    loss.backward()\n" in every
    assert out(every) == every
    # FSDPModule.set_reshard_after_backward is on the torch.distributed._composable.fsdp path too
    old_torch = out(ACCUMULATION, torch_version="2.4")
    assert "torch.distributed._composable.fsdp import" in old_torch
    assert "    model.set_reshard_after_backward((i + 1) % 4 == 0)\n    loss.backward()\n" in old_torch
    reshard = rewrite(ACCUMULATION, accumulation_params="reshard")
    assert "set_reshard_after_backward" not in reshard.code.decode()
    assert "set_requires_gradient_sync((i + 1) % 4 == 0)" in reshard.code.decode()
    assert any(c.code == "accumulation" and "--accumulation-params reshard" in c.what for c in reshard.changes)


def test_accumulation_whose_condition_changes_after_backward_is_computed_before_it():
    script = ACCUMULATION.replace(
        "    if (i + 1) % 4 == 0:", "    micro = i + 1\n    if micro % 4 == 0:"
    )
    assert "    model.set_requires_gradient_sync((i + 1) % 4 == 0)\n" in out(script)


def test_accumulation_whose_condition_cannot_be_computed_before_backward_is_reported_not_guessed():
    script = ACCUMULATION.replace(
        "    if (i + 1) % 4 == 0:", "    micro = next(counter)\n    if micro % 4 == 0:"
    )
    result = rewrite(script)
    assert "set_requires_gradient_sync" not in result.code.decode()
    assert any("changes after backward()" in a.what and "`micro = next(counter)`" in a.why for a in result.attention)


def test_an_unused_underscore_micro_loop_variable_is_named_for_the_condition():
    script = MODEL + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
for x in batches:
    for _ in range(3):
        model(x).sum().backward()
    opt.step()
'''
    text = out(script)
    assert "    for micro_step in range(3):\n        model.set_requires_gradient_sync(micro_step == 3 - 1)\n" in text


def test_keep_global_batch_divides_the_batch_and_checks_it_divides():
    script = MODEL + '''
from torch.utils.data import DataLoader

model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(data, batch_size=bs * 2, shuffle=True)
for x in loader:
    model(x).sum().backward()
    opt.step()
'''
    text = out(script, keep_global_batch=True)
    assert 'assert (bs * 2) % world_size == 0, "the batch size must divide by the number of ranks"\n' in text
    assert "loader = DataLoader(data, batch_size=(bs * 2) // world_size, sampler=sampler)\n" in text
    assert "batch_size=bs * 2, sampler=sampler" in out(script)  # the default keeps the per-rank batch


PLAIN = MODEL + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
for x in batches:
    model(x).sum().backward()
    opt.step()
'''


def test_mixed_precision_policy_on_every_fully_shard_and_what_auto_reads():
    text = out(PLAIN, mixed_precision="bf16")
    assert "mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)\n" in text
    assert text.count("mp_policy=mp_policy") == 2  # the blocks and the root
    auto = rewrite(PLAIN, mixed_precision="auto")  # no autocast in the script: stays fp32, and says so
    assert "MixedPrecisionPolicy" not in auto.code.decode()
    assert any("uses no autocast" in a.what for a in auto.attention)
    fp16 = rewrite(PLAIN.replace("    model(x).sum()", "    with torch.autocast('cuda'):\n        y = model(x)\n    y.sum()"),
                   mixed_precision="auto")
    assert "param_dtype=torch.float16" in fp16.code.decode()  # autocast's default dtype on CUDA
    assert any("without a GradScaler" in a.what for a in fp16.attention)


def test_mixed_precision_with_batchnorm_is_refused_with_the_reason():
    script = PLAIN.replace("self.fc = nn.Linear(4, 4)", "self.fc = nn.Linear(4, 4)\n        self.bn = nn.BatchNorm1d(4)")
    result = rewrite(script, mixed_precision="bf16")
    assert result.refusals and "BatchNorm" in result.refusals[0].what
    assert result.code == result.original


def test_cpu_offload_and_hsdp_shape_the_launch_and_the_shards():
    text = out(PLAIN, cpu_offload=True, hsdp=2)
    assert 'dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")' in text
    assert "offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())\n" in text
    assert text.count("offload_policy=offload_policy") == 2
    assert 'mesh_dim_names=("replicate", "shard")' in text and "(2, world_size // 2)" in text


def test_hsdp_replicas_that_do_not_divide_the_ranks_stop_the_run_at_start_up_with_the_counts():
    """--hsdp 3 launched on 2 ranks (or run as `python train.py`, one rank): the rewrite cannot
    know the launch, so the script says it before building the mesh, and the report warns."""
    result = rewrite(PLAIN, hsdp=3)
    [check] = [line.strip() for line in result.code.decode().splitlines() if line.strip().startswith("assert world_size")]
    for ranks in (1, 2, 4):
        with pytest.raises(AssertionError, match=f"^HSDP: {ranks} ranks do not split into 3 replica groups: "
                                                 "launch a multiple of 3$"):
            exec(check, {"world_size": ranks})
    exec(check, {"world_size": 6})
    assert any("must be a multiple of 3" in c.what for c in result.changes if c.code == "launch")


ALIGNED_SAVES = MODEL + '''
def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    for step, x in enumerate(batches):
        model(x).sum().backward()
        opt.step()
        torch.save({"model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step}, "ckpt.pt")
    torch.save({
        "model": model.state_dict(),
    }, "final.pt")
'''


@pytest.mark.parametrize("flags, call", [({}, "dcp.save("), ({"async_checkpoint": True}, "checkpoint_future = dcp.async_save(")])
def test_a_save_aligned_with_its_bracket_stays_aligned(flags, call):
    """`torch.save({` becomes `dcp.save({` (2 shorter), `future = dcp.async_save({` (longer):
    the lines aligned with the bracket move with it; a hanging indent stays as written."""
    lines = out(ALIGNED_SAVES, **flags).splitlines()
    first = next(i for i, line in enumerate(lines) if line.lstrip().startswith(call + '{"model"'))
    column = lines[first].index("{") + 1
    assert lines[first + 1].index('"optimizer"') == column and lines[first + 2].index('"step"') == column
    hanging = next(i for i, line in enumerate(lines) if line.lstrip() == call + "{")
    assert lines[hanging + 1] == '        "model": get_model_state_dict(model),'


def test_a_model_compiled_where_it_is_built_is_compiled_after_sharding():
    text = out(MODEL + """
torch.manual_seed(0)
model = torch.compile(Net().to("cpu"), mode="max-autotune")
opt = optim.SGD(model.parameters(), lr=0.1)
""", reshard_after_forward="always")
    assert (
        'model = Net().to("cpu")\nfor block in model.blocks:\n    fully_shard(block)\nfully_shard(model)\n'
        'model = torch.compile(model, mode="max-autotune")\nopt = optim.SGD(model.parameters(), lr=0.1)\n'
    ) in text.replace("dist.destroy_process_group()\n", "").replace(", mesh=mesh", "")


def test_reshard_after_forward_policies():
    default = out(PLAIN)
    assert (
        "for index, block in enumerate(model.blocks):\n"
        "    fully_shard(block, mesh=mesh, reshard_after_forward=index < len(model.blocks) - 1)\n"
        "fully_shard(model, mesh=mesh)\n"
    ) in default
    always = out(PLAIN, reshard_after_forward="always")
    assert "for block in model.blocks:\n    fully_shard(block, mesh=mesh)\nfully_shard(model, mesh=mesh)\n" in always
    never = out(PLAIN, reshard_after_forward="never")
    assert (
        "for block in model.blocks:\n    fully_shard(block, mesh=mesh, reshard_after_forward=False)\n"
        "fully_shard(model, mesh=mesh, reshard_after_forward=False)\n"
    ) in never


def test_logged_losses_are_averaged_over_ranks_outside_the_rank_zero_gate():
    script = PLAIN.replace("    model(x).sum().backward()\n", "    loss = model(x).sum()\n    loss.backward()\n") + (
        'print(f"loss {loss.item():.3f}")\n'
    )
    text = out(script)
    assert (
        "loss_avg = loss.detach().clone()\n"
        "dist.all_reduce(loss_avg)  # a sum: gloo has no ReduceOp.AVG\n"
        "loss_avg /= dist.get_world_size()\n"
        "if rank == 0:\n"
        '    print(f"loss {loss_avg.item():.3f}")\n'
    ) in text
    plain = out(script, reduce_logs=False)
    assert "all_reduce" not in plain and 'if rank == 0:\n    print(f"loss {loss.item():.3f}")\n' in plain


def test_a_grad_norm_read_in_place_is_read_as_a_full_tensor():
    script = PLAIN.replace(
        "    opt.step()\n",
        "    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()\n"
        "    g2 = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))\n    opt.step()\n",
    )
    text = out(script)
    assert "gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor().item()\n" in text
    assert "g2 = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor())\n" in text
    assert out(text) == text  # a second rewrite changes nothing


@pytest.mark.parametrize("version, module", [
    ("2.4", "torch.distributed._composable.fsdp"),
    ("2.5", "torch.distributed._composable.fsdp"),
    ("2.6", "torch.distributed.fsdp"),
    ("", "torch.distributed.fsdp"),
])
def test_torch_version_picks_the_fsdp2_import_path(version, module):
    text = out(PLAIN, torch_version=version, mixed_precision="bf16", cpu_offload=True)
    assert f"from {module} import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard\n" in text


def test_a_save_under_rank_zero_moves_out_and_plain_writes_stay():
    code = out(MODEL + '''
import json

def main():
    rank = 0
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(torch.ones(4)).sum().backward()
        opt.step()
    if rank == 0:
        print("saving")
        torch.save(model.state_dict(), "final.pt")
        with open("cfg.json", "w") as f:
            json.dump({"steps": 2}, f)

main()
''')
    assert (
        "    if rank == 0:\n"
        '        print("saving")\n'
        "    if rank_1 == 0 and os.path.isfile(\"final.pt\"):  # a single-GPU run's file: moved aside, DCP saves a directory\n"
        '        os.replace("final.pt", "final.pt.single-gpu")\n'
        "    dist.barrier()  # the path is free on every rank\n"
        '    dcp.save(get_model_state_dict(model), checkpoint_id="final.pt")\n'
        "    if rank == 0:\n"
        '        with open("cfg.json", "w") as f:\n'
    ) in code


def test_a_save_under_a_rank_gate_with_an_else_is_refused():
    source = MODEL + '''
def main(rank):
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4)).sum().backward()
    opt.step()
    if rank == 0:
        torch.save(model.state_dict(), "final.pt")
    else:
        print("not saving")

main(0)
'''
    result = rewrite(source)
    assert result.refusals and result.refusals[0].what == "a checkpoint save inside a rank-0 branch that cannot be split"
    save_line = dedent(source).splitlines().index('        torch.save(model.state_dict(), "final.pt")') + 1
    assert result.refusals[0].line == save_line and result.code == dedent(source).encode()


def test_export_full_gathers_on_every_rank_and_writes_on_rank_zero():
    code = out(MODEL + '''
def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4)).sum().backward()
    opt.step()
    torch.save(model.state_dict(), "model.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "resume.pt")
    model.load_state_dict(torch.load("model.pt", map_location="cpu"))

main()
''', export="full")
    assert (
        "    model_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
        "    if rank == 0:\n"
        '        torch.save(model_state, "model.pt")\n'
    ) in code
    # a save with optimizer state stays a DCP checkpoint
    assert 'dcp.save({"model": get_model_state_dict(model), "opt": get_optimizer_state_dict(model, opt)}, checkpoint_id="resume.pt")' in code
    assert (
        "    for module in model.modules():\n        if isinstance(module, FSDPModule):\n            module.reshard()\n"
        '    set_model_state_dict(model, torch.load("model.pt", map_location="cpu") if rank == 0 else {}, '
        "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))\n"
    ) in code


def test_whole_model_pickle_becomes_a_state_dict_save_and_other_data_is_untouched():
    result = rewrite(MODEL + '''
def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = model(torch.ones(4)).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.save(model, "model.pt")
    torch.save(torch.tensor(losses), "losses.pt")
    torch.save({"losses": losses, "best": min(losses)}, "metrics.pt")

main()
''')
    code = result.code.decode()
    assert '    dcp.save(get_model_state_dict(model), checkpoint_id="model.pt")\n' in code
    assert '    torch.save(torch.tensor(losses), "losses.pt")\n' in code
    assert '    torch.save({"losses": losses, "best": min(losses)}, "metrics.pt")\n' in code
    assert any("pickled the whole module" in a.what for a in result.attention)


def test_an_alias_of_the_model_saves_like_the_model():
    code = out(MODEL + '''
def main(ddp=False):
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    raw_model = model.module if ddp else model
    model(torch.ones(4)).sum().backward()
    opt.step()
    torch.save(raw_model.state_dict(), "final.pt")

main()
''')
    assert '    dcp.save(get_model_state_dict(raw_model), checkpoint_id="final.pt")\n' in code


def test_a_checkpoint_read_before_the_model_is_built_is_refused():
    source = MODEL + '''
def main():
    checkpoint = torch.load("ckpt.pt")
    model = Net()
    model.load_state_dict(checkpoint["model"])
    opt = optim.SGD(model.parameters(), lr=0.1)
    opt.load_state_dict(checkpoint["opt"])
    model(torch.ones(4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "ckpt.pt")

main()
'''
    result = rewrite(source)
    assert result.refusals and result.refusals[0].what == "the checkpoint is read before `model` is built"
    assert result.code == dedent(source).encode()


def test_a_value_that_may_be_a_tensor_is_flagged_at_the_resume():
    result = rewrite(MODEL + '''
def main(resume):
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    if resume:
        ckpt = torch.load("ckpt.pt")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step, loss = ckpt["step"], ckpt["loss"]
    for step in range(2):
        loss = model(torch.ones(4)).sum()
        loss.backward()
        opt.step()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "loss": loss}, "ckpt.pt")

main(False)
''')
    code = result.code.decode()
    assert (
        "        ckpt = {\n"
        '            "model": get_model_state_dict(model),\n'
        '            "opt": get_optimizer_state_dict(model, opt),\n'
        '            "step": None,\n'
        '            "loss": None,\n'
        "        }\n"
        '        if os.path.isdir("ckpt.pt"):  # a DCP checkpoint directory: this script\'s own save\n'
        '            dcp.load(ckpt, checkpoint_id="ckpt.pt")\n'
    ) in code
    assert [a.what for a in result.attention if a.code == "resume"] == [
        "'loss' may be saved as a tensor: its dcp.load placeholder is None"
    ]


def test_async_saves_wait_for_the_previous_one_and_at_the_end():
    code = out(MODEL + '''
def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model(torch.ones(4)).sum().backward()
        opt.step()
        torch.save({"model": model.state_dict(), "step": step}, "ckpt.pt")

main()
''', async_checkpoint=True)
    assert (
        '    checkpoint_group = dist.new_group(backend="gloo")\n'
        "    checkpoint_future = None\n"
        "    for step in range(4):\n"
    ) in code
    assert (
        "        if checkpoint_future is not None:\n"
        "            checkpoint_future.result()\n"
        "        if rank == 0 and os.path.isfile(\"ckpt.pt\"):  # a single-GPU run's file: moved aside, DCP saves a directory\n"
        '            os.replace("ckpt.pt", "ckpt.pt.single-gpu")\n'
        "        dist.barrier()  # the path is free on every rank\n"
        '        checkpoint_future = dcp.async_save({"model": get_model_state_dict(model), "step": step}, '
        'checkpoint_id="ckpt.pt", process_group=checkpoint_group)\n'
    ) in code
    assert code.endswith(
        "    if checkpoint_future is not None:\n        checkpoint_future.result()\n    dist.destroy_process_group()\n\nmain()\n"
    )


def test_a_dcp_save_first_moves_a_file_at_its_path_aside_on_rank_zero():
    """A single-GPU run's file at a save's path: dcp.save would fail there (FileExistsError)
    after the training up to it; rank 0 renames the file, every rank waits, then saves."""
    result = rewrite(MODEL + '''
def main(path):
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model(torch.ones(4)).sum().backward()
        opt.step()
        torch.save({"model": model.state_dict(), "step": step}, path)

main("ckpt.pt")
''')
    code = result.code.decode()
    assert (
        "        if rank == 0 and os.path.isfile(path):  # a single-GPU run's file: moved aside, DCP saves a directory\n"
        '            os.replace(path, str(path) + ".single-gpu")\n'
        "        dist.barrier()  # the path is free on every rank\n"
        '        dcp.save({"model": get_model_state_dict(model), "step": step}, checkpoint_id=path)\n'
    ) in code
    assert "import os\n" in code
    saves = [c for c in result.changes if c.code == "checkpoint" and "dcp.save" in c.what]
    assert len(saves) == 1 and "is first renamed `str(path) + \".single-gpu\"` on rank 0" in saves[0].why


def test_async_checkpoint_with_nothing_to_make_async_says_so():
    train = MODEL + '''
def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model(torch.ones(4)).sum().backward()
        opt.step()
    SAVE

main()
'''
    def notes(result):
        return [a.what for a in result.attention if a.what.startswith("--async-checkpoint")]

    unsaved = rewrite(train.replace("SAVE", "print(step)"), async_checkpoint=True)
    assert notes(unsaved) == ["--async-checkpoint changes nothing: the script saves no model or optimizer state"]
    full = rewrite(train.replace("SAVE", 'torch.save(model.state_dict(), "m.pt")'), async_checkpoint=True,
                   export="full")
    assert notes(full) == [
        "--async-checkpoint changes nothing: every checkpoint save stays one torch.save file (--export full)"]
    assert "async_save" not in full.code.decode()
    dcp = rewrite(train.replace("SAVE", 'torch.save(model.state_dict(), "m.pt")'), async_checkpoint=True)
    assert "dcp.async_save" in dcp.code.decode() and notes(dcp) == []
    assert notes(rewrite(train.replace("SAVE", "print(step)"))) == []  # not asked: nothing said


def test_a_rank_gated_call_of_a_saving_helper_runs_on_every_rank():
    code = out(MODEL + '''
def save_checkpoint(model, opt, path):
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)


def main(is_main=True):
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4)).sum().backward()
    opt.step()
    if is_main:
        print("saving")
        save_checkpoint(model, opt, "ckpt.pt")

main()
''')
    assert '    if is_main:\n        print("saving")\n    save_checkpoint(model, opt, "ckpt.pt")\n' in code


@pytest.mark.parametrize(
    "test, gated",
    [
        ("rank == 0", True),
        ("args.local_rank == 0", True),
        ("dist.get_rank() == 0", True),
        ('int(os.environ.get("RANK", 0)) == 0', True),
        ("not rank", True),
        ("master_process", True),
        ("accelerator.is_main_process", True),
        ("args.rank_loss", False),
        ("step % 2 == 0", False),
        ("rank == 1", False),
    ],
)
def test_what_counts_as_a_rank_zero_test(test, gated):
    import libcst as cst

    from fsdp2_retrofit.analysis.checkpoints import is_rank_test

    assert is_rank_test(cst.parse_expression(test)) is gated


def test_a_save_under_a_plain_condition_that_mentions_rank_stays_under_it():
    code = out(MODEL + '''
def main(args):
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4)).sum().backward()
    opt.step()
    if args.rank_loss:
        torch.save(model.state_dict(), "final.pt")

main(None)
''')
    assert (
        "    if args.rank_loss:\n"
        "        if rank == 0 and os.path.isfile(\"final.pt\"):  # a single-GPU run's file: moved aside, DCP saves a directory\n"
        '            os.replace("final.pt", "final.pt.single-gpu")\n'
        "        dist.barrier()  # the path is free on every rank\n"
        '        dcp.save(get_model_state_dict(model), checkpoint_id="final.pt")\n'
    ) in code


def test_a_scheduler_built_after_the_resume_is_refused():
    source = MODEL + '''
def main():
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    ckpt = torch.load("ckpt.pt")
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched = optim.lr_scheduler.StepLR(opt, 1)
    sched.load_state_dict(ckpt["sched"])
    model(torch.ones(4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, "ckpt.pt")

main()
'''
    result = rewrite(source)
    assert result.refusals and result.refusals[0].what == "the checkpoint is read before `sched` is built"


def test_a_save_under_a_rank_test_joined_by_or_is_refused():
    result = rewrite(MODEL + '''
def main(rank, final):
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4)).sum().backward()
    opt.step()
    if final or rank == 0:
        torch.save(model.state_dict(), "final.pt")

main(0, True)
''')
    assert result.refusals and result.refusals[0].what == "a checkpoint save inside a rank-0 branch that cannot be split"


def test_an_evaluation_under_no_grad_in_a_split_rank_gate_runs_on_every_rank():
    code = out(MODEL + '''
import json

def main(master_process=True):
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4)).sum().backward()
    opt.step()
    if master_process:
        with torch.no_grad():
            val = model(torch.ones(4)).sum().item()
        torch.save(model.state_dict(), "final.pt")
        with open("val.json", "w") as f:
            json.dump({"val": val}, f)

main()
''')
    assert (
        "    with torch.no_grad():\n"
        "        val = model(torch.ones(4)).sum().item()\n"
        "    if rank == 0 and os.path.isfile(\"final.pt\"):  # a single-GPU run's file: moved aside, DCP saves a directory\n"
        '        os.replace("final.pt", "final.pt.single-gpu")\n'
        "    dist.barrier()  # the path is free on every rank\n"
        '    dcp.save(get_model_state_dict(model), checkpoint_id="final.pt")\n'
        "    if master_process:\n"
        '        with open("val.json", "w") as f:\n'
    ) in code


def test_meta_init_with_cpu_offload_allocates_the_shards_on_the_cpu():
    text = out(PLAIN, meta_init=True, cpu_offload=True)
    assert 'model.to_empty(device="cpu")' in text
    assert "offload_policy=offload_policy" in text


def test_tensor_batches_without_a_dataloader_are_flagged_as_training_differently():
    result = rewrite_source((MODEL + '''
torch.manual_seed(0)
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
data = torch.randn(64, 8)
for i in range(0, 64, 16):
    x = data[i:i + 16]
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
''').encode(), "train.py", RetrofitOptions())
    flagged = [a for a in result.attention if a.differs]
    loop_line = MODEL.count("\n") + 6  # the `for` over slices of `data`
    assert [(a.code, a.line) for a in flagged] == [("data", loop_line)]
    assert all(not a.differs for a in result.attention if a not in flagged)


def test_shard_option_naming_no_class_of_the_model_is_refused():
    """--shard NoSuchClass would shard only the root: refused, naming the classes found."""
    code = MODEL + "\nmodel = Net()\nopt = optim.SGD(model.parameters(), lr=0.1)\n"
    result = rewrite(code, shard=("NoSuchClass",))
    line = code.splitlines().index("model = Net()") + 1
    assert [(r.code, r.line) for r in result.refusals] == [("FSR630", line)]
    assert "--shard NoSuchClass" in result.refusals[0].what
    assert "(its classes: Block, Linear, Net, Sequential)" in result.refusals[0].what
    # a class the model is built of, bare or dotted, and torch's own leaves are accepted
    for name in ("Block", "mymodels.Block", "Linear", "Net"):
        assert not rewrite(MODEL + "\nmodel = Net()\nopt = optim.SGD(model.parameters(), lr=0.1)\n",
                           shard=(name,)).refusals, name


def test_shard_option_reads_the_methods_init_calls_on_self():
    """ResNet's shape: the blocks are built in `self._make_layer(...)`; a class it builds is
    accepted, one no module is of is refused."""
    code = MODEL.replace(
        "self.blocks = nn.Sequential(*[Block() for _ in range(3)])", "self.blocks = self._make_layer(3)"
    ).replace("    def forward(self, x):\n        return self.head", """    def _make_layer(self, n):
        return nn.Sequential(*[Block() for _ in range(n)])

    def forward(self, x):
        return self.head""") + "\nmodel = Net()\nopt = optim.SGD(model.parameters(), lr=0.1)\n"
    assert "self._make_layer(3)" in code and "def _make_layer" in code
    ok = rewrite(code, shard=("Block",))
    assert not ok.refusals and not [a for a in ok.attention if "--shard" in a.what]
    assert [r.code for r in rewrite(code, shard=("Nope",)).refusals] == ["FSR630"]


def test_shard_option_with_a_class_made_through_partial_is_a_note():
    code = ("from functools import partial\n" + MODEL).replace(
        "self.blocks = nn.Sequential(*[Block() for _ in range(3)])",
        "make = partial(Block)\n        self.blocks = nn.Sequential(*[make() for _ in range(3)])",
    ) + "\nmodel = Net()\nopt = optim.SGD(model.parameters(), lr=0.1)\n"
    result = rewrite(code, shard=("Nope",))
    assert not result.refusals
    assert any(a.what.startswith("--shard Nope: not a class the rewrite reads") for a in result.attention)


def test_shard_option_for_a_model_with_unread_classes_is_a_note():
    """A submodule some function returns may hold the class: matched at run time, said so."""
    code = MODEL.replace("self.head = nn.Linear(4, 2)", "self.head = make_head()") + '''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
'''
    result = rewrite(code, shard=("Head",))
    assert not result.refusals
    assert any("--shard Head: not a class the rewrite reads" in a.what for a in result.attention)


@pytest.mark.parametrize("version, refused", [("2.4", True), ("2.5", False), ("2.6", False), ("", False)])
@pytest.mark.parametrize("build", [
    "torch.amp.GradScaler('cuda')", "torch.cuda.amp.GradScaler()", "GradScaler('cuda', init_scale=1024)",
])
def test_a_grad_scaler_needs_torch_2_5(version, refused, build):
    """GradScaler unscales fully_shard's DTensor gradients (and reduces its inf check over the
    ranks) from torch 2.5 on: --torch-version 2.4 output would fail at scaler.step."""
    script = MODEL.replace("import torch\n", "import torch\nfrom torch.amp import GradScaler\n", 1) + f'''
model = Net()
opt = optim.SGD(model.parameters(), lr=0.1)
scaler = {build}
for x in torch.randn(4, 8, 4):
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)
    scaler.update()
'''
    result = rewrite(script, torch_version=version)
    if refused:
        assert [(r.code, r.line) for r in result.refusals] == [("FSR643", MODEL.count("\n") + 5)]  # + the import line
        assert result.code == dedent(script).encode()
    else:
        assert not result.refusals, result.refusals
        assert f"scaler = {build}\n" in result.code.decode()


def test_a_keyword_argument_takes_no_name_from_the_generated_code():
    """`DataLoader(..., sampler=train_sampler)` binds no `sampler`: the generated sampler is `sampler`,
    not `sampler_1`; a name the script binds itself (`sampler = None`) is still taken."""
    script = MODEL + dedent('''
        def main():
            model = Net()
            opt = optim.SGD(model.parameters(), lr=0.1)
            data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 4))
            train_sampler = None
            loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=train_sampler)
            for x, y in loader:
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()


        if __name__ == "__main__":
            main()
    ''')
    code = rewrite_source(script.encode(), "train.py").code.decode()
    assert "sampler = DistributedSampler(data" in code and "sampler_1" not in code
    taken = rewrite_source(script.replace("train_sampler", "sampler").encode(), "train.py").code.decode()
    assert "sampler_1 = DistributedSampler(data" in taken
