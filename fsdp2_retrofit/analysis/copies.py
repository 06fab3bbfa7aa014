"""State copies that go wrong once a model is sharded.

An EMA kept as a sharded copy of the model (`ema = copy.deepcopy(model)`, sharded
with the model's units) is updated shard by shard: `p_ema.mul_(d).add_(p)`,
`torch._foreach_lerp_`, `lerp_`, even `ema.load_state_dict(model.state_dict())`
pair DTensors of one layout (checked by execution: fixtures/rewrite/ema_copy).
What does not survive sharding is state copied between a sharded module and
*plain* tensors:

- a loop over a sharded module's state that `.copy_`s from another dict
  (`for k, v in ema.state_dict().items(): v.copy_(saved[k])`): a plain tensor
  copied into a DTensor fails (mixed torch.Tensor and DTensor), and a full tensor
  is not this rank's shard anyway;
- a dict or list of clones of a sharded module's tensors (`{k: v.clone() for k, v
  in model.state_dict().items()}`): each rank holds DTensor shards, and a
  `torch.save` of it writes shards, not an averaged model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Set

import libcst as cst

from fsdp2_retrofit.syntax.names import calls_in, code

_STATE_ITERATORS = {"state_dict", "parameters", "named_parameters"}
_STATE_GETTERS = {"state_dict", "parameters", "named_parameters"}


@dataclass
class UnsafeCopy:
    node: cst.CSTNode
    what: str
    why: str


def unsafe_state_copies(facts) -> List[UnsafeCopy]:
    """Copies between the state of a model that gets sharded and plain tensors."""
    r = facts.resolver
    out: List[UnsafeCopy] = []
    for loop in r.nodes(cst.For):
        owner = _state_owner(loop.iter, facts, loop)
        if owner is None:
            continue
        for call in _copy_calls(loop.body):
            source = call.args[0].value if call.args else None
            plain = _subscripted_name(source)
            if plain is None or _holds_state_of_model(plain, loop, facts):
                continue
            out.append(UnsafeCopy(
                call,
                f"`{code(call)}` copies entries of `{plain}` into the state of sharded `{owner}`",
                "after fully_shard its parameters are DTensor shards: copying a plain (full) tensor into one "
                "fails, and each rank owns a different piece; load whole state dicts with "
                "set_model_state_dict(..., options=StateDictOptions(full_state_dict=True)), or keep the EMA as "
                "a sharded copy (`ema = copy.deepcopy(model)`) updated parameter by parameter",
            ))
    for comp in r.nodes(cst.DictComp) + r.nodes(cst.ListComp):
        for_in = comp.for_in
        owner = _state_owner(for_in.iter, facts, comp)
        if owner is None or not _clones(comp):
            continue
        out.append(UnsafeCopy(
            comp,
            f"`{code(comp)[:60]}` clones the state of sharded `{owner}` into plain containers",
            "each rank's clones are its own DTensor shards, not the full tensors: a torch.save of them writes "
            "shards; keep the EMA as a sharded copy (`ema = copy.deepcopy(model)` right after the build), "
            "which is saved with get_model_state_dict",
        ))
    return out


def _state_owner(expr, facts, at) -> Optional[str]:
    """`m` for `m.state_dict().items()`, `m.parameters()`, `zip(m.parameters(), ...)`
    when m is a model that gets sharded (trained, copied or frozen) in that function."""
    names = facts.model_names.get(facts.resolver.enclosing_function(at), set())
    candidates = [expr]
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value in ("zip", "enumerate"):
        candidates = [a.value for a in expr.args]
    for value in candidates:
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in (
            "items", "values"
        ):
            value = value.func.value
        if (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Attribute)
            and value.func.attr.value in _STATE_ITERATORS
            and isinstance(value.func.value, cst.Name)
            and value.func.value.value in names
        ):
            return value.func.value.value
    return None


def _copy_calls(body) -> List[cst.Call]:
    return [c for c in calls_in(body) if isinstance(c.func, cst.Attribute) and c.func.attr.value == "copy_"]


def _subscripted_name(expr) -> Optional[str]:
    """`saved` for `saved[k]`, `saved[k].to(device)`, `saved[k].data`."""
    while True:
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            expr = expr.func.value
        elif isinstance(expr, cst.Attribute):
            expr = expr.value
        else:
            break
    if isinstance(expr, cst.Subscript) and isinstance(expr.value, cst.Name):
        return expr.value.value
    return None


def _holds_state_of_model(name: str, at, facts) -> bool:
    """`name` is bound (in the same function) to the state of a model that gets sharded:
    `msd = model.state_dict()`, `dict(model.named_parameters())`: DTensors of the same layout."""
    r = facts.resolver
    function = r.enclosing_function(at)
    models: Set[str] = facts.model_names.get(function, set())
    for assign in r.nodes(cst.Assign):
        if r.enclosing_function(assign) is not function:
            continue
        if not any(isinstance(t.target, cst.Name) and t.target.value == name for t in assign.targets):
            continue
        value = assign.value
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "dict" and value.args:
            value = value.args[0].value
        if (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Attribute)
            and value.func.attr.value in _STATE_GETTERS
            and isinstance(value.func.value, cst.Name)
            and value.func.value.value in models
        ):
            return True
    return False


def _clones(comp) -> bool:
    element = comp.value if isinstance(comp, cst.DictComp) else comp.elt
    return any(isinstance(c.func, cst.Attribute) and c.func.attr.value in ("clone", "cpu") for c in calls_in(element))
