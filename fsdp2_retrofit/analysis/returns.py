"""Helpers of the script that hand back what they build: `return model, optimizer`.

`model, optimizer = build(cfg)` in `main`: `main`'s `model` and `optimizer` are the
helper's. The analysis follows a name out of a function when every `return` of the
function gives it back at the same place (alone, or at one position of a tuple) and
the call is the whole value of an assignment to plain names of the same shape.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set

import libcst as cst

from fsdp2_retrofit.syntax.names import SELF_RETURNING_METHODS

_ALONE = -1  # `return model`: the name is the whole returned value


def own_returns(resolver, fn: cst.FunctionDef) -> List[cst.Return]:
    """The `return` statements of `fn` itself (not of a def nested in it), from the
    resolver's index."""
    return [r for r in resolver.descendants(fn, cst.Return) if resolver.enclosing_function(r) is fn]


def _returned_at(returns: List[cst.Return]) -> List[Dict[str, int]]:
    """For each of `returns`: {name: position} of the plain names it gives back (position
    _ALONE when the return value is the name itself)."""
    out = []
    for node in returns:
        value = node.value
        if isinstance(value, cst.Name):
            out.append({value.value: _ALONE})
        elif isinstance(value, cst.Tuple):
            out.append({el.value.value: i for i, el in enumerate(value.elements)
                        if type(el) is cst.Element and isinstance(el.value, cst.Name)})
        else:
            out.append({})
    return out


def returned_names(resolver, fn: cst.FunctionDef, names: Iterable[str]) -> Dict[str, int]:
    """{name: position} for each of `names` that every return of `fn` gives back at the
    same position (_ALONE: as the whole value)."""
    returns = _returned_at(own_returns(resolver, fn))
    out = {}
    for name in names:
        places = {r.get(name) for r in returns}
        if returns and len(places) == 1 and None not in places:
            out[name] = places.pop()
    return out


def call_targets(resolver, call: cst.Call, fn: cst.FunctionDef) -> Optional[Dict[int, str]]:
    """{position: caller's name} when `call` (of `fn`) is the whole value of a one-target
    assignment, `model = build()` or `model, opt = build()` with as many plain names as
    `fn` returns; None otherwise."""
    assign = resolver.parent(call)
    if type(assign) is not cst.Assign or assign.value is not call or len(assign.targets) != 1:
        return None
    target = assign.targets[0].target
    sizes = {len(r.value.elements) if isinstance(r.value, cst.Tuple) else _ALONE for r in own_returns(resolver, fn)}
    size = sizes.pop() if len(sizes) == 1 else None
    if isinstance(target, cst.Name) and size == _ALONE:
        return {_ALONE: target.value}
    if isinstance(target, (cst.Tuple, cst.List)) and size == len(target.elements):
        if all(type(el) is cst.Element and isinstance(el.value, cst.Name) for el in target.elements):
            return {i: el.value.value for i, el in enumerate(target.elements)}
    return None


def names_out(resolver, call: cst.Call, fn: cst.FunctionDef, names: Iterable[str]) -> Dict[str, str]:
    """{caller's name: fn's name} for each of `names` that `fn` returns into the names
    `call` assigns."""
    targets = call_targets(resolver, call, fn)
    if targets is None:
        return {}
    return {targets[pos]: name for name, pos in returned_names(resolver, fn, names).items() if pos in targets}


def returns_any(resolver, fn: cst.FunctionDef, names: Set[str]) -> bool:
    """Some `return` of `fn` hands back one of `names` itself: alone, in a tuple, list or
    dict, or through its self-returning methods (`return model.to(device), optimizer`).
    Reads the resolver's index of returns: walking `fn` cost ~3 ms a rewrite of the example."""
    return any(n.value is not None and _hands_back(n.value, names) for n in own_returns(resolver, fn))


def _hands_back(expr, names: Set[str]) -> bool:
    if isinstance(expr, cst.Name):
        return expr.value in names
    if isinstance(expr, cst.Call):
        func = expr.func
        return isinstance(func, cst.Attribute) and func.attr.value in SELF_RETURNING_METHODS and _hands_back(
            func.value, names)
    if isinstance(expr, (cst.Tuple, cst.List, cst.Set)):
        return any(_hands_back(el.value, names) for el in expr.elements)
    if isinstance(expr, cst.Dict):
        return any(_hands_back(el.value, names) for el in expr.elements if isinstance(el, cst.DictElement))
    return False
