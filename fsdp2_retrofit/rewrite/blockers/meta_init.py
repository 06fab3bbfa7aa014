"""FSR5.. meta_init: --meta-init: models the rewrite cannot build on the meta device and re-create (FSR501, FSR502, FSR503, FSR504, FSR505)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class MetaInitLibraryModel(Blocker):
    """--meta-init with a model built by a library (transformers, timm, ...).

    ## Why
    Its initialisation or pretrained weights live in the library, which the rewrite never reads.

    ## What to do
    Run without --meta-init.
    """

    CODE = "FSR501"
    NAME = "meta-init-library-model"
    INVALID = (Invalid(
        """\
import transformers
import torch


def main(name):
    model = transformers.AutoModelForCausalLM.from_pretrained(name)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in range(3):
        loss = model(batch).sum()
        loss.backward()
        optimizer.step()
""",
        line=6,
        options={'meta_init': True},
    ),)


class MetaInitCompoundBuild(Blocker):
    """--meta-init with a model built inside a compound statement.

    ## Why
    The meta build, to_empty and re-initialisation need the model built by one plain statement.

    ## What to do
    Build the model in one plain statement, or run without --meta-init.
    """

    CODE = "FSR502"
    NAME = "meta-init-compound-build"
    INVALID = (Invalid(
        """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x)


def main(big):
    if big:
        model = Net(16)
    else:
        model = Net(8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x in [torch.randn(2, 8)]:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
""",
        line=16,
        options={'meta_init': True},
    ),)
    # the choice made before the build, the model built by one plain statement
    VALID = (Valid(
        """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x)


def main(big):
    dim = 16 if big else 8
    model = Net(dim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x in [torch.randn(2, dim)]:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
""",
        options={'meta_init': True},
    ),)


class MetaInitCannotReplay(Blocker):
    """--meta-init where the model's initialisation cannot be re-created.

    ## Why
    After to_empty the memory holds garbage: every parameter and buffer must be re-initialised
    exactly as the constructor did, and the analysis cannot follow this part of it.

    ## What to do
    Run without --meta-init, or follow the message's hint.
    """

    CODE = "FSR503"
    NAME = "meta-init-cannot-replay"
    INVALID = (Invalid(
        """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x)


def main():
    model = Net().to('cuda', torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x in [torch.randn(2, 8)]:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
""",
        line=15,
        options={'meta_init': True},
    ),)


class MetaInitNotBuiltByClass(Blocker):
    """--meta-init with a model not built by calling its class.

    ## Why
    The re-initialisation is read from the constructor call and the class's __init__.

    ## What to do
    Call the model's class in the training script, or run without --meta-init.
    """

    CODE = "FSR504"
    NAME = "meta-init-not-built-by-class"
    INVALID = (Invalid(
        """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x)


def build():
    return Net()


def main():
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x in [torch.randn(2, 8)]:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
""",
        line=19,
        options={'meta_init': True},
    ),)


class MetaInitUseBeforeShard(Blocker):
    """--meta-init with a statement using the model between its build and fully_shard.

    ## Why
    The model has no values until to_empty and the re-initialisation, which would also overwrite it.

    ## What to do
    Load weights after sharding (set_model_state_dict / dcp.load), or run without --meta-init.
    """

    CODE = "FSR505"
    NAME = "meta-init-use-before-shard"
    INVALID = (Invalid(
        """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc(x)


def main():
    model = Net()
    model.load_state_dict(torch.load('w.pt'))
    model.to('cpu')
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x in [torch.randn(2, 8)]:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
""",
        line=16,
        options={'meta_init': True},
    ),)
