"""FSR1.. spawn: mp.spawn launchers the rewrite cannot turn into torchrun workers (FSR101, FSR102, FSR103, FSR104, FSR105, FSR106, FSR107, FSR108, FSR109, FSR110, FSR111)."""
from __future__ import annotations

import textwrap

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)

_HEAD = """\
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
"""

_INIT = """\
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
"""

_BODY = """\
    model = torch.nn.Linear(8, 2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    opt.step()
"""

_WORKER = "def train(rank, world_size):\n" + _INIT + _BODY  # lines 4-9 after _HEAD
_SPAWN = "mp.spawn(train, args=(2,), nprocs=2)\n"


class SpawnMoreThanOnce(Blocker):
    """The script calls mp.spawn more than once.

    ## Why
    torchrun starts one set of processes per run.

    ## What to do
    Launch one worker function.
    """

    CODE = "FSR101"
    NAME = "spawn-more-than-once"
    INVALID = (Invalid(_HEAD + _WORKER + _SPAWN + _SPAWN, line=11),)


class SpawnWorkerNotTopLevel(Blocker):
    """The function mp.spawn starts is not a top-level function of the script.

    ## Why
    The rewrite must call it once per torchrun process and rewrite its process group.

    ## What to do
    Spawn a function defined at the top level of the script.
    """

    CODE = "FSR102"
    NAME = "spawn-worker-not-top-level"
    INVALID = (Invalid(
        _HEAD + "def main():\n" + textwrap.indent(_WORKER, "    ")
        + "    mp.spawn(train, args=(2,), nprocs=2)\nmain()\n",
        line=11,
    ),)


class SpawnArgsNotLiteral(Blocker):
    """The args of mp.spawn are not a tuple written in the call.

    ## Why
    Each argument is mapped to one of the worker's parameters (the world size to WORLD_SIZE).

    ## What to do
    Write `args=(a, b, ...)` in the call.
    """

    CODE = "FSR103"
    NAME = "spawn-args-not-literal"
    INVALID = (Invalid(_HEAD + _WORKER + "mp.spawn(train, args=make_args(), nprocs=2)\n", line=10),)


class SpawnResultUsed(Blocker):
    """The value mp.spawn returns is used.

    ## Why
    torchrun workers return nothing to a launcher: there is no spawn context or return value.

    ## What to do
    Call mp.spawn(...) as a statement of its own.
    """

    CODE = "FSR104"
    NAME = "spawn-result-used"
    INVALID = (Invalid(_HEAD + _WORKER + "ctx = mp.spawn(train, args=(2,), nprocs=2)\n", line=10),)


class SpawnLauncherOption(Blocker):
    """mp.spawn is given `join=False` or another launcher option.

    ## Why
    The launching process would keep working alongside its workers; under torchrun there is none.

    ## What to do
    Join the workers (the default) and run rewrite again.
    """

    CODE = "FSR105"
    NAME = "spawn-launcher-option"
    INVALID = (Invalid(_HEAD + _WORKER + "mp.spawn(train, args=(2,), nprocs=2, join=False)\n", line=10),)


class SpawnSharedObject(Blocker):
    """A queue, pipe, manager or shared value is handed to the workers.

    ## Why
    These live in the launching process; torchrun workers are separate programs and cannot receive
    them.

    ## What to do
    Exchange results through files or collectives (dist.gather_object) instead.
    """

    CODE = "FSR106"
    NAME = "spawn-shared-object"
    INVALID = (Invalid(_HEAD + _WORKER + "q = mp.Queue()\nmp.spawn(train, args=(q,), nprocs=2)\n", line=11),)


class SpawnWorkerSignature(Blocker):
    """The worker does not take exactly the spawn index plus the spawn args.

    ## Why
    The rewrite maps each spawn argument to one parameter.

    ## What to do
    Give the worker plain parameters.
    """

    CODE = "FSR107"
    NAME = "spawn-worker-signature"
    INVALID = (Invalid(_HEAD + "def train(rank, world_size, epochs=10):\n" + _INIT + _BODY + _SPAWN, line=4),)


class SpawnWorkerWithoutProcessGroup(Blocker):
    """The spawned worker starts no process group.

    ## Why
    An mp.spawn worker without init_process_group cannot become a torchrun worker automatically.

    ## What to do
    Call dist.init_process_group in the worker.
    """

    CODE = "FSR108"
    NAME = "spawn-worker-without-process-group"
    INVALID = (Invalid(_HEAD + "def train(rank, world_size):\n" + _BODY + _SPAWN, line=4),)


class SpawnInitStore(Blocker):
    """init_process_group is given a store.

    ## Why
    torchrun's env:// rendezvous replaces the store.

    ## What to do
    Drop `store=` and run rewrite again.
    """

    CODE = "FSR109"
    NAME = "spawn-init-store"
    INVALID = (Invalid(
        _HEAD + """\
def train(rank, world_size):
    store = dist.TCPStore("127.0.0.1", 29500, world_size, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size)
""" + _BODY + _SPAWN,
        line=6,
    ),)


class SpawnComputedRank(Blocker):
    """The worker computes its global rank for init_process_group.

    ## Why
    torchrun's RANK replaces it, but the script's own rank arithmetic would stay in use elsewhere.

    ## What to do
    Pass the spawn index as the rank.
    """

    CODE = "FSR110"
    NAME = "spawn-computed-rank"
    INVALID = (Invalid(
        _HEAD + """\
def train(gpu, node_rank):
    dist.init_process_group("nccl", rank=node_rank * 2 + gpu, world_size=4)
""" + _BODY + "mp.spawn(train, args=(1,), nprocs=2)\n",
        line=5,
    ),)
    VALID = (Valid(_HEAD + _WORKER + _SPAWN),)


class SpawnInitPositional(Blocker):
    """init_process_group takes positional arguments after the backend.

    ## Why
    init_method, world_size and rank must be recognised to be dropped.

    ## What to do
    Pass them by keyword.
    """

    CODE = "FSR111"
    NAME = "spawn-init-positional"
    INVALID = (Invalid(
        _HEAD + """\
def train(rank, world_size):
    dist.init_process_group("nccl", "tcp://127.0.0.1:29500", rank=rank, world_size=world_size)
""" + _BODY + _SPAWN,
        line=5,
    ),)
