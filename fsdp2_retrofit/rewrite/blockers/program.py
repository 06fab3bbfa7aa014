"""FSR9.. program: training steps in project modules the rewrite cannot take in (FSR970)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class TrainingStepNotReached(Blocker):
    """A training step (`loss.backward()`) in a project module the script reaches, which the rewrite
    cannot take into its analysis (the program cannot be linked: the reason is named).

    ## Why
    Converting the script alone would shard the model while the loop elsewhere keeps its plain
    DataLoader, its saves and its logging: every rank would train on the same batches and write its
    shards into one file, and the rewrite would call that converted.

    ## What to do
    Remove what the reason names (a top-level name bound in two modules, a module used as a value,
    an import renamed with `as`), or run rewrite on the module that holds the training loop.
    """

    CODE = "FSR970"
    NAME = "training-step-not-reached"
    STAGE = "program"
    INVALID = (Invalid(
        """\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import engine

model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
getattr(engine, 'train')(model, loader, optimizer, 2)
torch.save(model.state_dict(), "model.pt")
""",
        line=9,
        files={"engine.py": """\
import torch


def train(model, loader, optimizer, epochs):
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        print(epoch, loss.item())
"""},
        path="engine.py",
    ),)
    # the loop's module called by name (engine.train): the program is linked and both files convert
    VALID = (Valid(
        """\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import engine

model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
engine.train(model, loader, optimizer, 2)
torch.save(model.state_dict(), "model.pt")
""",
        files={"engine.py": """\
import torch


def train(model, loader, optimizer, epochs):
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        print(epoch, loss.item())
"""},
    ),)
