"""FSR2.. ddp: DistributedDataParallel / DataParallel code the migration cannot lift (FSR201, FSR202, FSR203, FSR204, FSR205, FSR206)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class DdpWrapInExpression(Blocker):
    """A DDP/DataParallel wrapper is built inside another expression, not `model = DDP(model, ...)`.

    ## Why
    The migration replaces wrap statements; a wrapper returned, passed on or stored in an attribute
    cannot be followed.

    ## What to do
    Wrap the model on its own line: `model = DDP(model, device_ids=[local_rank])`.
    """

    CODE = "FSR201"
    NAME = "ddp-wrap-in-expression"
    INVALID = (Invalid(
        """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def build_model(local_rank):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
    return DDP(model, device_ids=[local_rank])


dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = build_model(local_rank)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
""",
        line=11,
    ),)
    VALID = (Valid(
        """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
model = DDP(model, device_ids=[local_rank])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 0:
    torch.save(model.module.state_dict(), "model.pt")
dist.destroy_process_group()
""",
    ),)


class DdpWrapperClassUsed(Blocker):
    """The script uses the wrapper class itself (isinstance, subclass).

    ## Why
    After the migration no model is a DDP/DataParallel: the test or subclass would change meaning.

    ## What to do
    Drop the test (the model is never wrapped after the rewrite) and run rewrite again.
    """

    CODE = "FSR202"
    NAME = "ddp-wrapper-class-used"
    INVALID = (Invalid(
        """\

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

model = torch.nn.parallel.DistributedDataParallel(Net())
isinstance(model, torch.nn.parallel.DistributedDataParallel)
opt = optim.SGD(model.parameters(), lr=0.1)
""",
        line=25,
    ),)


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
            """\
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
model = DDP(model, device_ids=[local_rank])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    last = step % 4 == 3
    with contextlib.nullcontext() if last else model.no_sync():
        loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
        loss.backward()
    if last:
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
""",
            line=17,
        ),
        Invalid(
            """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
model = DDP(model, device_ids=[local_rank])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    if step % 4 != 3:
        with model.no_sync(): loss.backward()
    else:
        loss.backward()
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
""",
            line=17,
        ),
    )
    VALID = (Valid(
        """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
model = DDP(model, device_ids=[local_rank])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    if step % 4 != 3:
        with model.no_sync():
            loss.backward()
    else:
        loss.backward()
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
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
    INVALID = (Invalid(
        """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
torch.manual_seed(1234 + dist.get_rank())
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
model = DDP(model, device_ids=[local_rank])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
""",
        line=11,
    ),)


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
        """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
if "LOCAL_RANK" in os.environ:
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    model = DDP(model, device_ids=[local_rank])
else:
    model = nn.DataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
""",
        line=13,
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
        """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
group = dist.new_group(ranks=list(range(dist.get_world_size())))
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
model = DDP(model, device_ids=[local_rank], process_group=group)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
""",
        line=13,
    ),)
