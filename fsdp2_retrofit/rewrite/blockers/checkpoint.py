"""FSR7.. checkpoint: saves of sharded state the rewrite cannot turn into DCP (FSR701, FSR704, FSR706, FSR707, FSR708)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class CheckpointUnsplittableRankBranch(Blocker):
    """A checkpoint save inside a rank-0 branch that cannot be split (an else branch, an `or`).

    ## Why
    The save is collective now: other ranks would never join it and the run would hang.

    ## What to do
    Save on every rank and keep only plain-file writes under the rank-0 `if`.
    """

    CODE = "FSR701"
    NAME = "checkpoint-unsplittable-rank-branch"
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

def main(rank, final):
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4)).sum().backward()
    opt.step()
    if final or rank == 0:
        torch.save(model.state_dict(), "final.pt")

main(0, True)
""",
        line=30,
    ),)
    # the save under a condition every rank shares (an argument)
    VALID = (Valid(
        """\
import torch
from torch import nn, optim


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def main(final):
    model = Net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4)).sum().backward()
    opt.step()
    if final:
        torch.save(model.state_dict(), "final.pt")


if __name__ == "__main__":
    main(True)
""",
    ),)


class CheckpointNameBoundOnRankZero(Blocker):
    """A save that now runs on every rank reads a name bound only under a rank-0 `if` the rewrite
    cannot broadcast from (an else branch, another condition, a nested block, after the save).

    ## Why
    The other ranks would stop with a NameError at the first checkpoint.

    ## What to do
    Bind the name on every rank (compute the path everywhere; create directories under the rank-0
    `if`).
    """

    CODE = "FSR704"
    NAME = "checkpoint-name-bound-on-rank-zero"
    INVALID = (Invalid(
        """\
import os

import torch
import torch.nn as nn


def main():
    rank = int(os.environ.get("RANK", 0))
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        run_dir = "runs/a"
    else:
        print("waiting")
    for step in range(3):
        loss = model(torch.randn(2, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(run_dir, "model.pt"))


if __name__ == "__main__":
    main()
""",
        line=11,
    ),)


class CheckpointOptimizerNotFollowed(Blocker):
    """An optimizer's state_dict() is saved where the tool cannot tell which optimizer it is, or which
    model it trains: a function or object handed different values by its calls (the refusal names
    the call), or an optimizer of several models.

    ## Why
    The save becomes dcp.save of get_optimizer_state_dict(model, optimizer), which needs the one
    model that optimizer trains; left as optimizer.state_dict() it would write numbered state the
    resume cannot read.

    ## What to do
    Hand the helper the same optimizer (and its model) at every call, or save where the optimizer is
    built.
    """

    CODE = "FSR706"
    NAME = "checkpoint-optimizer-not-followed"
    INVALID = (Invalid(
        '''\
"""Checkpoint helpers outside the code that builds the model and optimizer: the save
reads them as globals, the load is handed them under other names."""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(F.gelu(self.norm(x)))


class Net(nn.Module):
    def __init__(self, dim=32, depth=3):
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def save_checkpoint(opt, step, path):
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}, path)


def load_checkpoint(model, opt, path):
    ckpt = torch.load(path)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    return ckpt["step"]


parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--save-every", type=int, default=4)
parser.add_argument("--ckpt", default="ckpt.pt")
parser.add_argument("--out", default="model.pt")
args = parser.parse_args()

torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 16), torch.randint(0, 10, (256,)))
loader = DataLoader(data, batch_size=args.batch_size, shuffle=False, drop_last=True)

net = Net()
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)

step = 0
if os.path.exists(args.ckpt):
    step = load_checkpoint(net, optimizer, args.ckpt)
    print(f"resumed from step {step}")

# the data order on resume: skip the batches already seen, by counting steps
while step < args.steps:
    for i, (x, y) in enumerate(loader):
        if step // len(loader) * len(loader) + i < step:
            continue
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        print(f"step {step} loss {loss.item():.4f}")
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(optimizer, step, args.ckpt)
        if step == args.steps:
            break

save_checkpoint(None, step, args.out)
''',
        line=83,
    ),)


class CheckpointModulePickledInState(Blocker):
    """A saved dict, list or tuple holds a sharded model itself (`{"net": net}`), not its state dict.

    ## Why
    Pickling a sharded module writes one rank's DTensor shards with FSDP2's hooks, every rank to the
    same file; nothing can load it back as the model (and the script's reload of it would unpickle
    those shards).

    ## What to do
    Save the model's state dict (`"net": net.state_dict()`) and reload it into a built model with
    load_state_dict; the rewrite then turns both into DCP.
    """

    CODE = "FSR707"
    NAME = "checkpoint-module-pickled-in-state"
    INVALID = (Invalid(
        """\

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def checkpoint(epoch):
    state = [net, epoch]
    torch.save(state, "ckpt.t7")


net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 2)), batch_size=8)
for epoch in range(3):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    checkpoint(epoch)
""",
        line=8,
    ),)


class CheckpointStateThroughHelper(Blocker):
    """A torch.save in a helper saves its parameter, and a call hands that parameter a sharded model's
    or its optimizer's state (`save_checkpoint({"state_dict": model.state_dict()}, path)`).

    ## Why
    The rewrite converts a save where it sees the state dict; behind a parameter, the torch.save
    would stay, and every rank would write its own DTensor shards into the one file: a checkpoint
    nothing can load as the model.

    ## What to do
    Save where the state is built, with the state dict inline in the torch.save call; the rewrite
    then turns it into DCP on every rank.
    """

    CODE = "FSR708"
    NAME = "checkpoint-state-through-helper"
    INVALID = (Invalid(
        """\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
def save_checkpoint(state, filename):
    torch.save(state, filename)


save_checkpoint({"epoch": 2, "state_dict": model.state_dict()}, "ckpt.pt")
""",
        line=10,
    ),)
