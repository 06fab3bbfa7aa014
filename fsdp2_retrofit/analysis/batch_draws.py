"""Batches a script draws itself, without a DataLoader: what the rewrite can split by rank.

Two shapes are recognised, each only where the analysis sees the whole draw:

- a *random draw*: a function binds `ix = torch.randint(high, (B,) ...)` (one draw, the
  global RNG or a `generator=`) and returns tensors whose rows are picked by `ix`
  (`torch.stack([data[i:i + T] for i in ix])`, `data[ix]`, then `.to(device)`,
  `.pin_memory()` ...; the slices may first be bound to a list, `seqs = [data[i:i + T] for i
  in ix]`, then stacked, `torch.stack(seqs)`, or joined along dim 0 with a leading axis,
  `torch.cat([s[None, :] for s in seqs])`): row k of every returned tensor depends on `ix[k]` alone, so a rank
  that keeps rows [rank * B // W, (rank + 1) * B // W) of the batch every rank drew trains
  on its part of the single run's batch. Every rank draws the same batch only where
  every seed call of the script takes a rank-uniform value (analysis/rank_uniform.py);
- a *position counter*: a method of one of the script's classes reads
  `data[self.pos:self.pos + ...]`, advances `self.pos += K` once, and resets it to 0 under
  an `if` that tests whether the next read fits; `self.pos` is read nowhere else. The
  counter can stay the global position: rank r reads at `self.pos + r * K`, the counter
  advances by `W * K`, and the test asks about the last rank's read;
- a *slice loop*: a training loop `for K in range(N):` cuts the batches out of whole tensors
  by hand, `data[K * B:(K + 1) * B]` (the bounds inline or bound to names in the loop's body:
  `start, end = K * B, (K + 1) * B`, `end = start + B`), N is `rows // B` (every batch full),
  and nothing else reads K: rank r can run the batches K = r, r + W, ... (each rank the same
  number of them), or keep its part of each batch.

The calls of these functions are sorted into training calls (in a function, or the
module, that calls backward(), outside `torch.no_grad()`) and the others (evaluation).
Everything is followed by value: calls through analysis/flow.py, the draw's index and the
returned tensors through their bindings, never through their spelling.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import libcst as cst

from fsdp2_retrofit.analysis.batch_size import short_code
from fsdp2_retrofit.analysis.rank_uniform import RankUniform
from fsdp2_retrofit.analysis.sibling_loaders import sibling_loaders
from fsdp2_retrofit.syntax.names import code, walk
from fsdp2_retrofit.syntax.torch_api import GET_RANK, GET_WORLD_SIZE, NO_GRAD as _NO_GRAD, RANDINT, ROW_CONCATS, ROW_STACKS

# methods of a tensor that keep its rows where they are
_ROW_KEEPING = frozenset({"to", "pin_memory", "cuda", "cpu", "long", "float", "int", "contiguous", "astype",
                          "clone", "detach"})


@dataclass
class RandomDraw:
    function: cst.FunctionDef
    draw: cst.Call  # torch.randint(...)
    size: cst.BaseExpression  # B of `(B,)`
    outputs: int  # the number of tensors returned (1: a bare tensor)


@dataclass
class PositionCounter:
    cls: cst.ClassDef
    method: cst.FunctionDef
    attr: str  # `pos` of self.pos
    reads: List[cst.Attribute]  # the `self.pos` read inside the data subscript
    advance: cst.AugAssign  # `self.pos += K`
    checks: List[cst.Attribute]  # the `self.pos` read in the if tests that reset it
    outputs: int


@dataclass
class SliceLoop:
    loop: cst.For  # `for K in range(N):`, the loop that trains
    count: cst.BaseExpression  # N
    size: cst.BaseExpression  # B, as the first slice spells it
    # the slices `data[L:U]` whose bounds are K * B and (K + 1) * B
    slices: List[cst.Slice]
    # (the last loop-body statement binding them, L, U) for bounds read through names bound in
    # the loop's body (`start, end = k * B, (k + 1) * B`), each pair once
    named: List[Tuple[cst.CSTNode, str, str]]
    inline: List[cst.Slice]  # the slices whose bounds are not such a pair of names
    sums: List[cst.AugAssign]  # `cost += ...` in the loop's body: each rank adds up its own batches


Source = Union[RandomDraw, PositionCounter]


@dataclass
class BatchCall:
    call: cst.Call
    stmt: cst.CSTNode  # the statement binding its result
    targets: List[str]  # the names it binds, in order ([] where it is not bound to names)
    training: Optional[bool]  # None: neither a training step (backward()) nor evaluation (torch.no_grad()) is seen
    source: Source


@dataclass
class HandBatches:
    draws: List[RandomDraw] = field(default_factory=list)
    counters: List[PositionCounter] = field(default_factory=list)
    slice_loops: List[SliceLoop] = field(default_factory=list)
    # (node, why, loop): a loop that slices batches by hand in a way the rewrite cannot split
    slice_flags: List[Tuple[cst.CSTNode, str, cst.For]] = field(default_factory=list)
    calls: List[BatchCall] = field(default_factory=list)
    # (node, why): a draw the rewrite sees but cannot split, with its reason
    unclear: List[Tuple[cst.CSTNode, str]] = field(default_factory=list)
    # (seed call, why) where the ranks would not draw alike
    seeds: List[Tuple[cst.CSTNode, str]] = field(default_factory=list)

    @property
    def found(self) -> bool:
        """A draw or a counter: the batches of the script's training loops come from it."""
        return bool(self.draws or self.counters or self.unclear)

    def splits(self, loop) -> bool:
        """`loop` is a slice loop the rewrite splits between the ranks."""
        return any(s.loop is loop for s in self.slice_loops)

    def handles(self, loop) -> bool:
        """`loop` is a slice loop: split, or flagged with its reason."""
        return self.splits(loop) or any(f[2] is loop for f in self.slice_flags)


def hand_drawn_batches(facts) -> HandBatches:
    """The batches the script draws itself (see the module's docstring), found once per facts."""
    known = getattr(facts, "_hand_batches", None)
    if known is None:
        known = _Finder(facts).run()
        object.__setattr__(facts, "_hand_batches", known)
    return known


class _Finder:
    def __init__(self, facts):
        self.facts = facts
        self.r = facts.resolver
        self.flow = facts.analysis.flow if facts.analysis is not None else None
        self.out = HandBatches()

    def run(self) -> HandBatches:
        if self.flow is None or not self.facts.loops:
            return self.out
        for call in self.r.nodes(cst.Call):
            if self.r.qnames(call) & RANDINT:
                self._random_draw(call)
        for cls in self.r.nodes(cst.ClassDef):
            if self.r.enclosing_function(cls) is None and not self.facts.classes.is_module_class(cls.name.value):
                self._position_counter(cls)
        for site in self.facts.loops:
            if isinstance(site.node, cst.For):
                self._slice_loop(site.node)
        if self.out.draws:
            self._seeds()
        for source in [*self.out.draws, *self.out.counters]:
            self._calls(source)
        if self.out.unclear and self._loader_trains():
            # the training batches come from a DataLoader (the data stage splits it): a draw the
            # rewrite cannot read as a batch is then something else (a diffusion model's timesteps)
            self.out.unclear = []
        return self.out

    def _loader_trains(self) -> bool:
        """A DataLoader of the script, or one a helper of a sibling module builds for a call of
        the script, feeds a training loop."""
        if any(loader.trains for loader in self.facts.loaders):
            return True
        return any(self.facts.analysis.loop_fed_by(found.call) is not None
                   for found in sibling_loaders(self.r, self.facts.classes))

    # -- random draws ------------------------------------------------------

    def _random_draw(self, call: cst.Call) -> None:
        fn = self.r.enclosing_function(call)
        stmt = self.r.statement_of(call)
        if fn is None or not _returns(fn):
            return  # drawn where no function hands a batch back: the data stage's flag
        if self._splits_by_rank(fn):
            return  # the function already draws per rank (a retrofitted script)
        where = f"`{code(call)}` (line {self.r.line(call)})"
        small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
        if not (isinstance(small, cst.Assign) and len(small.targets) == 1 and small.value is call
                and isinstance(small.targets[0].target, cst.Name)):
            self._unclear(call, f"the draw {where} is not bound to a name of its own (`ix = torch.randint(...)`)")
            return
        ix = small.targets[0].target.value
        size = _draw_size(call)
        if size is None:
            self._unclear(call, f"the draw {where} has no size of the form `(B,)`")
            return
        if len(self._bindings(fn, ix)) != 1:
            self._unclear(call, f"`{ix}`, the draw {where}, is bound again in {fn.name.value}()")
            return
        returns = [n for n in walk(fn.body) if isinstance(n, cst.Return) and self.r.enclosing_function(n) is fn]
        if len(returns) != 1 or returns[0].value is None:
            self._unclear(call, f"{fn.name.value}() does not end in one `return` of the batch tensors")
            return
        value = returns[0].value
        names = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else [value]
        for name in names:
            if not (isinstance(name, cst.Name) and self._by_rows(fn, name.value, ix, set())):
                self._unclear(
                    returns[0],
                    f"`{code(name)}`, returned by {fn.name.value}(), is not made of rows picked by the draw {where} "
                    "(`torch.stack([data[i:i + T] for i in ix])`, `data[ix]`): the rewrite cannot split it by rank",
                )
                return
        self.out.draws.append(RandomDraw(fn, call, size, len(names) if isinstance(value, cst.Tuple) else 1))

    def _splits_by_rank(self, node) -> bool:
        """`node` asks for the rank or the world size (`dist.get_rank()`, `dist.get_world_size()`)."""
        return any(isinstance(n, cst.Call) and self.r.qnames(n) & (GET_RANK | GET_WORLD_SIZE) for n in walk(node))

    def _bindings(self, fn: Optional[cst.FunctionDef], name: str, within=None
                  ) -> List[Tuple[cst.CSTNode, Optional[cst.BaseExpression]]]:
        """(statement, value) for each binding of `name` in `fn` (None: a value not seen element by
        element); `within`: only those inside that node, `fn`'s parameters left out."""
        found = []
        for node in walk(within if within is not None else fn.body):
            if self.r.enclosing_function(node) is not fn:
                continue
            if isinstance(node, cst.Assign):
                for t in node.targets:
                    found.extend((node, v) for v in _bound_values(t.target, node.value, name))
            elif isinstance(node, (cst.AugAssign, cst.AnnAssign)) and isinstance(node.target, cst.Name) \
                    and node.target.value == name:
                found.append((node, None))
            elif isinstance(node, (cst.For, cst.CompFor)) and name in _target_names(node.target) \
                    and not isinstance(node, cst.CompFor):
                found.append((node, None))
            elif isinstance(node, (cst.WithItem,)) and node.asname is not None and name in _target_names(node.asname.name):
                found.append((node, None))
        if within is not None or fn is None:
            return found
        params = {p.name.value for p in [*fn.params.params, *fn.params.kwonly_params, *fn.params.posonly_params]}
        if name in params:
            found.append((fn, None))
        return found

    def _by_rows(self, fn, name: str, ix: str, seen: set) -> bool:
        """Every binding of `name` in `fn` is a tensor whose rows the draw `ix` picks."""
        if name in seen:
            return True  # `x = x.to(device)`: the other bindings decide
        seen = seen | {name}
        bindings = self._bindings(fn, name)
        return bool(bindings) and all(v is not None and self._rows(fn, v, ix, seen) for _, v in bindings)

    def _rows(self, fn, expr, ix: str, seen: set) -> bool:
        if isinstance(expr, cst.Name):
            return expr.value != ix and self._by_rows(fn, expr.value, ix, seen)
        if isinstance(expr, cst.Subscript):  # data[ix]
            return (len(expr.slice) == 1 and isinstance(expr.slice[0].slice, cst.Index)
                    and isinstance(expr.slice[0].slice.value, cst.Name) and expr.slice[0].slice.value.value == ix)
        if not isinstance(expr, cst.Call):
            return False
        func = expr.func
        if isinstance(func, cst.Attribute) and func.attr.value in _ROW_KEEPING:
            return self._rows(fn, func.value, ix, seen)
        if self.r.qnames(expr) & ROW_STACKS and expr.args and not expr.args[0].keyword:
            first = expr.args[0].value
            if isinstance(first, (cst.ListComp, cst.GeneratorExp)):  # [data[i:i + T] for i in ix]
                comp = first.for_in
                return comp.inner_for_in is None and not comp.ifs and self._one_per_index(fn, comp.iter, ix)
            if isinstance(first, cst.Name) and first.value != ix and self._one_per_index(fn, first, ix):
                return True  # torch.stack(seqs), seqs = [data[i:i + T] for i in ix]
            return self._rows(fn, first, ix, seen)
        if self.r.qnames(expr) & ROW_CONCATS and expr.args and not expr.args[0].keyword and _along_rows(expr):
            first = expr.args[0].value  # torch.cat([s[None, :] for s in seqs], dim=0): one row per element
            if isinstance(first, (cst.ListComp, cst.GeneratorExp)):
                comp = first.for_in
                return (comp.inner_for_in is None and not comp.ifs and isinstance(comp.target, cst.Name)
                        and _one_row_of(first.elt, comp.target.value) and self._one_per_index(fn, comp.iter, ix))
        return False

    def _one_per_index(self, fn, items, ix: str) -> bool:
        """`items` is the draw `ix` itself, or a list `fn` binds once to `[f(i) for i in ix]` and
        only reads whole (a comprehension over it, a stack): element k belongs to `ix[k]`."""
        if not isinstance(items, cst.Name):
            return False
        if items.value == ix:
            return True
        bindings = self._bindings(fn, items.value)
        if len(bindings) != 1 or not isinstance(bindings[0][1], cst.ListComp):
            return False
        comp = bindings[0][1].for_in
        if not (comp.inner_for_in is None and not comp.ifs and isinstance(comp.iter, cst.Name)
                and comp.iter.value == ix):
            return False
        for node in walk(fn.body):  # `seqs.sort()`, `seqs[0] = ...`, `seqs[::-1]`: the order may change
            if isinstance(node, (cst.Attribute, cst.Subscript)) and isinstance(node.value, cst.Name) \
                    and node.value.value == items.value and self.r.enclosing_function(node) is fn:
                return False
        return True

    def _seeds(self) -> None:
        """Seed calls whose value may differ between ranks (then the ranks draw different batches)."""
        uniform = RankUniform(self.r, facts=self.facts)
        for call in self.r.nodes(cst.Call):
            func = call.func
            name = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else None
            if name not in ("manual_seed", "seed", "manual_seed_all"):
                continue
            if not call.args:
                if name == "seed":
                    self.out.seeds.append((call, f"`{code(call)}` (line {self.r.line(call)}) seeds each process "
                                                 "from the clock"))
                continue
            if not all(uniform.condition(a.value, call) for a in call.args):
                self.out.seeds.append((call, f"the seed `{code(call)}` (line {self.r.line(call)}) may differ "
                                             "between ranks"))

    # -- position counters -------------------------------------------------

    def _position_counter(self, cls: cst.ClassDef) -> None:
        for method in [s for s in cls.body.body if isinstance(s, cst.FunctionDef)]:
            advances = [n for n in walk(method.body) if isinstance(n, cst.AugAssign)
                        and isinstance(n.operator, cst.AddAssign) and _self_attr(n.target) is not None]
            if advances and self._splits_by_rank(method):
                return  # the counter already reads per rank (a retrofitted script)
            for advance in advances:
                attr = _self_attr(advance.target)
                reads = [n for n in walk(method.body) if isinstance(n, cst.Subscript) and _reads_from(n, attr)]
                if len(reads) != 1:
                    continue
                self._counter(cls, method, attr, advance, reads[0])
                return

    def _counter(self, cls, method, attr: str, advance: cst.AugAssign, read: cst.Subscript) -> None:
        where = f"`self.{attr}` of {cls.name.value} (advanced at line {self.r.line(advance)})"
        if sum(1 for n in walk(method.body) if isinstance(n, cst.AugAssign) and _self_attr(n.target) == attr) != 1:
            self._unclear(advance, f"{where} is advanced more than once in {method.name.value}()")
            return
        in_read = {id(n) for n in walk(read) if _self_attr(n) == attr}
        checks = []
        for node in walk(cls):
            if _self_attr(node) != attr or id(node) in in_read or node is advance.target:
                continue
            parent = self.r.parent(node)
            if isinstance(parent, cst.AssignTarget) and isinstance(self.r.parent(parent).value, cst.Integer) \
                    and self.r.parent(parent).value.value == "0":
                continue  # `self.pos = 0`: the start, and the reset
            test = _reset_test(node, attr, self.r)
            if test is not None and self.r.enclosing_function(node) is method:
                checks.append(node)
                continue
            self._unclear(node, f"{where} is also read or set at line {self.r.line(node)} (`{code(self.r.statement_of(node))}`"
                                "): the rewrite splits only a counter it sees whole")
            return
        for node in self.r.nodes(cst.Attribute):  # read from outside the class: a log, a checkpoint
            if node.attr.value == attr and self.r.enclosing_class(node) is not cls:
                self._unclear(node, f"{where} is also read at line {self.r.line(node)}: the rewrite splits only "
                                    "a counter it sees whole")
                return
        late = self._bound_after(method, advance.value, read)
        if late is not None:
            self._unclear(advance, f"`{code(advance.value)}`, the step of {where}, reads `{late}`, bound after the "
                                   f"read at line {self.r.line(read)}")
            return
        returns = [n for n in walk(method.body) if isinstance(n, cst.Return) and self.r.enclosing_function(n) is method]
        if len(returns) != 1 or returns[0].value is None:
            self._unclear(advance, f"{method.name.value}() does not end in one `return` of the batch tensors")
            return
        value = returns[0].value
        outputs = len(value.elements) if isinstance(value, cst.Tuple) else 1
        self.out.counters.append(PositionCounter(cls, method, attr, [n for n in walk(read) if _self_attr(n) == attr],
                                                 advance, checks, outputs))

    def _bound_after(self, method, step, read) -> Optional[str]:
        """A name the step reads that the method binds after the data read (or in it)."""
        at = self.r.order(self.r.statement_of(read))
        for name in sorted(_target_names(step) - {"self"}):
            for node, _ in self._bindings(method, name):
                if node is not method and self.r.order(node) >= at:
                    return name
        return None

    # -- slice loops -------------------------------------------------------

    def _slice_loop(self, loop: cst.For) -> None:
        """`for K in range(N):` training on `data[K * B:(K + 1) * B]` (see the module's docstring)."""
        it = loop.iter
        if not (isinstance(loop.target, cst.Name) and isinstance(it, cst.Call) and "builtins.range" in self.r.qnames(it)
                and len(it.args) == 1 and it.args[0].keyword is None and not it.args[0].star):
            return
        matched = self._bounded_slices(loop)
        if not matched:
            return  # no batch cut by the index: not this shape (the data stage's flag)
        if self._under_no_grad(loop) or self._reads_rank(loop, matched):
            return  # evaluation; or a loop that splits by rank already (a retrofitted script)
        index = loop.target.value
        where = f"`for {index} in {code(it)}` (line {self.r.line(loop)})"
        size = matched[0][1]
        for piece, b, _ in matched[1:]:
            if not self._same(b, size):
                self._slice_flag(piece, loop, f"{where} cuts batches of `{code(size)}` and of `{code(b)}` rows: the "
                                              "rewrite splits only batches of one size")
                return
        late = self._bound_in(loop, size)
        if late is not None:
            self._slice_flag(loop, loop, f"`{code(size)}`, the batch size of {where}, reads `{late}`, bound in the "
                                         "loop: the rewrite splits only batches of one size")
            return
        exempt = {id(n) for _, _, through in matched for expr in through for n in walk(expr)}
        for read in self._index_reads(loop):
            if id(read) not in exempt:
                stmt = self.r.statement_of(read)
                self._slice_flag(read, loop, f"`{index}`, the batch index of {where}, is also read at line "
                                             f"{self.r.line(read)} (`{short_code(stmt)}`), not only in the bounds "
                                             f"`{index} * {code(size)}`, `({index} + 1) * {code(size)}`: split "
                                             "between the ranks, it would change")
                return
        count = it.args[0].value
        whole = self.flow.values(count)
        if not whole or not all(isinstance(v, cst.BinaryOperation) and isinstance(v.operator, cst.FloorDivide)
                                and self._same(v.right, size) for v in whole):
            self._slice_flag(count, loop, f"{where} counts `{code(count)}` batches, not `rows // {code(size)}`: a "
                                          "last batch shorter than the others would fall to one rank")
            return
        named: List[Tuple[cst.CSTNode, str, str]] = []
        inline: List[cst.Slice] = []
        for piece, _, _ in matched:
            pair = self._named_pair(loop, piece)
            if pair is None:
                inline.append(piece)
            elif all(p[1:] != pair[1:] for p in named):
                named.append(pair)
        if any(n in {name for p in named for name in p[1:]} for piece in inline for n in _target_names(piece)):
            named, inline = [], [m[0] for m in matched]  # `x[start:start + B]` beside `y[start:end]`: rebound
            # names would move the inline bounds twice (--keep-global-batch): every slice is edited in place
        sums = [n for n in walk(loop.body) if isinstance(n, cst.AugAssign) and isinstance(n.target, cst.Name)
                and self.r.enclosing_function(n) is self.r.enclosing_function(loop)]
        self.out.slice_loops.append(SliceLoop(loop, count, size, [m[0] for m in matched], named, inline, sums))

    def _bounded_slices(self, loop: cst.For) -> List[Tuple[cst.Slice, cst.BaseExpression, List[cst.CSTNode]]]:
        """(slice, B, the expressions its bounds were found in) for each `data[L:U]` of the loop's body
        whose bounds are K * B and (K + 1) * B (K the loop's index), by value."""
        fn = self.r.enclosing_function(loop)
        found = []
        for piece in walk(loop.body):
            if not isinstance(piece, cst.Slice) or piece.lower is None or piece.upper is None \
                    or piece.step is not None or self.r.enclosing_function(piece) is not fn:
                continue
            lower = self._bound_form(loop, piece.lower, 0)
            upper = self._bound_form(loop, piece.upper, 0)
            if lower and upper and lower[0] == "lower" and upper[0] == "upper" and self._same(lower[1], upper[1]):
                found.append((piece, lower[1], lower[2] + upper[2]))
        return found

    def _bound_form(self, loop: cst.For, expr, depth: int):
        """("lower", B, through) for K * B or B * K; ("upper", B, through) for (K + 1) * B,
        B * (K + 1) or L + B (L a lower bound); through a name bound once in the loop's body
        before it is read; `through`: the expressions read on the way. None otherwise."""
        if depth > 4:
            return None
        if isinstance(expr, cst.Name) and not self._is_index(loop, expr):
            value = self._bound_before(loop, expr)
            found = self._bound_form(loop, value, depth + 1) if value is not None else None
            return (found[0], found[1], [expr, *found[2]]) if found else None
        if not isinstance(expr, cst.BinaryOperation) or expr.lpar:
            return None
        left, right = expr.left, expr.right
        if isinstance(expr.operator, cst.Multiply):
            for k, b in ((left, right), (right, left)):
                if self._is_index(loop, k) and self._size(loop, b):
                    return ("lower", b, [expr])
                if self._index_plus_one(loop, k) and self._size(loop, b):
                    return ("upper", b, [expr])
        if isinstance(expr.operator, cst.Add):
            for low, b in ((left, right), (right, left)):
                found = self._bound_form(loop, low, depth + 1)
                if found and found[0] == "lower" and self._same(found[1], b):
                    return ("upper", b, [expr, *found[2]])
        return None

    def _is_index(self, loop: cst.For, expr) -> bool:
        return isinstance(expr, cst.Name) and self.flow.values(expr) == frozenset([loop])

    def _index_plus_one(self, loop: cst.For, expr) -> bool:
        """`(K + 1)` or `(1 + K)`."""
        if not (isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add)):
            return False
        return any(self._is_index(loop, k) and isinstance(one, cst.Integer) and one.value == "1"
                   for k, one in ((expr.left, expr.right), (expr.right, expr.left)))

    def _size(self, loop: cst.For, expr) -> bool:
        """A batch size: a number, a name or an attribute of names, or a product of them, not the index."""
        if isinstance(expr, cst.Integer) or (isinstance(expr, cst.Name) and not self._is_index(loop, expr)):
            return True
        if isinstance(expr, cst.Attribute):  # args.batch_size, self.cfg.batch_size
            return isinstance(expr.value, (cst.Name, cst.Attribute)) and self._size(loop, expr.value)
        return (isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply)
                and self._size(loop, expr.left) and self._size(loop, expr.right))

    def _same(self, a, b) -> bool:
        """`a` and `b` are the same batch size: spelled alike in one scope, or holding the same values."""
        return code(a) == code(b) or (isinstance(a, cst.Name) and isinstance(b, cst.Name)
                                      and self.flow.values(a) == self.flow.values(b))

    def _bound_before(self, loop: cst.For, name: cst.Name):
        """The value of `name`'s one binding in the loop's body, a statement of the body itself that
        runs before the one reading `name` (None where it is bound otherwise or elsewhere in the loop)."""
        fn = self.r.enclosing_function(loop)
        bindings = [node for node, _ in self._bindings(fn, name.value, within=loop.body)]
        if len(bindings) != 1:
            return None
        stmt = self.r.statement_of(bindings[0])
        reader = self._body_statement(loop, name)
        body = list(loop.body.body)
        if stmt not in body or reader is None or body.index(stmt) >= body.index(reader):
            return None
        values = [v for _, v in self._bindings(fn, name.value, within=stmt)]
        return values[0] if len(values) == 1 else None

    def _body_statement(self, loop: cst.For, node):
        """The statement of the loop's body that holds `node`."""
        for up in [node, *self.r.ancestors(node)]:
            if self.r.parent(up) is loop.body:
                return up
        return None

    def _named_pair(self, loop: cst.For, piece: cst.Slice) -> Optional[Tuple[cst.CSTNode, str, str]]:
        """(the later statement binding them, L, U) for `data[L:U]` with both bounds names."""
        if not (isinstance(piece.lower, cst.Name) and isinstance(piece.upper, cst.Name)):
            return None
        fn = self.r.enclosing_function(loop)
        stmts = [self.r.statement_of(node) for n in (piece.lower, piece.upper)
                 for node, _ in self._bindings(fn, n.value, within=loop.body)]
        last = max(stmts, key=self.r.order)
        return last, piece.lower.value, piece.upper.value

    def _bound_in(self, loop: cst.For, expr) -> Optional[str]:
        """A name `expr` reads that the loop binds (its index included)."""
        fn = self.r.enclosing_function(loop)
        for name in sorted(_target_names(expr)):
            if name in _target_names(loop.target) or self._bindings(fn, name, within=loop.body):
                return name
        return None

    def _index_reads(self, loop: cst.For) -> List[cst.Name]:
        """The reads of the loop's index, wherever they are in its function (by value)."""
        fn = self.r.enclosing_function(loop)
        scope = fn.body if fn is not None else self.facts.module
        index = loop.target.value
        reads = []
        for node in walk(scope):
            if not isinstance(node, cst.Name) or node.value != index or node is loop.target:
                continue
            parent = self.r.parent(node)
            if isinstance(parent, cst.Attribute) and parent.attr is node or isinstance(parent, cst.Arg) \
                    and parent.keyword is node:
                continue
            if loop in self.flow.values(node):  # a read, or a binding of the same name
                reads.append(node)
        return reads

    def _reads_rank(self, loop: cst.For, matched) -> bool:
        """The loop, or a value the data it slices can hold, asks for the rank or the world size."""
        if self._splits_by_rank(loop) or any(self._rank_value(n) for n in walk(loop) if isinstance(n, cst.Name)):
            return True
        for piece, _, _ in matched:
            sub = next((up for up in self.r.ancestors(piece) if isinstance(up, cst.Subscript)), None)
            if sub is not None and any(isinstance(v, cst.CSTNode) and self._splits_by_rank(v)
                                       for v in self.flow.values(sub.value)):
                return True
        return False

    def _rank_value(self, name: cst.Name) -> bool:
        return any(isinstance(v, cst.Call) and self.r.qnames(v) & (GET_RANK | GET_WORLD_SIZE)
                   for v in self.flow.values(name))

    def _slice_flag(self, node, loop: cst.For, why: str) -> None:
        self.out.slice_flags.append((node, why, loop))

    # -- calls -------------------------------------------------------------

    def _calls(self, source: Source) -> None:
        fn = source.function if isinstance(source, RandomDraw) else source.method
        for call, _ in self.flow.bound_calls(fn):
            stmt = self.r.statement_of(call)
            block = self.r.block_of(stmt)
            body = list(getattr(block, "body", []))
            after = body[body.index(stmt) + 1] if stmt in body and body.index(stmt) + 1 < len(body) else None
            if after is not None and self._splits_by_rank(after):
                continue  # `x, y = x.chunk(world_size)[rank], ...` follows: split already
            small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
            targets: List[str] = []
            if isinstance(small, cst.Assign) and small.value is call and len(small.targets) == 1:
                target = small.targets[0].target
                elements = target.elements if isinstance(target, (cst.Tuple, cst.List)) else None
                if elements is None and isinstance(target, cst.Name) and source.outputs == 1:
                    targets = [target.value]
                elif elements is not None and len(elements) == source.outputs and all(
                        isinstance(e.value, cst.Name) and not isinstance(e, cst.StarredElement) for e in elements):
                    targets = [e.value.value for e in elements]
            self.out.calls.append(BatchCall(call, stmt, targets, self._training(call), source))

    def _training(self, call: cst.Call) -> Optional[bool]:
        """True: the call draws a training batch (its function, or the module, calls backward(),
        and it runs outside `torch.no_grad()` / `torch.inference_mode()`); False: evaluation (under
        one of them, or in a function decorated with one); None: neither is seen."""
        fn = self.r.enclosing_function(call)
        if self._under_no_grad(call):
            return False
        scope = fn.body if fn is not None else self.facts.module
        if any(isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "backward"
               and self.r.enclosing_function(n) is fn for n in walk(scope)):
            return True
        return None

    def _under_no_grad(self, node) -> bool:
        """`node` runs under `torch.no_grad()` / `torch.inference_mode()` (a `with`, or a decorated function)."""
        for up in self.r.ancestors(node):
            if isinstance(up, cst.With) and any(self._no_grad(item.item) for item in up.items):
                return True
            if isinstance(up, cst.FunctionDef) and any(self._no_grad(d.decorator) for d in up.decorators):
                return True
        return False

    def _no_grad(self, expr) -> bool:
        """`torch.no_grad()`, `torch.inference_mode()` (or the bare name, as a decorator)."""
        return bool(self.r.qnames(expr) & _NO_GRAD
                    or (isinstance(expr, cst.Call) and self.r.qnames(expr.func) & _NO_GRAD))

    def _unclear(self, node, why: str) -> None:
        self.out.unclear.append((node, why))


def _returns(fn: cst.FunctionDef) -> bool:
    return any(isinstance(n, cst.Return) and n.value is not None for n in walk(fn.body))


def _draw_size(call: cst.Call) -> Optional[cst.BaseExpression]:
    """B of `torch.randint(high, (B,))`, `torch.randint(low, high, (B,))` or `size=(B,)`."""
    positional = [a for a in call.args if a.keyword is None and not a.star]
    size = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "size"), None)
    if size is None and len(positional) in (2, 3) and isinstance(positional[-1].value, (cst.Tuple, cst.List)):
        size = positional[-1].value
    if isinstance(size, (cst.Tuple, cst.List)) and len(size.elements) == 1 \
            and isinstance(size.elements[0], cst.Element):
        return size.elements[0].value
    return None


def _along_rows(call: cst.Call) -> bool:
    """A join along dim 0: no dim (the default), `dim=0`, or 0 as the second positional argument."""
    dims = [a.value for a in call.args[1:] if a.keyword is None or a.keyword.value in ("dim", "axis")]
    return not dims or (len(dims) == 1 and isinstance(dims[0], cst.Integer) and dims[0].value == "0")


def _one_row_of(elt, var: str) -> bool:
    """`var[None]`, `var[None, :]`, `var[None, ...]` or `var.unsqueeze(0)`: `var` with a leading axis of 1."""
    if isinstance(elt, cst.Subscript) and isinstance(elt.value, cst.Name) and elt.value.value == var:
        first, rest = elt.slice[0].slice, elt.slice[1:]
        if not (isinstance(first, cst.Index) and isinstance(first.value, cst.Name) and first.value.value == "None"):
            return False
        return all(
            (isinstance(e.slice, cst.Slice) and e.slice.lower is None and e.slice.upper is None and e.slice.step is None)
            or (isinstance(e.slice, cst.Index) and isinstance(e.slice.value, cst.Ellipsis))
            for e in rest
        )
    if isinstance(elt, cst.Call) and isinstance(elt.func, cst.Attribute) and elt.func.attr.value == "unsqueeze" \
            and isinstance(elt.func.value, cst.Name) and elt.func.value.value == var and len(elt.args) == 1:
        arg = elt.args[0]
        return (arg.keyword is None or arg.keyword.value == "dim") and isinstance(arg.value, cst.Integer) \
            and arg.value.value == "0"
    return False


def _bound_values(target, value, name: str):
    """The values `target = value` gives `name` (None where it is bound but not seen element by element)."""
    if isinstance(target, cst.Name):
        if target.value == name:
            yield value
        return
    if isinstance(target, (cst.Tuple, cst.List)):
        values = value.elements if isinstance(value, (cst.Tuple, cst.List)) else None
        if values is not None and len(values) == len(target.elements) and not any(
                isinstance(e, cst.StarredElement) for e in [*target.elements, *values]):
            for t, v in zip(target.elements, values):
                yield from _bound_values(t.value, v.value, name)
        elif name in _target_names(target):
            yield None


def _target_names(target) -> set:
    return {n.value for n in walk(target) if isinstance(n, cst.Name)}


def _self_attr(node) -> Optional[str]:
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self":
        return node.attr.value
    return None


def _reads_from(sub: cst.Subscript, attr: str) -> bool:
    """`data[self.pos:self.pos + n]`: one slice, its start the counter."""
    if len(sub.slice) != 1 or not isinstance(sub.slice[0].slice, cst.Slice):
        return False
    part = sub.slice[0].slice
    return _self_attr(part.lower) == attr and part.step is None and part.upper is not None


def _reset_test(node, attr: str, r) -> Optional[cst.If]:
    """The `if` whose test reads `node` (`self.pos`) and whose body only sets the counter to 0."""
    for up in r.ancestors(node):
        if isinstance(up, cst.If):
            if not any(n is node for n in walk(up.test)) or up.orelse is not None:
                return None
            body = up.body.body
            simple = [s.body[0] for s in body if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1]
            ok = len(simple) == len(body) == 1 and isinstance(simple[0], cst.Assign) and \
                _self_attr(simple[0].targets[0].target) == attr and code(simple[0].value) == "0"
            return up if ok else None
        if isinstance(up, cst.BaseStatement):
            pass
    return None


__all__ = ["BatchCall", "HandBatches", "PositionCounter", "RandomDraw", "SliceLoop", "hand_drawn_batches"]
