"""FSR4.. launch: where the process group and the mesh cannot be started (FSR401, FSR402, FSR403, FSR404, FSR405)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


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
        """\

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
    ddp = "RANK" in os.environ
    if ddp:
        if True:
                dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", 0))
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
""",
        line=34,
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
    INVALID = (Invalid(
        """\

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
    model = Net()
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = dist.get_world_size()
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
""",
        line=31,
    ),)


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
        """\
import torch
import pytorch_lightning as pl
from torch import nn

model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
pl.Trainer(max_epochs=1).fit(model)
""",
        line=7,
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
        '''\
"""A residual MLP; one helper builds the model and its optimizer and returns both."""
import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, dim=16, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(lr):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return model.to("cpu"), optimizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="model.pt")
    args = parser.parse_args()
    model, optimizer = build(1e-2)
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(384, 16), torch.randint(0, 4, (384,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")
        if step + 1 >= args.steps:
            break
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
''',
        line=32,
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
    INVALID = (Invalid(
        """\
import torch
from torch import nn

dist = torch.distributions
model = nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

for step in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
""",
        line=4,
    ),)
