"""Folder creations that raise when the folder exists: `os.makedirs(d)`, `os.mkdir(d)`,
`Path(d).mkdir()` without `exist_ok=True`.

In one process the folder does not exist yet (or the script stops, as its author meant or
not). Under torchrun every rank runs the same call on the same path: the first creates the
folder, every other rank raises FileExistsError. Found by what is called (qualified names:
`from os import makedirs`, `import os as o`) and, for `mkdir` as a method, by the value of
its receiver (analysis/flow.py): a `pathlib.Path(...)`, `Path.cwd()`, a path joined with
`/`, its `.parent`, or a name or argument that holds one.

Left out: a call under a rank-0 `if` (one rank runs it), one inside a `try` whose handler
catches FileExistsError (or OSError, Exception, a bare `except`) and does nothing else (the
script already lets it exist), one with `*args`/`**kwargs` or `dir_fd` (not read here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import code, keyword_arg

MAKEDIRS = frozenset({"os.makedirs"})
MKDIR = frozenset({"os.mkdir"})
_PATH_TYPES = frozenset({"pathlib.Path", "pathlib.PosixPath", "pathlib.WindowsPath",
                         "pathlib.Path.cwd", "pathlib.Path.home"})
_PATH_METHODS = frozenset({"joinpath", "with_name", "with_suffix", "with_stem", "resolve", "absolute",
                           "expanduser"})
_CAUGHT = frozenset({"FileExistsError", "OSError", "IOError", "EnvironmentError", "Exception", "BaseException"})
# where exist_ok sits among the positional arguments: makedirs(name, mode, exist_ok), mkdir(mode, parents, exist_ok)
_EXIST_OK_AT = {"makedirs": 2, "path": 2}
_MAX_DEPTH = 8


@dataclass
class FolderCreation:
    call: cst.Call
    kind: str  # "makedirs", "mkdir" (os.mkdir) or "path" (a Path's mkdir method)
    exist_ok: Optional[cst.BaseExpression]  # the exist_ok argument the call has (False), or None
    handled: Optional[cst.Try]  # a `try` whose handler catches FileExistsError and does more than pass


def folder_creations(facts) -> List[FolderCreation]:
    """The calls every rank runs that create a folder and raise when it exists."""
    from .checkpoints import rank_gate

    r = facts.resolver
    out = []
    for call in r.nodes(cst.Call):
        kind = _kind(call, facts)
        if kind is None or any(a.star for a in call.args) or keyword_arg(call, "dir_fd") is not None:
            continue
        exist_ok = keyword_arg(call, "exist_ok")
        at = _EXIST_OK_AT.get(kind)
        positional = [a for a in call.args if a.keyword is None]
        if exist_ok is None and at is not None and len(positional) > at:
            exist_ok = positional[at].value
        if exist_ok is not None and not (isinstance(exist_ok, cst.Name) and exist_ok.value == "False"):
            continue  # exist_ok=True, or a value read when it runs
        if rank_gate(call, facts) is not None:
            continue
        catching = _catching_try(call, r)
        if catching is not None and _only_passes(catching, call, r):
            continue
        out.append(FolderCreation(call, kind, exist_ok, catching))
    return out


def _kind(call: cst.Call, facts) -> Optional[str]:
    r = facts.resolver
    if r.is_call_to(call, MAKEDIRS):
        return "makedirs"
    if r.is_call_to(call, MKDIR):
        return "mkdir"
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value == "mkdir" and is_path(func.value, facts):
        return "path"
    return None


def is_path(expr: cst.BaseExpression, facts, depth: int = 0) -> bool:
    """`expr` holds a pathlib path (by value: see the module's docstring)."""
    if depth > _MAX_DEPTH:
        return False
    r = facts.resolver
    if isinstance(expr, cst.Call):
        if r.qnames(expr) & _PATH_TYPES:
            return True
        func = expr.func
        if isinstance(func, cst.Attribute) and func.attr.value in _PATH_METHODS:
            return is_path(func.value, facts, depth + 1)
    elif isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Divide):
        return is_path(expr.left, facts, depth + 1)
    elif isinstance(expr, cst.Attribute) and expr.attr.value == "parent":
        return is_path(expr.value, facts, depth + 1)
    if isinstance(expr, (cst.Name, cst.Attribute, cst.Call)):
        values = facts.analysis.flow.values(expr)
        return any(v is not expr and isinstance(v, cst.CSTNode) and is_path(v, facts, depth + 1) for v in values)
    return False


def _catching_try(call: cst.Call, r) -> Optional[cst.Try]:
    """The innermost `try` of the call's function whose body holds it and whose handlers
    catch FileExistsError."""
    for anc in r.ancestors(call):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return None
        if isinstance(anc, cst.Try) and any(a is anc.body for a in r.ancestors(call)) and \
                any(_catches(h) for h in anc.handlers):
            return anc
    return None


def _catches(handler: cst.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    kinds = handler.type.elements if isinstance(handler.type, cst.Tuple) else [handler.type]
    return any(code(k.value if isinstance(k, cst.Element) else k).rsplit(".", 1)[-1] in _CAUGHT for k in kinds)


def _only_passes(node: cst.Try, call: cst.Call, r) -> bool:
    """Each handler that catches it does nothing (`pass`, `...`, `continue`)."""
    for handler in node.handlers:
        if not _catches(handler):
            continue
        body = handler.body.body if isinstance(handler.body, cst.IndentedBlock) else [handler.body]
        for stmt in body:
            smalls = stmt.body if isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)) else [stmt]
            for small in smalls:
                if isinstance(small, (cst.Pass, cst.Continue)):
                    continue
                if isinstance(small, cst.Expr) and isinstance(small.value, (cst.Ellipsis, cst.SimpleString)):
                    continue
                return False
    return True
