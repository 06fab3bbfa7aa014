"""rank_zero: print and log on rank 0 only; never put a collective under that gate."""
from __future__ import annotations

from typing import List

import libcst as cst

from fsdp2_retrofit.analysis import LogSite, ScriptFacts, code
from fsdp2_retrofit.rewrite.edit import with_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.names import calls_in
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
        runs: List[List[LogSite]] = []
        for site in facts.logs:
            test = self.rank_zero_test(site.stmt, facts)
            if site.gated or test is None:
                continue
            if self._may_be_collective(site.stmt, facts):
                self.attention(
                    site.stmt,
                    "this log line computes with the model: left on every rank",
                    "a forward or collective inside a rank-0 branch deadlocks the other ranks",
                )
                continue
            block = facts.resolver.block_of(site.stmt)
            prev = runs[-1][-1] if runs else None
            if (
                prev is not None
                and facts.resolver.block_of(prev.stmt) is block
                and _next_statement(prev.stmt, block) is site.stmt
            ):
                runs[-1].append(site)
            else:
                runs.append([site])
        for run in runs:
            test = self.rank_zero_test(run[0].stmt, facts)
            first = run[0].stmt
            reduce, logged = self._averaged_losses(run, facts)
            if not reduce and self._join_enclosing_if(run, test, facts, editor):
                continue
            if reduce:
                editor.insert_before(first, [reduce[0].with_changes(leading_lines=first.leading_lines)] + reduce[1:])
            inner = [logged[0].with_changes(leading_lines=[])] + logged[1:]
            gate = cst.If(
                test=self.expr(test),
                body=cst.IndentedBlock(body=inner),
                leading_lines=[] if reduce else first.leading_lines,
            )
            editor.replace(first, gate)
            if test.startswith("dist."):
                self.add_import("torch.distributed", asname="dist")
            for site in run[1:]:
                editor.replace(site.stmt, None)
            self.change(
                first,
                f"print/log on rank 0 only (`if {test}:`)",
                "every rank runs the script; unguarded output repeats world_size times",
            )
        self._gate_progress_bars(facts, editor)
        self._flag_gated_collectives(facts)

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
        """(statements that average each logged loss over the ranks, the run's statements
        reading the averages). A loss is a `<name with "loss">.item()` the log line reads."""
        stmts = [site.stmt for site in run]
        if not self.options.reduce_logs:
            return [], stmts
        function = facts.resolver.enclosing_function(run[0].stmt)
        reduced = _all_reduced_names(function or facts.module, facts)
        names: List[str] = []
        for stmt in stmts:
            for name in _item_reads(stmt):
                if "loss" in name.lower() and name not in reduced and name not in names:
                    names.append(name)
        if not names:
            return [], stmts
        mapping, reduce = {}, []
        for name in names:
            avg = self.fresh_name(f"{name.rsplit('.', 1)[-1]}_avg", function)
            self.__dict__["_visible"][id(function)].add(avg)
            mapping[name] = avg
            reduce += [
                self.stmt(f"{avg} = {name}.detach().clone()\n"),
                self.stmt(f"dist.all_reduce({avg})  # a sum: gloo has no ReduceOp.AVG\n"),
                self.stmt(f"{avg} /= dist.get_world_size()\n"),
            ]
        self.add_import("torch.distributed", asname="dist")
        self.change(
            run[0].stmt,
            f"the logged {', '.join(f'`{n}`' for n in names)} is the mean over ranks "
            f"({', '.join(mapping.values())}, all-reduced on every rank before the rank-0 print)",
            "each rank's loss is the mean of its own part of the batch; their mean is the loss of the whole "
            "global batch, the number the single-GPU run printed (--no-reduce-logs prints rank 0's own)",
        )
        return reduce, [s.visit(_ReadAverages(mapping)) for s in stmts]

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
        if test.startswith("dist."):
            self.add_import("torch.distributed", asname="dist")
        self.change(
            owner,
            f"print/log on rank 0 only (`if {code(cond)} and {test}:`)",
            "every rank runs the script; unguarded output repeats world_size times",
        )
        return True

    def _may_be_collective(self, stmt, facts: ScriptFacts) -> bool:
        models = facts.model_names.get(facts.resolver.enclosing_function(stmt), set())
        for node in calls_in(stmt):
            func = node.func
            if isinstance(func, cst.Name) and func.value in models:
                return True  # model(x): a forward
            if (
                isinstance(func, cst.Attribute)
                and isinstance(func.value, cst.Name)
                and func.value.value in models
                and func.attr.value not in LOCAL_METHODS
            ):
                return True
            if any(isinstance(a.value, cst.Name) and a.value.value in models for a in node.args):
                return True  # evaluate(model, ...)
            if isinstance(func, cst.Attribute) and func.attr.value == "full_tensor":
                return True
        return False

    def _gate_progress_bars(self, facts: ScriptFacts, editor: StatementEditor) -> None:
        bars = [
            node
            for node in facts.resolver.nodes(cst.Call)
            if any(q.split(".")[0] == "tqdm" for q in facts.resolver.qnames(node))
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


class _ReadAverages(cst.CSTTransformer):
    """`loss.item()` -> `loss_avg.item()` for the names in the mapping."""

    def __init__(self, mapping):
        super().__init__()
        self.mapping = mapping

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call):
        func = updated_node.func
        if isinstance(func, cst.Attribute) and func.attr.value == "item" and _dotted(func.value) in self.mapping:
            return updated_node.with_changes(func=func.with_changes(value=cst.Name(self.mapping[_dotted(func.value)])))
        return updated_node


def _dotted(node) -> str:
    """`loss` for a name, `trainer.loss` for an attribute of names; "" otherwise."""
    if type(node) is cst.Name:
        return node.value
    if type(node) is cst.Attribute:
        head = _dotted(node.value)
        return f"{head}.{node.attr.value}" if head else ""
    return ""


def _item_reads(stmt) -> List[str]:
    found: List[str] = []
    for node in calls_in(stmt):
        f = node.func
        if isinstance(f, cst.Attribute) and f.attr.value == "item" and _dotted(f.value):
            found.append(_dotted(f.value))  # `loss.item()`, `trainer.loss.item()` (a callback's)
    return found


def _all_reduced_names(scope, facts: ScriptFacts) -> set:
    """Names passed to an all_reduce in `scope`: already averaged (a second rewrite)."""
    found = set()
    for node in facts.resolver.descendants(scope, cst.Call):
        f = node.func
        if isinstance(f, cst.Attribute) and f.attr.value == "all_reduce" and node.args:
            if isinstance(node.args[0].value, cst.Name):
                found.add(node.args[0].value.value)
    return found


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
