"""Add the imports the stages ask for where a person (or isort) would put them: in
the group of their kind, in sorted order. The user's own imports never move.

Only the module's top-level statement list is read and rebuilt (no tree walk, no
recursion, whatever the length of the file). The adder knows the statements it
writes: a name merged into an existing `from m import ...` makes a new statement
that stands for the user's (reported through `carry`), left where it was.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import dotted

from .edit import parser_config

Wanted = Tuple[str, Optional[str], Optional[str]]  # (module, object or None, alias or None)
Carry = Callable[[cst.CSTNode, cst.CSTNode], None]  # (old node, the new node that stands for it)

if sys.version_info >= (3, 10):
    _STDLIB = frozenset(sys.stdlib_module_names)
else:  # Python 3.9: the top-level modules a training script imports from the standard library
    _STDLIB = frozenset(
        "__future__ abc argparse ast asyncio atexit base64 bisect builtins collections contextlib copy csv "
        "dataclasses datetime enum functools gc glob gzip hashlib heapq importlib inspect io itertools json "
        "logging math multiprocessing operator os pathlib pickle platform pprint queue random re shutil signal "
        "socket statistics string struct subprocess sys tempfile threading time timeit traceback types typing "
        "unittest urllib uuid warnings weakref zipfile".split()
    )


def is_stdlib(module: str) -> bool:
    return module.split(".")[0] in _STDLIB


def add_imports(module: cst.Module, wanted: Sequence[Wanted], carry: Optional[Carry] = None) -> cst.Module:
    """`module` with every wanted import bound at its top level.

    An import already there is not repeated; a name from a module the file already
    imports from (in its leading imports) joins that statement; the rest are new
    lines, each placed in its group.
    """
    carry = carry or _no_carry
    plain, aliased, objects = _requested(wanted)
    body = list(module.body)
    _drop_present(body, plain, aliased, objects)
    if not (plain or aliased or objects):
        return module
    _merge_into_leading(body, objects, carry)
    new = [f"import {m}" for m in sorted(plain)]
    new += [f"import {m} as {a}" for m, a in aliased.items()]
    for mod in sorted(objects):
        names = sorted(objects[mod], key=lambda pair: (pair[0], pair[1] or ""))
        new.append(f"from {mod} import " + ", ".join(o if a is None else f"{o} as {a}" for o, a in names))
    if not new:
        return module.with_changes(body=body)
    config = parser_config(module)
    _blank_line_after_leading_imports(body, carry)
    for text in new:
        body = _insert(body, cst.parse_statement(text, config=config), carry)
    return module.with_changes(body=body)


def _no_carry(old: cst.CSTNode, new: cst.CSTNode) -> None:
    pass


def _requested(wanted: Sequence[Wanted]):
    plain: Set[str] = set()
    aliased: Dict[str, str] = {}
    objects: Dict[str, List[Tuple[str, Optional[str]]]] = {}
    for mod, obj, alias in wanted:
        if obj is None and alias is None:
            plain.add(mod)
        elif obj is None:
            aliased[mod] = alias
        elif (obj, alias) not in objects.setdefault(mod, []):
            objects[mod].append((obj, alias))
    return plain, aliased, objects


def _top_imports(body) -> List[cst.BaseSmallStatement]:
    return [
        small
        for stmt in body
        if isinstance(stmt, cst.SimpleStatementLine)
        for small in stmt.body
        if isinstance(small, (cst.Import, cst.ImportFrom))
    ]


def _from_module(imp: cst.ImportFrom) -> Optional[str]:
    if imp.relative or imp.module is None:
        return None
    return dotted(imp.module)


def _drop_present(body, plain: Set[str], aliased: Dict[str, str], objects) -> None:
    """Forget the wanted imports the module's top level already has."""
    for imp in _top_imports(body):
        if isinstance(imp, cst.Import):
            for alias in imp.names:
                name = dotted(alias.name)
                if alias.asname is None:
                    plain.discard(name)
                elif aliased.get(name) == dotted(alias.asname.name):
                    del aliased[name]
            continue
        mod = _from_module(imp)
        if mod not in objects:
            continue
        if isinstance(imp.names, cst.ImportStar):
            del objects[mod]
            continue
        have = {(dotted(a.name), dotted(a.asname.name) if a.asname else None) for a in imp.names}
        objects[mod] = [pair for pair in objects[mod] if pair not in have]
        if not objects[mod]:
            del objects[mod]


def _leading_end(body) -> Tuple[int, int]:
    """(first, end): the leading import statements are body[first:end] (after a docstring)."""
    first = 1 if body and _is_docstring(body[0]) else 0
    end = first
    while end < len(body) and _is_import(body[end]):
        end += 1
    return first, end


def _merge_into_leading(body: list, objects, carry: Carry) -> None:
    """Names from a module a leading `from m import ...` imports join it (sorted)."""
    first, end = _leading_end(body)
    for i in range(first, end):
        imp = body[i].body[0]
        if not isinstance(imp, cst.ImportFrom) or isinstance(imp.names, cst.ImportStar):
            continue
        mod = _from_module(imp)
        if mod not in objects:
            continue
        extra = [
            cst.ImportAlias(name=cst.Name(o), asname=cst.AsName(name=cst.Name(a)) if a else None)
            for o, a in objects.pop(mod)
        ]
        old = list(imp.names)
        names = sorted(old + extra, key=lambda alias: dotted(alias.name))
        commas = [a.comma for a in old[:-1]] + [cst.MaybeSentinel.DEFAULT] * len(extra) + [old[-1].comma]
        new_imp = imp.with_changes(names=[a.with_changes(comma=c) for a, c in zip(names, commas)])
        carry(imp, new_imp)
        body[i] = _changed(body[i], carry, body=[new_imp])


def _changed(stmt, carry: Carry, **changes):
    new = stmt.with_changes(**changes)
    carry(stmt, new)
    return new


def _blank_line_after_leading_imports(body: list, carry: Carry) -> None:
    """The code after the imports starts a paragraph of its own."""
    _first, end = _leading_end(body)
    if end >= len(body):
        return
    stmt = body[end]
    lines = list(getattr(stmt, "leading_lines", ()))
    if not lines:
        body[end] = _changed(stmt, carry, leading_lines=[cst.EmptyLine()])
    elif lines[0].comment is not None:
        body[end] = _changed(stmt, carry, leading_lines=[cst.EmptyLine(), *lines])


def top_module(stmt: cst.SimpleStatementLine) -> str:
    small = stmt.body[0]
    if isinstance(small, cst.ImportFrom):
        return dotted(small.module) if small.module is not None else ""
    return dotted(small.names[0].name)


def _is_import(stmt) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], (cst.Import, cst.ImportFrom))
    )


def _is_future(stmt) -> bool:
    return _is_import(stmt) and isinstance(stmt.body[0], cst.ImportFrom) and top_module(stmt) == "__future__"


def _is_docstring(stmt) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _key(stmt):
    return (isinstance(stmt.body[0], cst.ImportFrom), top_module(stmt))


def _is_stdlib(stmt) -> bool:
    return is_stdlib(top_module(stmt))


def _runs(body) -> List[List[int]]:
    """Indexes of the first block of import statements (`from __future__` ones aside),
    split where a blank line or comment separates them."""
    runs: List[List[int]] = []
    for i, stmt in enumerate(body):
        if not _is_import(stmt) or (_is_future(stmt) and not runs):
            if runs and not _is_future(stmt):
                break
            continue
        if not runs or stmt.leading_lines:
            runs.append([])
        runs[-1].append(i)
    return runs


def _insert(body: list, new, carry: Carry) -> list:
    runs = _runs(body)
    if not runs:
        # no import block to join: after the docstring and any `from __future__` imports
        _first, end = _leading_end(body)
        return body[:end] + [new] + body[end:]
    stdlib = _is_stdlib(new)
    run = _pick_run(body, runs, new, stdlib)
    if run is None:
        # no group of its kind: a new group before the first non-stdlib group (stdlib),
        # or after the last group
        if stdlib:
            first = runs[0][0]
            for r in runs:
                if not all(_is_stdlib(body[i]) for i in r):
                    first = r[0]
                    break
            target = body[first]
            body[first] = _changed(target, carry, leading_lines=[cst.EmptyLine(indent=False)])
            return body[:first] + [new.with_changes(leading_lines=target.leading_lines)] + body[first:]
        last = runs[-1][-1]
        return body[: last + 1] + [new.with_changes(leading_lines=[cst.EmptyLine(indent=False)])] + body[last + 1 :]
    for i in run:
        if _key(body[i]) > _key(new):
            target = body[i]
            if i == run[0]:
                body[i] = _changed(target, carry, leading_lines=[])
                new = new.with_changes(leading_lines=target.leading_lines)
            return body[:i] + [new] + body[i:]
    last = run[-1]
    return body[: last + 1] + [new] + body[last + 1 :]


def _pick_run(body, runs, new, stdlib: bool) -> Optional[List[int]]:
    package = top_module(new).split(".")[0]
    for r in runs:
        if any(top_module(body[i]).split(".")[0] == package for i in r):
            return r
    for r in runs:
        if stdlib and any(_is_stdlib(body[i]) for i in r):
            return r
    return None
