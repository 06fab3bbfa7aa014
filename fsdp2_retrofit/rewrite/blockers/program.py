"""FSR9.. program: training steps in project modules the rewrite cannot take in (FSR970)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import DATA_IMPORTS, LOADER, MODEL, OPT

_ENGINE = """\
def train(model, loader, opt):
    for x, y in loader:
        (model(x) - y).pow(2).mean().backward()
        opt.step()
"""
_SCRIPT = DATA_IMPORTS + "import engine\n" + MODEL + OPT + LOADER + "{call}(model, loader, opt)\n"


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
        _SCRIPT.format(call='getattr(engine, "train")'),
        line=3,
        files={"engine.py": _ENGINE},
        path="engine.py",
    ),)
    # the loop's module called by name (engine.train): the program is linked and both files convert
    VALID = (Valid(_SCRIPT.format(call="engine.train"), files={"engine.py": _ENGINE}),)
    # the loop's module called by name (engine.train): the program is linked and both files convert
