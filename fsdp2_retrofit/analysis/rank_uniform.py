"""Conditions every rank evaluates alike: where a collective may go.

A collective (the all_reduce of a logged loss) under `if step % log_every == 0:` runs on
the steps that log, and every rank takes the branch on the same steps. Under `if
loss.item() < best:` each rank decides from its own part of the batch: some ranks enter
the all_reduce and wait for the others, which never come (a hang). A condition is
*rank-uniform* when it is provably the same on every rank; anything not proven is not.

Proven the same on every rank (followed by value, through the scope's bindings):
literals; the index of `for i, _ in enumerate(...)` and the variable of `for i in
range(<uniform>)` (a loop the ranks run in step: the loop holds the training's own
collectives); a counter (`step = 0`, `step += 1`); the result of `parse_args()` /
`parse_known_args()` (every rank gets the same command line); imported names and the
script's own functions and classes; a script class built from uniform arguments (a
config dataclass); attributes, subscripts and arithmetic of uniform values; `len`,
`int`, `float`, `min`, `max`, `abs`, `round`, `bool` of them, `len` of a DataLoader
(DistributedSampler pads every rank to the same length). Not proven: a function's
parameters (its callers are not followed), tensors and their reads (`loss.item()`),
clocks, random numbers, anything naming a rank or the main process (`args.local_rank`,
`master_process`), the environment (`os.environ`), anything else.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from fsdp2_retrofit.analysis.rank_bindings import binding_targets
from fsdp2_retrofit.syntax.names import parameter_names
from fsdp2_retrofit.syntax.rank import mentions_rank

_CALLS = frozenset({"len", "int", "float", "min", "max", "abs", "round", "bool", "str"})
# `__name__`: every rank runs the script as `__main__`
_CONSTANTS = frozenset({"True", "False", "None", "__name__"})
# module attributes that differ between the processes of one run (`os.environ["LOCAL_RANK"]`)
_PER_PROCESS = frozenset({"environ", "pid"})
_PARSE = frozenset({"parse_args", "parse_known_args"})
_LITERALS = (cst.Integer, cst.Float, cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)


class RankUniform:
    """`condition(expr, node)`: is `expr`, read at `node`, the same on every rank?"""

    def __init__(self, resolver, loaders: Set[str] = frozenset()):
        self.r = resolver
        self.loaders = set(loaders)
        self._bindings: Optional[Dict[Tuple[int, str], List[cst.CSTNode]]] = None
        self._known: Dict[Tuple[int, str], bool] = {}

    def condition(self, expr: cst.BaseExpression, at: cst.CSTNode) -> bool:
        return self._uniform(expr, self.r.enclosing_function(at))

    def _scope_bindings(self) -> Dict[Tuple[int, str], List[cst.CSTNode]]:
        if self._bindings is None:
            found: Dict[Tuple[int, str], List[cst.CSTNode]] = {}
            for node, name in binding_targets(self.r):
                scope = self.r.enclosing_function(node)
                found.setdefault((id(scope), name), []).append(node)
            self._bindings = found
        return self._bindings

    def _uniform(self, expr, scope) -> bool:
        if mentions_rank(expr):
            return False  # `args.local_rank`, `master_process`: one value per rank by design
        kind = type(expr)
        if kind in _LITERALS:
            return True
        if kind is cst.Name:
            return expr.value in _CONSTANTS or self._name(expr.value, scope)
        if kind is cst.Attribute:
            return expr.attr.value not in _PER_PROCESS and self._uniform(expr.value, scope)
        if kind is cst.Subscript:
            return self._uniform(expr.value, scope) and all(
                type(s.slice) is cst.Index and self._uniform(s.slice.value, scope) for s in expr.slice)
        if kind is cst.BinaryOperation:
            return self._uniform(expr.left, scope) and self._uniform(expr.right, scope)
        if kind is cst.UnaryOperation:
            return self._uniform(expr.expression, scope)
        if kind is cst.BooleanOperation:
            return self._uniform(expr.left, scope) and self._uniform(expr.right, scope)
        if kind is cst.Comparison:
            return self._uniform(expr.left, scope) and all(self._uniform(c.comparator, scope)
                                                          for c in expr.comparisons)
        if kind in (cst.Tuple, cst.List):
            return all(type(e) is cst.Element and self._uniform(e.value, scope) for e in expr.elements)
        if kind is cst.Call:
            return self._call(expr, scope)
        return False

    def _call(self, call: cst.Call, scope) -> bool:
        func = call.func
        if any(a.star for a in call.args):
            return False
        if type(func) is cst.Attribute and func.attr.value in _PARSE:
            return True  # argparse: every rank parses the same command line
        if type(func) is not cst.Name:
            return False
        if func.value == "len" and len(call.args) == 1 and type(call.args[0].value) is cst.Name \
                and call.args[0].value.value in self.loaders:
            return True
        if func.value in _CALLS or self._script_class(func.value):
            return all(self._uniform(a.value, scope) for a in call.args)
        return False

    def _script_class(self, name: str) -> bool:
        nodes = self._scope_bindings().get((id(None), name), [])
        return bool(nodes) and all(type(n) is cst.ClassDef for n in nodes)

    def _name(self, name: str, scope) -> bool:
        key = (id(scope), name)
        if key in self._known:
            return self._known[key]
        self._known[key] = False  # a cycle (`x = x + loss`) proves nothing
        answer = self._name_in(name, scope)
        self._known[key] = answer
        return answer

    def _name_in(self, name: str, scope) -> bool:
        if scope is not None and name in parameter_names(scope):
            return False
        nodes = self._scope_bindings().get((id(scope), name))
        if not nodes:
            if scope is None:
                return False  # a builtin or a name from nowhere
            outer = self.r.enclosing_function(scope)
            return self._name(name, outer)  # a closure or global read
        return all(self._binding(node, name, scope) for node in nodes)

    def _binding(self, node, name: str, scope) -> bool:
        kind = type(node)
        if kind in (cst.Import, cst.ImportFrom, cst.FunctionDef, cst.ClassDef):
            return True
        if kind is cst.Assign:
            return all(self._assigned(t.target, node.value, name, scope) for t in node.targets)
        if kind in (cst.AugAssign, cst.AnnAssign):
            return type(node.target) is cst.Name and node.value is not None and self._uniform(node.value, scope)
        if kind is cst.For:
            return self._loop_counter(node, name, scope)
        return False

    def _assigned(self, target, value, name: str, scope) -> bool:
        """`name = <uniform>`; `a, name = <x>, <uniform>` (element by element); another
        target of the statement does not bind `name` and proves nothing either way."""
        if type(target) is cst.Name:
            return target.value != name or self._uniform(value, scope)
        if type(target) in (cst.Tuple, cst.List):
            elements = [e.value for e in target.elements]
            if type(value) in (cst.Tuple, cst.List) and len(value.elements) == len(elements) and not any(
                    type(e) is cst.StarredElement for e in [*target.elements, *value.elements]):
                return all(self._assigned(t, v.value, name, scope) for t, v in zip(elements, value.elements))
            return not any(type(t) is cst.Name and t.value == name for t in elements) and all(
                type(t) is cst.Name for t in elements)
        return False

    def _loop_counter(self, loop: cst.For, name: str, scope) -> bool:
        """`i` of `for i, batch in enumerate(...)` or `for i in range(<uniform>)`."""
        it = loop.iter
        if type(it) is not cst.Call or type(it.func) is not cst.Name:
            return False
        target = loop.target
        if it.func.value == "range":
            return type(target) is cst.Name and target.value == name and all(
                self._uniform(a.value, scope) for a in it.args)
        if it.func.value == "enumerate":
            return (type(target) in (cst.Tuple, cst.List) and target.elements
                    and type(target.elements[0].value) is cst.Name and target.elements[0].value.value == name)
        return False


def ranks_part_at(node: cst.CSTNode, stop, resolver, uniform: RankUniform) -> Optional[cst.CSTNode]:
    """The outermost statement around `node` (below `stop`, a function or None for the module)
    that some ranks may enter and others not: an `if`/`elif`/`else` whose tests are not all
    rank-uniform, or a `try` whose handler holds `node`. None when every rank reaches `node`
    together (as far as the conditions go). Loops are not asked: the training loop around a
    log line runs the model's own collectives, which the ranks must already run in step."""
    outermost = None
    child = node
    for parent in resolver.ancestors(node):
        if parent is stop:
            break
        if type(parent) is cst.If:
            tests = _chain_tests(parent, child, resolver)
            if not all(uniform.condition(t, parent) for t in tests):
                outermost = _chain_head(parent, resolver)
        elif type(parent) is cst.Try and type(child) is not cst.IndentedBlock:
            outermost = parent  # an except/else/finally part: runs where the body raised (or not)
        child = parent
    return outermost


def _chain_tests(the_if: cst.If, child, resolver) -> List[cst.BaseExpression]:
    """The tests deciding whether `child` (the body or the orelse of `the_if`) runs: an
    `elif` is also decided by the tests before it."""
    tests = [the_if.test]
    head = the_if
    parent = resolver.parent(head)
    while type(parent) is cst.If and parent.orelse is head:
        tests.append(parent.test)
        head = parent
        parent = resolver.parent(head)
    return tests


def _chain_head(the_if: cst.If, resolver) -> cst.If:
    """The `if` statement an `elif` belongs to."""
    head = the_if
    parent = resolver.parent(head)
    while type(parent) is cst.If and parent.orelse is head:
        head = parent
        parent = resolver.parent(head)
    return head


def bound_inside(stmt: cst.CSTNode, resolver) -> Set[str]:
    """The names some statement or expression inside `stmt` binds."""
    out: Set[str] = set()
    for node, name in binding_targets(resolver):
        if any(a is stmt for a in resolver.ancestors(node)):
            out.add(name)
    return out
