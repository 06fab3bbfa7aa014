"""FSD114 change-after-shard."""
from __future__ import annotations

from typing import Optional

import libcst as cst

from fsdp2_retrofit.analysis.closures import sharded_here
from fsdp2_retrofit.analysis.dtype_casts import cast_receiver, dtype_cast
from fsdp2_retrofit.analysis.sharding import part_root
from fsdp2_retrofit.syntax.names import SELF_RETURNING_METHODS, bind_args
from fsdp2_retrofit.syntax.torch_api import TORCH_LOAD
from . import Invalid, Rule, Valid

_HEAD = "import torch\nimport torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\n"
_REGISTER = {"add_module", "register_module", "register_parameter"}
_GROW = {"append", "extend", "insert", "update"}
_PLAIN_LOADERS = {"safetensors.torch.load_file", "safetensors.torch.load"}


class ChangeAfterShard(Rule):
    """Checks for a structural change to a module after `fully_shard` of it.

    ## What it does
    After `fully_shard(model)` of the root (in the same function, a function it is passed to, or
    a nested function closing over it), flags:
    - a new submodule or parameter: `model.head = nn.Linear(...)`, `model.add_module(...)`,
      `register_parameter`, `model.layers.append(Block())`;
    - a dtype cast of the module: `model.half()`, `model.bfloat16()`, `model.float()`,
      `model.to(torch.bfloat16)`, `model.to(dtype=...)`, also in a chain of moves
      (`model.to(device).to(torch.bfloat16)`) (as a statement, or assigned back to the
      module);
    - `model.load_state_dict(d)` of a plain dict: a dict built in the script, the
      `state_dict()` of a module that is not sharded, a `safetensors` file
      (`torch.load` is FSD112's); this one after the sharding of any of its blocks too.
    A part added or a cast between the blocks' `fully_shard` and the root's is not
    flagged: the root's `fully_shard` takes the parameters as they are then. Neither is a
    new submodule sharded in turn: `fully_shard(model.head)` after it in the same function,
    or, for a helper handed the model, after the helper's call in its caller.
    Nor is `m.register_parameter(name, p)` putting back a parameter the same function
    took out of fully_shard's way before it (`m.register_parameter(name, None)`: a
    0-dim one, which fully_shard cannot split) when `p` gets a gradient hook there
    (`register_post_accumulate_grad_hook`, `register_hook`) that can sync it.

    ## Why is this bad?
    `fully_shard` turns the parameters it finds into DTensor shards and builds its
    all-gather and reduce-scatter over exactly those. A parameter added later is a
    plain tensor no collective touches: each rank trains its own copy and the ranks
    drift apart, silently. A dtype cast after the first forward leaves FSDP2
    gathering in the old dtype (a dtype error in the next forward, or worse with
    mixed precision). A plain dict holds full tensors, not shards: loading it
    copies the wrong slices or fails on shapes.

    ## Example
    ```python
    fully_shard(model)
    model.head = nn.Linear(512, 10)
    model.to(torch.bfloat16)
    ```

    ## Use instead
    ```python
    model.head = nn.Linear(512, 10)
    model.to(torch.bfloat16)  # or MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model)
    ```
    Load full state dicts before sharding, or with `set_model_state_dict(model, sd,
    options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`.

    ## Fix safety
    No automatic fix: moving the change before `fully_shard` can change what the
    optimizer, the loaded checkpoint or later code sees.
    """

    CODE = "FSD114"
    NAME = "change-after-shard"
    MESSAGE = "{what} after `fully_shard` of `{root}`: {why}"
    TRIGGERS = (
        "add_module", "register_module", "register_parameter", "append", "extend", "insert", "update",
        "half", "bfloat16", "float", "double", ".to(", "load_state_dict", " = ",
    )
    VALID = (
        Valid(_HEAD + "model.head = nn.Linear(4, 2)\nmodel.to(torch.bfloat16)\nfully_shard(model)\n"),
        Valid(_HEAD + "fully_shard(model)\nmodel.head = nn.Linear(4, 2)\nfully_shard(model.head)\n"),  # sharded in turn
        Valid(  # a helper swaps the submodule, its caller shards the new one (torchtune's embedding resize)
            _HEAD + "def swap(m):\n    m.head = nn.Linear(4, 2)\ndef resize(model):\n    swap(model)\n"
            "    fully_shard(model.head)\ndef main():\n    model = Net()\n    fully_shard(model)\n    resize(model)\n"
        ),
        Valid(_HEAD + "fully_shard(model)\nmodel.to('cuda')\nout = model(x).float()\n"),  # device moves are fine
        Valid(_HEAD + "fully_shard(model)\nw = model.head.weight.float()\nmodel.history = []\n"),  # tensors, plain data
        Valid(_HEAD + "fully_shard(model)\nmodel.head.weight.float().tolist()\n"),  # a tensor's cast, read
        Valid(_HEAD + "fully_shard(model)\nstate = get_model_state_dict(model)\ndcp.load(state, checkpoint_id=p)\n"
              "model.load_state_dict(state)\n"),  # DCP-loaded sharded state
        Valid("import torch\nimport torch.nn as nn\nmodel = Net()\nmodel.head = nn.Linear(4, 2)\nmodel.half()\n"),
        Valid(_HEAD + "for block in model.blocks:\n    fully_shard(block)\nmodel.head = nn.Linear(4, 2)\n"
              "fully_shard(model)\n"),  # the root's fully_shard comes after: it shards the head
        Valid(_HEAD + "scale = model.scale\nmodel.register_parameter('scale', None)\nfully_shard(model)\n"
              "model.register_parameter('scale', scale)\nscale.register_post_accumulate_grad_hook(average)\n"),
        # a 0-dim parameter put back after fully_shard (which cannot split it), with a gradient hook
    )
    INVALID = (
        Invalid(_HEAD + "fully_shard(model)\nmodel.head = nn.Linear(4, 2)\n", line=6),
        Invalid(  # the caller shards another submodule than the one swapped in
            _HEAD + "def swap(m):\n    m.head = nn.Linear(4, 2)\ndef resize(model):\n    swap(model)\n"
            "    fully_shard(model.embed)\ndef main():\n    model = Net()\n    fully_shard(model)\n    resize(model)\n",
            line=6,
        ),
        Invalid(_HEAD + "fully_shard(model)\nmodel.to(torch.bfloat16)\n", line=6),
        Invalid(_HEAD + "scale = model.scale\nmodel.register_parameter('scale', None)\nfully_shard(model)\n"
                "model.register_parameter('scale', scale)\n", line=8),  # put back, but no hook syncs its gradient
        Invalid(_HEAD + "fully_shard(model)\nmodel = model.half()\n", line=6),
        Invalid(_HEAD + "fully_shard(model)\nmodel.to('cuda').to(torch.bfloat16)\n", line=6),  # a chained cast
        Invalid(_HEAD + "fully_shard(model)\nmodel.layers.append(Block())\nclass Block(nn.Module):\n    pass\n", line=6),
        Invalid(_HEAD + "fully_shard(model)\nmodel.load_state_dict({k: v for k, v in base.items()})\n", line=6),
        Invalid(_HEAD + "base = Net()\nfully_shard(model)\nmodel.load_state_dict(base.state_dict())\n", line=7),
        Invalid(  # a nested function closing over the sharded model
            "import torch\nfrom torch.distributed.fsdp import fully_shard\ndef main():\n    model = Net()\n"
            "    fully_shard(model)\n    def to_bf16():\n        model.to(dtype=torch.bfloat16)\n    to_bf16()\n",
            line=7,
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        if not shards.uses_fully_shard:
            return
        classes = {c.name.value for c in ctx.nodes(cst.ClassDef)}
        for assign in ctx.nodes(cst.Assign):
            for t in assign.targets:
                target = t.target
                if isinstance(target, cst.Attribute) and _builds_module(ctx, assign.value, classes):
                    found = sharded_here(shards, target.value, assign, root_sharded=True)
                    if found is not None and not _sharded_later(ctx, assign, target):
                        yield assign, self._new_part(ctx, found, f"`{_code(target)} = {_code(assign.value.func)}(...)`"), None
                        break
        for call in ctx.nodes(cst.Call):
            func = call.func
            if not isinstance(func, cst.Attribute):
                continue
            method = func.attr.value
            if method in _REGISTER or (method in _GROW and any(_builds_module(ctx, a.value, classes) for a in call.args)):
                if method == "register_parameter" and _put_back(ctx, call):
                    continue
                found = sharded_here(shards, func.value, call, root_sharded=True)
                if found is not None:
                    yield call, self._new_part(ctx, found, f"`{_code(func)}(...)`"), None
            elif dtype_cast(call) is not None:
                if not _module_cast(ctx, call):
                    continue
                found = sharded_here(shards, cast_receiver(call), call, root_sharded=True)
                if found is not None:
                    yield call, self._fields(ctx, found, f"dtype cast `{_code(call)}`",
                                             "FSDP2 keeps gathering in the dtype it recorded (cast before `fully_shard`, "
                                             "or use MixedPrecisionPolicy)"), None
            elif method == "load_state_dict" and call.args:
                found = sharded_here(shards, func.value, call)
                plain = found is not None and self._plain(ctx, call.args[0].value, call, depth=3)
                if plain:
                    yield call, self._fields(ctx, found, f"`{_code(func)}` of {plain}",
                                             "full tensors into DTensor shards (load before sharding, or "
                                             "set_model_state_dict with full_state_dict=True)"), None

    def _new_part(self, ctx, found, what):
        return self._fields(ctx, found, f"new submodule or parameter {what}",
                            "its parameters stay plain tensors no collective syncs; the ranks drift apart")

    def _fields(self, ctx, found, what, why):
        root, anchor = found
        return {"what": what, "root": root, "why": why}

    def _plain(self, ctx, expr, at, depth) -> Optional[str]:
        """What plain (unsharded) state `expr` is, or None when it is not known to be plain."""
        if depth == 0:
            return None
        if isinstance(expr, (cst.Dict, cst.DictComp)):
            return "a dict built here"
        if isinstance(expr, cst.Call):
            names = ctx.resolver.qnames(expr)
            if names & TORCH_LOAD:
                return None  # FSD112
            if names & _PLAIN_LOADERS:
                return "a safetensors file"
            func = expr.func
            if isinstance(func, cst.Name) and func.value == "dict":
                return "a dict built here"
            if isinstance(func, cst.Attribute) and func.attr.value == "state_dict" and not expr.args:
                owner = part_root(func.value)
                if owner is not None and owner[0] != "self" and sharded_here(ctx.shards, func.value, at, fsdp2=False) is None:
                    if isinstance(func.value, cst.Name) and ctx.shards.bound_values(func.value.value, at):
                        return f"the state dict of unsharded `{_code(func.value)}`"
            return None
        if isinstance(expr, cst.Name):
            values = ctx.shards.bound_values(expr.value, at)
            if len(values) == 1:
                return self._plain(ctx, values[0], at, depth - 1)
        return None


def _sharded_later(ctx, assign: cst.Assign, target: cst.Attribute) -> bool:
    """The new submodule is sharded in turn: `fully_shard(model.head)` after
    `model.head = nn.Linear(...)` in the same function, or, where `model` is a parameter of
    that function, after a call of it in a function of this file that hands it the module
    (`_swap(model, n)` then `fully_shard(model.head)`: a helper that swaps a submodule
    of a sharded model, the caller shards the new one)."""
    shards = ctx.shards
    attr = target.attr.value
    sites = [s for s in shards.sites if s.direct and not s.legacy and isinstance(s.call, cst.Call) and s.call.args]

    def sharded_after(owner: str, scope, order: int) -> bool:
        for s in sites:
            arg = s.call.args[0].value
            if (shards.scope_of(s.call) is scope and shards.order(s.call) > order
                    and isinstance(arg, cst.Attribute) and arg.attr.value == attr and _code(arg.value) == owner):
                return True
        return False

    fn = shards.scope_of(assign)
    if sharded_after(_code(target.value), fn, shards.order(assign)):
        return True
    if not (isinstance(fn, cst.FunctionDef) and isinstance(target.value, cst.Name)):
        return False
    for call in ctx.nodes(cst.Call):
        if not (isinstance(call.func, cst.Name) and call.func.value == fn.name.value):
            continue
        for param, arg in bind_args(fn, call, 0):
            if param == target.value.value and sharded_after(_code(arg), shards.scope_of(call), shards.order(call)):
                return True
    return False


def _put_back(ctx, call: cst.Call) -> bool:
    """`m.register_parameter(name, p)` puts back a parameter its function took out of
    fully_shard's way (`m.register_parameter(name, None)` before: a 0-dim one, which
    fully_shard cannot split) and gives it a gradient hook (`p.register_post_accumulate_grad_hook`
    or `p.register_hook`) that can sync it over the ranks. Without the hook it is flagged."""
    if len(call.args) != 2:
        return False
    receiver, name, value = _code(call.func.value), _code(call.args[0].value), _code(call.args[1].value)
    scope = ctx.resolver.enclosing_function(call)
    emptied = hooked = False
    for other in ctx.nodes(cst.Call):
        func = other.func
        if not isinstance(func, cst.Attribute) or ctx.resolver.enclosing_function(other) is not scope:
            continue
        if (func.attr.value == "register_parameter" and len(other.args) == 2 and _code(func.value) == receiver
                and _code(other.args[0].value) == name and _code(other.args[1].value) == "None"):
            emptied = True
        elif func.attr.value in ("register_post_accumulate_grad_hook", "register_hook") and _code(func.value) == value:
            hooked = True
    return emptied and hooked


def _builds_module(ctx, value, classes) -> bool:
    """`nn.Linear(...)`, `nn.Parameter(...)`, `Block(...)` (a class of this file)."""
    if not isinstance(value, cst.Call):
        return False
    if isinstance(value.func, cst.Name) and value.func.value in classes:
        return True
    return any(
        n.startswith("torch.nn.") and not n.startswith("torch.nn.functional.") and n.rsplit(".", 1)[-1][:1].isupper()
        for n in ctx.resolver.qnames(value)
    )


def _module_cast(ctx, call: cst.Call) -> bool:
    """The cast's result is dropped (the module is cast in place) or bound back to the
    module itself: a cast of a module, not of a tensor read from it. In a chain of methods
    that return the module (`model.to(device).to(torch.bfloat16)`, `model.half().cuda()`), the chain's."""
    r = ctx.resolver
    outer = call
    while (isinstance(r.parent(outer), cst.Attribute) and r.parent(outer).attr.value in SELF_RETURNING_METHODS
           and isinstance(r.parent(r.parent(outer)), cst.Call) and r.parent(r.parent(outer)).func is r.parent(outer)):
        outer = r.parent(r.parent(outer))
    parent = r.parent(outer)
    if isinstance(parent, cst.Expr):
        return True
    receiver = part_root(cast_receiver(call))
    if isinstance(parent, cst.Assign) and receiver is not None:
        return any(part_root(t.target) == receiver for t in parent.targets)
    return False


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
