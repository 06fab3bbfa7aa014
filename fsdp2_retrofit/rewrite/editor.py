"""The rewrite's edit engine, shared by the rewrite's stages and `check --fix`: statement
and expression edits keyed by the original nodes of an analysed tree, applied in one pass.

Light to import (libcst and syntax.names only): `check --fix` uses it without loading
the rewrite's analysis."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Union

import libcst as cst

from fsdp2_retrofit.syntax.names import Origins, is_node

Stmt = Union[cst.SimpleStatementLine, cst.BaseCompoundStatement]
# What replaces a node: a new node, or a function of the node as edited so far
Replacement = Union[cst.CSTNode, Callable[[cst.CSTNode], cst.CSTNode]]


_STATEMENT_TYPES: Dict[type, bool] = {}


def _is_statement(node) -> bool:
    """isinstance(node, (SimpleStatementLine, BaseCompoundStatement)), remembered per type."""
    found = _STATEMENT_TYPES.get(type(node))
    if found is None:
        found = _STATEMENT_TYPES[type(node)] = isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement))
    return found


class CarryLines:
    """Mixin for a transformer: each node it rebuilds stands for the node it replaces
    (recorded in `origins`, when set)."""

    origins: Optional[Origins] = None

    def on_leave(self, original_node, updated_node):
        result = super().on_leave(original_node, updated_node)
        if self.origins is not None and is_node(result):  # not a removal or flatten sentinel
            self.origins.carry(original_node, result)
        return result


class StatementEditor(CarryLines, cst.CSTTransformer):
    """Inserts, replaces, removes and moves statements, and replaces expressions
    (any node), all keyed by the original nodes of the tree the stage analysed.

    As every edit is keyed by an original node, given the analysis's `resolver` the
    editor descends only into the nodes that hold an edit and their ancestors: every
    other subtree is kept as it is (the same nodes), and a rewrite costs what it
    changes, not the size of the file. A new kind of edit must be listed in
    `_edit_paths`, or it is never reached.
    """

    resolver = None  # the Resolver of the tree this editor is applied to (None: visit everything)

    def __init__(self) -> None:
        super().__init__()
        self.before: Dict[cst.CSTNode, List[Stmt]] = defaultdict(list)
        self.after: Dict[cst.CSTNode, List[Stmt]] = defaultdict(list)
        self.append: Dict[cst.CSTNode, List[Stmt]] = defaultdict(list)
        self.replacement: Dict[cst.CSTNode, Optional[Stmt]] = {}
        self._updated: Dict[cst.CSTNode, cst.CSTNode] = {}
        self.leading: Dict[cst.CSTNode, List[cst.EmptyLine]] = {}
        # leading lines for an original statement placed elsewhere (inside a new `if`)
        self.relead: Dict[cst.CSTNode, List[cst.EmptyLine]] = {}
        # node -> its edits, applied in order when the node is left
        self.expressions: Dict[cst.CSTNode, List[Replacement]] = defaultdict(list)

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.resolver is not None:
            if self.__dict__.get("_paths") is None:
                self._paths = self._edit_paths()
            if id(node) not in self._paths:
                return False
        return super().on_visit(node)

    def _edit_paths(self) -> set:
        """id() of the nodes edits are keyed on, with all their ancestors (nodes of the
        tree or keys of the edits: alive while the editor is, so their ids are theirs)."""
        paths = {id(self.resolver.module)}
        edits = (self.before, self.after, self.append, self.replacement, self.leading, self.relead, self.expressions)
        for keyed in edits:
            for node in keyed:
                while isinstance(node, cst.CSTNode) and id(node) not in paths:
                    paths.add(id(node))
                    node = self.resolver.parent(node)
        return paths

    def has_work(self) -> bool:
        return bool(
            self.before or self.after or self.append or self.replacement or self.leading or self.expressions
        )

    def replace_expression(self, original: cst.CSTNode, new: Replacement) -> None:
        """Replace `original` (any node of the analysed tree) by `new`, or by
        `new(updated)` where `updated` is the node with its children's edits made
        and the edits registered before this one applied: edits compose."""
        self.expressions[original].append(new)

    def insert_before(self, stmt: cst.CSTNode, new: Sequence[Stmt]) -> None:
        self.before[stmt].extend(new)

    def insert_paragraph_before(self, stmt: cst.CSTNode, new: Sequence[Stmt], first_in_block: bool) -> None:
        """Insert `new` as a paragraph of its own: a blank line before (unless it
        opens the block) and after it."""
        new = list(new)
        if not first_in_block:
            new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        self.before[stmt].extend(new)
        if not getattr(stmt, "leading_lines", None):
            self.set_leading_lines(stmt, [cst.EmptyLine(indent=False)])

    def set_leading_lines(self, stmt: cst.CSTNode, lines: Sequence[cst.EmptyLine]) -> None:
        """Replace the blank lines and comments above a statement (its edits kept)."""
        self.leading[stmt] = list(lines)

    def insert_after(self, stmt: cst.CSTNode, new: Sequence[Stmt]) -> None:
        self.after[stmt].extend(new)

    def append_to(self, block: cst.CSTNode, new: Sequence[Stmt]) -> None:
        """Add at the end of a block, before a final `return`."""
        self.append[block].extend(new)

    def replace(self, stmt: cst.CSTNode, new: Optional[Stmt]) -> None:
        self.replacement[stmt] = new

    def move_after(self, stmt: cst.CSTNode, anchor: cst.CSTNode) -> None:
        self.replacement[stmt] = None
        self.after[anchor].append(stmt)

    def on_leave(self, original_node, updated_node):
        if updated_node is original_node and self.resolver is not None and id(original_node) not in self._paths:
            return original_node  # off every edit's path (on_visit skipped it): kept, the same node
        result = super().on_leave(original_node, updated_node)
        edits = self.expressions.get(original_node, ())
        for new in edits:
            result = new(result) if callable(new) else new
        if edits and self.origins is not None and is_node(result):
            self.origins.carry(original_node, result)
        if _is_statement(original_node):
            self._updated[original_node] = result
        return result

    def _resolve(self, node: cst.CSTNode) -> cst.CSTNode:
        """The edited version of an original statement; for a new compound statement
        built around original ones (an `if` holding moved statements), theirs."""
        if node in self._updated:
            resolved = self._updated[node]
        elif isinstance(node, (cst.BaseCompoundStatement, cst.Else)) and isinstance(
            getattr(node, "body", None), cst.IndentedBlock
        ):
            resolved = node.with_changes(
                body=node.body.with_changes(body=[self._resolve(s) for s in node.body.body])
            )
            if getattr(node, "orelse", None) is not None:
                resolved = resolved.with_changes(orelse=self._resolve(node.orelse))
        else:
            resolved = node
        if node in self.relead:
            resolved = self._changed(resolved, leading_lines=self.relead[node])
        return resolved

    def _changed(self, node: cst.CSTNode, **changes) -> cst.CSTNode:
        new = node.with_changes(**changes)
        if self.origins is not None:
            self.origins.carry(node, new)
        return new

    def _edit_body(self, original_block, body_orig, body_new) -> list:
        out = []
        for orig, new in zip(body_orig, body_new):
            out.extend(self._resolve(s) for s in self.before.get(orig, ()))
            if orig in self.replacement:
                if self.replacement[orig] is not None:
                    out.append(self._resolve(self.replacement[orig]))
            else:
                if orig in self.leading:
                    new = self._changed(new, leading_lines=self.leading[orig])
                out.append(new)
            out.extend(self._resolve(s) for s in self.after.get(orig, ()))
        tail = [self._resolve(s) for s in self.append.get(original_block, ())]
        if tail:
            if out and isinstance(out[-1], cst.SimpleStatementLine) and isinstance(out[-1].body[0], cst.Return):
                out[-1:-1] = tail
            else:
                out.extend(tail)
        return out

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock):
        return updated_node.with_changes(body=self._edit_body(original_node, original_node.body, updated_node.body))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module):
        return updated_node.with_changes(body=self._edit_body(original_node, original_node.body, updated_node.body))


class CombinedEditor(StatementEditor):
    """The edits several stages planned on the same tree, applied in one pass,
    merged in stage order (expression edits of one node run in that order too)."""

    def __init__(self, editors: Sequence[StatementEditor]) -> None:
        super().__init__()
        for editor in editors:
            for mine, theirs in (
                (self.before, editor.before),
                (self.after, editor.after),
                (self.append, editor.append),
                (self.expressions, editor.expressions),
            ):
                for key, items in theirs.items():
                    mine[key].extend(items)
            self.replacement.update(editor.replacement)
            self.leading.update(editor.leading)
            self.relead.update(editor.relead)
