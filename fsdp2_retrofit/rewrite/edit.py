"""Small expression edits shared by stages: call arguments and dict entries; the parser
config generated code is parsed with."""
from __future__ import annotations

from typing import Dict, Union

import libcst as cst

DictLike = Union[cst.Dict, cst.Call]

_CONFIGS: Dict[tuple, object] = {}


def parser_config(tree: cst.Module):
    """`tree.config_for_parsing` (the file's encoding, indent and newline, for parsing
    generated code in its style), made once per style: libcst builds and validates a
    new config object on every read, and each stage asks."""
    key = (tree.encoding, tree.default_indent, tree.default_newline)
    config = _CONFIGS.get(key)
    if config is None:
        config = _CONFIGS[key] = tree.config_for_parsing
    return config


def aside_path(node: cst.BaseExpression, path: str) -> str:
    """Where a single-GPU file at the checkpoint path `node` (written `path`) is moved, since
    the FSDP2 script saves a DCP directory there: `path` + ".single-gpu"."""
    if isinstance(node, cst.SimpleString) and node.prefix == "" and len(node.quote) == 1:
        return path[:-1] + ".single-gpu" + path[-1]
    return f'str({path}) + ".single-gpu"'


def without_keyword(call: cst.Call, keyword: str) -> cst.Call:
    """`call` without its `keyword=` argument, the commas kept tidy."""
    args = [a for a in call.args if not (a.keyword is not None and a.keyword.value == keyword)]
    if len(args) != len(call.args) and args and len(args) < len(call.args):
        removed_last = call.args[-1].keyword is not None and call.args[-1].keyword.value == keyword
        if removed_last:
            args[-1] = args[-1].with_changes(
                comma=call.args[-1].comma, whitespace_after_arg=call.args[-1].whitespace_after_arg
            )
    return call.with_changes(args=args)


def with_keyword(call: cst.Call, keyword: str, value: cst.BaseExpression) -> cst.Call:
    """`call` with `keyword=value` added last (before any `**kwargs`)."""
    new = cst.Arg(
        value=value,
        keyword=cst.Name(keyword),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )
    args = list(call.args)
    if not args:  # `path.mkdir()`: the keyword alone, no comma after it
        return call.with_changes(args=[new])
    at = next((i for i, a in enumerate(args) if a.star == "**"), len(args))
    if at == len(args):
        trailing = args[-1].comma
        if isinstance(trailing, cst.Comma):  # multi-line call with a trailing comma
            between = args[-2].comma if len(args) >= 2 else trailing
            args[-1] = args[-1].with_changes(comma=between)
            new = new.with_changes(comma=trailing)
        else:
            new = new.with_changes(whitespace_after_arg=args[-1].whitespace_after_arg)
            args[-1] = args[-1].with_changes(
                comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")),
                whitespace_after_arg=cst.SimpleWhitespace(""),
            )
        args.append(new)
    else:
        args.insert(at, new.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))))
    return call.with_changes(args=args)


def without_entry(node: DictLike, key: str) -> DictLike:
    """A `{...}` literal or `dict(...)` call without the entry for `key`."""
    if isinstance(node, cst.Call):
        return without_keyword(node, key)
    elements = [
        e
        for e in node.elements
        if not (isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString) and e.key.evaluated_value == key)
    ]
    if elements and len(elements) < len(node.elements) and node.elements[-1] not in elements:
        elements[-1] = elements[-1].with_changes(comma=node.elements[-1].comma)
    return node.with_changes(elements=elements)
