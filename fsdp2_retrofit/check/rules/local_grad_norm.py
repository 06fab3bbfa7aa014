"""FSD107 local-grad-norm."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.syntax.names import walk
from fsdp2_retrofit.syntax.torch_api import CLIP_GRAD_NORM
from . import Edit, Fix, Invalid, Rule, Valid

_HEAD = "import torch\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"
_CLIP = "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
_FULL = "norm = norm.full_tensor()\n"
# reading a tensor as a number
_NUMBER_FUNCS = {"float", "int", "print", "round", "str", "format"}
_NUMBER_METHODS = {"item", "tolist", "cpu", "numpy"}
_LOG_METHODS = {"log", "info", "debug", "warning", "add_scalar", "log_metrics", "log_dict", "write", "set_postfix"}


class LocalGradNorm(Rule):
    """Checks for the total norm from `clip_grad_norm_` read as a number without `.full_tensor()`.

    ## What it does
    Flags reads of the value `clip_grad_norm_` returns for a sharded module's
    parameters as a number: `.item()`, `float(...)` (also of the call itself:
    `float(clip_grad_norm_(...))`), an f-string, `print`, a logger or metrics call, a
    metrics dict (`{"grad_norm": norm}`, `metrics["grad_norm"] = norm`). A test
    `norm is not None` reads no value.

    ## Why is this bad?
    With DTensor parameters the returned norm is a DTensor. The clipping itself is
    global and correct, but reading the norm locally gives this rank's view, which
    differs per rank; logged values (and any decision made on them, such as skipping
    a step on a non-finite norm) disagree between ranks.

    ## Example
    ```python
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    print(f"grad norm {norm.item():.3f}")
    ```

    ## Use instead
    ```python
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    norm = norm.full_tensor()
    print(f"grad norm {norm.item():.3f}")
    ```

    ## Fix safety
    The fix is safe: it inserts `norm = norm.full_tensor()` right after the clip, on
    every rank (never inside a rank-0 branch, where the collective would hang).
    """

    CODE = "FSD107"
    NAME = "local-grad-norm"
    MESSAGE = "`{name}` from `clip_grad_norm_` is a DTensor read locally; use `{name}.full_tensor()` first"
    TRIGGERS = ("clip_grad_norm_",)
    VALID = (
        Valid(_HEAD + _CLIP + _FULL + "print(f'norm {norm.item():.3f}')\n"),
        Valid(_HEAD + "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"),
        Valid("import torch\nnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\nprint(norm.item())\n"),
        Valid(_HEAD + _CLIP + "print(norm.full_tensor().item())\n"),
        Valid(_HEAD + _CLIP + "if norm is not None:\n    norm = norm.full_tensor()\n    print(float(norm))\n"),
        Valid(_HEAD + "g = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor())\n"),
    )
    INVALID = (
        Invalid(_HEAD + _CLIP + "print(f'norm {norm.item():.3f}')\n", line=5,
                fixed=_HEAD + _CLIP + _FULL + "print(f'norm {norm.item():.3f}')\n"),
        Invalid(_HEAD + _CLIP + "logger.info('norm %f', float(norm))\n", line=5,
                fixed=_HEAD + _CLIP + _FULL + "logger.info('norm %f', float(norm))\n"),
        Invalid(_HEAD + _CLIP + "if rank == 0:\n    print(f'norm {norm}')\n", line=6,
                fixed=_HEAD + _CLIP + _FULL + "if rank == 0:\n    print(f'norm {norm}')\n"),
        Invalid(_HEAD + "g = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()\n", line=4,
                fixed=_HEAD + "g = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor().item()\n"),
        Invalid(_HEAD + "g = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))\n", line=4,
                fixed=_HEAD + "g = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor())\n"),
        Invalid(_HEAD + _CLIP + "metrics = {}\nif norm is not None:\n    metrics['grad_norm'] = norm\n", line=7,
                fixed=_HEAD + _CLIP + _FULL + "metrics = {}\nif norm is not None:\n    metrics['grad_norm'] = norm\n"),
        # the name rebound to its own number: the read is in the rebinding statement
        Invalid(_HEAD + _CLIP + "norm = norm.item()\n", line=5,
                fixed=_HEAD + _CLIP + _FULL + "norm = norm.item()\n"),
    )

    def check(self, ctx):
        shards = ctx.shards
        for clip in ctx.nodes(cst.Call):
            if not (ctx.resolver.qnames(clip) & CLIP_GRAD_NORM) or not clip.args:
                continue
            if shards.sharded_module(clip.args[0].value, clip) is None:
                continue
            # a rank-0 branch around the clip (FSD110's finding) leaves no safe place for the collective
            gated = shards.rank_zero_branch(clip) is not None
            parent = ctx.resolver.parent(clip)
            if isinstance(parent, cst.Attribute) and parent.attr.value in _NUMBER_METHODS:
                new = parent.with_changes(value=cst.Call(cst.Attribute(clip, cst.Name("full_tensor"))))
                fix = None if gated else Fix("Read it with `.full_tensor()`", [Edit(parent, new)])
                yield clip, {"name": "clip_grad_norm_(...)"}, fix
                continue
            if isinstance(parent, cst.Arg) and parent.value is clip and _number_call(ctx.resolver.parent(parent)):
                # `float(clip_grad_norm_(...))`: read as a number straight away
                new = parent.with_changes(value=cst.Call(cst.Attribute(clip, cst.Name("full_tensor"))))
                fix = None if gated else Fix("Read it with `.full_tensor()`", [Edit(parent, new)])
                yield clip, {"name": "clip_grad_norm_(...)"}, fix
                continue
            if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1
                    and isinstance(parent.targets[0].target, cst.Name)):
                continue
            name = parent.targets[0].target.value
            stmt = ctx.resolver.statement_of(clip)
            fix = None
            # only where a statement can follow the clip's own line: not `a = clip(...); print(a)`,
            # not a one-line `if c: a = clip(...)`
            if not gated and isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
                fix = Fix(
                    f"Insert `{name} = {name}.full_tensor()` after the clip",
                    [Edit(stmt, [cst.parse_statement(f"{name} = {name}.full_tensor()\n")], kind="after")],
                )
            for use in _numeric_reads(ctx, name, clip):
                yield use, {"name": name}, fix


def _numeric_reads(ctx, name: str, clip: cst.Call):
    """Reads of `name` as a number after the clip, up to its next assignment, same function."""
    r = ctx.resolver
    shards = ctx.shards
    fn = shards.scope_of(clip)
    start = shards.order(clip)
    rebound = sorted((
        (shards.order(a), a) for a in ctx.nodes(cst.Assign)
        if shards.scope_of(a) is fn and shards.order(a) > start
        and any(isinstance(t.target, cst.Name) and t.target.value == name for t in a.targets)
    ), key=lambda pair: pair[0])
    end = rebound[0][0] if rebound else 10**12
    # `norm = norm.item()`: the value of the rebinding statement still reads the clip's norm
    last_read = {id(n) for n in walk(rebound[0][1].value) if type(n) is cst.Name} if rebound else set()
    for node in ctx.nodes(cst.Name):
        if node.value != name or shards.scope_of(node) is not fn:
            continue
        if not (start < shards.order(node) < end or id(node) in last_read):
            continue
        parent = r.parent(node)
        if isinstance(parent, cst.Attribute) and parent.value is node:
            if parent.attr.value == "full_tensor":
                continue
            if parent.attr.value in _NUMBER_METHODS:
                yield node
            continue
        if isinstance(parent, cst.FormattedStringExpression):
            yield node
            continue
        if isinstance(parent, cst.Arg):
            if _number_call(r.parent(parent)):
                yield node
            continue
        if isinstance(parent, cst.DictElement) and parent.value is node:
            yield node  # wandb.log({"grad_norm": norm}) and friends
        elif (isinstance(parent, cst.Assign) and parent.value is node and len(parent.targets) == 1
              and isinstance(parent.targets[0].target, cst.Subscript)):
            yield node  # metrics["grad_norm"] = norm: a dict a logger reads
        elif isinstance(parent, cst.Comparison) and all(_identity(c) for c in parent.comparisons):
            continue  # `norm is not None`: no value read
        elif isinstance(parent, cst.ComparisonTarget) and _identity(parent):
            continue
        elif isinstance(parent, (cst.FormattedStringExpression, cst.Comparison, cst.ComparisonTarget)):
            yield node


def _identity(target: cst.ComparisonTarget) -> bool:
    return isinstance(target.operator, (cst.Is, cst.IsNot))


def _number_call(call) -> bool:
    """`float(x)`, `print(x)`, `logger.info(..., x)`, `math.isfinite(x)`: x read as a number."""
    if not isinstance(call, cst.Call):
        return False
    func = call.func
    return (
        (isinstance(func, cst.Name) and func.value in _NUMBER_FUNCS)
        or (isinstance(func, cst.Attribute) and (func.attr.value in _LOG_METHODS or "math." in _dotted(func)))
    )


def _dotted(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node) + "."
