"""FSR6.. rank_decisions: decisions that would differ between ranks (FSR640, FSR641)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class RankLocalDecisionGatesCollective(Blocker):
    """A condition (an `if`, a `break`) that reads a value of one rank's own part of the data (its
    loss, a sum over its part of a split DataLoader) decides whether a collective runs: a checkpoint
    save, a forward of the sharded model, the training loop's next step.

    ## Why
    Each rank decides from its own value: some ranks enter the collective (or leave the loop) and
    the others do not, and the run hangs. A figure the rewrite combines over the ranks (a loop's
    sums, codemods/loop_sums.py) is the same on every rank and is not refused.

    ## What to do
    Decide from a value every rank shares: average it over the ranks first (dist.all_reduce, then
    divide by the world size), or broadcast rank 0's decision (dist.broadcast_object_list).
    """

    CODE = "FSR640"
    NAME = "rank-local-decision-gates-collective"
    STAGE = "rank_decisions"
    INVALID = (Invalid(
        """\
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def run_epoch(model, loader, optimizer=None):
    total_loss, correct = 0.0, 0
    for x, y in loader:
        out = model(x)
        loss = F.cross_entropy(out, y)
        if optimizer is not None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        total_loss += loss.item() * y.size(0)
        correct += (out.argmax(1) == y).sum().item()
    return total_loss / len(loader.dataset), correct / len(loader.dataset)


def test(model, loader):
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
    return correct / len(loader.dataset)


def main():
    torch.manual_seed(0)
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    train_loader = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True)
    test_loader = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    best = 0.0
    for epoch in range(3):
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loss.item() < 0.01:
                break


if __name__ == "__main__":
    main()
""",
        line=43,
    ),)
    # the loop left on a step count, the same on every rank
    VALID = (Valid(
        """\
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def main(max_steps=100):
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    train_loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    for epoch in range(3):
        for xb, yb in train_loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step >= max_steps:
                break


if __name__ == "__main__":
    main()
""",
    ),)


class RandomControlFlowInForward(Blocker):
    """The forward of the sharded model decides its control flow (a loop's length, an `if`) from a
    random draw (`random.*`, `numpy.random.*`, `torch.rand*`) of a generator the script does not
    seed with a value every rank shares, directly or through a parameter the training loop binds
    under an `if` on such a draw (`if np.random.random() < 0.1: labels = None`).

    ## Why
    Each rank draws its own number: the ranks run different layers (or the same layer a different
    number of times), so the all-gathers and reduce-scatters fully_shard issues per layer no longer
    pair up between the ranks: a size mismatch error (gloo) or a hang (NCCL).

    ## What to do
    Seed that generator with the same value on every rank before training (`random.seed(0)`,
    `np.random.seed(0)`, `torch.manual_seed(0)`), or draw the number on rank 0 and broadcast it
    (dist.broadcast_object_list) before the forward.
    """

    CODE = "FSR641"
    NAME = "random-control-flow-in-forward"
    STAGE = "rank_decisions"
    INVALID = (Invalid(
        """\
import os
import random

import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.middle = nn.Linear(16, 16)
        self.last = nn.Linear(16, 2)

    def forward(self, x):
        h = self.first(x).relu()
        if random.random() < 0.5:
            h = self.middle(h).relu()
        return self.last(h)


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32, 2)
for step in range(3):
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
""",
        line=18,
    ),)
