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
(DistributedSampler pads every rank to the same length).

Given the script's facts (`facts=`), also: a sum of a loop over a split DataLoader read after
the loop, which the rewrite combines over the ranks there (analysis/loop_sums.py); the value
of a call of a script function whose every `return` gives a uniform value (`acc =
evaluate(model, loader)`), element by element for `a, b = f(...)` where every return is a
tuple; `len(p)` and `len(p.dataset)` of a parameter that holds DataLoaders only (followed by
value, analysis/flow.py: every rank builds the same dataset).

Given the facts, also: a parameter of a top-level function of the script whose name is only
ever called, where every call passes a uniform value (`def go(arg)` called as `go(options)`,
`options = parser.parse_args()`), followed by value through analysis/flow.py.

Not proven: a function's other parameters, tensors and their
reads (`loss.item()`), clocks, random numbers, anything naming a rank or the main process
(`args.local_rank`, `master_process`), the environment (`os.environ`), anything else.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from fsdp2_retrofit.analysis.loop_sums import reduced_after_loop
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

    def __init__(self, resolver, loaders: Set[str] = frozenset(), facts=None):
        self.r = resolver
        self.loaders = set(loaders)
        self.facts = facts
        self._bindings: Optional[Dict[Tuple[int, str], List[cst.CSTNode]]] = None
        self._known: Dict[Tuple[int, str], bool] = {}
        self._returns: Dict[Tuple[int, int], bool] = {}

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
            if self.facts is not None and reduced_after_loop(self.facts, scope, expr.value, expr):
                return True  # a loop's sum, combined over the ranks after the loop
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
        if func.value == "len" and len(call.args) == 1 and self._loader_length(call.args[0].value, scope):
            return True
        if func.value in _CALLS or self._script_class(func.value):
            return all(self._uniform(a.value, scope) for a in call.args)
        function = self._script_function(func.value)
        if function is not None:
            return self._returns_uniform(function, None)
        return False

    def _loader_length(self, expr, scope) -> bool:
        """`p` or `p.dataset` of a parameter `p` that holds DataLoaders only."""
        if type(expr) is cst.Attribute and expr.attr.value == "dataset":
            expr = expr.value
        if self.facts is None or self.facts.analysis is None or type(expr) is not cst.Name or scope is None \
                or expr.value not in parameter_names(scope):
            return False
        values = self.facts.analysis.flow.values(expr)
        loaders = {id(l.call) for l in self.facts.loaders} | set(self.facts.training_loader_calls)
        return bool(values) and all(id(v) in loaders for v in values)

    def _script_function(self, name: str) -> Optional[cst.FunctionDef]:
        """The script's top-level function `name` (bound once, as a def), when the facts are known."""
        if self.facts is None:
            return None
        nodes = self._scope_bindings().get((id(None), name), [])
        return nodes[0] if len(nodes) == 1 and type(nodes[0]) is cst.FunctionDef else None

    def _returns_uniform(self, function: cst.FunctionDef, index: Optional[int]) -> bool:
        """Every `return` of `function` gives a uniform value (element `index` of a returned tuple)."""
        key = (id(function), -1 if index is None else index)
        if key in self._returns:
            return self._returns[key]
        self._returns[key] = False  # recursion proves nothing
        returns = [r for r in self.r.descendants(function, cst.Return) if self.r.enclosing_function(r) is function]
        answer = bool(returns)
        for ret in returns:
            value = ret.value
            if value is None:
                answer = answer and index is None
                continue
            if index is not None:
                if type(value) not in (cst.Tuple, cst.List) or len(value.elements) <= index or any(
                        type(e) is not cst.Element for e in value.elements):
                    answer = False
                    break
                value = value.elements[index].value
            if not self._uniform(value, function):
                answer = False
                break
        self._returns[key] = answer
        return answer

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
            return self._parameter(scope, name)
        nodes = self._scope_bindings().get((id(scope), name))
        if not nodes:
            if scope is None:
                return False  # a builtin or a name from nowhere
            outer = self.r.enclosing_function(scope)
            return self._name(name, outer)  # a closure or global read
        return all(self._binding(node, name, scope) for node in nodes)

    def _parameter(self, fn, name: str) -> bool:
        """A parameter of one of the script's top-level functions that every call passes a uniform
        value (`go(args)` under `if __name__ == "__main__":`, `args = parser.parse_args()`): the
        arguments are followed by value (analysis/flow.py) and judged where they are passed. Only
        where the function's name is never read but to call it (no callback, no thread target,
        whose calls would not be seen)."""
        if self.facts is None or self.facts.analysis is None or type(fn) is not cst.FunctionDef:
            return False
        if self.r.enclosing_function(fn) is not None or self.r.enclosing_class(fn) is not None:
            return False
        if self._script_function(fn.name.value) is not fn or not self._only_called(fn):
            return False
        flow = self.facts.analysis.flow
        if not flow.bound_calls(fn):
            return False
        origins = flow.parameter_values(fn, name)
        return bool(origins) and all(
            isinstance(o, cst.BaseExpression) and self._uniform(o, self.r.enclosing_function(o)) for o in origins)

    def _only_called(self, fn: cst.FunctionDef) -> bool:
        """Every read of `fn`'s name is the callee of a call."""
        for node in self.r.nodes(cst.Name):
            if node.value != fn.name.value or node is fn.name:
                continue
            parent = self.r.parent(node)
            if not (type(parent) is cst.Call and parent.func is node):
                return False
        return True

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
            if type(value) is cst.Call and type(value.func) is cst.Name and not any(
                    type(e) is cst.StarredElement for e in target.elements):
                function = self._script_function(value.func.value)
                index = next((i for i, t in enumerate(elements) if type(t) is cst.Name and t.value == name), None)
                if function is not None and index is not None:
                    return self._returns_uniform(function, index)
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


class RankLocal:
    """`source(expr, at)`: where a value of one rank's own part of the data enters `expr`, read
    at `at`: the batch a loop over a split DataLoader binds, followed through the values read
    from it (the loss, a sum not combined over the ranks), assignments, unpacking and the returns
    of the script's functions; None when none is found. Where `RankUniform` proves a value the same
    on every rank, this finds the values known to differ: a condition that is neither is left
    alone (an evaluation over data every rank reads whole, a clock)."""

    def __init__(self, uniform: RankUniform, facts):
        self.u = uniform
        self.facts = facts
        self._known: Dict[Tuple[int, str], Optional[cst.CSTNode]] = {}
        self._returns: Dict[int, Optional[cst.CSTNode]] = {}
        self._split: Dict[int, bool] = {}
        self._bindings_seen: Dict[Tuple[int, str], Optional[cst.CSTNode]] = {}

    def source(self, expr: cst.BaseExpression, at: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self._expr(expr, self.u.r.enclosing_function(at))

    def _expr(self, expr, scope) -> Optional[cst.CSTNode]:
        if self.u._uniform(expr, scope):
            return None
        for node in _reads(expr):
            if type(node) is cst.Name:
                if reduced_after_loop(self.facts, scope, node.value, node):
                    continue
                loop = self._loop_binding(node, scope)
                found = self._bound(loop, node.value, scope) if loop is not None else self._name_at(node, scope)
            else:  # a call of a script function
                function = self.u._script_function(node.func.value)
                found = self._returned(function) if function is not None else None
            if found is not None:
                return found
        return None

    def _loop_binding(self, read: cst.Name, scope) -> Optional[cst.For]:
        """The innermost `for` around `read` (in its scope) whose target binds the name: inside the
        loop the name holds what that loop iterates, whatever else binds it elsewhere."""
        for a in self.u.r.ancestors(read):
            if a is scope or isinstance(a, cst.FunctionDef):
                return None
            if type(a) is cst.For and read.value in {n.value for n in walk_names(a.target)}:
                return a
        return None

    def _name_at(self, read: cst.Name, scope) -> Optional[cst.CSTNode]:
        """The bindings of the name that can reach `read`: those before it, and those after it in a
        loop around both (the next pass reads them); a closure's or global's: all of them."""
        r = self.u.r
        name = read.value
        if scope is not None and name in parameter_names(scope):
            return None
        nodes = self.u._scope_bindings().get((id(scope), name))
        if not nodes:
            return self._name(name, r.enclosing_function(scope)) if scope is not None else None
        loops = {id(a) for a in r.ancestors(read) if type(a) in (cst.For, cst.While)}
        for node in nodes:
            if r.order(node) > r.order(read) and not any(
                    id(a) in loops for a in r.ancestors(node) if type(a) in (cst.For, cst.While)):
                continue
            found = self._bound(node, name, scope)
            if found is not None:
                return found
        return None

    def _name(self, name: str, scope) -> Optional[cst.CSTNode]:
        """Every binding of `name` in `scope` (a read from an inner function: any may reach it)."""
        key = (id(scope), name)
        if key in self._known:
            return self._known[key]
        self._known[key] = None  # a cycle finds nothing more
        found = None
        if scope is None or name not in parameter_names(scope):
            nodes = self.u._scope_bindings().get((id(scope), name))
            if not nodes and scope is not None:
                found = self._name(name, self.u.r.enclosing_function(scope))
            for node in nodes or []:
                found = self._bound(node, name, scope)
                if found is not None:
                    break
        self._known[key] = found
        return found

    def _bound(self, node, name: str, scope) -> Optional[cst.CSTNode]:
        key = (id(node), name)
        if key in self._bindings_seen:
            return self._bindings_seen[key]
        self._bindings_seen[key] = None  # a cycle (`x = x + loss`) finds nothing more
        found = self._binding(node, name, scope)
        self._bindings_seen[key] = found
        return found

    def _binding(self, node, name: str, scope) -> Optional[cst.CSTNode]:
        if type(node) is cst.For and self._in_split_loop(node) and not self.u._loop_counter(node, name, scope):
            return node  # this rank's batch (not the step index `enumerate` counts: the same on every rank)
        kind = type(node)
        if kind in (cst.Assign, cst.AugAssign, cst.AnnAssign) and node.value is not None:
            return self._expr(node.value, scope)
        return None

    def _returned(self, function: cst.FunctionDef) -> Optional[cst.CSTNode]:
        if id(function) in self._returns:
            return self._returns[id(function)]
        self._returns[id(function)] = None
        found = None
        for ret in self.u.r.descendants(function, cst.Return):
            if ret.value is not None and self.u.r.enclosing_function(ret) is function:
                found = self._expr(ret.value, function)
                if found is not None:
                    break
        self._returns[id(function)] = found
        return found

    def _in_split_loop(self, node) -> bool:
        from fsdp2_retrofit.analysis.loop_sums import over_split_data

        for a in [node, *self.u.r.ancestors(node)]:
            if isinstance(a, cst.FunctionDef):
                return False
            if type(a) is cst.For:
                if id(a) not in self._split:
                    self._split[id(a)] = over_split_data(a, self.facts)
                if self._split[id(a)]:
                    return True
        return False


def walk_names(target) -> List[cst.Name]:
    """The names a `for` target binds."""
    if type(target) is cst.Name:
        return [target]
    if type(target) in (cst.Tuple, cst.List):
        return [n for e in target.elements for n in walk_names(e.value)]
    if type(target) is cst.StarredElement:
        return walk_names(target.value)
    return []


def _reads(expr) -> List[cst.CSTNode]:
    """The names an expression reads (not attribute names, not keywords) and the calls of
    plain names in it, in source order."""
    out: List[cst.CSTNode] = []

    def visit(node):
        if type(node) is cst.Name:
            out.append(node)
            return
        if type(node) is cst.Attribute:
            visit(node.value)
            return
        if type(node) is cst.Call and type(node.func) is cst.Name:
            out.append(node)
        if type(node) is cst.Arg:
            visit(node.value)
            return
        for child in node.children:
            visit(child)

    visit(expr)
    return out
