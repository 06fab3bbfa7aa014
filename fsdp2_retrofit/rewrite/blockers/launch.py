"""FSR4.. launch: where the process group and the mesh cannot be started (FSR401, FSR402, FSR403, FSR404, FSR405)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import MODEL, OPT, STEPS, TRAINING

_DIST = "import torch\nimport torch.distributed as dist\n"


class LaunchConditionalProcessGroup(Blocker):
    """The process group is started under a condition.

    ## Why
    fully_shard needs the process group and a device mesh on every run.

    ## What to do
    Start it directly under one `if` (`if ddp: init_process_group(backend)`, no init_method or rank
    arguments; the other branch then gets a process group of one process), or unconditionally.
    """

    CODE = "FSR401"
    NAME = "launch-conditional-process-group"
    INVALID = (Invalid(
        "import os\n" + _DIST + """\
if "RANK" in os.environ:
    if torch.cuda.is_available():
        dist.init_process_group("nccl")
""" + TRAINING,
        line=6,
    ),)


class LaunchModelBeforeProcessGroup(Blocker):
    """The model is built before the script starts its process group.

    ## Why
    fully_shard needs the device mesh, which needs the process group; sharding must follow the
    build.

    ## What to do
    Start the process group (init_process_group) before building the model.
    """

    CODE = "FSR402"
    NAME = "launch-model-before-process-group"
    INVALID = (Invalid(_DIST + MODEL + 'dist.init_process_group("gloo")\n' + OPT + STEPS, line=3),)


class LaunchTrainingFramework(Blocker):
    """The script trains through Accelerate, Lightning (Trainer or Fabric) or DeepSpeed.

    ## Why
    The framework starts the process group and wraps the model itself; a torchrun process group and
    fully_shard added on top fail at start-up (the default process group initialised twice).

    ## What to do
    Use the framework's own FSDP2 support (Accelerate's FSDP plugin, Lightning's
    ModelParallelStrategy, a DeepSpeed ZeRO config), or drop the framework first.
    """

    CODE = "FSR403"
    NAME = "launch-training-framework"
    INVALID = (Invalid(
        "import torch\nimport pytorch_lightning as pl\n" + MODEL + OPT + "pl.Trainer(max_epochs=1).fit(model)\n",
        line=5,
    ),)


class LaunchReturnedModelUnfollowed(Blocker):
    """A helper builds the model and returns it in a way the rewrite does not follow.

    ## Why
    The process group must start before the helper runs and end after its caller is done with the
    model; the rewrite follows `return model, optimizer` (plain names) into one `model, optimizer =
    build(...)`.

    ## What to do
    Return plain names and call the helper once, as `model = build(...)` or `model, optimizer =
    build(...)`.
    """

    CODE = "FSR404"
    NAME = "launch-returned-model-unfollowed"
    INVALID = (Invalid(
        """\
import torch
def build():
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model.to("cpu"), opt
model, opt = build()
""" + STEPS,
        line=3,
    ),)
    # plain names returned, the helper called once
    VALID = (Valid(
        """\
import torch
def build():
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt
model, opt = build()
""" + STEPS,
    ),)


class LaunchDistNameTaken(Blocker):
    """The script binds the name `dist` to something other than torch.distributed.

    ## Why
    Every line the rewrite writes calls torch.distributed as `dist` (`dist.init_process_group`,
    `dist.get_rank()`) and imports it as `import torch.distributed as dist`; with the script's own
    `dist` (`import torch.distributions as dist`) one import rebinds the other and the process group
    or the script's own `dist.<name>` raises AttributeError at run time.

    ## What to do
    Give the script's value another name (`import torch.distributions as D`, and `D.Categorical`
    where it is used), then rewrite again.
    """

    CODE = "FSR405"
    NAME = "launch-dist-name-taken"
    INVALID = (Invalid("import torch\ndist = torch.distributions\n" + TRAINING, line=2),)
    VALID = (Valid("import torch\nD = torch.distributions\n" + TRAINING),)
