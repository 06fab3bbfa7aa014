"""FSD101 forward-call."""
from __future__ import annotations

import libcst as cst

from . import Edit, Fix, Invalid, Rule, Valid

_PRELUDE = """\
import torch
from torch.distributed.fsdp import fully_shard
model = Net()
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
"""

_HOLDER = """\
from torch.distributed.fsdp import fully_shard
class Holder:
    def __init__(self, net):
        self.net = net
    def run(self, x):
        return {body}
model = Net()
fully_shard(model)
holder = Holder(model)
"""

_NESTED = """\
from torch.distributed.fsdp import fully_shard
def main():
    model = Net()
    fully_shard(model)
    def step(x):
        return {body}
    step(1)
"""


class ForwardCall(Rule):
    """Checks for `.forward(...)` called directly on a sharded module.

    ## What it does
    Flags `m.forward(x)` where `m` is a module sharded with `fully_shard` (or FSDP1), or
    one of its sharded blocks.

    ## Why is this bad?
    FSDP2 all-gathers a unit's parameters in a forward pre-hook and frees them again in
    a post-hook. `m.forward(x)` skips `nn.Module.__call__` and with it both hooks: the
    forward runs on the local shards (a shape error at best, a silently wrong result at
    worst), and backward never reduce-scatters the gradients of that unit.

    ## Example
    ```python
    fully_shard(model)
    logits = model.forward(x)
    ```

    ## Use instead
    ```python
    fully_shard(model)
    logits = model(x)
    ```
    To call another method as an entry point (`model.generate(...)`), register it with
    `torch.distributed.fsdp.register_fsdp_forward_method(model, "generate")`.

    ## Fix safety
    The fix is safe: calling the module instead of its `forward` runs the same code
    plus the module's hooks, which FSDP2 needs. Hooks you registered yourself run too.
    """

    CODE = "FSD101"
    NAME = "forward-call"
    MESSAGE = "`{target}.forward(...)` bypasses FSDP2's hooks on sharded `{root}`; call `{target}(...)`"
    VALID = (
        Valid(_HOLDER.format(body="x") + "other = Holder(Net())\ny = other.net.forward(x)\n"),  # may hold an unsharded one
        Valid(_PRELUDE + "y = model(x)\n"),
        Valid("model = Net()\ny = model.forward(x)\n"),  # nothing is sharded
        Valid(
            "import torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
            "class Child(Parent):\n    def forward(self, x):\n        return super().forward(x)\n"
        ),
        Valid(
            "from torch.distributed.fsdp import fully_shard\nclass Tokenizer:\n    def forward(self, s):\n"
            "        return s.split()\ntok = Tokenizer()\nwords = tok.forward(text)\n"
        ),
        Valid("from torch.distributed.fsdp import fully_shard\nmodel = Net()\ny = model.forward(x)\nfully_shard(model)\n"),
        Valid(_NESTED.format(body="model.forward(x)").replace(  # the nested function binds its own model
            "        return", "        model = Net()\n        return")),
        Valid(  # only blocks are units: the root's own forward is an ordinary call
            "from torch.distributed.fsdp import fully_shard\nmodel = Net()\nfor b in model.blocks:\n"
            "    fully_shard(b)\ny = model.forward(x)\n"
        ),
    )
    INVALID = (
        Invalid(  # a sharded module held by an object of the script: followed by value
            _HOLDER.format(body="x") + "y = holder.net.forward(x)\n", line=10,
            fixed=_HOLDER.format(body="x") + "y = holder.net(x)\n",
        ),
        Invalid(  # inside the holder's method, called on the object that holds the sharded module
            _HOLDER.format(body="self.net.forward(x)") + "holder.run(x)\n", line=6,
            fixed=_HOLDER.format(body="self.net(x)") + "holder.run(x)\n",
        ),
        Invalid(_PRELUDE + "y = model.forward(x)\n", line=7, fixed=_PRELUDE + "y = model(x)\n"),
        Invalid(
            _PRELUDE + "h = model.blocks[0].forward(x, mask=m)\n",
            line=7,
            fixed=_PRELUDE + "h = model.blocks[0](x, mask=m)\n",
        ),
        Invalid(
            _PRELUDE + "def evaluate(net, batch):\n    return net.forward(batch)\nevaluate(model, x)\n",
            line=8,
            fixed=_PRELUDE + "def evaluate(net, batch):\n    return net(batch)\nevaluate(model, x)\n",
        ),
        Invalid(  # returned, sharded, in a tuple
            "from torch.distributed.fsdp import fully_shard\ndef build():\n    m = Net()\n    fully_shard(m)\n"
            "    return m, 1\nmodel, opt = build()\ny = model.forward(x)\n",
            line=7,
            fixed="from torch.distributed.fsdp import fully_shard\ndef build():\n    m = Net()\n    fully_shard(m)\n"
            "    return m, 1\nmodel, opt = build()\ny = model(x)\n",
        ),
        Invalid(  # sharded by a helper that shards its argument (torchtitan's apply_fsdp)
            "from torch.distributed.fsdp import fully_shard\ndef apply_fsdp(m):\n    for b in m.layers:\n"
            "        fully_shard(b)\n    fully_shard(m)\nmodel = Net()\napply_fsdp(model)\ny = model.forward(x)\n",
            line=8,
            fixed="from torch.distributed.fsdp import fully_shard\ndef apply_fsdp(m):\n    for b in m.layers:\n"
            "        fully_shard(b)\n    fully_shard(m)\nmodel = Net()\napply_fsdp(model)\ny = model(x)\n",
        ),
        Invalid(  # a nested function reading the sharded model of the function around it
            _NESTED.format(body="model.forward(x)"), line=6, fixed=_NESTED.format(body="model(x)"),
        ),
        Invalid(  # another name for the module: `.cuda()` returns the module itself
            _PRELUDE + "net = model.cuda()\ny = net.forward(x)\n",
            line=8,
            fixed=_PRELUDE + "net = model.cuda()\ny = net(x)\n",
        ),
        Invalid(
            "import torch.distributed.fsdp as fsdp\nmodel = fsdp.fully_shard(Net())\nout = model.forward(x)\n",
            line=3,
            fixed="import torch.distributed.fsdp as fsdp\nmodel = fsdp.fully_shard(Net())\nout = model(x)\n",
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        for call in ctx.nodes(cst.Call):
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value == "forward"):
                continue
            root = shards.sharded_module(func.value, call, unit=True)
            if root is None:
                continue
            fix = Fix(f"Call `{_code(func.value)}(...)`", [Edit(call, call.with_changes(func=func.value))])
            yield call, {"target": _code(func.value), "root": root}, fix


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
