"""make_dirs: `if not os.path.exists(d): os.makedirs(d)` (or `os.mkdir(d)`, or `os.path.isdir`)
becomes `os.makedirs(d, exist_ok=True)`; a bare `os.makedirs(d)`, `os.mkdir(d)` or
`Path(d).mkdir()` gets `exist_ok=True` (`os.mkdir` becomes `os.makedirs`).

Every rank runs the check and the creation: between one rank's `exists()` and its
`makedirs()` another rank creates the folder, and the first dies with FileExistsError
(measured on a public script: one run in a corpus run of 55). Without the check it is
certain: every rank but the first finds the folder made and raises. What counts as such
a call, and what is left alone (under a rank-0 `if`, inside a `try` that lets the folder
exist): analysis/folder_creations.py. A folder left by an earlier run no longer stops the
script, as the bare call did in one process; `exist_ok=False` written out is not changed
(the script asks for that error): it is reported, since every rank but one raises.

Every rank creates the folder (exist_ok) rather than rank 0 followed by a barrier: a
barrier must be reached by every rank, and the check-then-create can sit where not every
rank gets (a branch on a per-rank value, a function only some ranks call), where a barrier
hangs; creating a folder that exists is no error and needs no collective. On several nodes
without a shared file system each node needs the folder anyway. `os.mkdir(d)` becomes
`os.makedirs` (which also creates missing parent folders, where mkdir raised)."""
from __future__ import annotations

from typing import Optional

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.folder_creations import MAKEDIRS, MKDIR, folder_creations
from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.rewrite.edit import with_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

_TESTS = frozenset({"os.path.exists", "os.path.isdir"})
_MAKEDIRS = MAKEDIRS | MKDIR


class CreateFoldersOnceCommand(RetrofitStage):
    DESCRIPTION = "Make folder creations every rank runs (`os.makedirs(d)`, `if not exists: ...`) safe (exist_ok=True)."
    CODE = "make_dirs"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        r = facts.resolver
        guarded = set()
        for stmt in r.nodes(cst.If):
            call = _guarded_makedirs(r, stmt)
            if call is None:
                continue
            guarded.add(id(call))
            made = with_keyword(self._as_makedirs(call, facts), "exist_ok", cst.Name("True"))
            line = code(made)
            new = cst.SimpleStatementLine(body=[cst.Expr(made)], leading_lines=stmt.leading_lines)
            self.carry(stmt, new)
            editor.replace(stmt, new)
            folder = code(call.args[0].value)
            self.change(
                stmt,
                f"`if not ...exists({folder}): {_short(stmt)}({folder})` -> `{line}`",
                "every rank runs it: one rank can create the folder between another's check and its makedirs",
                "FileExistsError on a rank at start-up, now and then",
            )
        for found in folder_creations(facts):
            if id(found.call) not in guarded:
                self._bare(found, facts, editor)

    def _as_makedirs(self, call: cst.Call, facts: ScriptFacts) -> cst.Call:
        """`os.mkdir(d, mode)` as `os.makedirs(d, mode)` (the same first two arguments); other calls as they are."""
        if not facts.resolver.is_call_to(call, MKDIR):
            return call
        if code(call.func) == "os.mkdir":
            return call.with_changes(func=cst.Attribute(value=cst.Name("os"), attr=cst.Name("makedirs")))
        self.add_import("os")
        return call.with_changes(func=self.expr("os.makedirs"))

    def _bare(self, found, facts: ScriptFacts, editor: StatementEditor) -> None:
        """`os.makedirs(d)`, `os.mkdir(d)`, `path.mkdir()` with no exist_ok, which every rank runs."""
        call = found.call
        if found.exist_ok is not None:
            self.attention(
                call,
                f"`{code(call)}` runs on every rank: every rank but the first raises FileExistsError",
                "exist_ok=False asks for the error when the folder exists, and under torchrun another rank has "
                "just made it; create it with exist_ok=True, or on rank 0 before a barrier every rank reaches",
                differs=True,
            )
            return
        if found.handled is not None:
            self.attention(
                call,
                f"`{code(call)}` runs on every rank: every rank but the first takes the `except` branch of "
                f"`{code(found.handled).splitlines()[0]}`",
                "under torchrun another rank has just made the folder; create it with exist_ok=True if the "
                "branch is meant for a folder left by an earlier run",
                differs=True,
            )
            return
        made = with_keyword(self._as_makedirs(call, facts), "exist_ok", cst.Name("True"))
        editor.replace_expression(call, lambda _updated, made=made: made)
        self.change(
            call,
            f"`{code(call)}` -> `{code(made)}`",
            "every rank runs it: the first creates the folder and every other rank raises FileExistsError; "
            "exist_ok=True on every rank needs no collective (a barrier would hang where only some ranks get). "
            "A folder left by an earlier run no longer stops the script, as it did in one process",
            "FileExistsError on every rank but one, at start-up",
        )


def _guarded_makedirs(r, stmt: cst.If) -> Optional[cst.Call]:
    """The `os.makedirs(d)` of `if not os.path.exists(d): os.makedirs(d)` (or isdir), alone in
    its `if`, without an `else`, and without exist_ok of its own."""
    test = stmt.test
    if stmt.orelse is not None or not isinstance(test, cst.UnaryOperation) or not isinstance(test.operator, cst.Not):
        return None
    probe = test.expression
    if not r.is_call_to(probe, _TESTS) or len(probe.args) != 1 or len(stmt.body.body) != 1:
        return None
    inner = stmt.body.body[0]
    if isinstance(inner, cst.SimpleStatementLine):  # an indented body; a one-line `if` holds the Expr itself
        inner = inner.body[0] if len(inner.body) == 1 else None
    if not isinstance(inner, cst.Expr) or not r.is_call_to(inner.value, _MAKEDIRS):
        return None
    call = inner.value
    first = call.args[0] if call.args else None
    if first is None or first.keyword is not None or code(first.value) != code(probe.args[0].value) or \
            any(a.star or (a.keyword is not None and a.keyword.value == "exist_ok") for a in call.args):
        return None
    return call


def _short(stmt: cst.If) -> str:
    """`makedirs` or `mkdir`, as the statement calls it."""
    return "mkdir" if "mkdir(" in code(stmt.body).replace("makedirs(", "") else "makedirs"
