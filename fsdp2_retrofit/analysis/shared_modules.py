"""Modules that two models the rewrite shards would both own.

A module handed to the constructors of two models (`shared = Block(); enc_a =
Encoder(shared); enc_b = Encoder(shared)`, weight sharing between two GAN encoders)
is a submodule of both. fully_shard of the first model turns the shared parameters
into DTensor shards managed by that model; the second fully_shard (and the rank-0
broadcast emitted before it) then meets parameters that are already sharded, and
sharding the shared module as its own unit does not help either: FSDP2 lets one
unit belong to one root only. The shard stage refuses such a script.

Recognised: a name bound to a module construction (or a model itself, or an
attribute of a model: `Encoder(shared=enc_a.block)`) passed directly as an argument
to the constructor calls of two or more models of the same function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import libcst as cst

from .flow import innermost_call as _innermost_call
from .models import ModelSite
from fsdp2_retrofit.syntax.names import code, root_name


@dataclass(frozen=True)
class SharedModule:
    name: str  # the shared module as the constructor arguments spell it
    owners: List[ModelSite]  # the models whose constructors receive it, in source order


def _build_call(model: ModelSite) -> Optional[cst.Call]:
    small = model.stmt.body[0] if len(model.stmt.body) == 1 else None
    value = getattr(small, "value", None)
    return _innermost_call(value) if value is not None else None


def shared_module(facts) -> Optional[SharedModule]:
    """The first module passed to the constructors of two models that get sharded, or None."""
    r = facts.resolver
    models = [m for m in facts.models + facts.frozen_models if not m.sharded]
    owners: Dict[tuple, List[ModelSite]] = {}
    spelled: Dict[tuple, str] = {}
    for model in models:
        call = _build_call(model)
        if call is None:
            continue
        scope = r.enclosing_function(model.stmt)
        same_scope = {m.name for m in models if r.enclosing_function(m.stmt) is scope}
        for arg in call.args:
            value = arg.value
            if isinstance(value, cst.Name):
                if value.value not in facts.module_ctor_names and value.value not in same_scope:
                    continue
            elif isinstance(value, cst.Attribute):
                if root_name(value) not in same_scope or root_name(value) == model.name:
                    continue
            else:
                continue
            key = (id(scope), code(value))
            spelled[key] = code(value)
            if model not in owners.setdefault(key, []):
                owners[key].append(model)
    for model in models:  # a model handed to another model's constructor is owned by both
        key = (id(r.enclosing_function(model.stmt)), model.name)
        if key in owners and model not in owners[key]:
            owners[key].insert(0, model)
    for key, found in owners.items():
        if len(found) >= 2:
            return SharedModule(spelled[key], sorted(found, key=lambda m: r.line(m.stmt)))
    return None


__all__ = ["SharedModule", "shared_module"]
