"""FSR6.. shard: models, optimizers and training steps fully_shard cannot be applied to safely (FSR601, FSR602, FSR603, FSR604, FSR605, FSR606, FSR607, FSR608, FSR609, FSR610, FSR611, FSR612, FSR613, FSR614, FSR615, FSR616, FSR617, FSR618, FSR619, FSR620, FSR621, FSR622, FSR623, FSR624, FSR625, FSR626, FSR627, FSR628, FSR629, FSR630, FSR643, FSR644, FSR645)."""
from __future__ import annotations

from typing import Iterator

import libcst as cst

from fsdp2_retrofit.analysis import ModelSite, ScriptFacts, code
from fsdp2_retrofit.analysis.dtype_casts import casts_after_shard, dtype_cast
from fsdp2_retrofit.analysis.forward_data_writes import forward_data_write
from fsdp2_retrofit.analysis.model_builds import handed_builds
from fsdp2_retrofit.analysis.model_classes import first_submodule, parameter_reads
from fsdp2_retrofit.analysis.no_model import no_model_blocker, nothing_found_at, unrecognised_trained_model
from fsdp2_retrofit.analysis.optimizers import FLATTENING_OPTIMIZERS, whole_tensor_operation
from fsdp2_retrofit.analysis.penalties import penalties
from fsdp2_retrofit.analysis.shared_modules import shared_module
from fsdp2_retrofit.syntax.names import root_name
from fsdp2_retrofit.syntax.torch_api import GRAD_SCALER

from . import Blocked, Blocker, Invalid, Valid  # noqa: F401


# -- the cases: a module-level model and optimizer, or the script's own small class ------------

_TORCH = """\
import torch
import torch.nn as nn


"""

# a class of the script: {init} and {forward} add lines to its __init__ and forward
_CLASS = """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4){init}

    def forward(self, x):{forward}
        return self.fc(x)


"""
_NET = _CLASS.format(init="", forward="")
_INIT, _FORWARD = 9, 11  # the lines {init} and (with no {init}) {forward} add to _CLASS

_COPY = "import copy\n" + _TORCH
_SWA = "from torch.optim.swa_utils import AveragedModel\n" + _TORCH
_SYS = "import sys\n" + _TORCH
_WRAPPER = _TORCH + """\
class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


"""
# a wrapper that is no nn.Module: it hands on the inner module's parameters and forward
_PLAIN_WRAPPER = _TORCH + """\
class Wrapper:
    def __init__(self, inner):
        self.inner = inner

    def parameters(self):
        return self.inner.parameters()

    def __call__(self, x):
        return self.inner(x)


"""
_HF = "import torch\nfrom transformers import AutoModelForCausalLM\n\n"

_OPT = "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
_ADAMW = "opt = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"

_LOOP = """\
for x in torch.randn(3, 2, 4):
    loss = model(x).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

_AUTOCAST = """\
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x in torch.randn(3, 2, 4):
    with torch.autocast("cuda", dtype={dtype}):
        loss = model(x).sum()
    loss.backward()
    opt.step()
"""


def _after(prelude: str, n: int) -> int:
    """The line of a case that is the n-th of its own lines, after `prelude`."""
    return prelude.count("\n") + n


class ShardWrapperLeft(Blocker):
    """The shard stage runs on a script that still uses DDP/FSDP1 wrappers.

    ## Why
    The wrapper must go before fully_shard.

    ## What to do
    Run the migrate stages first (the composite `rewrite` does).
    """

    CODE = "FSR601"
    NAME = "shard-wrapper-left"
    INVALID = (Invalid(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n" + _TORCH
        + "model = DDP(nn.Linear(4, 4))\n" + _OPT + _LOOP,
        line=6,
        stage="shard",  # the composite runs migrate_ddp first, which lifts the wrap
    ),)


class ShardAutocastDtypeUnknown(Blocker):
    """--mixed-precision auto with several or unknown autocast dtypes.

    ## Why
    FSDP2 takes one parameter dtype per unit.

    ## What to do
    Name it: --mixed-precision bf16 or fp16.
    """

    CODE = "FSR602"
    NAME = "shard-autocast-dtype-unknown"
    INVALID = (Invalid(
        _TORCH + "dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16\n"
        + _AUTOCAST.format(dtype="dtype"),
        line=_after(_TORCH, 2),
        options={"mixed_precision": "auto"},
    ),)
    # the autocast dtype named: --mixed-precision auto reads bf16 from it
    VALID = (Valid(_TORCH + _AUTOCAST.format(dtype="torch.bfloat16"), options={"mixed_precision": "auto"}),)


class ShardBatchnormLowPrecision(Blocker):
    """Mixed precision for a model with BatchNorm layers.

    ## Why
    FSDP2 would cast their parameters and running statistics to the low-precision dtype.

    ## What to do
    Run without --mixed-precision (autocast alone keeps BatchNorm in float32).
    """

    CODE = "FSR603"
    NAME = "shard-batchnorm-low-precision"
    INVALID = (Invalid(
        _TORCH + "model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))\n" + _OPT,
        line=_after(_TORCH, 1),
        options={"mixed_precision": "bf16"},
    ),)


class ShardCompiledInBuild(Blocker):
    """The model is compiled in the expression that builds it.

    ## Why
    fully_shard must see the plain module, before torch.compile wraps it.

    ## What to do
    Build it first (`model = Net()`), then `model = torch.compile(model)` on its own line.
    """

    CODE = "FSR604"
    NAME = "shard-compiled-in-build"
    INVALID = (Invalid(_TORCH + 'model = torch.compile(nn.Linear(4, 4)).to("cuda")\n' + _OPT, line=_after(_TORCH, 1)),)
    # compiled as the whole build statement: the rewrite splits it and shards the plain module
    VALID = (Valid(_TORCH + "model = torch.compile(nn.Linear(4, 4))\n" + _OPT + _LOOP),)


class ShardTrainerClassLoop(Blocker):
    """The training loop lives in a class of a sibling module that the program did not take in (one
    module more than the 64 a program reads, or a module that does not parse), handed the model.

    ## Why
    A trainer class of another file is converted in its own file with the program linked into one
    analysis; a module the program did not read has no such conversion, and the script alone would
    leave that loop with its plain sampler, saves and logging.

    ## What to do
    Rewrite the module that holds the loop, or import fewer project modules from the entry (or fix
    the module that does not parse).
    """

    CODE = "FSR605"
    NAME = "shard-trainer-class-loop"
    INVALID = (Invalid(  # 70 modules: the program reads 64, trainer.py is not among them
        "import torch\n" + "".join(f"import m{i}\n" for i in range(70)) + """\
from trainer import Trainer

model = torch.nn.Linear(4, 4)
Trainer(model).fit(3)
""",
        line=75,
        files={**{f"m{i}.py": f"X{i} = {i}\n" for i in range(70)}, "trainer.py": """\
import torch


class Trainer:
    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def fit(self, steps):
        for _ in range(steps):
            loss = self.model(torch.randn(2, 4)).sum()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
"""},
    ),)


class ShardCopyElsewhere(Blocker):
    """A sharded model is copied other than right after its build.

    ## Why
    FSDP2 modules cannot be deep-copied; a copy is sharded like the model only when made as `name =
    copy.deepcopy(model)` in the block that builds it.

    ## What to do
    Make the copy right after the model is built (ema = copy.deepcopy(model)).
    """

    CODE = "FSR606"
    NAME = "shard-copy-elsewhere"
    INVALID = (Invalid(  # a snapshot in the training loop
        _COPY + "model = nn.Linear(4, 4)\n" + _OPT + _LOOP + "    best = copy.deepcopy(model)\n",
        line=_after(_COPY, 8),
    ),)
    # the copy right after the build: sharded like the model
    VALID = (Valid(_COPY + "model = nn.Linear(4, 4)\nema = copy.deepcopy(model)\n" + _OPT + _LOOP),)


class ShardAveragedModelInConstructor(Blocker):
    """`AveragedModel(...)` of a sharded model inside a constructor.

    ## Why
    Its copy is sharded like the model only when made in the block that builds the model.

    ## What to do
    Make it right after the model is built.
    """

    CODE = "FSR607"
    NAME = "shard-averaged-model-in-constructor"
    INVALID = (Invalid(  # made after training
        _SWA + "model = nn.Linear(4, 4)\n" + _OPT + _LOOP + "swa = AveragedModel(model)\n",
        line=_after(_SWA, 8),
    ),)
    # made right after the build: its `.module` is sharded like the model
    VALID = (Valid(_SWA + "model = nn.Linear(4, 4)\nema = AveragedModel(model)\n" + _OPT + _LOOP),)


class ShardClassCopiesModel(Blocker):
    """A class deep-copies the model it is handed.

    ## Why
    The copy is made inside a constructor, where the rewrite cannot shard it with the model's units.

    ## What to do
    Keep the copy as `ema = copy.deepcopy(model)` right after the build.
    """

    CODE = "FSR608"
    NAME = "shard-class-copies-model"
    INVALID = (Invalid(
        _COPY + """\
class EMA:
    def __init__(self, model):
        self.module = copy.deepcopy(model)


model = nn.Linear(4, 4)
ema = EMA(model)
""" + _OPT,
        line=_after(_COPY, 7),
    ),)


class ShardMetaInitWithCopy(Blocker):
    """--meta-init with a copy of the model.

    ## Why
    The copy would be made of the model on the meta device, before its re-initialisation.

    ## What to do
    Run without --meta-init.
    """

    CODE = "FSR609"
    NAME = "shard-meta-init-with-copy"
    INVALID = (Invalid(
        _COPY + "model = nn.Linear(4, 4)\nema = copy.deepcopy(model)\n" + _OPT,
        line=_after(_COPY, 2),
        options={"meta_init": True},
    ),)


class ShardOptimizerInClass(Blocker):
    """The optimizer is built inside a trainer class from parameters that cannot be followed to a
    model.

    ## Why
    The rewrite must shard the model before that optimizer is built; one a trainer builds from the
    model it is handed (`model.configure_optimizers(cfg)` in its run()) is followed.

    ## What to do
    Build the optimizer as one call on the model the class is handed, or build the model and
    optimizer in a function and pass them to the class.
    """

    CODE = "FSR610"
    NAME = "shard-optimizer-in-class"
    INVALID = (Invalid(
        _TORCH + """\
class Trainer:
    def __init__(self, make_model):
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)


trainer = Trainer(lambda: nn.Linear(4, 4))
""",
        line=_after(_TORCH, 4),
    ),)


class ShardNoModel(Blocker):
    """No nn.Module is built in the script.

    ## Why
    There is no model to shard.

    ## What to do
    Run rewrite on the script that builds the model and its optimizer.
    """

    CODE = "FSR611"
    NAME = "shard-no-model"
    INVALID = (
        Invalid("print('hi')\n", line=1),
        # the class that trains is picked by a name read at run time, from a package that makes its names
        # when it is imported: refused at the lookup, not at line 1
        Invalid("import sys\n\nfrom agents import *\n\n\ndef main(name):\n    agent_class = globals()[name]\n"
                "    agent_class().run()\n\n\nmain(sys.argv[1])\n", line=7,
                files={"agents/__init__.py": "import importlib\n\nfor name in ['mnist']:\n"
                       "    globals().update(vars(importlib.import_module('agents.' + name)))\n",
                       "agents/mnist.py": "import torch\n\n\nclass MnistAgent:\n    def run(self):\n"
                       "        model = torch.nn.Linear(4, 2)\n"
                       "        opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                       "        model(torch.randn(2, 4)).sum().backward()\n        opt.step()\n"}),
        # the same through a module imported by a name it is given
        Invalid("import importlib\nimport sys\n\ntask = importlib.import_module(sys.argv[1])\ntask.main()\n",
                line=4),
    )
    VALID = (
        # the module built through a helper of the script that hands back what it is given, moved or not
        Valid(_TORCH + "def on_gpu(t, flag):\n    return t.cuda() if flag else t\n\n\n"
              + "model = on_gpu(nn.Linear(4, 4), torch.cuda.is_available())\n" + _OPT + _LOOP),
    )


class ShardNoOptimizer(Blocker):
    """No optimizer trains a model built in the script.

    ## Why
    fully_shard must come before the optimizer is built from the model's parameters.

    ## What to do
    Build the optimizer from model.parameters() in the same script.
    """

    CODE = "FSR612"
    NAME = "shard-no-optimizer"
    INVALID = (Invalid(
        _TORCH + "model = nn.Linear(4, 4)\nmodel(torch.randn(2, 4)).sum().backward()\n", line=_after(_TORCH, 1),
    ),)
    VALID = (
        # the optimizer is built where the model is handed, after a rebinding that moves it (`net = net.cuda()
        # if ... else net` reads what `net` held before: the module built on the line above)
        Valid(_TORCH + "def fit(net):\n    opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
              + "".join("    " + l for l in _LOOP.replace("model", "net").splitlines(True))
              + "\n\nnet = nn.Linear(4, 4)\nnet = net.cuda() if torch.cuda.is_available() else net\nfit(net)\n"),
        # apex's BatchNorm converter hands back the module it converts, as torch's does: a model a helper
        # returns in a tuple after converting it under an option is still followed to the optimizer factory
        Valid("import sys\n\nimport apex\n" + _TORCH
              + "def make_optimizer(model):\n    return torch.optim.SGD(model.parameters(), lr=0.1)\n\n\n"
              + "def set_model(sync):\n    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))\n"
              + "    criterion = nn.MSELoss()\n    if sync:\n        model = apex.parallel.convert_syncbn_model(model)\n"
              + "    if torch.cuda.is_available():\n        model = model.cuda()\n    return model, criterion\n\n\n"
              + "model, criterion = set_model('--sync-bn' in sys.argv)\nopt = make_optimizer(model)\n" + _LOOP),
    )


class ShardModelsInDifferentBlocks(Blocker):
    """Models are built in different blocks.

    ## Why
    One process group and mesh must cover every model; the rewrite needs them built in one place.

    ## What to do
    Build all models in the same function.
    """

    CODE = "FSR613"
    NAME = "shard-models-in-different-blocks"
    INVALID = (Invalid(
        _TORCH + """\
def pretrain():
    teacher = nn.Linear(4, 4)
    teacher_opt = torch.optim.SGD(teacher.parameters(), lr=0.1)


def main():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
""",
        line=_after(_TORCH, 7),
    ),)
    # both models built (and trained) in the one function
    VALID = (Valid(
        _TORCH + """\
def main():
    teacher = nn.Linear(4, 4)
    teacher_opt = torch.optim.SGD(teacher.parameters(), lr=0.1)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""
    ),)


class ShardLibraryPlacementArgument(Blocker):
    """A library model is loaded with device_map= or quantization (load_in_8bit/4bit,
    quantization_config).

    ## Why
    Placed or quantized weights are not plain trainable parameters FSDP2 can shard and reduce.

    ## What to do
    Drop the argument (train in bf16 with --mixed-precision bf16), or keep the script single-GPU.
    """

    CODE = "FSR614"
    NAME = "shard-library-placement-argument"
    INVALID = (Invalid(_HF + 'model = AutoModelForCausalLM.from_pretrained("gpt2", device_map="auto")\n' + _ADAMW,
                       line=_after(_HF, 1)),)


class ShardLibraryPushToHub(Blocker):
    """push_to_hub of a model the rewrite shards.

    ## Why
    Each rank holds only its shards: the library would upload one rank's pieces.

    ## What to do
    Save with save_pretrained(dir) (the rewrite gathers the full state) and upload that folder on
    rank 0.
    """

    CODE = "FSR615"
    NAME = "shard-library-push-to-hub"
    INVALID = (Invalid(_HF + 'model = AutoModelForCausalLM.from_pretrained("gpt2")\n' + _ADAMW
                       + 'model.push_to_hub("me/gpt2-tuned")\n', line=_after(_HF, 3)),)
    # saved to a folder: the rewrite gathers the full state for save_pretrained
    VALID = (Valid(_HF + 'model = AutoModelForCausalLM.from_pretrained("gpt2")\n' + _ADAMW
                   + 'model.save_pretrained("out")\n'),)


class ShardLibraryPeft(Blocker):
    """The model is wrapped by PEFT after it is built.

    ## Why
    The adapters would stay plain tensors whose gradients no rank reduces: the ranks drift apart.

    ## What to do
    Train without PEFT, or keep the script single-GPU.
    """

    CODE = "FSR616"
    NAME = "shard-library-peft"
    INVALID = (Invalid(
        "from peft import LoraConfig, get_peft_model\n" + _HF + 'model = AutoModelForCausalLM.from_pretrained("gpt2")\n'
        + "model = get_peft_model(model, LoraConfig())\n" + _ADAMW,
        line=_after("from peft import LoraConfig, get_peft_model\n" + _HF, 2),
    ),)


class ShardGlobalBuiltInFunction(Blocker):
    """The model is a global built inside a set-up function.

    ## Why
    The process group would be torn down at the end of the set-up function.

    ## What to do
    Build the model in the function that trains and saves it, or pass it as an argument.
    """

    CODE = "FSR617"
    NAME = "shard-global-built-in-function"
    INVALID = (Invalid(
        _TORCH + """\
def setup():
    global model, opt
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)


setup()
""",
        line=_after(_TORCH, 3),
    ),)


class ShardPlainListOfLayers(Blocker):
    """A model keeps layers in a plain Python list that its `__init__` does not register.

    ## Why
    Their parameters are not registered: they are neither trained nor sharded. A list whose every
    element `__init__` registers (a loop over it calling `self.add_module(name, layer)`,
    `self.register_module` or `setattr(self, name, layer)`) holds submodules of the model, and is not
    refused.

    ## What to do
    Use nn.ModuleList, or register each layer (`self.add_module(f"layer{i}", layer)`).
    """

    CODE = "FSR618"
    NAME = "shard-plain-list-of-layers"
    INVALID = (
        Invalid(
            _CLASS.format(init="\n        self.blocks = [nn.Linear(4, 4) for _ in range(2)]", forward="")
            + "model = Net()\n" + _OPT,
            line=_INIT,
        ),
        # registered only under a condition: some layers may stay unregistered
        Invalid(
            _CLASS.format(init="\n        self.blocks = [nn.Linear(4, 4) for _ in range(2)]\n"
                               "        for i, block in enumerate(self.blocks):\n"
                               "            if i:\n"
                               "                self.add_module(f\"block{i}\", block)", forward="")
            + "model = Net()\n" + _OPT,
            line=_INIT,
        ),
    )
    VALID = (
        Valid(
            _CLASS.format(init="\n        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])",
                          forward="")
            + "model = Net()\n" + _OPT + _LOOP
        ),
        # a plain list whose every layer __init__ registers: they are the model's submodules
        Valid(
            _CLASS.format(init="\n        self.blocks = [nn.Linear(4, 4) for _ in range(2)]\n"
                               "        for i, block in enumerate(self.blocks):\n"
                               "            self.add_module(f\"block{i}\", block)", forward="")
            + "model = Net()\n" + _OPT + _LOOP
        ),
    )


class ShardOptimizerInInit(Blocker):
    """An optimizer is built inside the model's __init__.

    ## Why
    It would hold the unsharded parameters; fully_shard replaces them with DTensors.

    ## What to do
    Build the optimizer in the training script, after the model.
    """

    CODE = "FSR619"
    NAME = "shard-optimizer-in-init"
    INVALID = (Invalid(
        _CLASS.format(init="\n        self.opt = torch.optim.SGD(self.parameters(), lr=0.1)", forward="")
        + "model = Net()\n" + _OPT,
        line=_INIT,
    ),)


class ShardModelReboundToWrapper(Blocker):
    """The model's name is rebound to an object wrapping it (`model = Wrapper(model)`) that is not an
    nn.Module, or after something has used the model.

    ## Why
    fully_shard must see the finished module right before the optimizer. An nn.Module wrapper is
    sharded in the model's place (as `model = Wrapper(Net())` is); a wrapper that is no module cannot
    be sharded, and calls meant for the sharded module (set_requires_gradient_sync, state dicts)
    would reach it instead. A module wrapped after an optimizer took its parameters (or a forward ran
    it) would be sharded after that use.

    ## What to do
    Make the wrapper an nn.Module subclass, or give it its own name (`wrapped = Wrapper(model)`);
    wrap the model right after it is built.
    """

    CODE = "FSR620"
    NAME = "shard-model-rebound-to-wrapper"
    INVALID = (
        # a wrapper that is not an nn.Module: fully_shard cannot shard it
        Invalid(_PLAIN_WRAPPER + "model = nn.Linear(4, 4)\nmodel = Wrapper(model)\n" + _OPT,
                line=_after(_PLAIN_WRAPPER, 2)),
        # the same through a function of the script that returns it
        Invalid(_PLAIN_WRAPPER + "def wrap(m):\n    return Wrapper(m)\n\n\nmodel = nn.Linear(4, 4)\nmodel = wrap(model)\n"
                + _OPT, line=_after(_PLAIN_WRAPPER, 6)),
        # a module wrapper around a model an optimizer has already taken the parameters of
        Invalid(_WRAPPER + "model = nn.Linear(4, 4)\n" + _OPT + "model = Wrapper(model)\n" + _LOOP,
                line=_after(_WRAPPER, 3)),
    )
    VALID = (
        # the wrapper built around the model in one expression: that is what gets sharded
        Valid(_WRAPPER + "model = Wrapper(nn.Linear(4, 4))\n" + _OPT + _LOOP),
        # the same in two statements: the nn.Module wrapper is what the optimizer trains, and is sharded
        Valid(_WRAPPER + "model = nn.Linear(4, 4)\nmodel = Wrapper(model)\n" + _OPT + _LOOP),
        # and through a function of the script that returns the module wrapper
        Valid(_WRAPPER + "def wrap(m):\n    return Wrapper(m)\n\n\nmodel = nn.Linear(4, 4)\nmodel = wrap(model)\n"
              + _OPT + _LOOP),
        # a training function that hands back the module it trained (`model = train_model(model, ...)`): the
        # same module, no wrapper
        Valid(_TORCH + "def train_model(net, opt):\n" + "".join("    " + l for l in _LOOP.replace("model", "net")
                                                                 .splitlines(True))
              + "    return net\n\n\nmodel = nn.Linear(4, 4)\n" + _OPT + "model = train_model(model, opt)\n"),
        # the same through a method of a class of the script (`net = Fitter(3).fit(net, opt)`)
        Valid(_TORCH + "class Fitter:\n    def fit(self, net, opt):\n"
              + "".join("        " + l for l in _LOOP.replace("model", "net").splitlines(True))
              + "        return net\n\n\nmodel = nn.Linear(4, 4)\n" + _OPT + "model = Fitter().fit(model, opt)\n"),
        # the same module with its BatchNorm layers replaced, no wrapper: fully_shard goes after it
        Valid(_TORCH + "model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))\n"
              + "model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n" + _OPT + _LOOP),
    )


class ShardFlatteningOptimizer(Blocker):
    """The model is trained by LBFGS, which flattens every gradient into one vector.

    ## Why
    After fully_shard gradients are DTensor shards: the flat vector, its line search and curvature
    pairs would be built from pieces, or gather everything on every rank.

    ## What to do
    Train without sharding, or use an optimizer that works parameter by parameter.
    """

    CODE = "FSR621"
    NAME = "shard-flattening-optimizer"
    INVALID = (Invalid(_TORCH + "model = nn.Linear(4, 4)\nopt = torch.optim.LBFGS(model.parameters())\n",
                       line=_after(_TORCH, 2)),)


class ShardOptimizerWholeMatrices(Blocker):
    """An optimizer class of the script reshapes, transposes or multiplies whole matrices
    (Newton-Schulz, Muon, Shampoo).

    ## Why
    After fully_shard each parameter is a DTensor shard: such an operation gathers the whole matrix
    on every rank or computes on one piece of it.

    ## What to do
    Gather explicitly (full_tensor), compute, keep this rank's part; or keep the script single-GPU.
    """

    CODE = "FSR622"
    NAME = "shard-optimizer-whole-matrices"
    INVALID = (Invalid(  # steps along the gradient's polar factor, from an SVD of the whole matrix
        _TORCH + """\
class PolarSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                u, _, vh = torch.linalg.svd(p.grad)
                p.sub_(u @ vh, alpha=group["lr"])


model = nn.Linear(4, 4)
opt = PolarSGD(model.parameters())
""",
        line=_after(_TORCH, 9),
    ),)


class ShardBlockParameterOutsideForward(Blocker):
    """A method of the model called outside forward reads a parameter of a block that becomes its own
    FSDP unit.

    ## Why
    Outside forward that parameter is a DTensor shard; registering the method
    (register_fsdp_forward_method) gathers only the root unit's, so a tensor built from it leaks a
    DTensor into forward.

    ## What to do
    Take dtype and device from a root parameter (embedding, head), or pass them in.
    """

    CODE = "FSR623"
    NAME = "shard-block-parameter-outside-forward"
    INVALID = (Invalid(
        _TORCH + """\
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def zero_state(self, batch):
        return next(self.parameters()).new_zeros(batch, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


model = Net()
""" + _OPT + "state = model.zero_state(2)\n",
        line=_after(_TORCH, 7),
    ),)


class ShardDoubleBackward(Blocker):
    """`torch.autograd.grad(..., create_graph=True)` (a gradient penalty: WGAN-GP, DRAGAN, R1) whose
    second backward the rewrite cannot train sharded.

    ## Why
    FSDP2 frees a unit's gathered parameters after its backward, and the graph create_graph=True keeps
    for the second backward still reads them. The rewrite keeps the units of the model the penalty
    runs through gathered from forward to its optimizer step (analysis/penalties.py), which trains at
    parity, but not when: the penalty's outputs do not come from a model it shards; the model is
    sharded already without that recipe; or a forward of the model that feeds the same backward() is
    made after the penalty. backward() runs that newest forward's part first, FSDP2 reduce-scatters
    each unit's gradient when it reaches the unit, and the penalty's share arrives after the reduction:
    it never reaches the shards.

    ## What to do
    Call the model on its other inputs before computing the penalty (or take the penalty's backward()
    first); pass the penalty's outputs from a forward of the model; or keep this model unsharded (DDP).
    """

    CODE = "FSR624"
    NAME = "shard-double-backward"
    INVALID = (Invalid(
        _TORCH + "model = nn.Linear(4, 4)\n" + _OPT + "x = torch.randn(2, 4, requires_grad=True)\n"
        + "(grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)\n"
        + "loss = model(x).mean() + grad.pow(2).mean()\nloss.backward()\nopt.step()\n",
        line=_after(_TORCH, 5),
    ), Invalid(
        _TORCH + "model = nn.Linear(4, 4)\n" + _OPT + "x = torch.randn(2, 4, requires_grad=True)\n"
        + "(grad,) = torch.autograd.grad(torch.tanh(x).sum(), x, create_graph=True)\n"
        + "loss = model(x).mean() + grad.pow(2).mean()\nloss.backward()\nopt.step()\n",
        line=_after(_TORCH, 4),
    ),)
    VALID = (Valid(
        _TORCH + "model = nn.Linear(4, 4)\n" + _OPT + "x = torch.randn(2, 4, requires_grad=True)\n"
        + "loss = model(x).mean()\n"
        + "(grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)\n"
        + "(loss + grad.pow(2).mean()).backward()\nopt.step()\n",
    ),)


class ShardUnrecognisedTrainedModel(Blocker):
    """An optimizer trains a module the rewrite does not recognise, beside models it does.

    ## Why
    Only the recognised models are sharded: this one would stay whole on every rank, its gradients
    never reduced, and the ranks would drift apart.

    ## What to do
    Import the class by name (`from models import Generator`, not only `from models import *` of two
    modules that both define it), or build it with a class of the script or a sibling module.
    """

    CODE = "FSR625"
    NAME = "shard-unrecognised-trained-model"
    INVALID = (Invalid(
        "from gans import make_generator\n" + _TORCH + """\
generator = make_generator()
critic = nn.Linear(4, 1)
opt_g = torch.optim.Adam(generator.parameters())
opt_c = torch.optim.Adam(critic.parameters())
""",
        line=_after("from gans import make_generator\n" + _TORCH, 1),
    ),)


class ShardModuleSharedByModels(Blocker):
    """One module is handed to the constructors of two models that get sharded (layers shared between
    two encoders).

    ## Why
    fully_shard of the first model turns the shared parameters into its DTensor shards; the second
    model then meets parameters that are already sharded (the rank-0 broadcast before it fails), and
    FSDP2 lets a unit belong to one root only, so the shared module cannot be its own unit either.

    ## What to do
    Put both models under one parent module and shard that (one root), or keep the script
    single-GPU.
    """

    CODE = "FSR626"
    NAME = "shard-module-shared-by-models"
    INVALID = (Invalid(
        _TORCH + """\
class Encoder(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.shared = shared

    def forward(self, x):
        return self.shared(self.inp(x))


shared = nn.Linear(4, 4)
enc_a = Encoder(shared)
enc_b = Encoder(shared)
opt = torch.optim.SGD([*enc_a.parameters(), *enc_b.parameters()], lr=0.1)
""",
        line=_after(_TORCH, 13),
    ),)


class ShardModelReboundInNestedFunction(Blocker):
    """A function nested in the one that builds the model declares the model's name `nonlocal` and
    binds it to another object.

    ## Why
    The rewrite shards the module the enclosing function built; after the nested function runs, the
    name holds an object fully_shard never saw (unsharded, or a wrapper around the sharded module),
    and the optimizer, state dicts and gradient sync would follow the wrong one.

    ## What to do
    Return the new object from the nested function and bind it in the enclosing function before the
    optimizer is built, or give it its own name.
    """

    CODE = "FSR627"
    NAME = "shard-model-rebound-in-nested-function"
    INVALID = (Invalid(
        _TORCH + """\
def main():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def compile_model():
        nonlocal model
        model = torch.compile(model)

    compile_model()
""",
        line=_after(_TORCH, 7),
    ),)


class ShardScalarParameterMetaInit(Blocker):
    """--meta-init with a model whose classes create a 0-dim parameter
    (`nn.Parameter(torch.zeros(()))`, a learned temperature or gate).

    ## Why
    fully_shard splits each parameter along dim 0 and cannot take a 0-dim one, so the rewrite keeps
    it out of fully_shard, whole on every rank, with a hook that averages its gradient; `to_empty`
    after the fully_shard calls replaces such a plain tensor with a new, uninitialised one, which
    the re-initialisation does not know and the hook is not on.

    ## What to do
    Drop --meta-init: the default rewrite builds the model as written and keeps the 0-dim parameters
    whole on every rank.
    """

    CODE = "FSR628"
    NAME = "shard-scalar-parameter-meta-init"
    INVALID = (Invalid(
        _CLASS.format(init="\n        self.gate = nn.Parameter(torch.zeros(()))", forward="")
        + "model = Net()\n" + _OPT,
        line=_INIT,
        options={"meta_init": True},
    ),)


class ShardOptimizerBeforeShardInBranch(Blocker):
    """An optimizer is built from a model's parameters before the model is sharded, inside a branch (an
    if/else, a try) the rewrite does not move.

    ## Why
    fully_shard replaces the parameters with DTensor shards: an optimizer built before it keeps the
    old tensors and the model never updates. The optimizer stage moves optimizers only within the
    block that shards the model (an if/else that only picks the optimizer, after the model's build,
    is sharded before).

    ## What to do
    Build (and place) the model before the if/else that builds its optimizer, or build the optimizer
    after the model is placed.
    """

    CODE = "FSR629"
    NAME = "shard-optimizer-before-shard-in-branch"
    INVALID = (Invalid(
        _SYS + """\
if len(sys.argv) > 1:
    model, opt = torch.load(sys.argv[1])
else:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
model = model.to("cuda")
""",
        line=_after(_SYS, 5),
    ),)
    # the model built and placed before the if/else that only picks its optimizer
    VALID = (Valid(
        _SYS + """\
model = nn.Linear(4, 4)
model = model.to("cuda")
if len(sys.argv) > 1:
    opt = torch.optim.Adam(model.parameters())
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
""" + _LOOP
    ),)


class ShardOptionClassNotFound(Blocker):
    """--shard names a class that no module of the model is built of.

    ## Why
    The generated loop shards the modules of the named classes; with none of them it shards only the
    root, one unit holding every parameter: the option would do nothing, without a word.

    ## What to do
    Name one of the classes the message lists (the model's repeated block); a model built from a
    library's classes is not checked (its classes are matched when the script runs).
    """

    CODE = "FSR630"
    NAME = "shard-option-class-not-found"
    INVALID = (Invalid(_NET + "model = Net()\n" + _OPT, line=_after(_NET, 1), options={"shard": ["NoSuchClass"]}),)


class ShardGradScalerBeforeTorch25(Blocker):
    """A GradScaler in a script retrofitted for torch 2.4 (--torch-version 2.4).

    ## Why
    fully_shard's gradients are DTensors; GradScaler unscales them and reduces its inf/NaN check
    over every rank's shards only from torch 2.5 on: on 2.4 the first scaler.step fails.

    ## What to do
    Target torch 2.5 or newer, or train in bfloat16 without a loss scaler.
    """

    CODE = "FSR643"
    NAME = "shard-grad-scaler-before-torch-2-5"
    INVALID = (Invalid(
        _TORCH + "model = nn.Linear(4, 4)\n" + _OPT + 'scaler = torch.amp.GradScaler("cuda")\n',
        line=_after(_TORCH, 3),
        options={"torch_version": "2.4"},
    ),)


class ShardForwardWritesParameterData(Blocker):
    """The forward of a trained model (or a method its forward calls on self) writes into one of its
    module's parameters through `.data`: an in-place call (`self.conv.weight.data[:, :,
    -1].zero_()`) or an assignment to `P.data` / `P.data[...]`.

    ## Why
    After fully_shard the forward runs on a copy FSDP2 all-gathered from the shards, and the write
    lands in that copy only: the backward gathers the parameter again from the shards and computes
    the gradients with the unwritten values, and the shards (what the optimizer steps and the
    checkpoint saves) never hold the write. The run trains differently from one process, silently.

    ## What to do
    Apply the change without writing the parameter (multiply the weight by a mask buffer in the
    forward: `F.conv2d(x, self.conv.weight * self.mask, ...)`), or write the parameter outside the
    forward, after optimizer.step(), where the write reaches the shards.
    """

    CODE = "FSR644"
    NAME = "shard-forward-writes-parameter-data"
    INVALID = (Invalid(
        _CLASS.format(init="", forward="\n        self.fc.weight.data.clamp_(-1, 1)") + "model = Net()\n" + _OPT,
        line=_FORWARD,
    ),)


class ShardCastAfterShard(Blocker):
    """A dtype cast of a trained model (`model.to(torch.bfloat16)`, `model.half()`, also chained:
    `model.to(device).to(torch.bfloat16)`) that runs after the place where fully_shard goes: in the
    training loop, after a block that runs a forward, or in a function the model is handed later.

    ## Why
    fully_shard goes where the model's build ends: its construction and the placements and casts
    that follow it, inline or in a function that only moves and casts it, up to the first statement
    that uses it. FSDP2 fixes the dtype of its all-gathers at the model's first forward: a cast after
    that one fails in the next forward (torch 2.13: RuntimeError "Expected out tensor to have dtype
    c10::BFloat16, but got float"). A cast before the first forward would work, but where the rewrite
    cannot show the cast comes first, it does not leave it to chance.

    ## What to do
    Cast the model where it is built, before the optimizer and any forward (inline, or in a function
    that only moves and casts it): fully_shard then shards it in that dtype and the run trains as the
    single process did. Or keep float32 parameters and pass --mixed-precision bf16 (a
    MixedPrecisionPolicy: bfloat16 compute with float32 parameters and optimizer state, which is not
    the same training).
    """

    CODE = "FSR645"
    NAME = "shard-cast-after-shard"
    INVALID = (
        # cast after a forward of the model (a warm-up under no_grad): fully_shard goes before the `with`
        Invalid(_TORCH + "model = nn.Linear(4, 4)\nwith torch.no_grad():\n    model(torch.randn(2, 4))\n"
                "model.to(torch.bfloat16)\n" + _OPT + _LOOP, line=_after(_TORCH, 4)),
        # in a function the trained model is handed after its build
        Invalid(_TORCH + "def train(net, opt):\n    net.half()\n" + "".join(
            "    " + l for l in _LOOP.replace("model", "net").splitlines(True))
            + "\n\nmodel = nn.Linear(4, 4)\n" + _OPT + "train(model, opt)\n", line=_after(_TORCH, 2)),
    )
    VALID = (
        # cast in an if/else right after the build, a chained cast: fully_shard comes after it
        Valid(_TORCH + "import sys\nmodel = nn.Linear(4, 4)\nif len(sys.argv) > 1:\n"
              "    model = model.to('cpu').to(torch.bfloat16)\nelse:\n    model = model.to('cpu')\n" + _OPT + _LOOP),
        # cast by a function that only moves and casts the module it is handed
        Valid(_TORCH + "def to_bf16(m):\n    return m.to(torch.bfloat16)\n\n\nmodel = nn.Linear(4, 4)\n"
              "model = to_bf16(model)\n" + _OPT + _LOOP),
        # float32 casts of a float32 model change nothing
        Valid(_TORCH + "model = nn.Linear(4, 4)\n" + _OPT + "model.float()\n" + _LOOP),
    )


# -- the checks: run by the shard stage on its analysis, in this order ------------------------


def find(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """The refusals of the shard stage, in the order the stage meets them (the first one is raised)."""
    yield from _wrappers(facts, options)
    yield from _refuse_double_backward(facts, options)
    yield from _refuse_old_grad_scaler(facts, options)
    yield from _compiled_builds(facts, options)
    yield from _trainer_classes(facts, options)
    yield from _copies(facts, options)
    yield from _no_model(facts, options)
    yield from _refuse_optimizers(facts, options)
    yield from _refuse_optimizers_built_before_shard(facts, options)
    yield from _unknown_model(facts, options)
    yield from _models_apart(facts, options)
    yield from _each_model(facts, options)
    yield from _casts_after_shard(facts, options)


def _wrappers(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """A DDP or FSDP1 wrapper a migration stage left: it must go before fully_shard."""
    for line, wrapper in facts.wrappers:
        if "FSDP1" not in wrapper:  # the migrate_ddp stage removes these before this stage runs
            yield Blocked(
                "FSR601",
                line,
                f"the script still uses {wrapper}",
                "the wrapper must go before fully_shard",
                "run the migrate_ddp stage first (the composite `rewrite` does)",
            )
            continue
        yield Blocked(
            "FSR601",
            line,
            f"the script still uses {wrapper}",
            "the FSDP1 wrap must go before fully_shard",
            "run the migrate_fsdp1 stage first (the composite `rewrite` does)",
        )


def _compiled_builds(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """A model compiled in the expression that builds it."""
    for call in facts.compiled_builds:
        if compiled_model(call, facts) is not None:
            continue  # `model = torch.compile(Net())`: split, see _split_compile
        yield Blocked(
            "FSR604",
            call,
            "the model is compiled in the expression that builds it",
            "fully_shard must see the plain module, before torch.compile wraps it",
            "build it first (`model = Net()`), then `model = torch.compile(model)` on its own line",
        )


def _trainer_classes(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """A training loop in a class of another file, handed the model."""
    for cls, call in facts.trainer_classes:
        yield Blocked(
            "FSR605",
            call,
            f"the training loop lives in class {cls}, which is handed the model",
            "the class is in another file, which the program did not take in (one module more than it reads, "
            "or a module that does not parse): its loop would keep its plain "
            "sampler, saves and logging",
            "rewrite the module that holds the loop, or import fewer project modules from the entry",
        )


def _copies(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """Copies of a model that gets sharded, made where the rewrite cannot shard them with it."""
    copied = {id(c.copy_call) for c in facts.copies}
    for call in facts.deep_copies:
        if id(call) in copied:
            continue  # `ema = copy.deepcopy(model)` after the build: sharded like the model
        yield Blocked(
            "FSR606",
            call,
            f"`{code(call)}` copies a model that gets sharded",
            "FSDP2 modules cannot be deep-copied; a copy is sharded like the model only when it is made as "
            "`name = copy.deepcopy(model)` in the block that builds the model, before the model is rebound, "
            "sharded or used in a loop",
            "make the copy right after the model is built (ema = copy.deepcopy(model))",
        )
    for what, call in facts.hidden_copies:
        if id(call) in copied:
            continue  # `ema = AveragedModel(model, ...)` after the build: its `.module` is sharded
        if what == "AveragedModel":
            yield Blocked(
                "FSR607",
                call,
                "`AveragedModel(...)` deep-copies a model that gets sharded, inside its constructor",
                "its copy (`.module`) is sharded like the model only when it is made as "
                "`name = AveragedModel(model, ...)` in the block that builds the model, before the model is "
                "rebound, sharded or used in a loop (FSDP2 modules cannot be deep-copied after sharding)",
                "make it right after the model is built",
            )
        yield Blocked(
            "FSR608",
            call,
            f"class {what} deep-copies the model it is handed",
            "the copy is made inside a constructor, where the rewrite cannot shard it with the model's units "
            "(FSDP2 modules cannot be deep-copied after sharding), and its state would be saved unconverted",
            "keep the average as `ema = copy.deepcopy(model)` right after the build, updated with "
            "`torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)` under "
            "torch.no_grad(): it is then sharded like the model",
        )
    if options.meta_init and facts.copies:
        yield Blocked(
            "FSR609",
            facts.copies[0].stmt,
            "--meta-init with a copy of the model",
            "the copy would be made of the model on the meta device, before its re-initialisation",
            "run without --meta-init",
        )


def _no_model(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """No model the rewrite can shard: the refusal names the blocker."""
    if not facts.models:
        handed = next(iter(handed_builds(facts)), None)
        if handed is not None and facts.class_optimizers:
            call, arg = handed
            yield Blocked(
                "FSR610",
                arg,
                f"the model `{code(arg.value)}` is built inside the arguments of `{code(call.func)}(...)`, "
                "where the rewrite cannot bind it to a name first",
                "fully_shard needs the model as a name before the optimizer is built from it; a build handed "
                "straight to a project class or function is named on the line before, but not where an argument "
                "before it is a call (it would run after it), in a conditional expression, a comprehension or "
                "another call's arguments",
                f"bind it first: `model = {code(arg.value)}`, then pass `model`",
            )
            return
        for cls, call in facts.class_optimizers:
            yield Blocked(
                "FSR610",
                call,
                f"the optimizer is built inside class {cls} from parameters the rewrite cannot follow to a "
                "model the script builds",
                "the rewrite must shard that model before the optimizer is built; an optimizer a trainer "
                "builds from the model it is handed (`self.optimizer = model.configure_optimizers(cfg)`, "
                "`torch.optim.AdamW(self.model.parameters())`) is followed, this one is not",
                f"build the optimizer as one call on the model {cls} is handed, or build the model and "
                f"optimizer in a function and pass them to {cls}",
            )
        blocker = no_model_blocker(facts) or nothing_found_at(facts)
        where, detail = blocker.at, (f": {blocker.detail}" if blocker.detail else "")
        if not facts.module_ctor_names:
            yield Blocked(
                "FSR611",
                where,
                f"no nn.Module is built in this script{detail}",
                "there is no model to shard",
                "run rewrite on the script that builds the model and its optimizer",
            )
        yield Blocked(
            "FSR612",
            where,
            f"no optimizer trains a model built in this script{detail}",
            "fully_shard must come before the optimizer is built from the model's parameters",
            "build the optimizer from model.parameters() in the same script",
        )


def _unknown_model(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """A trained module of a class the rewrite does not recognise."""
    unknown = unrecognised_trained_model(facts)
    if unknown is not None:
        yield Blocked(
            "FSR625",
            unknown.at,
            f"an optimizer trains a module the rewrite does not recognise: {unknown.detail}",
            "the rewrite shards the models it recognises; this one would stay a whole module on every rank "
            "whose gradients no rank reduces, and the ranks would drift apart",
            "import the class by name (`from models import Generator`), or build the module with a class "
            "defined in the script or a sibling module",
        )


def _models_apart(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """Models built apart, sharing a submodule, or rebound by a nested function."""
    scopes = {id(m.block) for m in facts.models}
    if len(scopes) > 1:
        yield Blocked(
            "FSR613",
            facts.models[1].stmt,
            "models are built in different blocks",
            "one process group and mesh must cover every model; the rewrite needs them built in one place",
            "build all models in the same function",
        )
    shared = shared_module(facts)
    if shared is not None:
        first, second = shared.owners[0], shared.owners[1]
        yield Blocked(
            "FSR626",
            second.stmt,
            f"`{shared.name}` is a submodule of both `{first.name}` (line {facts.resolver.line(first.stmt)}) "
            f"and `{second.name}`, which both get sharded",
            "fully_shard of the first model makes the shared parameters its DTensor shards, and the second "
            "model would meet them already sharded; FSDP2 lets a unit belong to one root only",
            f"put `{first.name}` and `{second.name}` under one parent module and shard that, or keep the "
            "script single-GPU",
        )
    for assign, name in facts.closure_rebinds:
        yield Blocked(
            "FSR627",
            assign,
            f"a nested function rebinds `{name}` (declared nonlocal), a model of the function around it",
            "the rewrite shards the module the enclosing function built; after this assignment the name holds "
            "an object fully_shard never saw, and the optimizer, state dicts and gradient sync would follow "
            "the wrong one",
            f"return the new object and bind `{name}` in the enclosing function before the optimizer is "
            "built, or give it its own name",
        )


def _casts_after_shard(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """A dtype cast of a sharded model that runs after its fully_shard (analysis/dtype_casts.py)."""
    for call, model in casts_after_shard(facts):
        dtype = dtype_cast(call)
        flag = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype)
        yield Blocked(
            "FSR645",
            call,
            f"`{code(call)}` casts `{model.name}` after fully_shard",
            f"fully_shard goes where the build of `{model.name}` ends (line {facts.resolver.line(model.shard_anchor)}), "
            "and this cast runs later, on the sharded model: FSDP2 fixes the dtype of its all-gathers at the "
            "model's first forward, so a cast after that forward fails in the next one (torch 2.13: "
            "RuntimeError 'Expected out tensor to have dtype ...'); the rewrite cannot show this one comes first",
            f"cast `{model.name}` where it is built, before the optimizer and any forward (inline, or in a "
            "function that only moves and casts it): it is then sharded in that dtype"
            + (f"; or keep float32 parameters with --mixed-precision {flag} (float32 master weights: not the "
               "same training)" if flag else ""),
        )


def _each_model(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """What each model's build and classes keep from sharding it."""
    for model in facts.models:
        if model.library is not None and model.library.refusal is not None and not model.sharded:
            kind, what, why, hint = model.library.refusal
            yield Blocked(kind, model.library.refusal_at or model.stmt, what, why, hint)
        if model.rebound_by is not None and not model.sharded:
            yield _rebound(model, facts)
        if _declared_global(model, facts):
            yield Blocked(
                "FSR617",
                model.stmt,
                f"`{model.name}` is a global built inside {model.scope.name.value}()",
                "set-up, training and saving are spread over functions that share globals; the "
                "process group would be torn down at the end of the set-up function",
                "build the model in the function that trains and saves it, or pass it as an argument",
            )
        # a class chosen at run time: each class the name may hold
        for info in filter(None, map(facts.classes.get, model.alternatives or [model.class_name])):
            for attr, node in info.plain_lists:
                yield Blocked(
                    "FSR618",
                    (node, model.stmt),
                    f"`self.{attr}` keeps layers in a plain Python list",
                    "its parameters are not registered: they are neither trained nor sharded",
                    f"use nn.ModuleList for self.{attr}",
                )
            yield from _refuse_block_parameter_reads(model, info, facts, options)
            yield from _refuse_forward_data_writes(model, info, facts, options)
            if info.optimizer_in_init:
                yield Blocked(
                    "FSR619",
                    (info.optimizer_in_init, model.stmt),
                    f"an optimizer is built inside {info.name}.__init__",
                    "it would hold the unsharded parameters; fully_shard replaces them with DTensors",
                    "build the optimizer in the training script, after the model",
                )

def _rebound(model: ModelSite, facts: ScriptFacts) -> Blocked:
    """FSR620 at `model = Wrapper(model)`, with why the wrapper cannot be what gets sharded: a
    module wrapper is sharded in the model's place (analysis/models.py) unless something uses the
    model before the wrap; anything else is not a module."""
    rebind = code(model.rebound_by).strip()
    module = any(stmt is model.rebound_by for _, stmt in facts.module_builds)
    used = (facts.analysis.anchors.used_before(model.name, model.top, model.rebound_by, model.block)
            if module and facts.analysis is not None else None)
    if used is not None:
        return Blocked(
            "FSR620",
            model.rebound_by,
            f"`{rebind}` wraps the model after `{code(used).strip()}` (line {facts.resolver.line(used)}) has "
            f"used it",
            "fully_shard must see the finished module, the wrapper, before anything takes its parameters or "
            "runs it: sharded after the wrap, the earlier use would hold the unsharded module; sharded before, "
            "the wrapper's own parameters would stay whole on every rank",
            f"wrap `{model.name}` right after it is built, before the statement on line "
            f"{facts.resolver.line(used)}",
        )
    return Blocked(
        "FSR620",
        model.rebound_by,
        f"`{rebind}` rebinds the model to an object that wraps it and is not an nn.Module",
        f"fully_shard shards modules: it must see the module right before the optimizer, and calls meant for "
        f"the sharded module (set_requires_gradient_sync, get_model_state_dict) would reach the wrapper under "
        f"the name `{model.name}`",
        f"give the wrapper its own name (`wrapped = Wrapper({model.name})`), or make the wrapper an nn.Module "
        f"subclass",
    )


def _refuse_old_grad_scaler(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """A GradScaler unscales FSDP2's DTensor gradients and reduces its inf/NaN check over
    their mesh from torch 2.5 on (pytorch#132816): before that, --torch-version 2.4 output
    would fail at the first `scaler.step` (or skip steps on some ranks only)."""
    version = options.torch_version
    if not version or tuple(int(p) for p in version.split(".")[:2]) >= (2, 5):
        return
    r = facts.resolver
    for call in r.nodes(cst.Call):
        if r.qnames(call) & GRAD_SCALER:
            yield Blocked(
                "FSR643",
                call,
                f"a GradScaler with --torch-version {version}",
                "torch 2.4's GradScaler cannot unscale FSDP2's DTensor gradients (its inf/NaN check is reduced "
                "over the ranks from torch 2.5 on)",
                "target torch 2.5 or newer (--torch-version 2.5), or train in bfloat16 without a scaler",
            )


def _refuse_block_parameter_reads(model: ModelSite, info, facts: ScriptFacts, options) -> Iterator[Blocked]:
    """A method called outside forward that reads a parameter of a block that gets its
    own unit: register_fsdp_forward_method gathers only the root unit's parameters."""
    if options.shard:
        return  # --shard CLASS: the units are found at run time
    blocks = {c.path[0] for c in (info.containers if model.runtime_blocks else model.containers)}
    for method in facts.methods_called_on(model, info):
        for node, sub in parameter_reads(info.methods[method], info):
            owner = sub if sub is not None else first_submodule(info)
            if owner in blocks:
                yield Blocked(
                    "FSR623",
                    (node, model.stmt),
                    f"{info.name.rsplit('.', 1)[-1]}.{method}() reads a parameter of `self.{owner}` outside forward",
                    f"`self.{owner}` holds blocks that each become an FSDP unit: outside their forward their "
                    "parameters are DTensor shards, and registering the method gathers only the root's; a tensor "
                    "built from one leaks a DTensor into forward",
                    "take dtype and device from a parameter of the root (an embedding, the head), or pass them in",
                )

def _refuse_forward_data_writes(model: ModelSite, info, facts: ScriptFacts, options) -> Iterator[Blocked]:
    """A forward that writes a parameter through `.data` (analysis/forward_data_writes.py):
    after fully_shard the write lands in the gathered copy, not in the shards."""
    if model.copy_of is not None or any(model is f for f in facts.frozen_models):
        return  # forward only: each forward gathers and writes again, no gradient reads it
    found = forward_data_write(info.name, facts.classes)
    if found is None:
        return
    owner = facts.classes.get(found.class_name)
    line = owner.namer.resolver.line(found.node) if owner.namer is not None else 0
    where = (f"{facts.classes.shown_file(owner.namespace)}:{line}" if owner.namespace else f"line {line}")
    yield Blocked(
        "FSR644",
        (found.node, model.stmt),
        f"{found.class_name.rsplit('.', 1)[-1]}.{found.method}() ({where}) writes `{found.parameter}` through "
        f"`.data` in the forward of `{model.name}`: `{code(found.node).strip()}`",
        "after fully_shard the forward runs on a copy all-gathered from the shards and the write lands in that "
        "copy only: the backward gathers the parameter again from the shards, so it computes the gradients "
        "with the unwritten values, and the shards the optimizer steps and the checkpoint saves never hold "
        "the write",
        "apply the change without writing the parameter (multiply by a mask buffer: "
        "`F.conv2d(x, self.conv.weight * self.mask, ...)`), or write the parameter outside the forward, "
        "after optimizer.step(), where the write reaches the shards",
    )

def _refuse_double_backward(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """A gradient penalty (autograd.grad with create_graph) the recipe of analysis/penalties.py
    cannot train: its model is not found, or a forward feeding the same backward follows it."""
    if not facts.models:
        return
    for penalty in penalties(facts):
        if penalty.blocked is not None:
            yield Blocked("FSR624", *penalty.blocked)

def _refuse_optimizers(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """Optimizers whose step cannot work on DTensor shards."""
    for opt in facts.optimizers:
        if opt.call is None:
            continue
        if facts.resolver.qnames(opt.call.func) & FLATTENING_OPTIMIZERS:
            yield Blocked(
                "FSR621",
                opt.stmt,
                f"`{opt.name}` is {code(opt.call.func)}, which flattens every gradient into one vector",
                "after fully_shard each parameter and gradient is a DTensor shard: its line search and "
                "curvature pairs would be computed on pieces of the vector (or gather all of it on every rank)",
                "train this model without sharding, or use an optimizer that works parameter by parameter",
            )
        if opt.wrapper is not None and opt.inner is None:
            yield from _unread_wrapper(opt, facts)
        if opt.method is not None and opt.method_builds & FLATTENING_OPTIMIZERS:
            yield Blocked(
                "FSR621",
                opt.stmt,
                f"`{opt.name}` is built by {opt.method.name.value}(), which builds "
                f"{sorted(opt.method_builds & FLATTENING_OPTIMIZERS)[0]}, flattening every gradient into one vector",
                "after fully_shard each parameter and gradient is a DTensor shard: its line search and "
                "curvature pairs would be computed on pieces of the vector (or gather all of it on every rank)",
                "train this model without sharding, or use an optimizer that works parameter by parameter",
            )
        if opt.own_class is not None:
            op = whole_tensor_operation(opt.own_class)
            if op is not None:
                yield Blocked(
                    "FSR622",
                    op,
                    f"optimizer class {opt.own_class.name.value} works on whole matrices (`{code(op)}`)",
                    "after fully_shard each parameter and gradient is a DTensor shard (rows split over the "
                    "ranks): a reshape, transpose or matrix product of it gathers the whole matrix on every "
                    "rank or computes on one piece of it",
                    "gather the gradient explicitly (`g.full_tensor()`), compute, and keep this rank's "
                    "part (distribute_tensor), or keep the script single-GPU",
                )

def _refuse_optimizers_built_before_shard(facts: ScriptFacts, options) -> Iterator[Blocked]:
    """An optimizer of a model built, in the function that shards the model, before the
    statement fully_shard follows and outside its block (a branch of an if/else, a try): the
    optimizer stage moves only statements of that block, so it would keep the unsharded
    parameters and the model would never update."""
    r = facts.resolver
    for model in facts.models:
        anchor = model.shard_anchor
        fn = r.enclosing_function(anchor)
        body = list(r.block_of(anchor).body) if r.block_of(anchor) is not None else []
        names = model.names.get(fn, {model.name})
        for opt in facts.optimizers:
            if (r.enclosing_function(opt.stmt) is not fn or not set(opt.models) & names or opt.stmt in body
                    or r.order(opt.stmt) > r.order(anchor)):
                continue
            yield Blocked(
                "FSR629",
                opt.stmt,
                f"`{opt.name}` is built from `{model.name}`'s parameters before `{model.name}` is sharded "
                f"(fully_shard goes after line {r.line(anchor)}), inside a block the rewrite does not move",
                "fully_shard replaces the parameters with DTensor shards: an optimizer built before it keeps "
                "the old tensors and the model never updates; the optimizer stage moves an optimizer only "
                "within the block that shards the model",
                "build the model (and place it) before the if/else that builds its optimizer, or build the "
                "optimizer after the model is placed",
            )

def _unread_wrapper(opt, facts: ScriptFacts) -> Iterator[Blocked]:
    """`opt = Wrapper(optim.Adam(...))` whose class is not in the script or a sibling module."""
    wrapper = code(opt.wrapper.func)
    for call in facts.resolver.nodes(cst.Call):
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value in ("state_dict", "load_state_dict")
                and isinstance(func.value, cst.Attribute)):
            continue
        names = facts.optimizer_names.get(facts.resolver.enclosing_function(call), {})
        if root_name(func.value) in names:
            yield Blocked(
                "FSR612",
                call,
                f"`{code(func.value)}.{func.attr.value}()`: the optimizer is held by `{wrapper}(...)`, whose class "
                "is not in this script or a sibling module",
                "the rewrite cannot tell whether that attribute is the torch optimizer, whose state must be "
                "read and written through get_optimizer_state_dict / set_optimizer_state_dict after fully_shard",
                f"rewrite the script beside the module that defines {wrapper}",
            )


def compiled_model(call: cst.Call, facts: ScriptFacts):
    """The model whose whole build statement is `name = torch.compile(<build>, ...)`."""
    for model in facts.models:
        small = model.stmt.body[0]
        if isinstance(small, cst.Assign) and small.value is call and call.args and call.args[0].keyword is None:
            return model
    return None


def _declared_global(model: ModelSite, facts: ScriptFacts) -> bool:
    if not isinstance(model.scope, cst.FunctionDef):
        return False
    found = [n.name.value for node in facts.resolver.descendants(model.scope.body, cst.Global) for n in node.names]
    return model.name in found
