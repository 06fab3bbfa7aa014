"""Sums over split data: what each rank adds up in a loop over a DataLoader that the data
stage gives a DistributedSampler, read after the loop.

After the retrofit each rank iterates its own part of such a loader. An evaluation over it
(`test_loss += F.cross_entropy(out, y, reduction="sum").item()`, `correct += (pred ==
y).sum().item()`, then `test_loss / len(loader.dataset)`) sums over that part only: the
printed figure is a fraction of the single run's, and a decision made from it (`if acc >
best: save(...)`) differs between the ranks. Combined over the ranks right after the loop,
on every rank, each sum is the sum over the whole data, the same on every rank.

A *loop sum* is a name that the loop's function sets to a number literal and adds to only
inside that loop (`+=`), every term recognised:
- "sum": a per-sample sum or count (`loss.item() * x.size(0)`, `y.size(0)`, `len(y)`,
  `(pred == y).sum().item()`, `F.cross_entropy(..., reduction="sum").item()`): summed over
  the ranks;
- "mean": a batch's mean loss (`loss.item()`, `float(loss)`): summed over the ranks and
  divided by the world size, which keeps `total / len(loader)` (per-rank batches) and
  `total / steps` (a step counter, the same on every rank) the single run's figure;
- "steps": a number literal (`steps += 1`): every rank counts the same (DistributedSampler
  gives every rank the same number of samples), left alone.
Exact where the world size divides the dataset: otherwise DistributedSampler repeats up to
world_size - 1 samples to even the ranks out, and they are counted too.

The loop is over split data when every DataLoader its iterable can hold (followed by value,
analysis/flow.py, through a function's parameter to what its calls pass) is one the data
stage splits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import calls_in, walk

# calls and attributes between a loss and its read that keep its value
KEEPS = frozenset({"detach", "cpu", "clone", "float", "double"})
_READS = frozenset({"item", "numpy", "tolist"})
# what a loop's iterable is wrapped in around the loader: `enumerate(loader)`, `tqdm(loader)`
_WRAPPERS = frozenset({"enumerate", "iter", "tqdm"})


@dataclass
class LoopSums:
    """The sums of one loop over split data that its function reads after the loop."""

    loop: cst.For
    function: Optional[cst.FunctionDef]
    sums: List[Tuple[str, str]]  # (name, "sum" | "mean"), in the order they are first added to
    # names added to in the loop from terms not recognised (each rank's own, not combined)
    unknown: List[str] = field(default_factory=list)
    reduced: bool = False  # the gather after the loop is there already (a second rewrite)
    # the loop reads a split loader at one call and a loader every rank reads whole at another:
    # its sums (in `unknown`) are left each rank's own
    mixed: bool = False


def chain_base(node):
    """`loss` of `loss.data`, `loss.detach().cpu()`, `loss.cpu()`."""
    while True:
        if type(node) is cst.Call and type(node.func) is cst.Attribute and node.func.attr.value in KEEPS \
                and not node.args:
            node = node.func.value
        elif type(node) is cst.Attribute and node.attr.value == "data":
            node = node.value
        else:
            return node


def dotted(node) -> str:
    """`loss` for a name, `trainer.loss` for an attribute of names; "" otherwise."""
    if type(node) is cst.Name:
        return node.value
    if type(node) is cst.Attribute:
        head = dotted(node.value)
        return f"{head}.{node.attr.value}" if head else ""
    return ""


def tensor_read(call) -> Optional[str]:
    """The dotted tensor a read chain reads: `loss` of `loss.item()`, `loss.data.numpy()`,
    `loss.detach().cpu().numpy()`, `loss.cpu().item()`; `trainer.loss` of `trainer.loss.item()`."""
    if type(call) is not cst.Call or type(call.func) is not cst.Attribute or call.func.attr.value not in _READS \
            or call.args:
        return None
    return dotted(chain_base(call.func.value)) or None


def loss_term(expr) -> Optional[str]:
    """The loss a term reads whole: `loss.item()`, `float(loss)`, `loss` (a tensor), `loss.detach()`."""
    if type(expr) is cst.Call and type(expr.func) is cst.Name and expr.func.value == "float" and len(expr.args) == 1:
        expr = expr.args[0].value
    base = tensor_read(expr) if type(expr) is cst.Call and type(expr.func) is cst.Attribute \
        and expr.func.attr.value == "item" else dotted(chain_base(expr))
    return base if base and "loss" in base.lower() else None


def is_count(expr) -> bool:
    """A number of samples or a per-sample sum: `y.size(0)`, `y.shape[0]`, `len(y)`, `y.numel()`,
    `(pred == y).sum().item()`, `F.cross_entropy(out, y, reduction="sum").item()`."""
    if type(expr) is cst.Subscript and type(expr.value) is cst.Attribute and expr.value.attr.value == "shape":
        return True
    if type(expr) is not cst.Call:
        return False
    f = expr.func
    if type(f) is cst.Name:
        return f.value == "len"
    if type(f) is not cst.Attribute:
        return False
    if f.attr.value in ("size", "numel"):
        return True
    if f.attr.value == "item" and not expr.args:
        inner = chain_base(f.value)
        if type(inner) is cst.Call and type(inner.func) is cst.Attribute and inner.func.attr.value == "sum":
            return True
        return type(inner) is cst.Call and any(
            a.keyword is not None and a.keyword.value == "reduction" and type(a.value) is cst.SimpleString
            and a.value.raw_value == "sum" for a in inner.args)
    return False


def term_kind(term) -> str:
    """How one `+=` term adds up over the ranks: "steps", "mean", "sum", "unknown-loss"
    (it reads a loss some other way) or "unknown"."""
    if type(term) in (cst.Integer, cst.Float):
        return "steps"
    if loss_term(term):
        return "mean"
    if type(term) is cst.BinaryOperation and type(term.operator) is cst.Multiply and \
            (loss_term(term.left) or loss_term(term.right)):
        return "sum"
    if is_count(term):
        return "sum"
    if any(tensor_read(c) and "loss" in tensor_read(c).lower() for c in calls_in(term)):
        return "unknown-loss"
    return "unknown"


def split_loader_calls(facts) -> set:
    """id() of the DataLoader calls the data stage gives a DistributedSampler."""
    return {id(l.call) for l in facts.loaders if l.trains}


def loader_calls(facts) -> set:
    return {id(l.call) for l in facts.loaders} | set(facts.training_loader_calls)


def iterated(expr):
    """The loader of `enumerate(loader)`, `tqdm(loader, ...)`, `iter(loader)`, `loader`."""
    while type(expr) is cst.Call and expr.args and (
            (type(expr.func) is cst.Name and expr.func.value in _WRAPPERS)
            or (type(expr.func) is cst.Attribute and expr.func.attr.value == "tqdm")):
        expr = expr.args[0].value
    return expr


def split_state(loop: cst.For, facts) -> Optional[str]:
    """"split": every DataLoader the loop's iterable can hold is split by the data stage (and it
    holds one, and nothing else); "mixed": it can hold a split one and one every rank reads whole
    (a helper handed the training loader at one call and the test loader at another); None."""
    if facts.analysis is None:
        return None
    values = facts.analysis.flow.values(iterated(loop.iter))
    split, loaders = split_loader_calls(facts), loader_calls(facts)
    held = [v for v in values if id(v) in loaders]
    if not held or len(held) != len(values) or not any(id(v) in split for v in held):
        return None
    if any(id(v) in shared_loader_calls(facts) for v in held):
        # a helper's DataLoader split for its training calls only (`distributed=True`): which calls can
        # the loop's iterable hold?
        return _helper_calls_state(iterated(loop.iter), facts)
    return "split" if all(id(v) in split for v in held) else "mixed"


def _helper_calls_state(expr, facts) -> str:
    """"split" / None / "mixed" for an iterable whose DataLoader a shared helper builds (shared_loader_calls):
    by the calls of the helper it can hold (`self.val_loader` holds `self.make_loader(60, ...)` only, which
    passes no `distributed=True`: read whole on every rank); "mixed" where it can hold anything else."""
    analysis = facts.analysis
    calls = [c for l in facts.loaders if id(l.call) in shared_loader_calls(facts)
             for c in analysis.shared_helper_calls(l) or ()]
    held = analysis.helper_calls_held(expr, calls)
    if not held or not all(v in calls for v in held):
        return "mixed"
    trains = [analysis.helper_call_trains(v) for v in held]
    return "split" if all(trains) else None if not any(trains) else "mixed"


def shared_loader_calls(facts) -> set:
    """id() of the DataLoader calls of helpers that build the training loader and one that does not
    train (the data stage splits them for the training calls only)."""
    known = facts.__dict__.get("_shared_loader_calls")
    if known is None:
        known = facts.__dict__["_shared_loader_calls"] = {
            id(l.call) for l in facts.loaders if l.trains and facts.analysis.shared_helper_calls(l) is not None}
    return known


def over_split_data(loop: cst.For, facts) -> bool:
    """Every DataLoader the loop's iterable can hold is split by the data stage (and it holds one)."""
    return split_state(loop, facts) == "split"


def _inside(node, outer, r) -> bool:
    first, last = r.span(outer)
    return first <= r.order(node) <= last


def _set_to_number(name: str, function, loop, r) -> bool:
    """`name = 0` (or `a, name = 0.0, 0`) in `function` before `loop`."""
    for a in r.nodes(cst.Assign):
        if r.enclosing_function(a) is not function or r.order(a) >= r.order(loop):
            continue
        for t in a.targets:
            if type(t.target) is cst.Name and t.target.value == name and type(a.value) in (cst.Integer, cst.Float):
                return True
            if type(t.target) in (cst.Tuple, cst.List) and type(a.value) in (cst.Tuple, cst.List) \
                    and len(t.target.elements) == len(a.value.elements):
                for te, ve in zip(t.target.elements, a.value.elements):
                    if type(te.value) is cst.Name and te.value.value == name and type(ve.value) in (cst.Integer, cst.Float):
                        return True
    return False


def _read_after(name: str, function, loop, r) -> List[cst.Name]:
    """Reads of `name` in `function` after `loop` (not inside it)."""
    last = r.span(loop)[1]
    out = []
    for n in r.nodes(cst.Name):
        if n.value != name or r.order(n) <= last or r.enclosing_function(n) is not function:
            continue
        parent = r.parent(n)
        if (type(parent) is cst.Attribute and parent.attr is n) or (type(parent) is cst.Arg and parent.keyword is n):
            continue
        if any(type(a) is cst.AssignTarget for a in _up_to_statement(n, r)):
            continue
        out.append(n)
    return out


def _up_to_statement(node, r):
    for a in r.ancestors(node):
        yield a
        if isinstance(a, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            return


def _log_statements(facts) -> set:
    return {id(site.stmt) for site in facts.logs}


def _left_to_the_logs(loop, reads, facts) -> bool:
    """The rank-0 log stage combines these sums itself, at the print (`_averaged_losses` of
    codemods/rank_zero.py): a training loop over a split loader it knows by name, whose sums are
    read after it by log lines only."""
    r = facts.resolver
    named = {l.name for l in facts.loaders if l.trains}
    if not any(l.node is loop and l.loader in named for l in facts.loops):
        return False
    logs = _log_statements(facts)
    return all(id(r.statement_of(n)) in logs for n in reads)


def loop_sums(facts) -> List[LoopSums]:
    """The loops over split data whose sums their function reads after the loop, and that the
    log stage does not combine at its prints (made once)."""
    cached = facts.__dict__.get("_loop_sums")
    if cached is not None:
        return cached
    r = facts.resolver
    out: List[LoopSums] = []
    for loop in r.nodes(cst.For):
        state = split_state(loop, facts)
        if state is None:
            continue
        function = r.enclosing_function(loop)
        kinds: Dict[str, set] = {}
        for node in r.descendants(loop, cst.AugAssign):
            if type(node.target) is cst.Name and r.enclosing_function(node) is function:
                kinds.setdefault(node.target.value, set()).add(
                    term_kind(node.value) if type(node.operator) is cst.AddAssign else "unknown")
        sums, unknown, reads = [], [], []
        for name, found in kinds.items():
            after = _read_after(name, function, loop, r)
            if not _set_to_number(name, function, loop, r) or not after:
                continue
            if any(type(a.target) is cst.Name and a.target.value == name and r.enclosing_function(a) is function
                   and not _inside(a, loop, r) for a in r.nodes(cst.AugAssign)):
                unknown.append(name)  # added to elsewhere too: not this loop's sum alone
                continue
            if found == {"steps"}:
                continue  # a step count: the same on every rank
            found = found - {"steps"}
            if len(found) == 1 and found <= {"sum", "mean"}:
                sums.append((name, next(iter(found))))
                reads += after
            else:
                unknown.append(name)
        if state == "mixed":
            if sums:  # summed over the ranks they would count the whole loader's samples world_size times
                out.append(LoopSums(loop, function, [], [n for n, _ in sums], mixed=True))
            continue
        if sums and _left_to_the_logs(loop, reads, facts):
            continue
        if sums or unknown:
            out.append(LoopSums(loop, function, sums, unknown, _gathered_after(loop, [n for n, _ in sums], r)))
    facts.__dict__["_loop_sums"] = out
    return out


def _gathered_after(loop, names, r) -> bool:
    """The statement after the loop gathers the sums (`dist.all_gather_object(_, (a, b))`): the
    output of a rewrite, rewritten again."""
    block = r.parent(loop)
    body = list(getattr(block, "body", []))
    if loop not in body:
        return False
    after = body[body.index(loop) + 1: body.index(loop) + 3]
    for stmt in after:
        for call in calls_in(stmt):
            if type(call.func) is cst.Attribute and call.func.attr.value == "all_gather_object" and len(call.args) == 2:
                gathered = {n.value for n in walk(call.args[1].value) if type(n) is cst.Name}
                if set(names) <= gathered:
                    return True
    return False


def reduced_after_loop(facts, function, name: str, at) -> bool:
    """`name`, read at `at`, is a loop sum combined over the ranks after its loop (at is after it)."""
    r = facts.resolver
    for found in loop_sums(facts):
        if found.function is function and any(n == name for n, _ in found.sums) and \
                r.order(at) > r.span(found.loop)[1]:
            return True
    return False
