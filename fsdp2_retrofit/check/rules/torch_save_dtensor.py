"""FSD102 torch-save-dtensor."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.syntax.torch_api import TORCH_SAVE
from . import Edit, Fix, Invalid, Rule, Valid

_PRELUDE = """\
import torch
from torch.distributed.fsdp import fully_shard

model = Net()
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters())
"""
_FIXED_PRELUDE = _PRELUDE.replace("import torch\n", "import torch\nimport torch.distributed.checkpoint as dcp\n")


class TorchSaveDTensor(Rule):
    """Checks for `torch.save` of a sharded module's or its optimizer's state.

    ## What it does
    Flags `torch.save(x, path)` where `x` is, or holds, the state of a module sharded
    with `fully_shard`: `model.state_dict()`, `optimizer.state_dict()` of an optimizer
    over sharded parameters, `get_model_state_dict(model)` without
    `full_state_dict=True`, the sharded module itself, a variable bound to any of
    these, or a dict or list that contains one.

    ## Why is this bad?
    After `fully_shard` every parameter is a DTensor holding this rank's shard. Each
    rank pickles its own shard to the same path (the last writer wins), and the file
    cannot be loaded as a model, nor into a run on a different number of ranks.

    ## Example
    ```python
    fully_shard(model)
    torch.save({"model": model.state_dict(), "step": step}, "ckpt.pt")
    ```

    ## Use instead
    ```python
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id="ckpt")
    ```
    or, for one file that single-GPU code can load, gather it on every rank and write
    on rank 0:
    ```python
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        torch.save(state, "model.pt")
    ```

    ## Fix safety
    The fix (`torch.save(x, path)` → `dcp.save(x, checkpoint_id=path)`) is unsafe: the
    checkpoint becomes a directory written by every rank, and the code that loads it
    must change to `dcp.load` (`fsdp2-retrofit rewrite` converts both sides).
    """

    CODE = "FSD102"
    FIX_SAFETY = "unsafe"
    NAME = "torch-save-dtensor"
    MESSAGE = "`torch.save` of {what}: each rank writes only its shards; save with `torch.distributed.checkpoint`"
    VALID = (
        Valid(_PRELUDE + "torch.save({'loss': losses, 'step': step}, 'metrics.pt')\n"),
        Valid("import torch\nmodel = Net()\ntorch.save(model.state_dict(), 'model.pt')\n"),
        Valid(
            _PRELUDE
            + "from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict\n"
            "state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
            "torch.save(state, 'model.pt')\n"
        ),
        Valid("import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\n"
              "torch.save(model.state_dict(), 'init.pt')\nfully_shard(model)\n"),
        Valid(_PRELUDE + "state = model.state_dict()\nstate = {'loss': 1.0}\ntorch.save(state, 'metrics.pt')\n"),
    )
    INVALID = (
        # an optimizer a factory builds from the sharded model's parameters (torchtune's
        # `config.instantiate`), stored on self and stepped in another method
        Invalid(
            "import torch\nfrom torch.distributed.fsdp import fully_shard\n\n\nclass Recipe:\n"
            "    def setup(self, cfg, model):\n        fully_shard(model)\n        self.model = model\n"
            "        self.opt = config.instantiate(cfg.optimizer, self.model.parameters())\n\n"
            "    def train(self, x):\n        self.model(x).sum().backward()\n        self.opt.step()\n"
            "        torch.save(self.opt.state_dict(), 'opt.pt')\n",
            line=14,
            fixed="import torch\nimport torch.distributed.checkpoint as dcp\nfrom torch.distributed.fsdp import fully_shard\n\n\n"
            "class Recipe:\n"
            "    def setup(self, cfg, model):\n        fully_shard(model)\n        self.model = model\n"
            "        self.opt = config.instantiate(cfg.optimizer, self.model.parameters())\n\n"
            "    def train(self, x):\n        self.model(x).sum().backward()\n        self.opt.step()\n"
            "        dcp.save(self.opt.state_dict(), checkpoint_id='opt.pt')\n",
        ),
        Invalid(
            _PRELUDE + "torch.save(model.state_dict(), 'model.pt')\n",
            line=7,
            fixed=_FIXED_PRELUDE + "dcp.save(model.state_dict(), checkpoint_id='model.pt')\n",
        ),
        Invalid(
            _PRELUDE + "state = model.state_dict()\ntorch.save(state, path)\n",
            line=8,
            fixed=_FIXED_PRELUDE + "state = model.state_dict()\ndcp.save(state, checkpoint_id=path)\n",
        ),
        Invalid(
            _PRELUDE + "ckpt = {'model': model.state_dict(), 'step': step}\n"
            "torch.save(ckpt, f'ckpt_{step}.pt')\n",
            line=8,
            fixed=_FIXED_PRELUDE + "ckpt = {'model': model.state_dict(), 'step': step}\n"
            "dcp.save(ckpt, checkpoint_id=f'ckpt_{step}.pt')\n",
        ),
        Invalid(
            _PRELUDE + "torch.save({'optimizer': optimizer.state_dict()}, 'opt.pt')\n",
            line=7,
            fixed=_FIXED_PRELUDE + "dcp.save({'optimizer': optimizer.state_dict()}, checkpoint_id='opt.pt')\n",
        ),
        Invalid(_PRELUDE + "torch.save(model, 'model.pt')\n", line=7),
        Invalid(  # nanoGPT's raw_model alias
            _PRELUDE + "raw_model = model\ntorch.save(raw_model.state_dict(), 'a.pt')\n", line=8,
            fixed=_FIXED_PRELUDE + "raw_model = model\ndcp.save(raw_model.state_dict(), checkpoint_id='a.pt')\n",
        ),
        Invalid(
            _PRELUDE + "ckpt = {}\nckpt['model'] = model.state_dict()\ntorch.save(ckpt, 'ckpt.pt')\n",
            line=9,
            fixed=_FIXED_PRELUDE
            + "ckpt = {}\nckpt['model'] = model.state_dict()\ndcp.save(ckpt, checkpoint_id='ckpt.pt')\n",
        ),
    )

    def check(self, ctx):
        for call in ctx.nodes(cst.Call):
            if not call.args or not (ctx.resolver.qnames(call) & TORCH_SAVE):
                continue
            what = ctx.shards.sharded_state(call.args[0].value, call)
            if what is None:
                continue
            # dcp.save is a collective: inside a rank-0 branch the "fix" would hang
            gated = ctx.shards.rank_zero_branch(call) is not None
            yield call, {"what": what}, None if gated else _fix(call, what, _dcp_name(ctx))


def _dcp_name(ctx):
    """(name, needs import) for torch.distributed.checkpoint: an existing
    `import torch.distributed.checkpoint as X`, else `dcp` when that name is free."""
    for imp in ctx.nodes(cst.Import):
        for alias in imp.names:
            if code(alias.name) == "torch.distributed.checkpoint" and alias.asname is not None:
                return code(alias.asname.name), False
    taken = {n.value for n in ctx.nodes(cst.Name)} - {"dcp"}
    for node in ctx.nodes(cst.Name):
        if node.value == "dcp":
            return None, False  # `dcp` means something else here: no fix rather than a wrong one
    return ("dcp", True) if "dcp" not in taken else (None, False)


def _fix(call: cst.Call, what: str, dcp):
    name, needs_import = dcp
    if name is None or what.startswith("sharded module") or len(call.args) != 2 or any(a.star for a in call.args):
        return None  # a pickled module has no state-dict form to hand to dcp.save
    state, path = call.args
    if path.keyword is not None and path.keyword.value != "f":
        return None
    new = call.with_changes(
        func=cst.Attribute(cst.Name(name), cst.Name("save")),
        args=[
            state.with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT),
            path.with_changes(
                keyword=cst.Name("checkpoint_id"),
                equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
            ),
        ],
    )
    return Fix(
        "Save with `dcp.save(..., checkpoint_id=...)` (the checkpoint becomes a directory)",
        [Edit(call, new)],
        safe=False,
        imports=(("torch.distributed.checkpoint", None, "dcp"),) if needs_import else (),
    )
