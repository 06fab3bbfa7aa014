"""What every rewrite stage shares: analysis of the tree it receives, statement
edits keyed by original nodes (rewrite/editor.py), and recording changes for the report."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, List, Optional

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, analyse
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.report import Attention, Change, Refusal, RefusedError
from fsdp2_retrofit.rewrite.refusals import CATALOGUE
from fsdp2_retrofit.syntax.names import Origins

from .context import RewriteContext
from .edit import parser_config
from .editor import CarryLines, Stmt
from .editor import CombinedEditor, StatementEditor  # noqa: F401  (the stages import them from here)
from .imports import add_imports

if TYPE_CHECKING:  # pragma: no cover
    from .blockers import Blocked

CHANGES_KEY = "fsdp2_retrofit.changes"
ATTENTION_KEY = "fsdp2_retrofit.attention"
OPTIONS_KEY = "fsdp2_retrofit.options"
FACTS_KEY = "fsdp2_retrofit.facts"  # the last analysis, reused while the tree is unchanged
DEFERRED_IMPORTS_KEY = "fsdp2_retrofit.deferred_imports"  # set by the composite: add these at the end
IMPORTS_KEY = "fsdp2_retrofit.imports"  # the imports a stage needs: (module, object, alias)
REMOVE_IMPORTS_KEY = "RemoveImportsVisitor"  # libcst's RemoveImportsVisitor.CONTEXT_KEY: removals scheduled
ORIGINS_KEY = "fsdp2_retrofit.origins"  # syntax.names.Origins: set by the composite, lines of the user's file


class RetrofitStage:
    """A rewrite stage: analyse the tree, then edit it through `StatementEditor`.

    Subclasses implement `edit(tree, facts, editor)`; they record every change with
    `self.change(...)` and refuse the file with `self.refuse(...)`.
    """

    CODE = "stage"
    DESCRIPTION = "No description."  # as libcst's CodemodCommand (libcst.tool list)
    # Whether later stages' analysis must see this stage's imports resolved (the
    # names it binds, e.g. `dist`, `fully_shard`). If not, the composite adds them
    # once at the end instead of after this stage.
    LATER_STAGES_READ_IMPORTS = False

    def __init__(self, context: RewriteContext, options: Optional[RetrofitOptions] = None) -> None:
        # a RewriteContext, or libcst's CodemodContext (the same fields: CodemodTest passes one)
        self.context = context
        self.options = options or context.scratch.get(OPTIONS_KEY) or RetrofitOptions()
        self.facts: Optional[ScriptFacts] = None

    def transform_module(self, tree: cst.Module) -> cst.Module:
        """Run the stage on `tree` (as libcst's CodemodCommand would, without its
        defensive deep copy of the tree: stages never mutate nodes and resolve their
        own metadata in the analysis), then add the imports it needs."""
        tree = self.transform_module_impl(tree)
        needed = self.context.scratch.get(IMPORTS_KEY)
        deferred = self.context.scratch.get(DEFERRED_IMPORTS_KEY)
        if needed and deferred is not None and not self.LATER_STAGES_READ_IMPORTS:
            deferred.extend(needed)
        elif needed:
            tree = add_imports(tree, needed, self.carry)
        return tree

    # What libcst.tool's `codemod` command asks of a command class besides
    # transform_module (.libcst.codemod.yaml lets it run any stage, as the README
    # says): stages subclass no libcst codemod class, as importing libcst.codemod
    # would load libcst.matchers, most of the tool's start-up time.
    @classmethod
    def may_edit(cls, earlier: ScriptFacts) -> bool:
        """Whether the stage can find work in a tree whose analysis before the last stages' edits is
        `earlier` (a stale analysis: its tree is not the one the stage gets). False lets the pipeline
        skip the stage and the analysis it would need; a stage says False only for what no edit of
        the stages before it makes (the user's own `download=True` calls, clock calls)."""
        return True

    @classmethod
    def add_args(cls, parser) -> None:
        """No command-line options of its own."""

    @classmethod
    def get_inherited_dependencies(cls) -> frozenset:
        """No libcst metadata providers: the analysis resolves its own."""
        return frozenset()

    @property
    def origins(self) -> Optional[Origins]:
        return self.context.scratch.get(ORIGINS_KEY)

    def carry(self, old: cst.CSTNode, new: cst.CSTNode) -> None:
        """`new` stands for `old` (for the report's line numbers)."""
        if self.origins is not None:
            self.origins.carry(old, new)

    def remove_unused_imports(self, tree: cst.Module) -> cst.Module:
        """Drop the imports the stage scheduled with RemoveImportsVisitor.remove_unused_import."""
        # libcst.codemod loads libcst.matchers (slow to import): only for a stage that scheduled removals
        if not self.context.scratch.get(REMOVE_IMPORTS_KEY):
            return tree
        from libcst.codemod.visitors import RemoveImportsVisitor
        from libcst.metadata import MetadataWrapper

        assert RemoveImportsVisitor.CONTEXT_KEY == REMOVE_IMPORTS_KEY

        class _Remove(CarryLines, RemoveImportsVisitor):
            @contextmanager
            def _handle_metadata_reference(self, module):
                # libcst's copies the tree first; ours keeps the nodes, so their origins hold
                wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
                outer = self.context
                with self.resolve(wrapper):
                    self.context = replace(outer, wrapper=wrapper)
                    try:
                        yield module
                    finally:
                        self.context = outer

        remover = _Remove(self.context)
        remover.origins = self.origins
        return remover.transform_module(tree)

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        editor = self.plan(tree, self.facts_for(tree))
        return tree.visit(editor) if editor.has_work() else tree

    def facts_for(self, tree: cst.Module) -> ScriptFacts:
        """The analysis of `tree`: the last one if it was of this very tree."""
        known = self.context.scratch.get(FACTS_KEY)
        if known is None or known.module is not tree:
            previous = known.resolver if known is not None else None
            known = analyse(tree, self.context.filename, self.origins, previous)
        facts = known
        self.context.scratch[FACTS_KEY] = facts
        return facts

    def plan(self, tree: cst.Module, facts: ScriptFacts) -> "StatementEditor":
        """Decide this stage's edits of `tree` (recorded in the returned editor)."""
        self.facts = facts
        self.config = parser_config(tree)
        editor = self.make_editor()
        editor.origins = self.origins
        editor.resolver = facts.resolver
        self.edit(tree, facts, editor)
        return editor

    def make_editor(self) -> "StatementEditor":
        return StatementEditor()

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: "StatementEditor") -> None:
        raise NotImplementedError

    # -- helpers for subclasses ----------------------------------------------

    def stmt(self, text: str) -> Stmt:
        """Parse one generated statement in the style of the file being edited."""
        return cst.parse_statement(text, config=self.config)

    def expr(self, text: str) -> cst.BaseExpression:
        return cst.parse_expression(text, config=self.config)

    def line(self, node: cst.CSTNode) -> int:
        return self.facts.resolver.line(node)

    def change(self, node_or_line, what: str, why: str, pitfall: str = "") -> None:
        line = node_or_line if isinstance(node_or_line, int) else self.line(node_or_line)
        self.context.scratch.setdefault(CHANGES_KEY, []).append(Change(line, self.CODE, what, why, pitfall))

    def attention(self, node_or_line, what: str, why: str, differs: bool = False) -> None:
        """Tell the user to look at something; `differs`: the output will not train exactly like the input."""
        line = node_or_line if isinstance(node_or_line, int) else self.line(node_or_line)
        self.context.scratch.setdefault(ATTENTION_KEY, []).append(Attention(line, self.CODE, what, why, differs))

    def refuse(self, code: str, node_or_line, what: str, why: str, hint: str = "") -> None:
        """Refuse the whole file: `code` is the kind of refusal (fsdp2_retrofit.rewrite.refusals)."""
        if code not in CATALOGUE:
            raise ValueError(f"refusal code {code!r} is not in the catalogue")
        line = node_or_line if isinstance(node_or_line, int) else self.line(node_or_line)
        raise RefusedError(Refusal(line, what, why, hint, code))

    def refuse_found(self, found: Iterable["Blocked"]) -> None:
        """Refuse the file with the first refusal a blocker family found (rewrite/blockers/)."""
        for blocked in found:
            at = blocked.at if isinstance(blocked.at, tuple) else (blocked.at,)
            line = next(filter(None, (a if isinstance(a, int) else self.line(a) for a in at)), 0)
            self.refuse(blocked.code, line, blocked.what, blocked.why, blocked.fix)

    def add_import(self, module: str, obj: Optional[str] = None, asname: Optional[str] = None) -> None:
        self.context.scratch.setdefault(IMPORTS_KEY, []).append((module, obj, asname))

    def rank_zero_test(self, stmt: cst.CSTNode, facts: ScriptFacts) -> Optional[str]:
        """`rank == 0` after the preamble in the entry scope, `dist.get_rank() == 0` in
        functions that receive the model; None where no process group exists yet."""
        function = facts.resolver.enclosing_function(stmt)
        entry_fn = facts.entry_scope if isinstance(facts.entry_scope, cst.FunctionDef) else None
        if function is entry_fn:
            if facts.distributed_init is None or self.before_group(stmt, facts):
                return None
            return f"{facts.rank_name} == 0" if facts.rank_name else "dist.get_rank() == 0"
        if function is not None and facts.model_names.get(function):
            return "dist.get_rank() == 0"
        if function is not None and self._defined_after_group(function, entry_fn, facts):
            return "dist.get_rank() == 0"
        return None

    def _defined_after_group(self, function: cst.FunctionDef, entry_fn, facts: ScriptFacts) -> bool:
        """`function` (a callback, a helper) is defined inside the entry scope below the statement
        that starts the process group: it can only run once the group exists."""
        if facts.distributed_init is None:
            return False
        r = facts.resolver
        outer = function
        while r.enclosing_function(outer) is not entry_fn:
            outer = r.enclosing_function(outer)
            if outer is None:
                return False
        if r.enclosing_class(outer) is not None:
            return False
        if entry_fn is None and r.block_of(outer) is facts.module:
            return False  # a top-level def: it may be called from anywhere
        return not self.before_group(outer, facts)

    def before_group(self, stmt: cst.CSTNode, facts: ScriptFacts) -> bool:
        """`stmt` runs in the entry function before its process group exists (outside the
        block that starts it, or above the statement that does)."""
        entry_fn = facts.entry_scope if isinstance(facts.entry_scope, cst.FunctionDef) else None
        if facts.distributed_init is None or facts.resolver.enclosing_function(stmt) is not entry_fn:
            return False
        from fsdp2_retrofit.analysis.process_group import process_group

        # the entry-block statement after which the group exists: the init itself, the
        # `if`/`else` that starts it either way, or the call of a set-up function that does
        known = self.__dict__.get("_group")  # (facts, its group): asked once per log line
        if known is None or known[0] is not facts:
            known = self._group = (facts, process_group(facts))
        init_stmt = known[1].start
        if init_stmt is None:
            return False
        block = facts.resolver.block_of(init_stmt)
        ancestor = _ancestor_in(stmt, block, facts)
        return ancestor is None or list(block.body).index(ancestor) < list(block.body).index(init_stmt)

    def fresh_name(self, wanted: str, scope_node: Optional[cst.CSTNode]) -> str:
        """`wanted`, or `wanted_1`, ... when the scope (or the module's globals) uses it."""
        cache = self.__dict__.setdefault("_visible", {})  # this stage's: it adds the names it takes
        if id(scope_node) not in cache:
            cache[id(scope_node)] = set(_visible_in(self.facts.resolver, scope_node))
        taken = cache[id(scope_node)]
        name, n = wanted, 0
        while name in taken:
            n += 1
            name = f"{wanted}_{n}"
        return name


def _ancestor_in(stmt, block, facts: ScriptFacts):
    """The statement of `block` that holds `stmt` (or None)."""
    body = list(block.body)
    node = stmt
    while node is not None and node not in body:
        node = facts.resolver.parent(node)
    return node


_VISIBLE: List[tuple] = []  # [(resolver, {id(scope): names})]: the stages of a group share an analysis


def _visible_in(resolver, scope_node: Optional[cst.CSTNode]) -> frozenset:
    """_names_visible, computed once per analysed tree and scope."""
    if not _VISIBLE or _VISIBLE[0][0] is not resolver:
        _VISIBLE[:] = [(resolver, {})]
    known = _VISIBLE[0][1]
    if id(scope_node) not in known:
        known[id(scope_node)] = frozenset(_names_visible(resolver, scope_node))
    return known[id(scope_node)]


def _names_visible(resolver, scope_node: Optional[cst.CSTNode]) -> set:
    """Names bound or read in a function plus the module's top level (not other bodies):
    the identifiers (not attribute names) outside every def and class but `scope_node`,
    and the names of the outermost of those defs and classes. The names of the bodies left
    out are not visited (the index's ranks give the stretches between them)."""
    inside = scope_node if isinstance(scope_node, cst.FunctionDef) else None
    others = [d for kind in (cst.FunctionDef, cst.ClassDef) for d in resolver.nodes(kind) if d is not inside]
    found = set()
    closed = []  # the spans of the outermost other bodies, in source order
    for d in sorted(others, key=resolver.order):
        first, last = resolver.span(d)
        if closed and first <= closed[-1][1]:
            continue  # inside a body that is not visible
        closed.append((first, last))
        found.add(d.name.value)
    stretches, at = [], 0  # the ranks outside those bodies: the names there, from the index
    for first, last in closed:
        stretches.append((at, first - 1))
        at = last + 1
    stretches.append((at, None))
    for first, last in stretches:
        for name in resolver.nodes_ranked(cst.Name, first, last):
            parent = resolver.parent(name)
            if type(parent) is cst.Attribute and parent.attr is name:  # `x.state_dict` binds no `state_dict`
                continue
            if type(parent) is cst.Arg and parent.keyword is name:  # nor `f(sampler=...)` a `sampler`
                continue
            found.add(name.value)
    return found
