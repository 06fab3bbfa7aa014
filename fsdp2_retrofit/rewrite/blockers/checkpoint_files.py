"""FSR7.. checkpoint_files: checkpoint files the rewrite cannot turn into DCP directories (FSR705, FSR803)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import MODEL, OPT, STEPS, TRAIN


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
        "import io\n" + TRAIN + "buffer = io.BytesIO()\ntorch.save(model.state_dict(), buffer)\n",
        line=9,
    ),)
    VALID = (Valid(TRAIN + 'torch.save(model.state_dict(), "m.pt")\n'),)
    # the state saved by path


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
        "import torch\n" + MODEL + OPT + """\
with open("m.pt", "rb") as f:
    model.load_state_dict(torch.load(f))
    print(f.name)
""" + STEPS,
        line=5,
    ),)
    VALID = (Valid("import torch\n" + MODEL + OPT + 'model.load_state_dict(torch.load("m.pt"))\n' + STEPS),)
