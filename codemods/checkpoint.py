"""checkpoint: no torch.save of sharded state; save it with torch.distributed.checkpoint,
on every rank (a save under a rank-0 `if` moves out of it)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.checkpoints import (
    SaveSite,
    rank_gate,
    rank_zero_names,
    save_format,
    saves,
    split_rank_test,
)
from fsdp2_retrofit.analysis.rank_values import rank_aliases
from fsdp2_retrofit.analysis.rank_zero_broadcast import broadcast_anchor
from fsdp2_retrofit.syntax.names import calls_in, names_in
from fsdp2_retrofit.syntax.rank import every_rank_call
from fsdp2_retrofit.syntax.torch_api import DESTROY_PROCESS_GROUP, STATE_DICT_MODULE
from fsdp2_retrofit.rewrite.edit import aside_path, with_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

FULL_OPTIONS = "StateDictOptions(full_state_dict=True, cpu_offload=True)"
FUTURE = "checkpoint_future"
GROUP = "checkpoint_group"
DIRECTORY_NOTE = (
    "each rank holds only its shards; DCP writes them in parallel and can reshard on load "
    "(one file for single-GPU code: `fsdp2-retrofit convert DIR FILE`)"
)


class _Realign(cst.CSTTransformer):
    """Move the continuation lines indented past `column` (aligned with an opening bracket
    of the call's first line) by `shift` columns, so they stay aligned when the text before
    that bracket changes length (`torch.save({` -> `dcp.save({`)."""

    def __init__(self, column: int, shift: int, block: int):
        super().__init__()
        self.column, self.shift, self.block = column, shift, block

    def leave_ParenthesizedWhitespace(self, original, updated):
        # libcst keeps the block's indentation apart (`indent`); `column` counts from it
        indent = updated.last_line.value
        if indent.strip(" ") or len(indent) + (self.block if updated.indent else 0) < self.column:
            return updated
        return updated.with_changes(last_line=cst.SimpleWhitespace(" " * max(0, len(indent) - self.shift)))


def _dcp_save(call: cst.Call, callee: cst.BaseExpression, align: Optional[Tuple[int, int, int]] = None) -> cst.Call:
    """`torch.save(state, path)` -> `<callee>(state, checkpoint_id=path)`; `align`: (the column
    after the call's `(`, how much shorter the text before it got, the block's indentation),
    see `_Realign`."""
    if align is not None and align[1]:
        call = call.with_changes(args=[a.visit(_Realign(*align)) for a in call.args])
    state, path = call.args[0], call.args[1]
    return call.with_changes(
        func=callee,
        args=[
            state.with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT),
            path.with_changes(
                keyword=cst.Name("checkpoint_id"),
                equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
                ),
                comma=path.comma if len(call.args) == 2 else cst.MaybeSentinel.DEFAULT,
            ),
        ],
    )


def _assigned_to(stmt: cst.CSTNode, name: str) -> cst.CSTNode:
    """`f(...)` -> `name = f(...)`."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr)):
        return stmt
    return stmt.with_changes(body=[cst.Assign([cst.AssignTarget(cst.Name(name))], stmt.body[0].value)])


class ConvertSavesCommand(RetrofitStage):
    DESCRIPTION = "Turn torch.save of model/optimizer state into dcp.save of get_*_state_dict(), on every rank."
    CODE = "checkpoint"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not facts.models:
            return
        self.future: Optional[str] = None
        self._async: set = set()  # save statements whose result is kept (async)
        self._originals: set = set()  # statements of the script placed inside new `if`s
        # new statements each save needs right before it, on every rank (a gather, a wait)
        self.pre: Dict[cst.CSTNode, List[cst.CSTNode]] = {}
        self.collective: Dict[cst.CSTNode, bool] = {}  # save statement -> runs on every rank
        every = saves(facts)
        _refuse_unconvertible(self, every, facts)
        sites = [s for s in every if s.state_calls or s.whole_model]
        async_ok = self.options.async_checkpoint and self._async_possible(sites, facts)
        for site in sites:
            self._convert(site, facts, editor, async_ok)
        if self.options.async_checkpoint and not any(self.collective.values()):
            self._nothing_async(sites, facts)
        self._move_out_of_rank_gates(sites, facts, editor)
        self._share_rank_zero_names(sites, facts, editor)
        if async_ok and self.future:
            self._wait_at_the_end(sites, facts, editor)

    # -- one save ---------------------------------------------------------------

    def _convert(self, site: SaveSite, facts: ScriptFacts, editor: StatementEditor, async_ok: bool) -> None:
        call, stmt = site.call, site.stmt
        if len(call.args) < 2:
            return
        full = save_format(site, self.options.export) == "full"
        if site.whole_model is not None:
            model = site.whole_model
            replacement = (
                f"get_model_state_dict({model}, options={FULL_OPTIONS})" if full else f"get_model_state_dict({model})"
            )
            states = {site.state: self.expr(replacement)}
            self.add_import(STATE_DICT_MODULE, "get_model_state_dict")
            self.attention(
                call,
                f"`torch.save({model}, ...)` pickled the whole module; it now saves `{model}`'s state dict",
                "a pickled sharded module holds one rank's shards and cannot be loaded; code that "
                f"loads the file must build the model and load_state_dict (pass {model} to set_model_state_dict; "
                "for single-GPU code, `fsdp2-retrofit convert DIR FILE` gives the state dict as one file); "
                f"this script's own `{model} = torch.load(...)` after training is converted",
            )
            calls = [(site.state, "model", model)]
        else:
            calls = [(s.call, s.kind, s.model if s.kind == "model" else s.owner) for s in site.state_calls]
            states = {}  # state_dict() calls -> their replacements
            for s in site.state_calls:
                if full:
                    states[s.call] = self.expr(f"get_model_state_dict({s.owner}, options={FULL_OPTIONS})")
                elif s.kind == "model":
                    states[s.call] = self.expr(f"get_model_state_dict({s.owner})")
                else:
                    states[s.call] = self.expr(f"get_optimizer_state_dict({s.model}, {s.owner})")
        for node, new in states.items():
            editor.replace_expression(node, new)
        kinds = sorted({"get_model_state_dict" if k == "model" else "get_optimizer_state_dict" for _, k, _ in calls})
        for kind in kinds:
            self.add_import(STATE_DICT_MODULE, kind)
        if full:
            self._full_export(site, calls, states, facts, editor)
            return
        self.collective[stmt] = True
        self.add_import("torch.distributed.checkpoint", asname="dcp")
        if async_ok:
            scope = facts.resolver.enclosing_function(call)
            self.future = self.future or self.fresh_name(FUTURE, scope)
            self.group = self.fresh_name(GROUP, scope)
            callee, group, future = self.expr("dcp.async_save"), self.group, self.future
            assigned = f"{future} = " if isinstance(stmt, cst.SimpleStatementLine) and isinstance(
                stmt.body[0], cst.Expr) else ""
            align = self._alignment(call, f"{assigned}dcp.async_save", facts)
            editor.replace_expression(call, lambda updated: with_keyword(
                _dcp_save(updated, callee, align), "process_group", cst.Name(group)))
            editor.replace_expression(stmt, lambda updated: _assigned_to(updated, future))
            self._async.add(stmt)
            wait = self.stmt(f"if {self.future} is not None:\n    {self.future}.result()\n")
            self.pre.setdefault(stmt, []).append(wait)
            how = "dcp.async_save (after waiting for the previous save)"
        else:
            callee = self.expr("dcp.save")
            align = self._alignment(call, "dcp.save", facts)
            editor.replace_expression(call, lambda updated: _dcp_save(updated, callee, align))
            how = "dcp.save"
        aside = self._keep_single_gpu_file(site, facts)
        self.change(
            call,
            f"torch.save -> {how} of {', '.join(kinds)}(...); `{code(site.path)}` is now a checkpoint directory",
            DIRECTORY_NOTE + f"; a file already at that path (a single-GPU run's) is first renamed `{aside}` on "
            "rank 0, every rank waiting at a barrier",
            "torch.save of sharded state writes one rank's DTensor shards, not a loadable model; dcp.save "
            "where a file is fails (FileExistsError) after the training up to it",
        )

    @staticmethod
    def _alignment(call: cst.Call, callee: str, facts: ScriptFacts) -> Optional[Tuple[int, int, int]]:
        """For a save written over several lines: the column after its `(`, how much shorter
        `callee` is than what it replaces, and the indentation of the line it starts on
        (None on one line: nothing to align)."""
        if "\n" not in code(call):
            return None
        pos = facts.resolver.position(call)
        if pos is None:
            return None
        first = facts.resolver.module.code_for_node(facts.resolver.module).splitlines()[pos.start.line - 1]
        before = code(call.func)
        return pos.start.column + len(before) + 1, len(before) - len(callee), len(first) - len(first.lstrip())

    def _keep_single_gpu_file(self, site: SaveSite, facts: ScriptFacts) -> str:
        """Before a DCP save: a file at its path (the single-GPU script's checkpoint, left by an
        earlier run) is renamed PATH.single-gpu on rank 0, as the resume stage does once it has
        read one, and every rank waits until the path is free. Returns the new name."""
        path = code(site.path)
        aside = aside_path(site.path, path)
        test = self.rank_zero_test(site.stmt, facts) or "dist.get_rank() == 0"
        if " or " in test:
            test = f"({test})"
        self.pre.setdefault(site.stmt, []).append(self.stmt(
            f"if {test} and os.path.isfile({path}):  # a single-GPU run's file: moved aside, DCP saves a directory\n"
            f"    os.replace({path}, {aside})\n"
        ))
        self.pre[site.stmt].append(self.stmt("dist.barrier()  # the path is free on every rank\n"))
        self.add_import("os")
        self.add_import("torch.distributed", asname="dist")
        return aside

    def _full_export(self, site: SaveSite, calls, states, facts: ScriptFacts, editor: StatementEditor) -> None:
        """--export full: the full state dict is gathered on every rank (a collective),
        rank 0 writes the file; a gathering call written inside the save moves before it."""
        stmt = site.stmt
        self.add_import(STATE_DICT_MODULE, "StateDictOptions")
        scope = facts.resolver.enclosing_function(stmt)
        inside = {id(n) for n in _descendants(stmt)}
        for node, _kind, owner in calls:
            if id(node) not in inside:
                continue
            name = self.fresh_name(f"{owner}_state", scope)
            hoisted = self.stmt(f"{name} = {code(states[node])}\n")
            self.pre.setdefault(stmt, []).append(hoisted)
            editor.replace_expression(node, cst.Name(name))
        self.collective[stmt] = False
        self.change(
            site.call,
            f"`{code(site.path)}` stays one torch.save file of the full state dict: gathered with "
            "get_model_state_dict(full_state_dict=True, cpu_offload=True) on every rank, written by rank 0",
            "--export full: single-GPU code loads the file as before",
            "gathering the state dict under a rank-0 `if` deadlocks; torch.save of sharded state writes shards",
        )

    # -- rank-0 branches ------------------------------------------------------------

    def _move_out_of_rank_gates(self, sites, facts: ScriptFacts, editor: StatementEditor) -> None:
        """Split each rank-0 `if` around a save: what gathers or writes sharded state
        runs on every rank, plain-file writes and prints stay on rank 0."""
        gates: Dict[cst.If, List[cst.CSTNode]] = {}
        for site in sites:
            if site.stmt not in self.collective:
                continue
            gate = rank_gate(site.stmt, facts)
            if gate is None:
                self._place_ungated(site, facts, editor)
            else:
                gates.setdefault(gate, []).append(site.call)
        # `if master_process: save_checkpoint(model, ...)`: a function of the script that saves
        # (`if self.gpu_id == 0: self._save_snapshot(epoch)`: a method of the same class)
        self.saving_calls = set()
        for call in self._calls_of_saving_functions(facts):
            self.saving_calls.add(id(call))
            gate = rank_gate(call, facts)
            if gate is not None:
                gates.setdefault(gate, []).append(call)
        self.split_gates = list(gates)
        for gate, gated in gates.items():
            self._split(gate, gated, facts, editor)

    def _share_rank_zero_names(self, sites, facts: ScriptFacts, editor: StatementEditor) -> None:
        """A save that now runs on every rank and reads a name bound under a rank-0 `if`
        (`if rank == 0: run_dir = ...`), directly or through values computed from it on
        every rank (`path = f"{run_dir}/m.pt"`, an argument of the function that saves): rank
        0 computes it, broadcast_object_list hands it to the others right after that `if` (or
        after init_process_group), on every rank, before anything reads it; where it cannot
        (analysis/rank_zero_broadcast.py says why), the file is refused at the `if`."""
        shared = set()
        for site in sites:
            if not self.collective.get(site.stmt):
                continue
            for read in rank_zero_names(site.stmt, facts, self.split_gates):
                name, gate = read.name, read.gate
                if (id(gate), name) in shared:
                    continue
                shared.add((id(gate), name))
                how = read.describe(self.line)
                anchor, test, why = broadcast_anchor(read, facts)
                if anchor is None:
                    self.refuse(
                        "FSR704",
                        gate,
                        f"{how} (under `if {code(gate.test)}:`); the save on line {self.line(site.stmt)} that "
                        "reads it now runs on every rank",
                        f"rank 0's value cannot be handed to the other ranks: {why}; without it they would stop "
                        "with a NameError at the first checkpoint, or save elsewhere",
                        f"bind `{name}` on every rank (compute the path everywhere; create directories under "
                        "the rank-0 `if`)",
                    )
                box = self.fresh_name(f"{name}_shared", facts.resolver.enclosing_function(gate))
                editor.insert_after(anchor, [
                    self.stmt(f"{box} = [{name}] if {test} else [None]\n"),
                    self.stmt(f"dist.broadcast_object_list({box}, src=0)  # every rank: the save reads it\n"),
                    self.stmt(f"{name} = {box}[0]\n"),
                ])
                self.add_import("torch.distributed", asname="dist")
                self.change(
                    gate,
                    (f"`{name}`, bound only under `if {code(gate.test)}:`" if read.otherwise is None else
                     f"`{name}`, bound under `if {code(gate.test)}:` on rank 0 and to a value of their own on the "
                     f"other ranks (line {self.line(read.otherwise)})") + ", is broadcast from rank 0 to every rank",
                    f"the save on line {self.line(site.stmt)} runs on every rank now and reads it"
                    + (f" ({how})" if read.chain else ""),
                    "without it the other ranks stop with a NameError at the first checkpoint, or save elsewhere",
                )

    def _calls_of_saving_functions(self, facts: ScriptFacts) -> List[cst.Call]:
        """Calls of the script's functions that (directly or through another) save state: a
        top-level function called by its name, a method called on `self` in its own class."""
        r = facts.resolver
        functions = {f.name.value for f in facts.module.body if isinstance(f, cst.FunctionDef)}

        def key(fn: cst.FunctionDef):
            """What calls name `fn` by: its name, or (its class, its name) for a method."""
            owner = r.enclosing_class(fn)
            if owner is not None and r.parent(r.parent(fn)) is owner:
                return id(owner), fn.name.value
            return fn.name.value if fn.name.value in functions else None

        def callee(call: cst.Call):
            func = call.func
            if isinstance(func, cst.Name) and func.value in functions:
                return func.value
            if type(func) is cst.Attribute and type(func.value) is cst.Name and func.value.value == "self":
                owner = r.enclosing_class(call)
                return (id(owner), func.attr.value) if owner is not None else None
            return None

        saving = {key(r.enclosing_function(stmt)) for stmt in self.collective if r.enclosing_function(stmt) is not None}
        calls = [(c, callee(c)) for c in r.nodes(cst.Call)]
        calls = [(c, k) for c, k in calls if k is not None]
        changed = True
        while changed:
            changed = False
            for call, k in calls:
                caller = r.enclosing_function(call)
                if k in saving and caller is not None and key(caller) not in saving:
                    saving.add(key(caller))
                    changed = True
        return [c for c, k in calls if k in saving]

    def _place_ungated(self, site: SaveSite, facts: ScriptFacts, editor: StatementEditor) -> None:
        """The statements a save needs go right before it (its comments above them); a
        full export's torch.save goes under `if rank == 0:`."""
        stmt = site.stmt
        pre = list(self.pre.get(stmt, []))
        leading = list(getattr(stmt, "leading_lines", []))
        if pre:
            pre[0] = pre[0].with_changes(leading_lines=leading)
            leading = []
            editor.insert_before(stmt, pre)
        if self.collective[stmt]:
            if pre:
                editor.set_leading_lines(stmt, [])
            return
        test = self.rank_zero_test(stmt, facts) or "dist.get_rank() == 0"
        if test.startswith("dist."):
            self.add_import("torch.distributed", asname="dist")
        editor.relead[stmt] = []
        editor.replace(stmt, cst.If(self.expr(test), cst.IndentedBlock([stmt]), leading_lines=leading))

    def _split(self, gate: cst.If, gated: List[cst.Call], facts: ScriptFacts, editor: StatementEditor) -> None:
        """`if A and rank == 0: body` -> `if A: body'`, where body' runs on every rank and
        only its output statements (prints, logs, plain-file writes) keep `if rank == 0:`.
        Assignments run on every rank too: later branches (`if loss < best: save`) must
        take the same way on every rank."""
        rank, other = split_rank_test(gate.test, rank_aliases(gate, facts))
        if gate.orelse is not None or not rank or not isinstance(gate.body, cst.IndentedBlock):
            self.refuse(
                "FSR701",
                gated[0],
                "a checkpoint save inside a rank-0 branch that cannot be split",
                "the save is collective now (every rank writes its shards); under a rank-0 "
                "`if` with an else branch or an `or` the other ranks never join it and the run deadlocks",
                "save on every rank and keep only plain-file writes under the rank-0 `if`",
            )
        self.gate_models = facts.model_names.get(facts.resolver.enclosing_function(gate), set()) | set(
            facts.optimizer_names.get(facts.resolver.enclosing_function(gate), {})
        )
        self.local_functions = {f.name.value for f in facts.module.body if isinstance(f, cst.FunctionDef)}
        body = self._push_down(list(gate.body.body), _conjunction(rank), editor, facts)
        if other:
            pieces = [gate.with_changes(test=_conjunction(other), body=gate.body.with_changes(body=body))]
        else:
            pieces = body
        first = pieces[0]
        if first in self._originals:
            editor.relead[first] = list(gate.leading_lines)
        else:
            pieces[0] = first.with_changes(leading_lines=gate.leading_lines)
        editor.replace(gate, pieces[0])
        editor.insert_after(gate, pieces[1:])
        self.change(
            gate,
            f"the save moves out of `if {code(gate.test)}:` to every rank; prints and plain-file writes stay on rank 0",
            "gathering and saving sharded state is collective: every rank must take part",
            "a collective under a rank-0 `if` deadlocks the other ranks",
        )

    def _push_down(self, stmts, test, editor: StatementEditor, facts: ScriptFacts) -> List[cst.CSTNode]:
        items: List[Tuple[bool, cst.CSTNode]] = []  # (runs on every rank, statement)
        for stmt in stmts:
            items.extend((True, new) for new in self.pre.get(stmt, []))
            self._originals.add(stmt)
            if stmt in self.collective:
                items.append((self.collective[stmt], stmt))
            elif isinstance(stmt, cst.SimpleStatementLine):
                items.append((self._every_rank(stmt, facts), stmt))
            elif isinstance(stmt, (cst.If, cst.For, cst.While, cst.With)) and isinstance(stmt.body, cst.IndentedBlock) and (
                self._needs_every_rank(stmt, facts)
            ):
                items.append((True, self._push_down_compound(stmt, test, editor, facts)))
            else:
                items.append((False, stmt))
        out: List[cst.CSTNode] = []
        run: List[cst.CSTNode] = []
        for i, (every, node) in enumerate(items):
            if not every:
                run.append(node)
            if run and (every or i == len(items) - 1):
                for s in run:
                    if s in self._originals:
                        editor.relead[s] = [] if s is run[0] else list(s.leading_lines)
                out.append(cst.If(test.deep_clone(), cst.IndentedBlock(run), leading_lines=list(run[0].leading_lines)))
                run = []
            if every:
                out.append(node)
        return out

    def _push_down_compound(self, stmt, test, editor: StatementEditor, facts: ScriptFacts) -> cst.CSTNode:
        new = stmt.with_changes(body=stmt.body.with_changes(body=self._push_down(list(stmt.body.body), test, editor, facts)))
        orelse = getattr(stmt, "orelse", None)
        if isinstance(orelse, cst.If):
            new = new.with_changes(orelse=self._push_down_compound(orelse, test, editor, facts))
        elif isinstance(orelse, cst.Else) and isinstance(orelse.body, cst.IndentedBlock):
            inner = self._push_down(list(orelse.body.body), test, editor, facts)
            new = new.with_changes(orelse=orelse.with_changes(body=orelse.body.with_changes(body=inner)))
        return new

    def _every_rank(self, stmt: cst.SimpleStatementLine, facts: ScriptFacts) -> bool:
        """Computations (assignments), anything touching the model, the optimizer or a
        function of the script, and collectives (`loss.backward()`: its gradient
        reduce-scatter; `.full_tensor()`, torch.distributed calls) run on every rank;
        other calls (output) on rank 0."""
        for small in stmt.body:
            if not isinstance(small, cst.Expr):
                return True
            if names_in(small) & (self.gate_models | self.local_functions):
                return True
            if any(id(call) in self.saving_calls for call in calls_in(small)):
                return True
            if any(every_rank_call(call, facts.resolver) for call in calls_in(small)):
                return True
        return False

    def _needs_every_rank(self, stmt, facts: ScriptFacts) -> bool:
        """A compound statement with a save, an assignment or a model use inside."""
        found = []
        collective = self.collective
        every = self._every_rank

        class _V(cst.CSTVisitor):
            def visit_SimpleStatementLine(self, node) -> bool:
                if node in collective or every(node, facts):
                    found.append(node)
                return False

        stmt.body.visit(_V())
        if isinstance(stmt, cst.If) and stmt.orelse is not None:
            stmt.orelse.visit(_V())
        return bool(found)

    # -- async ------------------------------------------------------------------------

    def _nothing_async(self, sites, facts: ScriptFacts) -> None:
        """--async-checkpoint where no save becomes a DCP save: said, not silently ignored."""
        if sites:  # --export full: every save stays one torch.save file
            where, what = sites[0].call, "every checkpoint save stays one torch.save file (--export full)"
        else:
            where, what = facts.models[0].stmt, "the script saves no model or optimizer state"
        self.attention(
            where,
            f"--async-checkpoint changes nothing: {what}",
            "only a DCP save (dcp.save of sharded state) can become dcp.async_save",
        )

    def _async_possible(self, sites, facts: ScriptFacts) -> bool:
        """Async saves keep their future in the function that builds the model."""
        entry = facts.entry_scope if isinstance(facts.entry_scope, cst.FunctionDef) else None
        outside = [s for s in sites if facts.resolver.enclosing_function(s.call) is not entry]
        for site in outside:
            self.attention(
                site.call,
                "--async-checkpoint: this save is outside the function that builds the model; it stays dcp.save",
                "the future of an async save must be waited on before the next save and at the end",
            )
        return not outside

    def _wait_at_the_end(self, sites, facts: ScriptFacts, editor: StatementEditor) -> None:
        block = facts.entry_block
        first = min(
            (facts.resolver.statement_of(s.call) for s in sites if s.stmt in self._async),
            key=lambda s: _position(s, facts),
        )
        top = first
        while top not in list(block.body):
            top = facts.resolver.parent(top)
        # the background save runs its collectives in a gloo group of its own: on the
        # training group they would interleave with the training's (gloo aborts)
        setup = [
            self.stmt(f'{self.group} = dist.new_group(backend="gloo")\n').with_changes(
                leading_lines=[cst.EmptyLine(indent=False)]
            ),
            self.stmt(f"{self.future} = None\n"),
        ]
        editor.insert_before(top, setup)
        self.add_import("torch.distributed", asname="dist")
        wait = self.stmt(f"if {self.future} is not None:\n    {self.future}.result()\n")
        destroy = next(
            (
                s
                for s in block.body
                if isinstance(s, cst.SimpleStatementLine)
                and isinstance(s.body[0], cst.Expr)
                and facts.resolver.is_call_to(s.body[0].value, DESTROY_PROCESS_GROUP)
            ),
            None,
        )
        if destroy is not None:
            editor.insert_before(destroy, [wait])
        else:
            editor.append_to(block, [wait])
        self.change(
            top,
            f"async saves in a gloo group of their own (`{self.group}`); `{self.future}` holds the running "
            "save, waited on before the next save, before a load of it and at the end",
            "dcp.async_save stages to CPU, returns and writes in the background; its collectives must not "
            "interleave with training's, and overlapping saves or an exit before it finishes lose the checkpoint",
        )


def _conjunction(parts) -> cst.BaseExpression:
    expr = parts[0]
    for p in parts[1:]:
        expr = cst.BooleanOperation(expr, cst.And(), p)
    return expr


def _descendants(node):
    found = []

    class _D(cst.CSTVisitor):
        def on_visit(self, n) -> bool:
            found.append(n)
            return True

    node.visit(_D())
    return found


def _position(stmt, facts: ScriptFacts) -> int:
    order = facts.resolver.nodes(cst.SimpleStatementLine)
    return next((i for i, s in enumerate(order) if s is stmt), 0)


def _refuse_unconvertible(stage, every, facts: ScriptFacts) -> None:
    """The saves of sharded state the stage cannot turn into DCP, each refused at its line (FSR706: an
    optimizer lost on the way; FSR708: state handed to a helper's torch.save; FSR707: a sharded module
    pickled whole; FSR709: state held through a name bound to another container)."""
    for site in every:
        for where, why in site.lost:
            stage.refuse(
                "FSR706",
                where,
                f"the optimizer state saved on line {stage.line(site.call)} cannot be followed: {why}",
                "dcp.save needs get_optimizer_state_dict(model, optimizer) of the one model that optimizer "
                "trains; left as state_dict() the checkpoint holds numbered state the resume cannot read",
                "hand the function the same optimizer and its model at every call, or save where they are built",
            )
    for site in every:
        for handing in site.handed_state[:1]:
            stage.refuse(
                "FSR708",
                site.call,
                f"`{code(site.call)}` saves a parameter that the call on line {stage.line(handing)} hands a "
                "sharded model's (or its optimizer's) state",
                "the save is in a helper the state is handed to: converted at its call it would need the helper "
                "rewritten to dcp.save on every rank; left as torch.save every rank writes its own DTensor shards "
                "into the one file, which nothing can load as the model",
                "call torch.save (or the helper's other work) where the state is built, with the state dict "
                "inline (`torch.save({\"state_dict\": model.state_dict(), ...}, path)`): the rewrite converts "
                "that to DCP",
            )
    for site in every:
        for model, node in site.held_models:
            stage.refuse(
                "FSR707",
                node,
                f"the state saved on line {stage.line(site.call)} holds the sharded module `{model}` itself, "
                "pickled whole",
                "a pickled sharded module is one rank's DTensor shards (every rank writing the same file); "
                "no code can load it back as the model",
                f"save `{model}.state_dict()` instead (and load_state_dict it back into a built model): "
                "the rewrite turns that into DCP",
            )
    classes = {c.name.value for c in facts.module.body if type(c) is cst.ClassDef}  # the program's own classes
    for site in every:
        record = site.state if type(site.state) is cst.Call and site.state_calls else None
        if record is not None and type(record.func) is cst.Name and record.func.value in classes:
            stage.refuse(
                "FSR709",
                site.call,
                f"`{code(site.call)}` saves `{code(record.func)}(...)`, an object of a class of the program holding "
                f"`{code(site.state_calls[0].call)}`, a sharded model's (or its optimizer's) state",
                "dcp.save writes a dict of tensors (and reads one back): an object of another type cannot be "
                "saved with it, and left as torch.save every rank would write its own DTensor shards into the "
                "one file",
                "save a dict (`dataclasses.asdict(...)` of the record, or the dict literal itself): the rewrite "
                "turns that into DCP",
            )
    for site in every:
        for name, held in site.nested_state[:1]:
            stage.refuse(
                "FSR709",
                site.call,
                f"`{code(site.call)}` saves `{name.value}` inside what it writes, and `{name.value}` holds "
                f"`{code(held)}` (line {stage.line(held)}), a sharded model's (or its optimizer's) state",
                "the rewrite converts a save where the state dict sits in the saved object itself; through a "
                "name bound to another dict (or a record built from it) the torch.save would stay, and every rank "
                "would write its own DTensor shards into the one file: a checkpoint nothing can load as the model",
                "put the state dicts in the saved object itself (`torch.save({\"net\": net.state_dict(), ...}, "
                "path)`, nested dict literals included): the rewrite turns that into DCP, and the load too",
            )
