"""The default of a field of a project dataclass, read by value (parsed, never run).

`cfg = TrainConfig()` (or a factory returning `TrainConfig()`), then `cfg.sharding_strategy`
where the class says `sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD` (or
`= field(default=...)`): the value is the default, provided nothing in the program gives the
field another value: no `x.sharding_strategy = ...`, no `TrainConfig(sharding_strategy=...)`,
no `replace(cfg, sharding_strategy=...)`, no `setattr`. Otherwise the reason, and the node
that gives it, for a refusal at that line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import code


@dataclass
class FieldDefault:
    value: Optional[cst.BaseExpression] = None  # the default, when it is the field's only value
    statement: Optional[cst.CSTNode] = None  # the field's line in the class
    why: str = ""  # why not, when value is None
    where: Optional[cst.CSTNode] = None  # the node that gives the field another value


def _is_dataclass(cls: cst.ClassDef) -> bool:
    for deco in cls.decorators:
        d = deco.decorator.func if isinstance(deco.decorator, cst.Call) else deco.decorator
        if code(d).rsplit(".", 1)[-1] == "dataclass":
            return True
    return False


def config_class(resolver, name: str) -> Optional[cst.ClassDef]:
    """The dataclass `name` of the module `resolver` reads, at its top level."""
    for stmt in resolver.module.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value == name and _is_dataclass(stmt):
            return stmt
    return None


def field_default(resolvers, cls: cst.ClassDef, call: cst.Call, name: str) -> FieldDefault:
    """The one value field `name` of dataclass `cls` (built by `call`) holds in the program whose
    modules `resolvers` read."""
    found = None
    for line in cls.body.body:
        for small in line.body if isinstance(line, cst.SimpleStatementLine) else ():
            if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) and small.target.value == name:
                found = (line, small)
    if found is None:
        return FieldDefault(why=f"`{name}` is not a field of the dataclass {cls.name.value}")
    line, ann = found
    value = ann.value
    if isinstance(value, cst.Call) and code(value.func).rsplit(".", 1)[-1] == "field":
        value = next((a.value for a in value.args if a.keyword is not None and a.keyword.value == "default"), None)
    if value is None:
        return FieldDefault(statement=line, why=f"the field {cls.name.value}.{name} has no default")
    if call.args:
        return FieldDefault(statement=line, where=call,
                            why=f"{cls.name.value}(...) is built with arguments: its `{name}` is not the default")
    calls = [n for r in resolvers for n in r.nodes(cst.Call)]
    for node in calls:  # TrainConfig(sharding_strategy=...), replace(cfg, sharding_strategy=...)
        if any(a.keyword is not None and a.keyword.value == name for a in node.args) and (
                code(node.func).rsplit(".", 1)[-1] in (cls.name.value, "replace")):
            return FieldDefault(statement=line, where=node,
                                why=f"`{code(node.func)}(..., {name}=...)` gives the field another value")
        if isinstance(node.func, cst.Name) and node.func.value == "setattr":
            return FieldDefault(statement=line, where=node,
                                why=f"`{code(node)}` may give the field {cls.name.value}.{name} another value")
    for kind in (cst.Assign, cst.AugAssign, cst.AnnAssign):
        for node in (n for r in resolvers for n in r.nodes(kind)):
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            if any(isinstance(t, cst.Attribute) and t.attr.value == name for t in targets):
                return FieldDefault(statement=line, where=node,
                                    why=f"`{code(node).strip()}` gives the field {cls.name.value}.{name} another "
                                        "value: the rewrite cannot know which one the wrap reads")
    return FieldDefault(value=value, statement=line)
