"""FSR7.. checkpoint_files: checkpoint files the rewrite cannot turn into DCP directories (FSR705, FSR803)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class CheckpointFileObject(Blocker):
    """Model or optimizer state saved to a file object the tool cannot replace by its path.

    ## Why
    The save becomes dcp.save of a checkpoint directory, which takes a path: a file object fails.

    ## What to do
    Save by path: torch.save(state, path) (or `with open(path, "wb") as f: torch.save(state, f)`
    alone).
    """

    CODE = "FSR705"
    NAME = "checkpoint-file-object"
    STAGE = "checkpoint_files"
    INVALID = (Invalid(
        """\
import io
import torch
import torch.nn as nn


def main():
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)



if __name__ == "__main__":
    main()
""",
        line=15,
    ),)
    # the state saved by path
    VALID = (Valid(
        """\
import torch
import torch.nn as nn


def main():
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    torch.save(model.state_dict(), "m.pt")


if __name__ == "__main__":
    main()
""",
    ),)


class ResumeFileObject(Blocker):
    """Model or optimizer state loaded from a file object the tool cannot replace by its path.

    ## Why
    A checkpoint of this script is now a DCP directory read with dcp.load, which takes a path.

    ## What to do
    Load by path: torch.load(path) (or `with open(path, "rb") as f: torch.load(f)` alone).
    """

    CODE = "FSR803"
    NAME = "resume-file-object"
    STAGE = "checkpoint_files"
    INVALID = (Invalid(
        """\
import io
import torch
import torch.nn as nn


def main():
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with open("m.pt", "rb") as f:
        model.load_state_dict(torch.load(f))
        print(f.name)

    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()



if __name__ == "__main__":
    main()
""",
        line=10,
    ),)
