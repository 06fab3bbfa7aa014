"""Dtype casts of a module: `model.half()`, `model.bfloat16()`, `model.to(torch.bfloat16)`,
`model.to(device).to(dtype=...)`, and which of them run on a model after its fully_shard.

An nn.Module's cast is in place: whatever the call's value is bound to, the module's own
parameters change dtype. fully_shard turns them into DTensor shards; FSDP2 takes a cast of
those shards while the model has not run a forward yet (nn.Module._apply, then
FSDPParam.reset_sharded_param), but it fixes the dtype of its all-gathers at the first
forward: a cast after that one fails in the next forward (measured on torch 2.13 CPU,
2 ranks: RuntimeError "Expected out tensor to have dtype c10::BFloat16, but got float";
a cast right after fully_shard and before any forward trained to the same weights as a
cast before it). The shard stage puts fully_shard after the casts of the build
(shard_anchors.py); `casts_after_shard` lists the others, which `rewrite` refuses (FSR645)
and `check` flags (FSD114).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import code, module_itself

# `module.half()` and the like, without arguments: the dtype each casts to
CAST_METHODS = {"half": "float16", "bfloat16": "bfloat16", "float": "float32", "double": "float64"}
DTYPES = frozenset({
    "float16", "half", "bfloat16", "float32", "float", "float64", "double",
    "float8_e4m3fn", "float8_e5m2", "complex64", "complex128",
})
_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
UNKNOWN = "?"  # a dtype the call reads when it runs (`model.to(dtype)`)


def dtype_cast(call: cst.Call) -> Optional[str]:
    """The dtype `call` casts its receiver to (`UNKNOWN` when it is read at run time), or None
    when it is no dtype cast: `x.half()`, `x.to(torch.bfloat16)`, `x.to(device, dtype=d)`."""
    func = call.func
    if not isinstance(func, cst.Attribute):
        return None
    method = func.attr.value
    if method in CAST_METHODS:
        return CAST_METHODS[method] if not call.args else None
    if method != "to":
        return None
    for arg in call.args:
        if arg.keyword is not None:
            if arg.keyword.value == "dtype":
                return _dtype_name(arg.value)
            continue
        value = arg.value
        if isinstance(value, cst.Attribute) and value.attr.value in DTYPES and code(value.value) == "torch":
            return _dtype_name(value)
    return None


def _dtype_name(value: cst.BaseExpression) -> str:
    if isinstance(value, cst.Attribute) and value.attr.value in DTYPES and code(value.value) == "torch":
        return _ALIASES.get(value.attr.value, value.attr.value)
    return UNKNOWN


def cast_receiver(call: cst.Call) -> cst.BaseExpression:
    """The module a cast changes: `model` of `model.to(device).to(torch.bfloat16)`."""
    return module_itself(call.func.value)


def casts_after_shard(facts) -> List[Tuple[cst.Call, object]]:
    """(cast, model site) for each dtype cast of a model the shard stage shards that runs after
    its fully_shard: in the function that builds it, after its shard anchor (a cast in the
    training loop, after a `with` block that runs a forward); or in another function the
    model reaches (a `train(model)` that casts first), unless every call of that function is
    part of the build (a helper that only places and casts it: before the anchor). A cast to
    float32 counts only where the model is cast to another dtype somewhere: on a float32
    model it changes nothing."""
    r = facts.resolver
    models = [m for m in list(facts.models) + list(facts.copies) if not m.sharded]
    out = []
    casts = [(c, dtype_cast(c)) for c in r.nodes(cst.Call)]
    casts = [(c, d) for c, d in casts if d is not None and isinstance(cast_receiver(c), cst.Name)]
    for model in models:
        mine = [(c, d) for c, d in casts
                if cast_receiver(c).value in model.names.get(r.enclosing_function(c), ())]
        if not any(d != "float32" for _, d in mine):
            continue
        build_fn = r.enclosing_function(model.stmt)
        start, end = r.order(model.stmt), r.span(model.shard_anchor)[1]
        for call, _ in mine:
            fn = r.enclosing_function(call)
            if fn is build_fn:
                if r.order(call) <= end:
                    continue  # part of the build (or of a binding before it)
            else:
                calls = facts.analysis.calls_of(fn) if fn is not None else []
                if calls and all(start <= r.order(c) <= end for c in calls):
                    continue  # a helper the build calls (`to_bf16(model)`): before fully_shard
            out.append((call, model))
    return out
