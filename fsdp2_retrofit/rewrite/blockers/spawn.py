"""FSR1.. spawn: mp.spawn launchers the rewrite cannot turn into torchrun workers (FSR101, FSR102, FSR103, FSR104, FSR105, FSR106, FSR107, FSR108, FSR109, FSR110, FSR111)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class SpawnMoreThanOnce(Blocker):
    """The script calls mp.spawn more than once.

    ## Why
    torchrun starts one set of processes per run.

    ## What to do
    Launch one worker function.
    """

    CODE = "FSR101"
    NAME = "spawn-more-than-once"
    INVALID = (Invalid(
        """\
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def train(rank, world_size, epochs):
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    model = nn.Linear(8, 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    mp.spawn(train, args=(world_size, 1), nprocs=world_size)  # smoke test
    mp.spawn(train, args=(world_size, 10), nprocs=world_size)
""",
        line=23,
    ),)


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
        """\
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def main(world_size):
    def train(rank, world_size):
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
        torch.cuda.set_device(rank)
        model = nn.Linear(8, 2).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(10):
            loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        dist.destroy_process_group()

    mp.spawn(train, args=(world_size,), nprocs=world_size)


if __name__ == "__main__":
    main(torch.cuda.device_count())
""",
        line=20,
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
    INVALID = (Invalid(
        """\

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
    mp.spawn(worker, args=make_args(), nprocs=n)
""",
        line=31,
    ),)


class SpawnResultUsed(Blocker):
    """The value mp.spawn returns is used.

    ## Why
    torchrun workers return nothing to a launcher: there is no spawn context or return value.

    ## What to do
    Call mp.spawn(...) as a statement of its own.
    """

    CODE = "FSR104"
    NAME = "spawn-result-used"
    INVALID = (Invalid(
        """\

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
    ctx = mp.spawn(worker, args=(n, None), nprocs=n, join=False)
""",
        line=31,
    ),)


class SpawnLauncherOption(Blocker):
    """mp.spawn is given `join=False` or another launcher option.

    ## Why
    The launching process would keep working alongside its workers; under torchrun there is none.

    ## What to do
    Join the workers (the default) and run rewrite again.
    """

    CODE = "FSR105"
    NAME = "spawn-launcher-option"
    INVALID = (Invalid(
        """\

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
    mp.spawn(worker, args=(n, None), nprocs=n, join=False)
""",
        line=31,
    ),)


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
    INVALID = (Invalid(
        """\

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
    q = mp.Queue()
    mp.spawn(worker, args=(n, q), nprocs=n)
""",
        line=32,
    ),)


class SpawnWorkerSignature(Blocker):
    """The worker does not take exactly the spawn index plus the spawn args.

    ## Why
    The rewrite maps each spawn argument to one parameter.

    ## What to do
    Give the worker plain parameters.
    """

    CODE = "FSR107"
    NAME = "spawn-worker-signature"
    INVALID = (Invalid(
        """\
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def train(rank, world_size, epochs=10):
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    model = nn.Linear(8, 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    mp.spawn(train, args=(world_size,), nprocs=world_size)
""",
        line=7,
    ),)


class SpawnWorkerWithoutProcessGroup(Blocker):
    """The spawned worker starts no process group.

    ## Why
    An mp.spawn worker without init_process_group cannot become a torchrun worker automatically.

    ## What to do
    Call dist.init_process_group in the worker.
    """

    CODE = "FSR108"
    NAME = "spawn-worker-without-process-group"
    INVALID = (Invalid(
        """\
import torch
import torch.multiprocessing as mp
import torch.nn as nn

LEARNING_RATES = [1e-2, 1e-3, 1e-4, 1e-5]


def train(rank, lrs):
    torch.cuda.set_device(rank)
    model = nn.Linear(8, 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[rank])
    for _ in range(10):
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.save(model.state_dict(), f"model_lr{lrs[rank]}.pt")


if __name__ == "__main__":
    mp.spawn(train, args=(LEARNING_RATES,), nprocs=len(LEARNING_RATES))
""",
        line=8,
    ),)


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
        """\
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def train(rank, world_size):
    store = dist.TCPStore("127.0.0.1", 29500, world_size, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    model = nn.Linear(8, 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(10):
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    mp.spawn(train, args=(world_size,), nprocs=world_size)
""",
        line=9,
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
        """\
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def train(gpu, node_rank, gpus_per_node, world_size):
    os.environ["MASTER_ADDR"] = "10.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group("nccl", rank=node_rank * gpus_per_node + gpu, world_size=world_size)
    torch.cuda.set_device(gpu)
    model = nn.Linear(8, 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(10):
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    gpus = torch.cuda.device_count()
    node_rank, nodes = int(os.environ["NODE_RANK"]), int(os.environ["NODES"])
    mp.spawn(train, args=(node_rank, gpus, nodes * gpus), nprocs=gpus)
""",
        line=12,
    ),)
    VALID = (Valid(
        """\
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def train(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    model = nn.Linear(8, 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(10):
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    mp.spawn(train, args=(world_size,), nprocs=world_size)
""",
    ),)


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
        """\
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def train(rank, world_size):
    dist.init_process_group("nccl", "tcp://127.0.0.1:29500", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    model = nn.Linear(8, 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(10):
        loss = model(torch.randn(4, 8, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    mp.spawn(train, args=(world_size,), nprocs=world_size)
""",
        line=8,
    ),)
