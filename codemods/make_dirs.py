"""make_dirs: `if not os.path.exists(d): os.makedirs(d)` (or `os.mkdir(d)`, or `os.path.isdir`)
becomes `os.makedirs(d, exist_ok=True)`.

Every rank runs the check and the creation: between one rank's `exists()` and its
`makedirs()` another rank creates the folder, and the first dies with FileExistsError
(measured on a public script: one run in a corpus run of 55).

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
from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.rewrite.edit import with_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

_TESTS = frozenset({"os.path.exists", "os.path.isdir"})
_MAKEDIRS = frozenset({"os.makedirs", "os.mkdir"})


class CreateFoldersOnceCommand(RetrofitStage):
    DESCRIPTION = "Make `if not exists: os.makedirs(d)` safe when every rank runs it (exist_ok=True)."
    CODE = "make_dirs"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        r = facts.resolver
        for stmt in r.nodes(cst.If):
            call = _guarded_makedirs(r, stmt)
            if call is None:
                continue
            if facts.resolver.is_call_to(call, {"os.mkdir"}):  # (path, mode=0o777): the same first two
                call = call.with_changes(func=cst.Attribute(value=cst.Name("os"), attr=cst.Name("makedirs"))) \
                    if code(call.func) == "os.mkdir" else call.with_changes(func=self.expr("os.makedirs"))
                if code(call.func) != "os.makedirs":
                    self.add_import("os")
            made = with_keyword(call, "exist_ok", cst.Name("True"))
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
