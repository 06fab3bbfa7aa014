"""What an argparse namespace holds when the command line gives no option: the defaults of the
parser's `add_argument` calls, read from the script (never run).

`args = parser.parse_args()` (or a helper of the script that returns it) holds, for each option,
its `default=` (with `type=int` applied to a string default, as argparse does), the value of
`parser.set_defaults(dest=...)` (which wins over the option's own), False/True for
`store_true`/`store_false`; the attribute is `dest=`, else the first long option with its dashes
turned into underscores (`--vocab-size` -> `vocab_size`). Options added to a group of the parser
(`parser.add_argument_group()`) count too.

A value is not read (None) where the command line decides it for sure (a required option, a
positional), where the script changes the namespace after parsing it (`args.vocab_size =
len(vocab)`, `setattr(args, ...)`, `vars(args).update(...)`), and the whole namespace is not read
where it is not one parser's (sub-commands, `parse_args([...])` of a list, two parsers the name
may hold). A default is only what the run gets when the command line does not override it: a
decision taken from one says so (analysis/leaf_units.py names the option in its report line).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import libcst as cst

PARSERS = frozenset({"argparse.ArgumentParser"})
_GROUPS = frozenset({"add_argument_group", "add_mutually_exclusive_group"})


class Defaults(dict):
    """dest -> the value it holds without options (None: not read); `options`: dest -> its option."""

    def __init__(self) -> None:
        super().__init__()
        self.options: Dict[str, str] = {}


def namespace_defaults(flow, call: cst.Call, value: Callable[[cst.BaseExpression], object]) -> Optional[Defaults]:
    """The defaults of the namespace `call` (`parser.parse_args()`) returns, each read by `value`
    (an int, a bool, or None); None when the call is not one parser's `parse_args()`."""
    func = call.func
    if type(func) is not cst.Attribute or func.attr.value != "parse_args" or call.args:
        return None
    parser = _parser(flow, func.value)
    if parser is None:
        return None
    if any(_on(flow, c, parser) for c in flow.calls_spelled("add_subparsers")):
        return None  # the namespace depends on the sub-command
    out = Defaults()
    for add in flow.calls_spelled("add_argument"):
        if type(add.func) is not cst.Attribute or not _on(flow, add, parser, groups=True):
            continue
        dest, option = _dest(add)
        if dest is None:
            continue
        out.options[dest] = option
        out[dest] = _default(add, value)
    for add in flow.calls_spelled("set_defaults"):
        if type(add.func) is cst.Attribute and _on(flow, add, parser):
            for arg in add.args:
                if arg.keyword is None:
                    return None  # `set_defaults(**table)`
                out[arg.keyword.value] = value(arg.value)
                out.options.setdefault(arg.keyword.value, f"set_defaults({arg.keyword.value}=...)")
    _forget_changes(flow, call, out)
    return out


def _parser(flow, receiver) -> Optional[cst.Call]:
    origins = flow.values(receiver)
    if len(origins) != 1:
        return None
    origin = next(iter(origins))
    if type(origin) is not cst.Call or not flow.r.qnames(origin) & PARSERS:
        return None
    return origin


def _on(flow, call: cst.Call, parser: cst.Call, groups: bool = False) -> bool:
    """`call` is a method call on `parser` (or, with `groups`, on a group of it)."""
    for origin in flow.values(call.func.value):
        if origin is parser:
            return True
        if groups and type(origin) is cst.Call and type(origin.func) is cst.Attribute and (
                origin.func.attr.value in _GROUPS and parser in flow.values(origin.func.value)):
            return True
    return False


def _dest(add: cst.Call):
    """(dest, the option that names it) of an `add_argument` call; (None, None) for a positional."""
    names = []
    for arg in add.args:
        if arg.keyword is None and type(arg.value) is cst.SimpleString:
            names.append(arg.value.evaluated_value)
    keywords = {a.keyword.value: a.value for a in add.args if a.keyword is not None}
    longs = [n for n in names if n.startswith("--")]
    shorts = [n for n in names if n.startswith("-") and not n.startswith("--")]
    option = (longs or shorts or [None])[0]
    if option is None:
        return None, None  # a positional: the command line gives it
    if "dest" in keywords:
        dest = keywords["dest"]
        return (dest.evaluated_value, option) if type(dest) is cst.SimpleString else (None, None)
    return option.lstrip("-").replace("-", "_"), option


def _default(add: cst.Call, value):
    keywords = {a.keyword.value: a.value for a in add.args if a.keyword is not None}
    required = keywords.get("required")
    if type(required) is cst.Name and required.value == "True":
        return None
    action = keywords.get("action")
    if "default" not in keywords:
        if type(action) is cst.SimpleString and action.evaluated_value in ("store_true", "store_false"):
            return action.evaluated_value == "store_false"
        return None
    default = keywords["default"]
    kind = keywords.get("type")
    if type(default) is cst.SimpleString and type(kind) is cst.Name and kind.value == "int":
        text = default.evaluated_value.strip()  # argparse applies `type` to a string default
        return int(text) if text.lstrip("-").isdigit() else None
    return value(default)


def _forget_changes(flow, parse: cst.Call, out: Defaults) -> None:
    """Attributes the script sets on the namespace after parsing hold what it sets: not read."""
    def holds(expr) -> bool:
        return parse in flow.values(expr)

    for node in flow.r.nodes(cst.Attribute):
        parent = flow.r.parent(node)
        stored = type(parent) in (cst.AssignTarget, cst.AugAssign, cst.AnnAssign) and parent.target is node
        if stored and holds(node.value) and node.attr.value in out:
            out[node.attr.value] = None
    for call in flow.calls_spelled("setattr"):
        if type(call.func) is cst.Name and len(call.args) > 1 and holds(call.args[0].value):
            name = call.args[1].value
            for dest in [name.evaluated_value] if type(name) is cst.SimpleString else list(out):
                if dest in out:
                    out[dest] = None
    for call in flow.calls_spelled("vars"):
        if type(call.func) is not cst.Name or not call.args or not holds(call.args[0].value):
            continue
        parent = flow.r.parent(call)
        written = type(parent) is cst.Attribute and parent.attr.value in ("update", "setdefault", "__setitem__") or (
            type(parent) is cst.Subscript and type(flow.r.parent(parent)) in (cst.AssignTarget, cst.AugAssign))
        if written:  # `vars(args).update(...)`, `vars(args)["x"] = ...`; `print(vars(args))` only reads
            for dest in out:
                out[dest] = None
