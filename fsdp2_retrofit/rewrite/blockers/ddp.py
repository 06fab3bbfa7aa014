"""FSR2.. ddp: DistributedDataParallel / DataParallel code the migration cannot lift (FSR201, FSR202, FSR203, FSR204, FSR205, FSR206)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import CUDA_MODEL, CUDA_STEPS, OPT

_IMPORTS = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
"""
_HEAD = _IMPORTS + 'dist.init_process_group("nccl")\n'  # lines 1-4
_WRAP = "model = DDP(model)\n"
_LOOP = OPT + CUDA_STEPS


class DdpWrapInExpression(Blocker):
    """A DDP/DataParallel wrapper is built inside another expression, not `model = DDP(model, ...)`
    (or `self.model = DDP(self.model, ...)` in a method of a trainer class).

    ## Why
    The migration replaces wrap statements; a wrapper returned, passed on or stored in a container
    or in another object's attribute cannot be followed.

    ## What to do
    Wrap the model on its own line: `model = DDP(model, device_ids=[local_rank])`.
    """

    CODE = "FSR201"
    NAME = "ddp-wrap-in-expression"
    INVALID = (Invalid(
        _HEAD + """\
def build(model):
    return DDP(model)
model = build(torch.nn.Linear(8, 2).cuda())
""" + _LOOP,
        line=6,
    ),)
    INVALID = INVALID + (Invalid(
        _HEAD + "import types\n" + CUDA_MODEL + "run = types.SimpleNamespace()\nrun.model = DDP(model)\n" + OPT + """\
for step in range(10):
    run.model(torch.randn(4, 8, device="cuda")).sum().backward()
    opt.step()
""",
        line=8,
    ),)
    VALID = (
        Valid(
            _HEAD + CUDA_MODEL + _WRAP + _LOOP + """\
if dist.get_rank() == 0:
    torch.save(model.module.state_dict(), "model.pt")
""",
        ),
        Valid(  # the wrap on the trainer's own attribute, the snapshot saved by a method under a rank test
            _HEAD + """\
import os
class Trainer:
    def __init__(self, model, opt):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model.to(self.gpu_id)
        self.opt = opt
        self.model = DDP(self.model, device_ids=[self.gpu_id])
    def save(self):
        torch.save(self.model.module.state_dict(), "model.pt")
    def train(self):
        for step in range(10):
            self.model(torch.randn(4, 8, device="cuda")).sum().backward()
            self.opt.step()
            if self.gpu_id == 0:
                self.save()
""" + CUDA_MODEL + OPT + "Trainer(model, opt).train()\n",
        ),
    )


class DdpWrapperClassUsed(Blocker):
    """The script uses the wrapper class itself (isinstance, subclass).

    ## Why
    After the migration no model is a DDP/DataParallel: the test or subclass would change meaning.

    ## What to do
    Drop the test (the model is never wrapped after the rewrite) and run rewrite again.
    """

    CODE = "FSR202"
    NAME = "ddp-wrapper-class-used"
    INVALID = (Invalid(_HEAD + CUDA_MODEL + _WRAP + "assert isinstance(model, DDP)\n" + _LOOP, line=7),)


class DdpNoSyncShape(Blocker):
    """`no_sync()` is used in a shape the migration does not convert.

    ## Why
    FSDP2 has no no_sync context; the migration turns `with model.no_sync():` (on lines of its own)
    and `ctx = model.no_sync() if ... else nullcontext()` into set_requires_gradient_sync.

    ## What to do
    Use `with model.no_sync():` around the backward of the micro-batches that must not sync.
    """

    CODE = "FSR203"
    NAME = "ddp-no-sync-shape"
    INVALID = (
        Invalid(
            "import contextlib\n" + _HEAD + CUDA_MODEL + _WRAP + OPT + """\
for step in range(10):
    with contextlib.nullcontext() if step % 4 == 3 else model.no_sync():
        model(torch.randn(4, 8, device="cuda")).sum().backward()
    if step % 4 == 3:
        opt.step()
""",
            line=10,
        ),
        Invalid(
            _HEAD + CUDA_MODEL + _WRAP + OPT + """\
for step in range(10):
    loss = model(torch.randn(4, 8, device="cuda")).sum()
    if step % 4 != 3:
        with model.no_sync(): loss.backward()
    else:
        loss.backward()
        opt.step()
""",
            line=11,
        ),
    )
    VALID = (Valid(
        _HEAD + CUDA_MODEL + _WRAP + OPT + """\
for step in range(10):
    loss = model(torch.randn(4, 8, device="cuda")).sum()
    if step % 4 != 3:
        with model.no_sync():
            loss.backward()
    else:
        loss.backward()
        opt.step()
""",
    ),)


class DdpRankSeed(Blocker):
    """The random seed of a DDP script depends on the rank.

    ## Why
    DDP copies rank 0's weights when it wraps; fully_shard keeps each rank's own slice of its own
    weights, so a per-rank seed would mix initialisations.

    ## What to do
    Seed the model build with the same value on every rank (seed data augmentation separately).
    """

    CODE = "FSR204"
    NAME = "ddp-rank-seed"
    INVALID = (Invalid(_HEAD + "torch.manual_seed(1234 + dist.get_rank())\n" + CUDA_MODEL + _WRAP + _LOOP, line=5),)


class DdpAndDataParallel(Blocker):
    """The script uses both DataParallel and DistributedDataParallel.

    ## Why
    One process per device cannot be derived from both.

    ## What to do
    Keep one of them.
    """

    CODE = "FSR205"
    NAME = "ddp-and-data-parallel"
    INVALID = (Invalid(
        "import os\n" + _IMPORTS + CUDA_MODEL + """\
if "LOCAL_RANK" in os.environ:
    dist.init_process_group("nccl")
    model = DDP(model)
else:
    model = torch.nn.DataParallel(model)
""" + _LOOP,
        line=8,
    ),)


class DdpUnknownArgument(Blocker):
    """A DDP/DataParallel argument has no FSDP2 counterpart the rewrite knows.

    ## Why
    Dropping it could change what the script does (e.g. a process_group other than the world).

    ## What to do
    Remove the argument (or build the mesh by hand) and run rewrite again.
    """

    CODE = "FSR206"
    NAME = "ddp-unknown-argument"
    INVALID = (Invalid(
        _HEAD + "group = dist.new_group(ranks=[0, 1])\n" + CUDA_MODEL
        + "model = DDP(model, process_group=group)\n" + _LOOP,
        line=7,
    ),)
