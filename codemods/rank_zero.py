"""rank_zero: print, log, show progress and write plain files on rank 0 only; never put a
collective under that gate. The values a log line reads of a loss, or of a float summed over
the training loop, are first combined over the ranks, on every rank (`_averaged_losses`)."""
from __future__ import annotations

from typing import List, Optional

import libcst as cst

from fsdp2_retrofit.analysis import LogSite, ScriptFacts, code
from fsdp2_retrofit.analysis.loop_sums import KEEPS as _KEEPS
from fsdp2_retrofit.analysis.loop_sums import dotted as _dotted
from fsdp2_retrofit.analysis.loop_sums import reduced_after_loop, term_kind
from fsdp2_retrofit.analysis.loop_sums import tensor_read as _tensor_read
from fsdp2_retrofit.analysis.rank_uniform import RankUniform, bound_inside, ranks_part_at
from fsdp2_retrofit.rewrite.gather_sums import gather_sums
from fsdp2_retrofit.rewrite.edit import with_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.names import calls_in, instance_attribute, names_read, walk
from fsdp2_retrofit.syntax.rank import every_rank_call, rank_zero_side
from fsdp2_retrofit.syntax.torch_api import TORCH_SAVE


# Module methods that read local state only: safe to call on one rank.
LOCAL_METHODS = {"parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules", "children"}


class GateRankZeroCommand(RetrofitStage):
    DESCRIPTION = "Print, log and show progress bars on rank 0 only."
    CODE = "rank_zero"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if facts.distributed_init is None:
            return
        self._uniform = None
        runs: List[List[LogSite]] = []
        hoisted = {}  # id(log statement) -> the indices of the calls it hands to a local first
        kept = self._writers_kept(facts)
        for site in facts.logs:
            test = self._test(site, facts)
            if site.gated or test is None or site.writer in kept:
                continue
            if self._may_be_collective(site.stmt, facts):
                calls = _hoistable(site.stmt, facts)
                if calls is None:
                    self.attention(
                        site.stmt,
                        "this log line computes with the model: left on every rank",
                        "a forward or collective inside a rank-0 branch deadlocks the other ranks; the call cannot "
                        "be taken out of the line first without changing what runs when (other calls with effects, "
                        "a condition or comprehension around it)",
                    )
                    continue
                hoisted[id(site.stmt)] = calls
                runs.append([site])  # a run of its own: the computation stays where it was, on every rank
                continue
            block = facts.resolver.block_of(site.stmt)
            prev = runs[-1][-1] if runs else None
            if (
                prev is not None
                and id(prev.stmt) not in hoisted
                and facts.resolver.block_of(prev.stmt) is block
                and _next_statement(prev.stmt, block) is site.stmt
            ):
                runs[-1].append(site)
            else:
                runs.append([site])
        for run in runs:
            test = self._test(run[0], facts)
            first = run[0].stmt
            reduce, logged, anchor = self._averaged_losses(run, facts)
            hoist = hoisted.get(id(first))
            if hoist is not None:
                logged = self._hoist(first, logged[0], hoist, facts, editor)
            elif not reduce and self._join_enclosing_if(run, test, facts, editor):
                continue
            if reduce and anchor is first:
                editor.insert_before(first, [reduce[0].with_changes(leading_lines=first.leading_lines)] + reduce[1:])
            elif reduce:
                editor.insert_before(anchor, reduce)
            inner = [logged[0].with_changes(leading_lines=[])] + logged[1:]
            gate = cst.If(
                test=self.expr(test),
                body=cst.IndentedBlock(body=inner),
                leading_lines=[] if (reduce and anchor is first) or hoist is not None else first.leading_lines,
            )
            editor.replace(first, gate)
            self._import_for(test)
            for site in run[1:]:
                editor.replace(site.stmt, None)
            files = any(site.file_write for site in run)
            self.change(
                first,
                f"print/log{' and file writes' if files else ''} on rank 0 only (`if {test}:`)",
                "every rank runs the script; unguarded output repeats world_size times"
                + (" (each rank appending its lines, or overwriting the file as another writes it)" if files else ""),
            )
        self._gate_progress_bars(facts, editor)
        self._flag_gated_collectives(facts)

    def _test(self, site: LogSite, facts: ScriptFacts) -> Optional[str]:
        """The rank-0 test of a log site; for a writer's construction or use where the process group
        may not exist yet (above it, or in a function called from anywhere), the launcher's RANK
        (torchrun sets it before the script runs; a plain run has none: rank 0)."""
        test = self.rank_zero_test(site.stmt, facts)
        if test is None and site.writer is not None:
            return _ENV_RANK_ZERO
        return test

    def _import_for(self, test: str) -> None:
        if test.startswith("dist."):
            self.add_import("torch.distributed", asname="dist")
        elif test == _ENV_RANK_ZERO:
            self.add_import("os")

    def _writers_kept(self, facts: ScriptFacts) -> set:
        """The writer groups left on every rank, each reported at its construction: a use that computes
        with the model where it cannot be taken out of the line first (its construction and other uses
        stay with it: a writer made on rank 0 only is no name on the others), and the writers
        analysis/logs.py could not follow whole."""
        kept = set()
        for site in facts.logs:
            if site.writer is None or site.gated or site.writer in kept:
                continue
            if self._may_be_collective(site.stmt, facts) and _hoistable(site.stmt, facts) is None:
                kept.add(site.writer)
                self.attention(
                    site.stmt,
                    "this write computes with the model: the writer it uses (made at "
                    f"line {site.writer.rsplit(':', 1)[1]}) is left on every rank, each writing the same file",
                    "a forward or collective inside a rank-0 branch deadlocks the other ranks, and the call cannot "
                    "be taken out of the line first; bind the value on every rank before the line, then rewrite again",
                    differs=False,
                )
        for construction, node, why in facts.unsafe_writers:
            self.attention(
                construction,
                f"this writer writes the same file on every rank (world_size times, racing): left as written; {why} "
                f"(line {facts.resolver.line(node)})",
                "a writer made on rank 0 only must be used on rank 0 only: each use of it must be a call of one of "
                "its methods, for the rewrite to gate the construction and every use together; gate them yourself "
                "(`if rank == 0:`), or open os.devnull on the other ranks",
                differs=False,
            )
        return kept

    def _hoist(self, stmt, logged, calls, facts: ScriptFacts, editor) -> list:
        """`print(f"best val {evaluate(model, x, y):.4f}")` -> `logged_value = evaluate(model, x, y)`
        on every rank, before the line, and the line (gated by the caller) reads the local."""
        function = facts.resolver.enclosing_function(stmt)
        every = calls_in(stmt)
        names = {}
        assigns = []
        for index in calls:
            name = self._take("logged_value", function)
            names[index] = name
            assigns.append(self.stmt(f"{name} = {code(every[index])}\n"))
        assigns[0] = assigns[0].with_changes(leading_lines=stmt.leading_lines)
        editor.insert_before(stmt, assigns)
        self.change(
            stmt,
            f"{', '.join(f'`{code(every[i])}`' for i in calls)} of this log line is computed on every rank first "
            f"({', '.join(names[i] for i in calls)}); only the print is on rank 0",
            "it runs the sharded model (a collective every rank must join), and printed on every rank the lines "
            "of the ranks interleave in a shared log",
        )
        return [logged.visit(_ReadLocals(names))]

    def _flag_gated_collectives(self, facts: ScriptFacts) -> None:
        """A rank-0 `if` of the script itself (a DDP-aware script's `if master_process:`)
        around a forward, a backward or a collective: harmless before sharding, a hang
        after it (the other ranks never join). The ones around a checkpoint save are split
        by the checkpoint stage; the others are flagged at their line."""
        r = facts.resolver
        saving = _saving_functions(facts)
        for gate in r.nodes(cst.If):
            side = rank_zero_side(gate.test)
            branch = gate.body if side == "body" else gate.orelse if side == "else" else None
            if branch is None:
                continue
            calls = r.descendants(branch, cst.Call)
            if any(r.is_call_to(c, TORCH_SAVE) or (isinstance(c.func, cst.Name) and c.func.value in saving)
                   for c in calls):
                continue  # the checkpoint stage splits it
            hit = next((c for c in calls if every_rank_call(c, r)), None)
            if hit is None:
                hit = next((s for s in r.descendants(branch, cst.SimpleStatementLine)
                            if self._may_be_collective(s, facts)), None)
            if hit is None:
                continue
            self.attention(
                gate,
                f"FSD110: `if {code(gate.test)}:` (rank 0 only) runs `{code(hit).strip()}` (line {r.line(hit)}): a forward, "
                "backward or collective of the sharded model; the run hangs whenever this branch is taken",
                "every rank must join the all-gathers and reduce-scatters of a sharded model; run the branch on "
                "every rank and keep only its prints and file writes under the rank-0 test",
                differs=True,
            )

    def _averaged_losses(self, run, facts: ScriptFacts):
        """(statements that put each logged loss on the global batch, run on every rank before
        the gate; the run's statements reading those values).

        A loss is a tensor read of a `<name with "loss">`: `loss.item()`, `loss.data.numpy()`,
        `loss.detach().cpu().numpy()`, `loss.cpu().item()` (`.numpy()`/`.tolist()` of a loss the
        scope calls backward() on: a scalar); it is all-reduced and divided by the world size
        (each rank's loss is the mean of its part of the batch). A float accumulated over the
        loop and logged by name (`running_loss += loss.item()`, `total += y.size(0)`) is gathered
        from every rank: summed, and divided by the world size where each term is a batch mean
        (see `_accumulation`). A read of a loss that cannot be averaged is flagged."""
        stmts = [site.stmt for site in run]
        if not self.options.reduce_logs:
            return [], stmts, None
        r = facts.resolver
        function = r.enclosing_function(run[0].stmt)
        scope = function or facts.module
        reduced = _all_reduced_names(scope, facts)
        tensors: List[str] = []
        floats: List[tuple] = []
        for stmt in stmts:
            for call in calls_in(stmt):
                base = _tensor_read(call)
                if base is None or "loss" not in base.lower() or base in reduced or base in tensors:
                    continue
                if call.func.attr.value != "item" and not _backward_on(base, scope, r):
                    self.attention(
                        stmt,
                        f"`{code(call)}` is logged as rank 0's own value (of its part of the batch)",
                        "it is not known to be a scalar loss (no backward() on it here), so it is not averaged "
                        "over the ranks: average it (all_reduce, then divide by the world size) before the print",
                    )
                    continue
                tensors.append(base)
            read = names_read(stmt)
            for name in dict.fromkeys(n.value for n in walk(stmt) if type(n) is cst.Name and n.value in read):
                if name in reduced or name in tensors or any(name == f[0] for f in floats):
                    continue
                if reduced_after_loop(facts, function, name, stmt):
                    continue  # combined over the ranks after its loop (codemods/loop_sums.py)
                kind = _accumulation(name, function, facts)
                if kind in ("mean", "sum"):
                    floats.append((name, kind))
                elif kind == "unknown-loss":
                    self.attention(
                        stmt,
                        f"`{name}` (accumulated over the loop from a loss) is logged as rank 0's own figure",
                        "each rank sums over its own part of the data; the sum of the terms is not recognised "
                        "(`x += loss.item()` or `x += loss.item() * n`), so it is not combined over the ranks",
                    )
        if not tensors and not floats:
            return [], stmts, None
        anchor = self._reduce_at(run[0].stmt, function, tensors + [n for n, _ in floats], facts)
        if anchor is None:
            return [], stmts, None
        mapping, reduce = {}, []
        for name in tensors:
            kind = _accumulation(name, function, facts)
            avg = self._take(f"{name.rsplit('.', 1)[-1]}_{'all' if kind == 'sum' else 'avg'}", function)
            mapping[name] = avg
            reduce += [
                self.stmt(f"{avg} = {name}.detach().clone()\n"),
                self.stmt(f"dist.all_reduce({avg})  # a sum: gloo has no ReduceOp.AVG\n"),
            ]
            if kind != "sum":
                reduce.append(self.stmt(f"{avg} /= dist.get_world_size()\n"))
        if floats:  # one gather for them all: a collective per value is a wait per value
            ranks = self._take(f"{floats[0][0]}_ranks" if len(floats) == 1 else "logged_ranks", function)
            for name, kind in floats:
                mapping[name] = self._take(f"{name}_{'avg' if kind == 'mean' else 'all'}", function)
            reduce += [self.stmt(line) for line in gather_sums(ranks, floats, mapping)]
        self.add_import("torch.distributed", asname="dist")
        if tensors:
            self.change(
                run[0].stmt,
                f"the logged {', '.join(f'`{n}`' for n in tensors)} is the mean over ranks "
                f"({', '.join(mapping[n] for n in tensors)}, all-reduced on every rank before the rank-0 print)",
                "each rank's loss is the mean of its own part of the batch; their mean is the loss of the whole "
                "global batch, the number the single-GPU run printed (--no-reduce-logs prints rank 0's own)",
            )
        if floats:
            self.change(
                run[0].stmt,
                "the logged " + ", ".join(
                    f"`{n}` is {'the mean over ranks' if k == 'mean' else 'the sum over ranks'} of each rank's "
                    f"sum (`{mapping[n]}`)" for n, k in floats) + ", gathered on every rank before the rank-0 print",
                "each rank sums over its own part of the data; summed over the ranks (divided by the world size "
                "where each term is a batch mean) it is the figure of the whole data, which len(loader.dataset) "
                "and len(loader) already count (exact when world_size divides the dataset: otherwise "
                "DistributedSampler repeats up to world_size - 1 samples, which are counted too; "
                "--no-reduce-logs prints rank 0's own)",
            )
        if anchor is not run[0].stmt:
            self.change(
                run[0].stmt,
                f"the logged values are combined over the ranks on every pass (before line {r.line(anchor)}), "
                f"not only when this line prints: `{_test_text(anchor)}` is not known to be the same on every rank",
                "a collective runs on every rank or on none: under a condition each rank decides for itself "
                "(a loss, a clock, a function parameter), the ranks that enter it would wait for the others",
            )
        return reduce, [s.visit(_ReadAverages(mapping)) for s in stmts], anchor

    def _reduce_at(self, first, function, values, facts: ScriptFacts):
        """The statement to put the all_reduce/all_gather of `values` before: the log line itself
        when every condition around it is rank-uniform (the collective runs on the steps that
        log), else the outermost statement whose condition is not (it runs on every pass).
        None (with an attention item) when that statement changes a value the log line reads."""
        r = facts.resolver
        if self._uniform is None:
            self._uniform = RankUniform(r, {l.name for l in facts.loaders})
        outer = ranks_part_at(first, function, r, self._uniform)
        if outer is None:
            return first
        roots = {v.split(".", 1)[0] for v in values}
        changed = sorted(roots & bound_inside(outer, r))
        if changed:
            self.attention(
                first,
                f"the logged {', '.join(f'`{v}`' for v in values)} is rank 0's own value (of its part of the batch)",
                f"the line sits under `{_test_text(outer)}` (line {r.line(outer)}), not known to be the same on every "
                f"rank, which also changes {', '.join(changed)}: an all_reduce inside could hang and one before it "
                "would read another value; average it yourself on every rank",
            )
            return None
        return outer

    def _take(self, wanted: str, function) -> str:
        name = self.fresh_name(wanted, function)
        self.__dict__["_visible"][id(function)].add(name)
        return name

    def _join_enclosing_if(self, run, test: str, facts: ScriptFacts, editor) -> bool:
        """When the run is the whole body of a plain `if cond:`, say `if cond and rank == 0:`
        rather than nesting a second `if` (a one-line diff)."""
        block = facts.resolver.block_of(run[0].stmt)
        owner = facts.resolver.parent(block) if block is not None else None
        if not (
            isinstance(owner, cst.If)
            and owner.orelse is None
            and facts.resolver.block_of(owner) is not None
            and [s.stmt for s in run] == list(block.body)
        ):
            return False
        cond = owner.test
        if isinstance(cond, (cst.BooleanOperation, cst.IfExp, cst.NamedExpr, cst.Lambda)) and not cond.lpar:
            cond = cond.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        joined = cst.BooleanOperation(
            left=cond,
            operator=cst.And(),
            right=self.expr(test),
        )
        editor.replace(owner, owner.with_changes(test=joined))
        self._import_for(test)
        files = any(site.file_write for site in run)
        self.change(
            owner,
            f"print/log{' and file writes' if files else ''} on rank 0 only (`if {code(cond)} and {test}:`)",
            "every rank runs the script; unguarded output repeats world_size times"
            + (" (each rank writing the same file)" if files else ""),
        )
        return True

    def _may_be_collective(self, stmt, facts: ScriptFacts) -> bool:
        """`stmt` may run a forward of the model (`model(x)`, `self.model(x)`, a method of it, the model
        handed to a call), `full_tensor()`, or a function or method of the script that does (`self.validate()`,
        followed a few calls deep): what a rank-0 branch must not hold."""
        return _collective_in(list(calls_in(stmt)), facts, 3, set())

    def _gate_progress_bars(self, facts: ScriptFacts, editor: StatementEditor) -> None:
        bars = [
            node
            for node in facts.resolver.nodes(cst.Call)
            if any(q.split(".")[0] == "tqdm" and q.split(".")[-1] in TQDM_BARS for q in facts.resolver.qnames(node))
            and not any(a.keyword is not None and a.keyword.value == "disable" for a in node.args)
        ]
        for bar in bars:
            test = self.rank_zero_test(facts.resolver.statement_of(bar), facts)
            if test is None:
                continue
            negated = test.replace("== 0", "!= 0")
            disable = self.expr(negated)
            editor.replace_expression(bar, lambda updated, disable=disable: with_keyword(updated, "disable", disable))
            if negated.startswith("dist."):
                self.add_import("torch.distributed", asname="dist")
            self.change(bar, f"progress bar shown on rank 0 only (`disable={negated}`)", "one bar, not world_size bars")


# rank 0 where the process group may not exist yet: torchrun's RANK (a plain run: none, rank 0)
_ENV_RANK_ZERO = 'os.environ.get("RANK", "0") == "0"'

# what makes a tqdm progress bar (tqdm.tqdm, tqdm.auto.tqdm, tqdm.trange, tqdm.contrib.tenumerate ...): these take
# `disable=`; tqdm's other functions do not (`tqdm.write(s)`, a log line, raises TypeError with it)
TQDM_BARS = frozenset({"tqdm", "trange", "tqdm_notebook", "tnrange", "tenumerate", "tzip", "tmap"})

# calls a log line may make besides the one it hands to a local: reads without effects
_PURE_CALLS = frozenset({"len", "float", "int", "round", "str", "abs", "min", "max", "repr", "format"})
_PURE_METHODS = frozenset({"item", "format", "tolist", "numpy", "detach", "cpu", "mean", "sum",
                           # what an image write does to a generated batch: `save_image(G(z).mul(0.5).add(0.5)
                           # .view(-1, 1, 28, 28), p)`: local to the tensor the hoisted forward returns
                           "view", "reshape", "permute", "transpose", "squeeze", "unsqueeze", "flatten",
                           "contiguous", "clamp", "clamp_", "mul", "add", "sub", "div", "float", "clone"})
# what a call inside must not sit in: taking it out would run it when it did not run, or once for many
_CONDITIONAL = (cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp, cst.IfExp,
                cst.BooleanOperation)


def _hoistable(stmt, facts: ScriptFacts) -> Optional[List[int]]:
    """The indices (in calls_in order) of the calls of a log line that run the model, when each can
    be computed before the line without changing what runs or in what order: the line is one call
    (the print or log), its other calls are reads without effects, and no call to take out sits in
    a lambda, comprehension, `a if c else b` or `and`/`or`. None otherwise."""
    if type(stmt) is not cst.SimpleStatementLine or len(stmt.body) != 1 or type(stmt.body[0]) is not cst.Expr \
            or type(stmt.body[0].value) is not cst.Call:
        return None
    every = calls_in(stmt)
    outer = stmt.body[0].value
    taken: List[int] = []
    inside: set = set()
    for index, call in enumerate(every):
        if call is outer or id(call) in inside:
            continue
        if _collective_in([call], facts, 3, set()):
            for a in facts.resolver.ancestors(call):
                if a is outer:
                    break
                if isinstance(a, _CONDITIONAL):
                    return None
            taken.append(index)
            inside.update(id(c) for c in calls_in(call))
        elif not (type(call.func) is cst.Name and call.func.value in _PURE_CALLS) and not (
                type(call.func) is cst.Attribute and call.func.attr.value in _PURE_METHODS):
            return None
    return taken or None


def _runs_model(call, models) -> bool:
    """The call itself runs the model (`model(x)`, `self.model(x)`, a method of it other than a local read,
    the model handed to it) or gathers a DTensor (`full_tensor()`)."""
    func = call.func
    if _is_model(func, models):
        return True
    if type(func) is cst.Attribute and _is_model(func.value, models) and func.attr.value not in LOCAL_METHODS:
        return True
    if any(_is_model(a.value, models) for a in call.args):
        return True
    return type(func) is cst.Attribute and func.attr.value == "full_tensor"


class _ReadLocals(cst.CSTTransformer):
    """The calls at the given indices (in calls_in order) replaced by the locals that hold their values."""

    def __init__(self, names):
        super().__init__()
        self.names = names
        self.index = -1
        self.replace = {}

    def visit_Call(self, node: cst.Call) -> bool:
        self.index += 1
        if self.index not in self.names:
            return True
        self.replace[id(node)] = self.names[self.index]
        self.index += len(calls_in(node)) - 1  # its inner calls go with it
        return False

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call):
        name = self.replace.get(id(original_node))
        return cst.Name(name) if name else updated_node


class _ReadAverages(cst.CSTTransformer):
    """`loss.item()` -> `loss_avg.item()` (and `loss.data.numpy()` -> `loss_avg.data.numpy()`)
    for the tensors in the mapping; `running_loss` -> `running_loss_avg` for the floats."""

    def __init__(self, mapping):
        super().__init__()
        self.mapping = mapping

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call):
        base = _tensor_read(original_node)
        if base in self.mapping:
            func = updated_node.func
            return updated_node.with_changes(func=func.with_changes(value=_with_base(func.value, self.mapping[base])))
        return updated_node

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name):
        return updated_node.with_changes(value=self.mapping.get(updated_node.value, updated_node.value))

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute):
        return updated_node.with_changes(attr=original_node.attr)  # `x.running_loss` is another value

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg):
        return updated_node.with_changes(keyword=original_node.keyword)


def _with_base(node, name: str):
    """`node` (a chain of _KEEPS calls and `.data` over a tensor) reading `name` instead."""
    if type(node) is cst.Call and type(node.func) is cst.Attribute and node.func.attr.value in _KEEPS \
            and not node.args:
        return node.with_changes(func=node.func.with_changes(value=_with_base(node.func.value, name)))
    if type(node) is cst.Attribute and node.attr.value == "data":
        return node.with_changes(value=_with_base(node.value, name))
    return cst.Name(name)


def _backward_on(base: str, scope, r) -> bool:
    """`<base>.backward()` runs in `scope`: the tensor is a scalar."""
    return any(type(c.func) is cst.Attribute and c.func.attr.value == "backward" and _dotted(c.func.value) == base
               for c in r.descendants(scope, cst.Call))


def _accumulation(name: str, function, facts: ScriptFacts) -> Optional[str]:
    """How `name` is accumulated (`name += term`) in `function` (the module's top level for None):
    "mean" (each term a batch's mean loss), "sum" (each a per-sample sum or count: a loss times a
    number, `y.size(0)`, `(pred == y).sum().item()`), "steps" (a number literal: the same on every
    rank), "unknown-loss" (terms that read a loss otherwise), "unknown", or None (not an
    accumulator: never set to a number literal there, never added to, or added to outside the
    training loops over a loader the DistributedSampler splits)."""
    r = facts.resolver
    kinds = set()
    split = {l.name for l in facts.loaders if l.trains}  # the loaders DistributedSampler splits
    loops = {id(l.node) for l in facts.loops if l.loader in split}
    if not any(type(a.value) in (cst.Integer, cst.Float) and any(
            type(t.target) is cst.Name and t.target.value == name for t in a.targets)
            and r.enclosing_function(a) is function for a in r.nodes(cst.Assign)):
        return None
    for node in r.nodes(cst.AugAssign):
        if type(node.target) is not cst.Name or node.target.value != name or r.enclosing_function(node) is not function:
            continue
        if not any(id(a) in loops for a in r.ancestors(node)):
            return None  # summed over data every rank reads whole (an evaluation), or not over a loader at all
        kinds.add(term_kind(node.value) if type(node.operator) is cst.AddAssign else "unknown")
    if not kinds:
        return None
    if len(kinds) == 1:
        return kinds.pop()
    return "unknown-loss" if "unknown-loss" in kinds or "mean" in kinds or "sum" in kinds else "unknown"


def _all_reduced_names(scope, facts: ScriptFacts) -> set:
    """Names passed to an all_reduce in `scope`: already averaged (a second rewrite)."""
    found = set()
    for node in facts.resolver.descendants(scope, cst.Call):
        f = node.func
        if isinstance(f, cst.Attribute) and f.attr.value == "all_reduce" and node.args:
            if isinstance(node.args[0].value, cst.Name):
                found.add(node.args[0].value.value)
    return found


def _test_text(stmt) -> str:
    """`if <test>` of an `if`/`while`, `try` of a `try`: how the report names the statement."""
    if type(stmt) is cst.If:
        return f"if {code(stmt.test)}"
    if type(stmt) is cst.While:
        return f"while {code(stmt.test)}"
    return "try: ... except"


def _next_statement(stmt, block):
    body = list(block.body)
    i = body.index(stmt)
    return body[i + 1] if i + 1 < len(body) else None


def _saving_functions(facts: ScriptFacts) -> set:
    """Names of the script's top-level functions that call torch.save in their body."""
    r = facts.resolver
    return {
        f.name.value for f in facts.module.body
        if isinstance(f, cst.FunctionDef) and any(r.is_call_to(c, TORCH_SAVE) for c in r.descendants(f, cst.Call))
    }


def _is_model(expr, models) -> bool:
    """`model` or `self.model`, where that is a model name of the function."""
    return (expr.value if isinstance(expr, cst.Name) else instance_attribute(expr)) in models


def _collective_in(calls: list, facts: ScriptFacts, depth: int, seen: set) -> bool:
    """One of `calls` runs the model or a collective (_runs_model), itself or in a function or method of
    the script it calls, `depth` calls deep (`seen`: id() of the functions looked at)."""
    r = facts.resolver
    for node in calls:
        if _runs_model(node, facts.model_names.get(r.enclosing_function(node), set())):
            return True
        if depth <= 0 or facts.analysis is None:
            continue
        for fn, _ in facts.analysis.callees(node):
            if id(fn) not in seen:
                seen.add(id(fn))
                if _collective_in(list(calls_in(fn.body)), facts, depth - 1, seen):
                    return True
    return False
