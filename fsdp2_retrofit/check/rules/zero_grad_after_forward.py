"""FSD113 zero-grad-after-forward."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis.zero_grad import zero_grads_between
from . import Edit, Fix, Invalid, Rule, Valid

_HEAD = (
    "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\nfully_shard(model)\n"
    "opt = torch.optim.AdamW(model.parameters())\n"
)
_LOOP = "for x in loader:\n    loss = model(x).sum()\n    {clear}\n    loss.backward()\n    opt.step()\n"


def _loop(clear: str) -> str:
    return _LOOP.format(clear=clear)


class ZeroGradAfterForward(Rule):
    """Checks for `zero_grad()` on a sharded module between its forward and backward.

    ## What it does
    Flags `model.zero_grad()` where `model` is sharded with `fully_shard`, a forward of
    `model` comes before it and a `.backward()` after it, in the same loop body (or,
    outside loops, the same function). Nested functions are checked too, with the
    modules they close over.

    ## Why is this bad?
    After a forward FSDP2 keeps the root's parameters (and those of every unit whose
    `reshard_after_forward` is off, typically the last block) gathered until backward.
    While they are gathered, the module's parameters are the unsharded tensors:
    `model.zero_grad()` clears those, and the sharded parameters, which hold the
    gradients of the previous step, keep them. Each backward adds to them: the
    gradients pile up step after step, silently.

    ## Example
    ```python
    loss = loss_fn(model(x), y)
    model.zero_grad()
    loss.backward()
    optimizer.step()
    ```

    ## Use instead
    ```python
    loss = loss_fn(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ```
    or call `model.zero_grad()` before the forward.

    ## Fix safety
    A fix is offered when exactly one optimizer is built over the module's parameters
    (in scope at the call): it clears through that optimizer, which holds the sharded
    parameters. It is safe when the optimizer is built from `model.parameters()`;
    otherwise unsafe, as the optimizer may hold only part of the parameters and leave
    the others' gradients uncleared.
    """

    CODE = "FSD113"
    NAME = "zero-grad-after-forward"
    MESSAGE = (
        "`{target}.zero_grad()` between the forward (line {forward}) and backward() of sharded `{target}` "
        "clears its gathered parameters, not the sharded gradients; {instead}"
    )
    TRIGGERS = ("zero_grad",)
    FIX_SAFETY = "mixed"
    VALID = (
        Valid(_HEAD + _loop("opt.zero_grad()")),
        Valid(_HEAD + "for x in loader:\n    model.zero_grad()\n    loss = model(x).sum()\n    loss.backward()\n"),
        Valid("import torch\nmodel = Net()\n" + _loop("model.zero_grad()")),  # nothing is sharded
        Valid(  # the backward comes before it: gradients are cleared after the step
            _HEAD + "for x in loader:\n    model(x).sum().backward()\n    opt.step()\n    model.zero_grad()\n"
        ),
        Valid(_HEAD + "for x in loader:\n    out = model(x)\n    model.zero_grad()\n"),  # no backward follows
        Valid(  # `probe` is not sharded
            _HEAD + "probe = Net()\nfor x in loader:\n    loss = probe(x).sum() + model(x).sum()\n"
            "    probe.zero_grad()\n    loss.backward()\n"
        ),
    )
    INVALID = (
        Invalid(_HEAD + _loop("model.zero_grad()"), line=8, fixed=_HEAD + _loop("opt.zero_grad()")),
        Invalid(
            _HEAD + _loop("model.zero_grad(set_to_none=True)"), line=8,
            fixed=_HEAD + _loop("opt.zero_grad(set_to_none=True)"),
        ),
        Invalid(  # the optimizer trains part of the model: the fix may leave other gradients (unsafe)
            _HEAD.replace("model.parameters()", "model.head.parameters()") + _loop("model.zero_grad()"), line=8,
            fixed=_HEAD.replace("model.parameters()", "model.head.parameters()") + _loop("opt.zero_grad()"),
        ),
        Invalid(  # a nested function closing over the model and its optimizer
            "import torch\nfrom torch.distributed.fsdp import fully_shard\ndef main():\n    model = Net()\n"
            "    fully_shard(model)\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "    def step(x):\n        loss = model(x).sum()\n        model.zero_grad()\n        loss.backward()\n"
            "        opt.step()\n    for x in loader:\n        step(x)\n",
            line=9,
            fixed="import torch\nfrom torch.distributed.fsdp import fully_shard\ndef main():\n    model = Net()\n"
            "    fully_shard(model)\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "    def step(x):\n        loss = model(x).sum()\n        opt.zero_grad()\n        loss.backward()\n"
            "        opt.step()\n    for x in loader:\n        step(x)\n",
        ),
        Invalid(  # received as an argument, forward through a helper: no optimizer in scope, no fix
            "from torch.distributed.fsdp import fully_shard\ndef compute(m, x):\n    return m(x).sum()\n"
            "def train(net, loader):\n    for x in loader:\n        loss = compute(net, x)\n        net.zero_grad()\n"
            "        loss.backward()\nmodel = Net()\nfully_shard(model)\ntrain(model, loader)\n",
            line=7,
        ),
        Invalid(  # two optimizers over the model: which one clears is not known
            _HEAD + "opt2 = torch.optim.SGD(model.parameters())\n" + _loop("model.zero_grad()"), line=9,
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        places = {}

        def model_of(expr, at):
            found = shards.fsdp2_root(expr, at)
            if found is None:
                return None
            places[id(at)] = found[1]
            return found[0]

        helpers = {f.name.value for f in ctx.module.body if isinstance(f, cst.FunctionDef)}
        for found in zero_grads_between(ctx.resolver, model_of, helpers):
            at = places.get(id(found.call), found.call)
            opts = [o for o in shards.optimizers if found.model in o.models and shards.optimizer(o.name, at) is o]
            fields = {"target": found.model, "forward": str(ctx.resolver.line(found.forward))}
            if len({o.name for o in opts}) != 1:
                yield found.call, {**fields, "instead": "call it before the forward or clear through the optimizer"}, None
                continue
            opt = opts[-1]
            whole = _is_parameters_of(opt.call.args[0].value, found.model) if opt.call.args else False
            func = found.call.func
            fix = Fix(
                f"Clear through `{opt.name}.zero_grad()`",
                [Edit(found.call, found.call.with_changes(func=func.with_changes(value=cst.parse_expression(opt.name))))],
                safe=whole,
            )
            yield found.call, {**fields, "instead": f"use `{opt.name}.zero_grad()`"}, fix


def _is_parameters_of(expr: cst.BaseExpression, model: str) -> bool:
    """`model.parameters()`."""
    return (
        isinstance(expr, cst.Call) and not expr.args and isinstance(expr.func, cst.Attribute)
        and expr.func.attr.value == "parameters" and isinstance(expr.func.value, cst.Name)
        and expr.func.value.value == model
    )
