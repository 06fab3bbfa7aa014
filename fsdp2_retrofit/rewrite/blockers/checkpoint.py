"""FSR7.. checkpoint: saves of sharded state the rewrite cannot turn into DCP (FSR701, FSR704, FSR706, FSR707, FSR708,
FSR709)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import TRAIN, TRAINING, indented


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
        "import torch\ndef main(rank, final):\n" + indented(TRAINING) + """\
    if final or rank == 0:
        torch.save(model.state_dict(), "final.pt")
main(0, True)
""",
        line=9,
    ),)
    # the save under a condition every rank shares (an argument)
    VALID = (Valid(
        "import torch\ndef main(final):\n" + indented(TRAINING) + """\
    if final:
        torch.save(model.state_dict(), "final.pt")
main(True)
""",
    ),)
    # the save under a condition every rank shares (an argument)


class CheckpointNameBoundOnRankZero(Blocker):
    """A save that now runs on every rank reads a name bound under a rank-0 `if` whose value the
    rewrite cannot hand to the other ranks: the `if` sits where some ranks may skip it, its test
    cannot be evaluated again on every rank, the name is read before it, or the other ranks bind
    a value of their own and read it elsewhere.

    ## Why
    The other ranks would stop with a NameError at the first checkpoint, or save elsewhere. Where
    every rank reaches the `if` together (in a function or at module level, in any block every rank
    runs), rank 0's value is broadcast right after it instead.

    ## What to do
    Bind the name on every rank (compute the path everywhere; create directories under the rank-0
    `if`).
    """

    CODE = "FSR704"
    NAME = "checkpoint-name-bound-on-rank-zero"
    INVALID = (
        # the other ranks bind their own value and read it: rank 0's would change what they do
        Invalid(
            "import torch\ndef main(rank):\n" + indented(TRAINING) + """\
    if rank == 0:
        run_dir = "runs/a"
    else:
        run_dir = None
    if run_dir is None:
        print("not saving")
    if rank == 0:
        torch.save(model.state_dict(), run_dir + "/model.pt")
main(0)
""",
            line=8,
        ),
        # the `if` inside a branch some ranks may skip (each rank's own environment)
        Invalid(
            "import os\nimport torch\ndef main(rank):\n" + indented(TRAINING) + """\
    if os.environ.get("SAVE"):
        if rank == 0:
            run_dir = "runs/a"
    if rank == 0:
        torch.save(model.state_dict(), run_dir + "/model.pt")
main(0)
""",
            line=10,
        ),
    )
    VALID = (
        # an `else` that binds nothing: rank 0's value is broadcast after the whole if/else
        Valid(
            "import torch\ndef main(rank):\n" + indented(TRAINING) + """\
    if rank == 0:
        run_dir = "runs/a"
    else:
        print("waiting")
    if rank == 0:
        torch.save(model.state_dict(), run_dir + "/model.pt")
main(0)
""",
        ),
        # at module level, the `if` inside a `with`, another condition every rank shares
        Valid(
            "import os\nimport torch\nrank = int(os.environ.get(\"RANK\", 0))\nkeep = True\n" + TRAINING + """\
with torch.no_grad():
    if rank == 0 and keep:
        run_dir = "runs/a"
if rank == 0:
    torch.save(model.state_dict(), run_dir + "/model.pt")
""",
        ),
    )


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
        TRAIN + """\
def save(opt, path):
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
save(opt, "ckpt.pt")
save(None, "final.pt")
""",
        line=10,
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
    INVALID = (Invalid(TRAIN + 'torch.save({"model": model, "step": 10}, "ckpt.pt")\n', line=7),)
    VALID = (Valid(TRAIN + 'torch.save({"model": model.state_dict(), "step": 10}, "ckpt.pt")\n'),)


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
        TRAIN + """\
def save_checkpoint(state, path):
    torch.save(state, path)
save_checkpoint({"epoch": 2, "model": model.state_dict()}, "ckpt.pt")
""",
        line=8,
    ),)


class CheckpointStateThroughName(Blocker):
    """A torch.save writes an object that holds, through a name bound to another dict, list or tuple, a
    sharded model's or its optimizer's state (`model_states = {"net": net.state_dict()}`, then
    `torch.save({"iter": step, "model_states": model_states}, path)`).

    ## Why
    The rewrite converts a save where it sees the state dict in the saved object; through a name bound
    elsewhere the torch.save would stay, and every rank would write its own DTensor shards into the one
    file: a checkpoint nothing can load as the model (left unreported, it was a silently wrong output).

    ## What to do
    Put the state dicts in the saved object itself (nested dict literals are fine); the rewrite then
    turns the save into DCP on every rank, and the load to match.
    """

    CODE = "FSR709"
    NAME = "checkpoint-state-through-name"
    INVALID = (Invalid(
        TRAIN + """model_states = {"net": model.state_dict()}
torch.save({"iter": 10, "model_states": model_states}, "ckpt.pt")
""",
        line=8,
    ), Invalid(  # through a record and the dict made from it (a Trainer's Snapshot dataclass)
        "from dataclasses import asdict, dataclass\n" + TRAIN + """@dataclass
class Snapshot:
    model_state: dict
    epoch: int
snapshot = Snapshot(model_state=model.state_dict(), epoch=3)
snapshot = asdict(snapshot)
torch.save(snapshot, "snapshot.pt")
""",
        line=14,
    ), Invalid(  # the record itself, saved inline: dcp.save takes a dict
        "from dataclasses import dataclass\n" + TRAIN + """@dataclass
class Snapshot:
    model_state: dict
    epoch: int
torch.save(Snapshot(model_state=model.state_dict(), epoch=3), "snapshot.pt")
""",
        line=12,
    ))
    VALID = (Valid(TRAIN + 'torch.save({"iter": 10, "model_states": {"net": model.state_dict()}}, "ckpt.pt")\n'),
             Valid("from dataclasses import asdict, dataclass\n" + TRAIN + """@dataclass
class Snapshot:
    model_state: dict
    epoch: int
torch.save(asdict(Snapshot(model_state=model.state_dict(), epoch=3)), "snapshot.pt")
"""))
