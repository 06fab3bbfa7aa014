"""Put the imports the stages added where a person (or isort) would: in the group of
their kind, in sorted order. The user's own imports never move."""
from __future__ import annotations

import sys
from typing import List, Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import code

_STDLIB = set(getattr(sys, "stdlib_module_names", ())) | {"os", "sys", "argparse", "math", "json", "time"}


def top_module(stmt: cst.SimpleStatementLine) -> str:
    small = stmt.body[0]
    if isinstance(small, cst.ImportFrom):
        return code(small.module) if small.module is not None else ""
    return code(small.names[0].name)


def _is_import(stmt) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], (cst.Import, cst.ImportFrom))
    )


def _key(stmt):
    return (isinstance(stmt.body[0], cst.ImportFrom), top_module(stmt))


def _is_stdlib(stmt) -> bool:
    return top_module(stmt).split(".")[0] in _STDLIB


def place_added_imports(module: cst.Module, original_imports: set) -> cst.Module:
    """Move top-level imports whose text is not in `original_imports` into place."""
    body = list(module.body)
    added = [s for s in body if _is_import(s) and code(s) not in original_imports]
    if not added:
        return module
    body = [s for s in body if s not in added]
    for new in added:
        body = _insert(body, _sorted_names(new).with_changes(leading_lines=[]))
    return module.with_changes(body=body)


def _sorted_names(stmt):
    """`from m import b, a` -> `from m import a, b` (only for imports the rewrite wrote)."""
    small = stmt.body[0]
    if not isinstance(small, cst.ImportFrom) or isinstance(small.names, cst.ImportStar):
        return stmt
    names = sorted(small.names, key=lambda a: code(a.name))
    commas = [a.comma for a in small.names]
    names = [a.with_changes(comma=c) for a, c in zip(names, commas)]
    return stmt.with_changes(body=[small.with_changes(names=names)])


def _runs(body) -> List[List[int]]:
    """Indexes of the leading import statements, split where a blank line or comment separates them."""
    runs: List[List[int]] = []
    for i, stmt in enumerate(body):
        if not _is_import(stmt):
            if runs or not _is_preamble(stmt):
                if runs:
                    break
                continue
            continue
        if not runs or stmt.leading_lines:
            runs.append([])
        runs[-1].append(i)
    return runs


def _is_preamble(stmt) -> bool:
    """A docstring before the imports."""
    return isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr)


def _insert(body: list, new) -> list:
    runs = _runs(body)
    if not runs:
        return body  # no import block to join: leave it where it was added
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
            body[first] = target.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
            return body[:first] + [new.with_changes(leading_lines=target.leading_lines)] + body[first:]
        last = runs[-1][-1]
        return body[: last + 1] + [new.with_changes(leading_lines=[cst.EmptyLine(indent=False)])] + body[last + 1 :]
    for i in run:
        if _key(body[i]) > _key(new):
            target = body[i]
            if i == run[0]:
                body[i] = target.with_changes(leading_lines=[])
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
