"""Name resolution over one parsed module: qualified names, parents, lines, scopes."""
from __future__ import annotations

import builtins
import re
from bisect import bisect_left, bisect_right
from collections import defaultdict
from itertools import accumulate
from dataclasses import fields
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple, Type

import libcst as cst
from libcst._nodes.internal import CodegenState  # not exported; stable since libcst 0.3
from libcst.metadata import MetadataWrapper, PositionProvider

from .torch_api import (  # noqa: F401  (torch's qualified names: one table, still importable from here)
    CONTAINERS,
    DATALOADERS,
    FULLY_SHARD,
    NOT_OPTIMIZERS,
    OPTIMIZER_PREFIX,
    TORCH_MODULE_BASES,
)

_EMPTY = cst.Module(body=[])

# nn.Module methods that return the module itself: placement and mode changes.
SELF_RETURNING_METHODS = {"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "train", "eval", "requires_grad_"}
# those that move parameters or change their dtype: fully_shard comes after them.
PLACEMENT_METHODS = {"to", "cuda", "cpu", "float", "double", "half", "bfloat16"}


def code(node: cst.CSTNode) -> str:
    """The source text of a node, without its surrounding whitespace."""
    return render(node).strip()


class _NoPosition:
    """A context manager that does nothing, made once (see _Codegen)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False


_NO_POSITION = _NoPosition()
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")  # a line and its break, as libcst counts breaks


class _Codegen(CodegenState):
    """libcst's code generation state, without the position bookkeeping it skips anyway:
    its record_syntactic_position is a generator-based context manager that yields and
    records nothing (PositionProvider overrides it); entered once per expression and
    statement, it is a third of the cost of rendering a module. No fields of its own:
    CodegenState's dataclass __init__ serves."""

    def record_syntactic_position(self, node, *, start_node=None, end_node=None):
        return _NO_POSITION


def render(node: cst.CSTNode, module: Optional[cst.Module] = None) -> str:
    """`module.code_for_node(node)` (`module.code` for the module itself), the same text
    (tests/test_syntax.py compares them over every fixture); `module` gives the indent
    and newline style (default: libcst's)."""
    style = module if module is not None else node if type(node) is cst.Module else _EMPTY
    state = _Codegen(default_indent=style.default_indent, default_newline=style.default_newline)
    node._codegen(state)
    return "".join(state.tokens)


def render_statements(module: cst.Module) -> Tuple[str, List[str]]:
    """`render(module)` and the code of each of its top-level statements (each as `render(stmt,
    module)` gives it), from one code generation."""
    state = _Codegen(default_indent=module.default_indent, default_newline=module.default_newline)
    for line in module.header:
        line._codegen(state)
    parts = []
    for stmt in module.body:
        at = len(state.tokens)
        stmt._codegen(state)
        parts.append("".join(state.tokens[at:]))
    for line in module.footer:
        line._codegen(state)
    if not module.has_trailing_newline:
        state.pop_trailing_newline()
    elif not state.tokens:
        state.add_token(state.default_newline)
    return "".join(state.tokens), parts


_BUILTINS = frozenset(dir(builtins))


def dotted(node: cst.CSTNode) -> str:
    """`a.b.c` for a name or an attribute chain (an import's module or name), without codegen."""
    kind = type(node)
    if kind is cst.Name:
        return node.value
    if kind is cst.Attribute:
        return f"{dotted(node.value)}.{node.attr.value}"
    return code(node)


def import_bindings(imp, keep_relative: bool = False) -> Iterator[tuple]:
    """(local name, dotted name) for each name an Import or ImportFrom binds
    (`from . import x` gives `x`, or `.x` with keep_relative)."""
    if isinstance(imp, cst.Import):
        for alias in imp.names:
            full = dotted(alias.name)
            if alias.asname is not None:
                yield dotted(alias.asname.name), full
            else:
                yield full.split(".")[0], full.split(".")[0]
    elif not isinstance(imp.names, cst.ImportStar):
        base = dotted(imp.module) if imp.module is not None else ""
        if keep_relative:
            base = "." * len(imp.relative) + base
        for alias in imp.names:
            name = dotted(alias.name)
            yield (dotted(alias.asname.name) if alias.asname is not None else name), (f"{base}.{name}" if base else name)


def _module_bindings(body) -> Iterator[str]:
    """Names the module's own code binds: assignments, loops, `with ... as`, classes and
    functions at the top level (inside top-level if/for/while/with/try too)."""
    for stmt in body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            yield stmt.name.value
        elif isinstance(stmt, cst.SimpleStatementLine):
            yield from assigned_names(stmt)
        else:
            if isinstance(stmt, cst.For):
                yield from (t.value for t in _flatten_target(stmt.target) if isinstance(t, cst.Name))
            elif isinstance(stmt, cst.With):
                for item in stmt.items:
                    if item.asname is not None:
                        yield from (t.value for t in _flatten_target(item.asname.name) if isinstance(t, cst.Name))
            for block in _blocks_of(stmt):
                yield from _module_bindings(block.body)


def _blocks_of(stmt) -> Iterator[cst.IndentedBlock]:
    """The indented blocks of a compound statement (none of them a new scope)."""
    parts = [getattr(stmt, "body", None), getattr(stmt, "orelse", None), getattr(stmt, "finalbody", None)]
    for part in parts + list(getattr(stmt, "handlers", ())):
        if isinstance(part, cst.IndentedBlock):
            yield part
        elif isinstance(part, cst.If):  # elif
            yield from _blocks_of(part)
        elif isinstance(getattr(part, "body", None), cst.IndentedBlock):  # else, except, finally
            yield part.body


class Origins:
    """Which node of the user's file (the first parse) each node of a later tree stands
    for, so every stage reports the user's own line numbers.

    Transforms call `carry(old, new)` for each node they rebuild; nodes they keep are
    the same objects. A node the rewrite wrote has no origin (see Resolver.line).
    """

    def __init__(self, first: cst.Module, text: Optional[str] = None):
        """`text`: the source `first` was parsed from, when at hand (lines are then
        counted from the end of the file too, for statements near it)."""
        self.first = first
        self._newlines = None if text is None else text.count("\n") + (0 if first.has_trailing_newline else 1)
        self._text = text
        self._source: Dict[cst.CSTNode, cst.CSTNode] = {}
        self.first_resolver: Optional["Resolver"] = None  # set by the first tree's Resolver
        self._at: Optional[Dict[cst.CSTNode, int]] = None  # top-level statement -> its index
        self._positions: Dict[cst.CSTNode, object] = {}  # statement -> its nodes' positions, alone
        self._breaks: Dict[cst.CSTNode, List[int]] = {}  # top-level statement -> breaks before each of its nodes
        self._counted: Dict[int, int] = {}  # id(statement of the first tree) -> _breaks_of

    def _lines_before(self, top: cst.CSTNode) -> int:
        """How many lines of the file come before a top-level statement (its leading
        comments and blank lines included). Only the statements between it and the
        nearer end of the file are rendered: knowing the file's length, those after the
        middle are counted from the end (the training function is mostly near it, after
        the model's classes)."""
        body = self.first.body
        if self._at is None:
            self._at = {stmt: i for i, stmt in enumerate(body)}
            self._forward = [len(self.first.header)]  # lines before body[0], body[1], ...
            self._backward = [] if self._newlines is None else [self._newlines - len(self.first.footer)]
        i = self._at[top]
        if self._backward and i >= len(body) // 2:
            while len(self._backward) <= len(body) - i:  # lines before body[-1], body[-2], ... after the end
                stmt = body[len(body) - len(self._backward)]
                self._backward.append(self._backward[-1] - self._breaks_of(stmt))
            return self._backward[len(body) - i]
        while len(self._forward) <= i:
            stmt = body[len(self._forward) - 1]
            self._forward.append(self._forward[-1] + self._breaks_of(stmt))
        return self._forward[i]

    def render(self, module: cst.Module) -> str:
        """`render(module)` for a tree the rewrite made from the first: each top-level
        statement it kept (the same node) is copied from the user's text instead of
        generated again (libcst's parse round-trips: a node's code is the text it was
        parsed from), the others are rendered. The statements' lines are counted from
        their nodes' own text (see _breaks_of, a third of the cost of rendering them);
        where that count and the text disagree, or the file's style differs (no final
        newline, another indent or newline in `module`), the whole tree is rendered."""
        first, text = self.first, self._text
        if (
            text is None
            or self.first_resolver is None
            or not (first.has_trailing_newline and module.has_trailing_newline)
            or (module.default_indent, module.default_newline) != (first.default_indent, first.default_newline)
        ):
            return render(module)
        at = {id(stmt): i for i, stmt in enumerate(first.body)}
        if not any(at.get(id(stmt)) is not None and first.body[at[id(stmt)]] is stmt for stmt in module.body):
            return render(module)
        starts = [len(first.header)]  # the line each statement's code starts at (its leading lines included)
        for stmt in first.body:
            starts.append(starts[-1] + self._breaks_of(stmt))
        lines = _LINE.findall(text)
        if starts[-1] + len(first.footer) != len(lines) or "".join(lines) != text:
            return render(module)
        offsets = [0, *accumulate(map(len, lines))]  # line -> the offset of its first character
        state = _Codegen(default_indent=module.default_indent, default_newline=module.default_newline)
        for line in module.header:
            line._codegen(state)
        for stmt in module.body:
            i = at.get(id(stmt))
            if i is not None and first.body[i] is stmt:
                state.add_token(text[offsets[starts[i]] : offsets[starts[i + 1]]])
            else:
                stmt._codegen(state)
        for line in module.footer:
            line._codegen(state)
        if not state.tokens:
            state.add_token(state.default_newline)  # an empty module keeps its newline (Module._codegen_impl)
        return "".join(state.tokens)

    def carry(self, old: cst.CSTNode, new: cst.CSTNode) -> None:
        if new is not old:
            self._source[new] = self._source.get(old, old)

    def line(self, node: cst.CSTNode) -> int:
        """The line of the user's file `node` stands for; 0 for a node the rewrite wrote.

        A node inside a simple statement line (most nodes asked about) is placed by
        libcst's PositionProvider over that statement alone, the statement by the line
        breaks of the code before it; any other node by PositionProvider over its
        top-level statement alone. Only what is asked about is rendered (a report names
        a few lines of a long file)."""
        node = self._source.get(node, node)
        top = node
        if self.first_resolver is None:
            Resolver(self.first, self)
        parents = self.first_resolver._parents
        stmt = None  # the simple statement line holding `node`
        while id(top) in parents and parents[id(top)] is not self.first:
            if stmt is None and isinstance(top, cst.SimpleStatementLine):
                stmt = top
            top = parents[id(top)]
        if parents.get(id(top)) is not self.first:
            return 0
        if stmt is None and isinstance(top, cst.SimpleStatementLine):
            stmt = top
        unit = top if stmt is None else stmt
        if stmt is not None and self._one_line(stmt):
            # a statement on one line (most are): every node in it starts on that line, after
            # its leading blank and comment lines; no positions resolved
            return self._lines_before(top) + self._breaks_before(top, stmt) + len(stmt.leading_lines) + 1
        if unit not in self._positions:
            alone = self.first.with_changes(body=[unit], header=[], footer=[])
            self._positions[unit] = MetadataWrapper(alone, unsafe_skip_copy=True).resolve(PositionProvider)
        pos = self._positions[unit].get(node)
        if pos is None:
            return 0
        return self._lines_before(top) + self._breaks_before(top, unit) + pos.start.line

    def _breaks_of(self, stmt: cst.CSTNode) -> int:
        """The line breaks in a statement's code, from its nodes' own text (not rendered);
        counted once per statement (the lines of the report and render share them)."""
        known = self._counted.get(id(stmt))  # statements of the first tree: alive while it is
        if known is not None:
            return known
        resolver = self.first_resolver
        first, last = resolver.span(stmt)
        newline = self.first.default_newline
        breaks = 0
        for node in resolver._seq[first : last + 1]:
            breaks += _breaks_in(node, newline)
        self._counted[id(stmt)] = breaks
        return breaks

    def _one_line(self, stmt: cst.SimpleStatementLine) -> bool:
        """Whether the statement's code, after its leading lines, has no line break but its
        end: its nodes' own text holds exactly the leading lines' and the final one."""
        return self._breaks_of(stmt) == len(stmt.leading_lines) + 1

    def _breaks_before(self, top: cst.CSTNode, stmt: cst.CSTNode) -> int:
        """The line breaks (as PositionProvider counts them) in the code of the top-level
        statement `top` before the code of `stmt`, a statement inside it: those in the
        text of the nodes before `stmt` in source order (not its ancestors), read from
        the nodes, not rendered; the running counts kept for the next statement asked."""
        if stmt is top:
            return 0
        resolver = self.first_resolver
        seq, first = resolver._seq, resolver._order[id(top)]
        end = resolver._order[id(stmt)] - first
        counts = self._breaks.setdefault(top, [0])
        while len(counts) <= end:
            counts.append(counts[-1] + _breaks_in(seq[first + len(counts) - 1], self.first.default_newline))
        count = counts[end]
        for ancestor in resolver.ancestors(stmt):
            if ancestor is self.first:
                break
            # its whitespace children come before the statement (`if a and \\` ... `:`): they count
            count -= _breaks_in(ancestor, self.first.default_newline, own=True)
        return count

class Resolver:
    """Metadata for one module, computed in one walk; nodes are the module's own (no copy).

    Qualified names come from the file's imports (wherever they are), its top-level
    classes, functions and assignments, and Python's builtins (`builtins.open`), not
    from libcst's scope analysis: a local variable that shadows an imported or global
    name is not told apart (rare in training scripts), and a file is resolved in one
    walk instead of libcst's several.
    """

    origins: Optional[Origins] = None

    def __init__(self, module: cst.Module, origins: Optional[Origins] = None, previous: Optional["Resolver"] = None):
        """`previous`: the Resolver of a tree `module` was made from; the subtrees the two
        share (the same nodes: a stage's edit keeps what it does not change) are indexed
        from it, not walked again."""
        self.module = module
        self.origins = origins
        self._positions = None  # computed on the first position() call: only stages that report need it
        self._index(module, previous)
        self._table = self._name_table(module, previous)
        self._added: Set[str] = set()  # the names add_bindings added
        # id(attribute) -> (the attribute, its qualified name): the attribute is held, so its id is
        # not reused while the entry lives; emptied when add_bindings changes the table
        self._attribute_names: Dict[int, tuple] = {}
        # id(indexed node) -> the innermost FunctionDef / ClassDef that is or holds it (see _enclosing)
        self._within: Dict[type, Dict[int, Optional[cst.CSTNode]]] = {cst.FunctionDef: {}, cst.ClassDef: {}}
        # what an analysis computes from this tree and its names alone, once for every stage that
        # asks (analysis.rank_values.aliases_of); emptied when add_bindings changes the names
        self.derived: Dict[str, object] = {}
        if origins is not None and module is origins.first:
            origins.first_resolver = self

    def _name_table(self, module: cst.Module, previous: Optional["Resolver"] = None) -> Dict[str, str]:
        """Local name -> qualified name, for the names the module binds globally or imports
        (the names a top-level statement `previous`'s tree had too binds are not looked for again)."""
        table: Dict[str, str] = {}
        known = previous._bound_by if previous is not None else {}
        self._bound_by: Dict[int, tuple] = {}  # id(top-level statement) -> (it, the names it binds)
        for stmt in module.body:
            found = known.get(id(stmt))
            if found is None or found[0] is not stmt:
                found = (stmt, list(_module_bindings((stmt,))))
            self._bound_by[id(stmt)] = found
            for name in found[1]:
                table[name] = name
        for kind in (cst.Import, cst.ImportFrom):
            for imp in self._by_type.get(kind, []):
                table.update(import_bindings(imp))
        return table

    def binds(self, name: str) -> bool:
        """Whether the module itself binds or imports `name` at its top level."""
        return name in self._table and name not in self._added

    def add_bindings(self, names: Dict[str, str], unsure: Iterable[str] = ()) -> None:
        """Names the module binds without spelling them (`from models import *`: read
        from the sibling files by analysis.star_imports); a name it binds itself keeps
        its own meaning, unless listed in `unsure` (a star import may rebind it): that
        one resolves to nothing."""
        self._attribute_names.clear()
        self.derived.clear()
        for name in unsure:
            self._table.pop(name, None)
        for name, qualified in names.items():
            if name not in self._table:
                self._table[name] = qualified
                self._added.add(name)

    def _index(self, module: cst.Module, previous: Optional["Resolver"] = None) -> None:
        """One walk records every node's parent and source-order rank and indexes the nodes
        by type; with `previous`, each subtree `module` shares with `previous`'s tree is
        copied from its index instead of walked."""
        if previous is not None:
            old_order, old_last, old_seq, old_parents = previous._order, previous._last, previous._seq, previous._parents
        else:
            old_order = {}
        seq: List[cst.CSTNode] = []
        # keyed by id(node): libcst's CSTNode.__hash__ is a Python method (id(self)); every
        # indexed node is kept alive by `seq`, so no id is reused while the index lives
        parents: Dict[int, cst.CSTNode] = {}
        last: Dict[int, int] = {}
        stack: List[tuple] = [(module, None)]
        pop, push, add = stack.pop, stack.append, seq.append
        fields_of, known_node, whitespace = _CHILD_FIELDS.get, _IS_NODE.get, _WHITESPACE
        while stack:
            node, parent = pop()
            if parent is _LEAVE:
                last[id(node)] = len(seq) - 1
                continue
            if parent is not None:
                parents[id(node)] = parent
            if old_order:
                start = old_order.get(id(node))
                if start is not None and old_seq[start] is node:
                    end = old_last[id(node)]
                    shift = len(seq) - start
                    block = old_seq[start : end + 1]
                    seq.extend(block)
                    keys = list(map(id, block))  # map/zip: no Python-level loop per copied node
                    inner = keys[1:]
                    parents.update(zip(inner, map(old_parents.__getitem__, inner)))
                    last.update(zip(keys, map(shift.__add__, map(old_last.__getitem__, keys))))
                    continue
            add(node)
            # child_nodes, inlined (the hottest loop of an analysis), without the SimpleWhitespace
            # leaves (four nodes in ten; no analysis asks about them: their line breaks are
            # counted with their parent's, see _breaks_in); children pushed last first
            visited, maybe = fields_of(type(node)) or _learn_fields(node)
            if maybe:
                children = [c for c in child_nodes(node) if type(c) is not whitespace]
            else:
                children = []
                for name in visited:
                    value = getattr(node, name)
                    kind = type(value)
                    if kind is tuple or kind is list:
                        children.extend(value)
                    elif kind is not whitespace and (known_node(kind) or (kind not in _IS_NODE and is_node(value))):
                        children.append(value)
            if children:
                push((node, _LEAVE))
                for child in reversed(children):
                    push((child, node))
            else:
                last[id(node)] = len(seq) - 1
        self._seq = seq
        self._parents = parents
        self._last = last
        self._order = dict(zip(map(id, seq), range(len(seq))))
        self._by_type: Dict[Type[cst.CSTNode], List[cst.CSTNode]] = defaultdict(list)
        for n in seq:
            self._by_type[type(n)].append(n)
        self._ranks: Dict[Type[cst.CSTNode], List[int]] = {}  # per type, the ranks of nodes(type)
        _RECENT_INDEXES.insert(0, self)
        del _RECENT_INDEXES[_KEEP_INDEXES:]

    def order(self, node: cst.CSTNode) -> int:
        """The node's rank in a pre-order walk: source order, a node before its children."""
        return self._order.get(id(node), -1)

    def nodes(self, kind: Type[cst.CSTNode]) -> List[cst.CSTNode]:
        """Every node of exactly this type, in source order."""
        return self._by_type.get(kind, [])

    def span(self, node: cst.CSTNode) -> tuple:
        """The ranks (see order) of the node and of its last descendant."""
        return self._order.get(id(node), -1), self._last.get(id(node), -1)

    def descendants(self, node: cst.CSTNode, kind: Type[cst.CSTNode]) -> List[cst.CSTNode]:
        """Every node of exactly this type inside `node` (itself included), in source
        order, from the index: no walk of the subtree."""
        first = self._order.get(id(node))
        if first is None:
            return []
        return self.nodes_ranked(kind, first, self._last[id(node)])

    def nodes_ranked(self, kind: Type[cst.CSTNode], first: int, last: Optional[int] = None) -> List[cst.CSTNode]:
        """Every node of exactly this type whose rank (see order) is from `first` to `last`
        (None: the end), in source order, from the index."""
        if kind not in self._ranks:
            self._ranks[kind] = [self._order[id(n)] for n in self._by_type.get(kind, [])]
        ranks = self._ranks[kind]
        end = len(ranks) if last is None else bisect_right(ranks, last)
        return self._by_type.get(kind, [])[bisect_left(ranks, first) : end]

    def qnames(self, node: cst.CSTNode) -> Set[str]:
        """Fully qualified names of a name, attribute or call (its callee)."""
        if type(node) is cst.Call:
            node = node.func
        found = self._dotted(node)
        return {found} if found else set()

    def _dotted(self, node) -> Optional[str]:
        kind = type(node)  # libcst's Name and Attribute have no subclasses: no isinstance needed
        if kind is cst.Name:
            found = self._table.get(node.value)
            if found is None and node.value in _BUILTINS:
                return f"builtins.{node.value}"
            return found
        if kind is cst.Attribute:
            known = self._attribute_names.get(id(node))
            if known is not None and known[0] is node:
                return known[1]
            base = self._dotted(node.value)
            found = f"{base}.{node.attr.value}" if base else None
            self._attribute_names[id(node)] = (node, found)
            return found
        return None

    def local_name(self, qname: str) -> Optional[str]:
        """A name the module binds to `qname` by an import (`nn` for torch.nn), if any."""
        return next((local for local, q in sorted(self._table.items()) if q == qname), None)

    def is_call_to(self, node: cst.CSTNode, names) -> bool:
        """A call of one of `names` (qualified names: a set, or any collection)."""
        if type(node) is not cst.Call:
            return False
        found = self._dotted(node.func)  # what qnames holds, without building the set
        return bool(found) and found in names

    def calls_prefix(self, node: cst.CSTNode, prefix: str) -> bool:
        if type(node) is not cst.Call:
            return False
        found = self._dotted(node.func)
        return bool(found) and found.startswith(prefix)

    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self._parents.get(id(node))

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        parents = self._parents
        node = parents.get(id(node))
        while node is not None:
            yield node
            node = parents.get(id(node))

    def line(self, node: cst.CSTNode) -> int:
        """The node's line; with `origins`, its line in the user's file (for a node the
        rewrite wrote, the user's next line after it)."""
        if self.origins is not None:
            return self._original_line(node)
        pos = self.position(node)
        return pos.start.line if pos is not None else 0

    def _original_line(self, node: cst.CSTNode) -> int:
        while node is not None:
            found = self.origins.line(node)
            if found:
                return found
            parent = self._parents.get(id(node))
            if isinstance(parent, (cst.IndentedBlock, cst.Module)):
                body = parent.body
                at = next((i for i, s in enumerate(body) if s is node), len(body))
                for later in body[at + 1:]:
                    found = self._first_original_line(later)
                    if found:
                        return found
            node = parent
        return 0

    def _first_original_line(self, stmt: cst.CSTNode) -> int:
        """The first user line a statement (or a new one wrapped around user statements) holds."""
        found = self.origins.line(stmt)
        if found or not isinstance(getattr(stmt, "body", None), cst.IndentedBlock):
            return found
        return next((n for n in map(self._first_original_line, stmt.body.body) if n), 0)

    def position(self, node: cst.CSTNode):
        """The node's CodeRange (1-based lines, 0-based columns), or None."""
        if self._positions is None:
            self._positions = MetadataWrapper(self.module, unsafe_skip_copy=True).resolve(PositionProvider)
        return self._positions.get(node)

    def enclosing_function(self, node: cst.CSTNode) -> Optional[cst.FunctionDef]:
        return self._enclosing(node, cst.FunctionDef)

    def enclosing_class(self, node: cst.CSTNode) -> Optional[cst.ClassDef]:
        return self._enclosing(node, cst.ClassDef)

    def _enclosing(self, node: cst.CSTNode, kind: type):
        """The nearest ancestor of type `kind`. Remembered for the ancestors walked (indexed
        nodes, kept alive by the index: their ids are not reused), so asking about every
        node of a function climbs each of its ancestors once."""
        parents, known = self._parents, self._within[kind]
        node = parents.get(id(node))
        walked = []
        found = None
        while node is not None:
            key = id(node)
            if key in known:
                found = known[key]
                break
            if type(node) is kind:
                found = node
                break
            walked.append(key)
            node = parents.get(key)
        for key in walked:
            known[key] = found
        return found

    def statement_of(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The statement (simple line or compound) that directly holds `node` in a block."""
        current = node
        for anc in self.ancestors(node):
            if isinstance(anc, (cst.IndentedBlock, cst.Module)):
                return current
            current = anc
        return None

    def block_of(self, stmt: cst.CSTNode):
        """The IndentedBlock or Module whose body lists `stmt`."""
        parent = self.parent(stmt)
        return parent if isinstance(parent, (cst.IndentedBlock, cst.Module)) else None



_LEAVE = object()


class _FieldOrder(cst.CSTVisitor):
    """Records the attributes libcst visits on a node, in its order, without descending."""

    def __init__(self) -> None:
        super().__init__()
        self.names: List[str] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        return False

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        self.names.append(attribute)

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        pass


_CHILD_FIELDS: Dict[type, tuple] = {}  # node type -> (visited attributes in order, attributes to check)


def _learn_fields(node: cst.CSTNode) -> tuple:
    recorder = _FieldOrder()
    node._visit_and_replace_children(recorder)
    visited = tuple(dict.fromkeys(recorder.names))
    # An attribute libcst did not visit on this node but could on another (it visits
    # FormattedStringExpression.format_spec only when it is set): empty here.
    maybe = tuple(
        f.name for f in fields(node)
        if f.name not in visited and (getattr(node, f.name) is None or isinstance(getattr(node, f.name), (tuple, list)))
    )
    found = _CHILD_FIELDS[type(node)] = (visited, maybe)
    return found


def child_nodes(node: cst.CSTNode) -> list:
    """`node.children` (the same nodes, in the same order) without rebuilding the node:
    libcst's `children` runs `_visit_and_replace_children`, which constructs a copy of
    the node. The attributes it visits, in its order, are learnt once per node type
    (by running it once with a visitor that records them) and read directly after;
    a node that holds nodes in an attribute not seen visited is asked libcst's way."""
    visited, maybe = _CHILD_FIELDS.get(type(node)) or _learn_fields(node)
    for name in maybe:
        value = getattr(node, name)
        if is_node(value) or (isinstance(value, (tuple, list)) and value):
            return list(node.children)
    out: list = []
    for name in visited:
        value = getattr(node, name)
        kind = type(value)
        if kind is tuple or kind is list:
            out.extend(value)
        elif _IS_NODE.get(kind) or (kind not in _IS_NODE and is_node(value)):
            out.append(value)
    return out


_IS_NODE: Dict[type, bool] = {}  # type -> whether it is a CSTNode (isinstance of the ABC costs a Python call)


def is_node(value) -> bool:
    """isinstance(value, cst.CSTNode), remembered per type (the ABC check is a Python call,
    and for a type that is not a node it asks every subclass of CSTNode once: hundreds)."""
    found = _IS_NODE.get(type(value))
    if found is None:
        found = _IS_NODE[type(value)] = cst.CSTNode in type(value).__mro__  # libcst registers no virtual subclasses
    return found


_TEXT_FIELDS: Dict[type, tuple] = {}  # node type -> the attributes that are not its children
_WHITESPACE = cst.SimpleWhitespace  # not indexed: see Resolver._index


def _breaks_in(node: cst.CSTNode, default_newline: str, own: bool = False) -> int:
    """The line breaks (\\n, \\r\\n or \\r, as libcst's PositionProvider counts them) in the
    text a node writes itself: its string attributes (a string's or a whitespace's value),
    a Newline's default newline, the `pass` line of an empty indented block; and, unless
    `own`, those of its SimpleWhitespace children (`\\` continuations), which the index
    leaves out (see Resolver._index)."""
    kind = type(node)
    names = _TEXT_FIELDS.get(kind)
    if names is None:
        visited, _ = _CHILD_FIELDS.get(kind) or _learn_fields(node)
        names = _TEXT_FIELDS[kind] = tuple(f.name for f in fields(node) if f.name not in visited)
    count = 0
    for name in names:
        value = getattr(node, name)
        if type(value) is str and ("\n" in value or "\r" in value):
            count += value.count("\n") + value.count("\r") - value.count("\r\n")
    if not own:
        visited, _ = _CHILD_FIELDS.get(kind) or _learn_fields(node)
        for name in visited:
            value = getattr(node, name)
            if type(value) is _WHITESPACE:
                text = value.value
                if "\n" in text or "\r" in text:
                    count += text.count("\n") + text.count("\r") - text.count("\r\n")
    # exact types: libcst has no subclasses of these, and an ABC isinstance costs a Python call
    if (kind is cst.Newline and node.value is None) or (kind is cst.IndentedBlock and not node.body):
        count += default_newline.count("\n") + default_newline.count("\r") - default_newline.count("\r\n")
    return count


# The Resolvers made last, newest first: walk reads a subtree one of them indexed
# instead of walking it again (trees are immutable: an indexed subtree cannot change).
_RECENT_INDEXES: List["Resolver"] = []
_KEEP_INDEXES = 4


def walk(node: cst.CSTNode) -> List[cst.CSTNode]:
    """`node` and every node under it, in source order (child_nodes: no node is rebuilt),
    but SimpleWhitespace leaves (the index leaves them out: see Resolver._index)."""
    for resolver in _RECENT_INDEXES:
        first = resolver._order.get(id(node))
        if first is not None:
            return resolver._seq[first : resolver._last[id(node)] + 1]
    out: List[cst.CSTNode] = []
    stack = [node]
    while stack:
        current = stack.pop()
        out.append(current)
        stack.extend(reversed([c for c in child_nodes(current) if type(c) is not _WHITESPACE]))
    return out


def last_assignment(name: str, stmt: cst.CSTNode, block) -> Optional[cst.SimpleStatementLine]:
    """The statement of `block` before `stmt` that last binds `name` (see
    assigned_names), or None; the caller decides which shapes of it it reads."""
    body = list(block.body)
    for earlier in reversed(body[: body.index(stmt)]):
        if name in assigned_names(earlier):
            return earlier
    return None


def calls_in(node: cst.CSTNode) -> List[cst.Call]:
    """Every call inside `node` (itself included), in source order."""
    return [n for n in walk(node) if type(n) is cst.Call]


def names_in(node: cst.CSTNode) -> Set[str]:
    """Every bare identifier read or written anywhere inside `node`."""
    return {n.value for n in walk(node) if type(n) is cst.Name}


def names_read(node: cst.CSTNode) -> set:
    """Names loaded in `node` (not attribute names or keywords). Read from the nodes' children
    (child_nodes), not with a libcst visitor: a visit rebuilds every node it passes (a linked
    program's modules are asked whole, several times)."""
    found: set = set()
    stack = [node]
    pop, push, extend = stack.pop, stack.append, stack.extend
    name, attribute, arg = cst.Name, cst.Attribute, cst.Arg
    while stack:
        current = pop()
        kind = type(current)
        if kind is name:
            found.add(current.value)
        elif kind is attribute or kind is arg:
            push(current.value)  # `x.attr`, `f(keyword=...)`: the attribute and the keyword are not read
        else:
            extend(child_nodes(current))
    return found


def assigned_names(stmt: cst.CSTNode) -> Set[str]:
    """Names a simple assignment statement binds (`a = ...`, `a, b = ...`)."""
    out: Set[str] = set()
    if type(stmt) is cst.SimpleStatementLine:
        for small in stmt.body:
            kind = type(small)
            if kind is cst.Assign:
                targets = [t.target for t in small.targets]
            elif kind is cst.AnnAssign or kind is cst.AugAssign:
                targets = [small.target]
            else:
                continue
            for target in targets:
                for el in _flatten_target(target):
                    if type(el) is cst.Name:
                        out.add(el.value)
    return out


def _flatten_target(target):
    if type(target) is cst.Tuple or type(target) is cst.List:
        for el in target.elements:
            yield from _flatten_target(el.value)
    else:
        yield target


def module_itself(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`model` for `model.to(device)`, `model.cuda().train()`: an nn.Module's placement
    and mode methods return the module itself, so the value is the receiver's."""
    while (type(expr) is cst.Call and type(expr.func) is cst.Attribute
           and expr.func.attr.value in SELF_RETURNING_METHODS):
        expr = expr.func.value
    return expr


def alias_target(expr: cst.BaseExpression) -> Optional[str]:
    """`model` for `model`, `model.module`, `model._orig_mod`, `model.to(device)` (a
    method returning the module itself), and a conditional whose two branches both name
    it (`model.module if ddp else model`); None otherwise."""
    if isinstance(expr, cst.IfExp):
        body, orelse = alias_target(expr.body), alias_target(expr.orelse)
        return body if body == orelse else None
    expr = module_itself(expr)
    if isinstance(expr, cst.Attribute) and expr.attr.value in ("module", "_orig_mod"):
        expr = module_itself(expr.value)
    return expr.value if isinstance(expr, cst.Name) else None


def root_name(expr: cst.BaseExpression) -> Optional[str]:
    """`model` for `model`, `model.blocks`, `model.to(d)`, `model.x.y()`."""
    while True:
        if isinstance(expr, cst.Name):
            return expr.value
        if isinstance(expr, cst.Attribute):
            expr = expr.value
        elif isinstance(expr, cst.Call):
            expr = expr.func
        elif isinstance(expr, cst.Subscript):
            expr = expr.value
        else:
            return None


def attr_path(expr: cst.BaseExpression) -> Optional[tuple]:
    """('self', 'a', 'b') for `self.a.b`; None for anything else."""
    parts = []
    while isinstance(expr, cst.Attribute):
        parts.append(expr.attr.value)
        expr = expr.value
    if isinstance(expr, cst.Name):
        parts.append(expr.value)
        return tuple(reversed(parts))
    return None


def instance_attribute(expr) -> Optional[str]:
    """`self.model` for an attribute of a plain name (`self.model`, `solver.net`); None for anything else."""
    if type(expr) is cst.Attribute and type(expr.value) is cst.Name:
        return f"{expr.value.value}.{expr.attr.value}"
    return None


def keyword_arg(call: cst.Call, name: str, index: Optional[int] = None) -> Optional[cst.BaseExpression]:
    """The value `call` passes as keyword `name`, else (with `index`) its positional argument at
    that place (before any `*args`); None when it passes neither."""
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a.value
    if index is not None:
        positional = [a for a in call.args if a.keyword is None and not a.star]
        if len(positional) > index:
            return positional[index].value
    return None


def bind_args(fn: cst.FunctionDef, call: cst.Call, skip: int = 0):
    """(parameter, argument) pairs a call of `fn` binds, for plain positional and keyword
    arguments; `skip` leading parameters are not in the call (1: `self` of a constructor)."""
    params = [p.name.value for p in fn.params.params][skip:]
    positional = [a for a in call.args if a.keyword is None and not a.star]
    for param, arg in zip(params, positional):
        yield param, arg.value
    all_params = set(params) | {p.name.value for p in fn.params.kwonly_params}
    for a in call.args:
        if a.keyword is not None and a.keyword.value in all_params:
            yield a.keyword.value, a.value


def is_main_guard(node) -> bool:
    """`if __name__ == "__main__":`"""
    return isinstance(node, cst.If) and "__name__" in names_in(node.test)


def iterated_name(expr) -> Optional[str]:
    """`loader` for `loader`, `enumerate(loader)`, `tqdm(loader, ...)`, `iter(loader)`."""
    while isinstance(expr, cst.Call) and expr.args:
        expr = expr.args[0].value
    return expr.value if isinstance(expr, cst.Name) else None


def parameter_names(fn: cst.FunctionDef) -> Set[str]:
    """The names a function's parameters bind (*args and **kwargs included)."""
    params = fn.params
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    every += [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
    return {p.name.value for p in every}
