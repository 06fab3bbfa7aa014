"""FSR8.. resume: loads of sharded state the rewrite cannot turn into DCP (FSR801, FSR802, FSR804, FSR805)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import MODEL, OPT, STEPS

_SAVE = 'torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "ckpt.pt")\n'
_ENC_DEC = """\
import torch
encoder = torch.nn.Linear(8, 8)
decoder = torch.nn.Linear(8, 2)
"""
_ENC_DEC_STEPS = """\
for step in range(10):
    decoder(encoder(torch.randn(4, 8))).sum().backward()
"""


class ResumeLoadBeforeBuild(Blocker):
    """A checkpoint is read before the model or optimizer it fills is built.

    ## Why
    dcp.load fills the state dicts of the sharded model, its optimizer and scheduler: they must
    exist.

    ## What to do
    Build them before loading, then load their state.
    """

    CODE = "FSR801"
    NAME = "resume-load-before-build"
    INVALID = (Invalid(
        """\
import torch
checkpoint = torch.load("ckpt.pt")
model = torch.nn.Linear(8, 2)
model.load_state_dict(checkpoint["model"])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
opt.load_state_dict(checkpoint["opt"])
""" + STEPS + _SAVE,
        line=2,
    ),)
    VALID = (Valid(
        "import torch\n" + MODEL + OPT + """\
checkpoint = torch.load("ckpt.pt")
model.load_state_dict(checkpoint["model"])
opt.load_state_dict(checkpoint["opt"])
""" + STEPS + _SAVE,
    ),)


class ResumeOptimizerOfSeveralModels(Blocker):
    """A loaded optimizer trains several models.

    ## Why
    get_/set_optimizer_state_dict take the one model the optimizer trains.

    ## What to do
    Give each model its own optimizer.
    """

    CODE = "FSR802"
    NAME = "resume-optimizer-of-several-models"
    # (the script never saves that optimizer's state: a save of it is refused first, FSR706)
    # (the script never saves that optimizer's state: a save of it is refused first, FSR706)
    INVALID = (Invalid(
        _ENC_DEC + """\
opt = torch.optim.SGD(list(encoder.parameters()) + list(decoder.parameters()), lr=0.1)
checkpoint = torch.load("ckpt.pt")
encoder.load_state_dict(checkpoint["encoder"])
decoder.load_state_dict(checkpoint["decoder"])
opt.load_state_dict(checkpoint["opt"])
""" + _ENC_DEC_STEPS + """\
    opt.step()
torch.save({"encoder": encoder.state_dict(), "decoder": decoder.state_dict()}, "last.pt")
""",
        line=5,
    ),)
    VALID = (Valid(
        _ENC_DEC + """\
enc_opt = torch.optim.SGD(encoder.parameters(), lr=0.1)
dec_opt = torch.optim.SGD(decoder.parameters(), lr=0.1)
checkpoint = torch.load("ckpt.pt")
enc_opt.load_state_dict(checkpoint["enc_opt"])
dec_opt.load_state_dict(checkpoint["dec_opt"])
""" + _ENC_DEC_STEPS + """\
    enc_opt.step()
    dec_opt.step()
torch.save({"enc_opt": enc_opt.state_dict(), "dec_opt": dec_opt.state_dict()}, "last.pt")
""",
    ),)
    # one optimizer per model, each loaded (and saved) with its model


class ResumePickledModuleReload(Blocker):
    """A pickled module (torch.save(model, path)) is reloaded where the tool cannot load it into the
    sharded model: into another name, inside a loop, or before training goes on.

    ## Why
    The save now writes the model's state dict as a DCP directory, so torch.load of it fails.
    Loading into the live sharded model does what the reload did only when nothing trains the model
    after it (the original's optimizer keeps training the module it held); a second model needs its
    own build and sharding.

    ## What to do
    Keep a state dict instead: torch.save(model.state_dict(), path), and to reload, build the model
    (or reuse it) and load_state_dict(torch.load(path)).
    """

    CODE = "FSR804"
    NAME = "resume-pickled-module-reload"
    INVALID = (Invalid(
        "import torch\n" + MODEL + OPT + """\
for epoch in range(3):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    torch.save(model, "best.pt")
    model = torch.load("best.pt", weights_only=False)
""",
        line=8,
    ),)


class ResumeOptimizerNotFollowed(Blocker):
    """An optimizer state is loaded where the tool cannot tell which optimizer receives it: a function
    or object handed different values by its calls (the refusal names the call).

    ## Why
    The load becomes set_optimizer_state_dict(model, optimizer, ...), which needs the one model that
    optimizer trains.

    ## What to do
    Hand the helper the same optimizer (and its model) at every call, or load where the optimizer is
    built.
    """

    CODE = "FSR805"
    NAME = "resume-optimizer-not-followed"
    INVALID = (Invalid(
        "import torch\n" + MODEL + OPT + """\
def load(model, opt, path):
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
load(model, opt, "ckpt.pt")
load(model, torch.optim.SGD(model.parameters()), "ckpt.pt")
""" + STEPS + _SAVE,
        line=9,
    ),)
