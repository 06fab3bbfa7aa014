"""A test that runs after some statements, written so that it can run before them.

Gradient accumulation often counts micro-batches after backward():

    loss.backward()
    micro += 1
    if micro % accum == 0:
        optimizer.step()

`set_requires_gradient_sync(...)` must be called before backward(), where `micro` still
holds its old value. `before(test, between)` gives the test as it reads with the
statements `between` undone: each assignment to something the test reads, last first, is
substituted into it (`micro += 1` makes `micro` read `(micro + 1)`), so the result,
evaluated before those statements, has the value the test has after them.

Only what evaluates to the same value twice is substituted: names, attributes, numbers
and strings, arithmetic, comparisons, `and`/`or`/`not`, a constant subscript, and
`len`/`int`/`min`/`max`/`abs`/`bool` of such. Anything else that writes what the test
reads (a call's value, an assignment inside an `if` or a loop, a tuple unpacking, a method
of the object whose attribute the test reads) is not guessed: the reason says which
statement and why.
"""
from __future__ import annotations

from typing import Iterable, List, NamedTuple, Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import attr_path, code, walk

_PURE_BUILTINS = frozenset({"len", "int", "min", "max", "abs", "bool"})
_ATOMS = (cst.Name, cst.Attribute, cst.Integer, cst.Float, cst.SimpleString, cst.Call, cst.Subscript)


class Ahead(NamedTuple):
    text: Optional[str]  # the test to evaluate before the statements, or None
    why: str = ""  # why not, when text is None
    used: Tuple[str, ...] = ()  # the assignments substituted into it (their first lines), in order


def before(test: cst.BaseExpression, between: Iterable[cst.CSTNode]) -> Ahead:
    """`test` to evaluate before the statements `between` (in the order they run), or why
    it cannot be. The text is `code(test)` when none of them writes what the test reads."""
    expr = test
    used: List[str] = []
    for stmt in reversed(list(between)):
        read = places(expr)
        written = _written(stmt)
        hit = sorted(read & set(written))
        if not hit:
            mutated = _mutating_call(stmt, read)
            if mutated:
                return Ahead(None, f"`{_line(stmt)}` may change `{mutated}` (a call on its object)")
            continue
        named = ", ".join(f"`{h}`" for h in hit)
        if not isinstance(stmt, cst.SimpleStatementLine):
            return Ahead(None, f"{named} is assigned inside `{_line(stmt)}`, which may or may not run")
        single = _single_assignment(stmt)
        if single is None or single[0] not in read or len(written) != 1:
            return Ahead(None, f"`{_line(stmt)}` changes {named} in a way not computed ahead here")
        place, value = single
        if not _pure(value):
            return Ahead(None, f"`{_line(stmt)}` gives `{place}` a value that may differ when computed earlier")
        expr = _substitute(expr, place, value)
        used.insert(0, _line(stmt))
    return Ahead(code(expr), "", tuple(used))


def statements_between(first: cst.CSTNode, last: cst.CSTNode, r) -> Tuple[Optional[list], str]:
    """The statements that run after statement `first` and before `last` (a statement or
    an `if` whose test is asked about) of the same loop iteration, in order: those after
    `first` in its block and the blocks around it (out of a `with`, an `if` or a `try`),
    then, down to `last`, those before it in each block that holds it. None, with why, when
    `first` sits in a loop that does not hold `last` (its statements run several times)
    or in a function `last` is not in."""
    out: list = []
    node = first
    while not _holds(r.block_of(node), last, r):
        block = r.block_of(node)
        if block is None or isinstance(block, cst.Module):
            return None, "the test is not in the block of backward() or around it"
        body = list(block.body)
        out += body[body.index(node) + 1:]
        owner = r.statement_of(block)
        if isinstance(owner, (cst.For, cst.While, cst.FunctionDef, cst.ClassDef)):
            return None, f"backward() runs in `{_line(owner)}`, which does not hold the test"
        node = owner
    block = r.block_of(node)
    while True:
        body = list(block.body)
        holder = next(s for s in body if s is last or _inside(last, s, r))
        start = body.index(node) + 1 if node in body else 0
        out += body[start:body.index(holder)]
        if holder is last:
            return out, ""
        inner = next((b for b in r.descendants(holder, cst.IndentedBlock)
                      if _holds(b, last, r) and r.statement_of(b) is holder), None)
        if inner is None:  # `if a: ... elif gate`: the test of an `elif` is an `If` of its own
            return out, ""
        block, node = inner, None


def _holds(block, node, r) -> bool:
    return block is not None and any(a is block for a in r.ancestors(node))


def _inside(node, outer, r) -> bool:
    return node is outer or any(a is outer for a in r.ancestors(node))


def places(expr: cst.CSTNode) -> set:
    """What `expr` reads: bare names and dotted attribute paths (`micro`, `self.micro`,
    `args.accum`), each dotted path with every prefix of it."""
    nodes = walk(expr)
    skip = _not_read(nodes)
    found = set()
    for node in nodes:
        if isinstance(node, (cst.Name, cst.Attribute)) and id(node) not in skip:
            dotted = _dotted(node)
            if dotted is not None:
                found.add(dotted)
    return found


def _not_read(nodes) -> set:
    """The ids of the Names among `nodes` that are no reads: attribute names (`micro` of
    `self.micro`) and keywords."""
    skip = set()
    for node in nodes:
        if isinstance(node, cst.Attribute):
            skip.add(id(node.attr))
        elif isinstance(node, cst.Arg) and node.keyword is not None:
            skip.add(id(node.keyword))
    return skip


def _dotted(node) -> Optional[str]:
    path = attr_path(node)
    return ".".join(path) if path else None


def _written(stmt: cst.CSTNode) -> List[str]:
    """The names and attribute paths `stmt` assigns anywhere inside it (loop targets,
    `with ... as`, `:=` included)."""
    out: List[str] = []
    for node in walk(stmt):
        if isinstance(node, cst.Assign):
            targets = [t.target for t in node.targets]
        elif isinstance(node, (cst.AugAssign, cst.AnnAssign, cst.NamedExpr)):
            targets = [node.target]
        elif isinstance(node, (cst.For, cst.CompFor)):
            targets = [node.target]
        elif isinstance(node, cst.AsName):
            targets = [node.name]
        else:
            continue
        for target in targets:
            for el in _flatten(target):
                while isinstance(el, cst.Subscript):  # `counts["micro"] += 1` changes `counts`
                    el = el.value
                dotted = _dotted(el)
                if dotted is not None:
                    out.append(dotted)
    return out


def _flatten(target):
    if isinstance(target, (cst.Tuple, cst.List)):
        for el in target.elements:
            yield from _flatten(el.value)
    elif isinstance(target, cst.StarredElement):
        yield from _flatten(target.value)
    else:
        yield target


def _single_assignment(stmt) -> Optional[Tuple[str, cst.BaseExpression]]:
    """(the place, the value it holds after `stmt`) for `x = e`, `x += e` (any augmented
    operator), `self.x = e` as the whole of a simple statement line."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        place = _dotted(small.targets[0].target)
        return (place, small.value) if place is not None else None
    if isinstance(small, cst.AnnAssign) and small.value is not None:
        place = _dotted(small.target)
        return (place, small.value) if place is not None else None
    if isinstance(small, cst.AugAssign):
        place = _dotted(small.target)
        if place is None:
            return None
        operator = code(small.operator).strip()[:-1]  # `+=` -> `+`, `//=` -> `//`
        return place, cst.parse_expression(f"{code(small.target)} {operator} ({code(small.value)})"
                                           if not isinstance(small.value, _ATOMS) else
                                           f"{code(small.target)} {operator} {code(small.value)}")
    return None


def _pure(expr: cst.CSTNode) -> bool:
    """`expr` evaluates to the same value before and after statements that do not write
    what it reads, and evaluating it changes nothing."""
    for node in walk(expr):
        if isinstance(node, cst.Call):
            if not (isinstance(node.func, cst.Name) and node.func.value in _PURE_BUILTINS):
                return False
        elif isinstance(node, cst.Subscript):
            if not all(isinstance(e.slice, cst.Index) and isinstance(e.slice.value, (cst.Integer, cst.SimpleString))
                       for e in node.slice):
                return False
        elif isinstance(node, (cst.Lambda, cst.Await, cst.Yield, cst.NamedExpr, cst.FormattedString,
                               cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)):
            return False
    return True


def _mutating_call(stmt, read: set) -> Optional[str]:
    """A place the test reads that `stmt` may change without assigning it, or None: it
    calls a method of the place or of an object the place is an attribute of (`buf.append(x)`
    changes `len(buf)`, `self.bump()` may change `self.micro`), or hands such an object to a
    call (`bump(self)`). A bare name handed to a call (`print(micro)`) is not changed."""
    methods, objects = {}, {}
    for place in sorted(read, key=len, reverse=True):
        parts = place.split(".")
        for n in range(1, len(parts) + 1):
            methods.setdefault(".".join(parts[:n]), place)
        for n in range(1, len(parts)):
            objects.setdefault(".".join(parts[:n]), place)
    for node in walk(stmt):
        if not isinstance(node, cst.Call):
            continue
        if isinstance(node.func, cst.Attribute) and _dotted(node.func.value) in methods:
            return methods[_dotted(node.func.value)]
        for arg in node.args:
            if _dotted(arg.value) in objects:
                return objects[_dotted(arg.value)]
    return None


def _substitute(expr: cst.BaseExpression, place: str, value: cst.BaseExpression) -> cst.BaseExpression:
    """`expr` with every read of `place` replaced by `value` (parenthesised unless atomic)."""
    text = code(value)
    replacement = cst.parse_expression(text if isinstance(value, _ATOMS) else f"({text})")

    skip = _not_read(walk(expr))  # `micro` of `x.micro` is a Name too: only whole places are swapped

    class _Swap(cst.CSTTransformer):
        def leave_Name(self, original, updated):
            return replacement if original.value == place and id(original) not in skip else updated

        def leave_Attribute(self, original, updated):
            return replacement if _dotted(original) == place else updated

    if isinstance(expr, (cst.Name, cst.Attribute)) and _dotted(expr) == place:
        return cst.parse_expression(text)  # the whole test: no parentheses
    return expr.visit(_Swap())


def _line(stmt) -> str:
    return code(stmt).splitlines()[0] if code(stmt) else ""
