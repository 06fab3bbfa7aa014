"""FSR5.. meta_init: --meta-init: models the rewrite cannot build on the meta device and re-create (FSR501, FSR502, FSR503, FSR504, FSR505)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


# -- the cases (all with --meta-init): a module-level model and its optimizer ------------------

_TORCH = """\
import torch
import torch.nn as nn


"""
_SYS = "import sys\n" + _TORCH
_OPT = "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
_META = {"meta_init": True}


def _after(prelude: str, n: int) -> int:
    """The line of a case that is the n-th of its own lines, after `prelude`."""
    return prelude.count("\n") + n


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
        "import torch\nfrom transformers import AutoModelForCausalLM\n\n"
        + 'model = AutoModelForCausalLM.from_pretrained("gpt2")\n' + _OPT,
        line=4,
        options=_META,
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
        _SYS + "if len(sys.argv) > 1:\n    model = nn.Linear(8, 8)\nelse:\n    model = nn.Linear(4, 4)\n" + _OPT,
        line=_after(_SYS, 2),
        options=_META,
    ),)
    # the choice made before the build, the model built by one plain statement
    VALID = (Valid(
        _SYS + "width = 8 if len(sys.argv) > 1 else 4\nmodel = nn.Linear(width, width)\n" + _OPT, options=_META,
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
    INVALID = (
        Invalid(  # a device move and a dtype change in one call
            _TORCH + 'model = nn.Linear(4, 4).to("cuda", torch.bfloat16)\n' + _OPT,
            line=_after(_TORCH, 1),
            options=_META,
        ),
        Invalid(  # a parameter of the class made from what the analysis cannot re-create
            _TORCH + """\
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.load("scale.pt"))


model = Net()
""" + _OPT,
            line=_after(_TORCH, 4),
            options=_META,
        ),
    )
    # the move alone: --meta-init drops it (each rank's shards go to its own device)
    VALID = (Valid(_TORCH + 'model = nn.Linear(4, 4).to("cuda")\n' + _OPT, options=_META),)


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
        _TORCH + "def build():\n    return nn.Linear(4, 4)\n\n\nmodel = build()\n" + _OPT,
        line=_after(_TORCH, 5),
        options=_META,
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
        _TORCH + 'model = nn.Linear(4, 4)\nmodel.load_state_dict(torch.load("w.pt"))\nmodel.to("cuda")\n' + _OPT,
        line=_after(_TORCH, 2),
        options=_META,
    ),)
    # the weights loaded after the model is placed: the rewrite loads them into the shards
    VALID = (Valid(
        _TORCH + 'model = nn.Linear(4, 4)\nmodel.to("cuda")\nmodel.load_state_dict(torch.load("w.pt"))\n' + _OPT,
        options=_META,
    ),)
