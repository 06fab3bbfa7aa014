"""resume: loads of checkpoints into the sharded model and optimizer.

A path this script saves with DCP is loaded with dcp.load into state dicts built
from the sharded model and optimizer, then set_*_state_dict; a single file (an
--export full save, or weights from elsewhere) is loaded with full_state_dict and
broadcast_from_rank0. A path this script saves that a resume may read before its first
save is told apart at run time (os.path.isdir): a single-GPU run's file there is read with
torch.load and set with full_state_dict=True, then moved aside for the DCP save (those
run-time loads: resume_either.py). Copies of a checkpoint directory become copytree on rank 0.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.syntax.torch_api import RNG_STATES
from fsdp2_retrofit.analysis.checkpoints import (
    LoadSite,
    LoadUse,
    calls_to,
    loads,
    may_be_tensor,
    path_key,
    saved_dict_keys,
)
from fsdp2_retrofit.analysis.resume_loads import (
    COPIES,
    CheckpointSaves,
    before_every_loop,
    bound_before,
    bound_only_after,
    checkpoint_saves,
    config_first,
    inside,
    mode_set_next,
    trained_after,
)
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

from .checkpoint import FUTURE, STATE_DICT_MODULE
from .resume_either import BROADCAST, RunTimeFormatLoads, strict_option

READERS = {"shutil.move", "builtins.open", "os.path.getsize"} | COPIES
IS_FILE = {"os.path.isfile"}


class ConvertLoadsCommand(RunTimeFormatLoads, RetrofitStage):
    DESCRIPTION = "Load checkpoints into the sharded model and optimizer (dcp.load + set_*_state_dict)."
    CODE = "resume"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not facts.models:
            return
        self.saved: CheckpointSaves = checkpoint_saves(facts, self.options.export)
        self.__dict__["_dcp_loaded"] = []  # the load sites _dcp_load converts
        for site in loads(facts):
            self._convert_load(site, facts, editor)
        self._other_readers(facts, editor)

    def _take_name(self, wanted: str, scope) -> str:
        """A fresh name the new code binds in `scope`: later fresh names there avoid it."""
        name = self.fresh_name(wanted, scope)
        self.__dict__["_visible"][id(scope)].add(name)
        return name

    # -- torch.load ---------------------------------------------------------------

    def _convert_load(self, site: LoadSite, facts: ScriptFacts, editor: StatementEditor) -> None:
        for use in site.uses:
            if use.lost is not None:
                self.refuse(
                    "FSR805",
                    use.lost[0],
                    f"the optimizer state loaded on line {self.line(use.call)} cannot be followed: {use.lost[1]}",
                    "set_optimizer_state_dict needs the one model the receiving optimizer trains",
                    "hand the function the same optimizer and its model at every call, or load where they are built",
                )
        if site.path_key in self.saved.whole_saves and site.var is not None:
            self._whole_model_reload(site, facts, editor)
            return
        state_uses = [u for u in site.uses if u.kind in ("model", "optimizer")]
        origin = self.saved.origin(site)
        if origin == "full":
            if state_uses:
                self._load_full(site, state_uses, facts, editor)
            return
        if origin == "either" and site.var is None and [u.kind for u in site.uses] == ["model"]:
            self._require_built(site, state_uses, facts)
            self._load_either(site, facts, editor)
            return
        if origin == "either" and state_uses and all(u.key is None and u.kind == "model" for u in state_uses):
            self.attention(
                site.call,
                f"`{code(site.path)}` is loaded as a single torch.save file (full state, broadcast from rank 0): "
                "check that it never names this script's own model save, now a DCP directory",
                "the path is not one this script saves to; in this shape (the loaded object kept in a "
                "variable) the tool cannot tell the two apart at run time",
            )
            self._load_full(site, state_uses, facts, editor)
            return
        if (origin == "dcp" and site.var is None and [u.kind for u in site.uses] == ["model"]
                and site.path_key not in self.saved.copy_dests and not self.saved.saved_before(site, facts)):
            # a resume at the start: the path may still hold the single-GPU run's file
            self._require_built(site, state_uses, facts)
            self._load_either(site, facts, editor, saved_here=True)
            return
        # a load kept in a variable is told apart at run time (_file_or_directory, _run_time_options)
        if origin == "either" and state_uses and site.var is None:
            self.attention(
                site.call,
                f"`{code(site.path)}` is loaded as a DCP checkpoint directory of this script (dcp.load): "
                "check that it names one; a single torch.save file there (a single-GPU run's) fails to load",
                "the path is not one this script saves to, but what is read from it is what its DCP saves write; "
                "a single-GPU checkpoint converts with `fsdp2-retrofit convert FILE DIR`, "
                "but only for the model (its optimizer state is keyed by parameter number, not name)",
            )
        if site.unknown_use is not None or not state_uses or (
            site.var and any(u.key is None for u in site.uses) and len(site.uses) > 1
        ):
            self.attention(
                site.call,
                f"reads `{code(site.path)}`, which is now a DCP checkpoint directory",
                "torch.load cannot read it, and the tool cannot follow every read of what it returns: "
                "load it with dcp.load into get_model_state_dict(model) / get_optimizer_state_dict(model, optimizer) "
                "and set_model_state_dict / set_optimizer_state_dict",
            )
            return
        late = config_first(site, facts)
        if late is not None:
            self._load_config_first(site, late, facts, editor)
            return
        self._require_built(site, state_uses + [u for u in site.uses if u.kind == "stateful"], facts)
        self._load_dcp(site, facts, editor)

    # -- a pickled module reloaded: `torch.save(model, p)` ... `model = torch.load(p)` ----

    def _whole_model_reload(self, site: LoadSite, facts: ScriptFacts, editor: StatementEditor) -> None:
        """The save writes the model's state dict now; `model = torch.load(p)` becomes a load
        of it into the sharded model itself, where nothing trains it afterwards (the original
        rebinds the name to a new module that its optimizer does not hold)."""
        model, form = self.saved.whole_saves[site.path_key]
        path = code(site.path)
        if site.var != model:
            self.refuse(
                "FSR804",
                site.call,
                f"`{site.var} = torch.load({path})` unpickles a second copy of `{model}`",
                f"the save on that path now writes `{model}`'s state dict as a DCP directory (torch.load of it "
                f"fails), and `{site.var}` is not the sharded model it could be loaded into",
                f"save `{model}.state_dict()` and build `{site.var}` as `{model}` is built, then "
                f"`{site.var}.load_state_dict(torch.load({path}))`",
            )
        problem = trained_after(site, facts)
        if problem:
            self.refuse(
                "FSR804",
                site.call,
                f"`{model} = torch.load({path})` reloads a pickled module and {problem}",
                "the save now writes the sharded model's state dict (torch.load of it fails); loading it into the "
                f"live model would let training go on with it, where the original's optimizer trains the module "
                f"`{model}` named before this line",
                f"save `{model}.state_dict()` and reload with `{model}.load_state_dict(torch.load({path}))`",
            )
        use = LoadUse(site.call, site.stmt, None, "model", model, model, None)
        scope = facts.resolver.enclosing_function(site.stmt)
        if form == "dcp":
            var = self._take_name(f"{model}_state", scope)
            new = [*self._reshard(use, facts), self.stmt(f"{var} = get_model_state_dict({model})\n"),
                   *self._dcp_load(var, path, site, facts), self.stmt(f"set_model_state_dict({model}, {var})\n")]
            self.add_import("torch.distributed.checkpoint", asname="dcp")
            self.add_import(STATE_DICT_MODULE, "get_model_state_dict")
            how = "dcp.load into get_model_state_dict, then set_model_state_dict"
        else:
            test = self.rank_zero_test(site.stmt, facts) or "dist.get_rank() == 0"
            new = [self.stmt("dist.barrier()  # every rank reads the file rank 0 wrote\n"),
                   *self._reshard(use, facts),
                   self.stmt(f"set_model_state_dict({model}, {code(site.call)} if {test} else {{}}, "
                             f"options={BROADCAST})\n")]
            self.add_import("torch.distributed", asname="dist")
            self.add_import(STATE_DICT_MODULE, "StateDictOptions")
            how = "rank 0 reads the file, set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)"
        self.add_import(STATE_DICT_MODULE, "set_model_state_dict")
        new[0] = new[0].with_changes(leading_lines=site.stmt.leading_lines)
        editor.replace(site.stmt, new[0])
        editor.insert_after(site.stmt, new[1:])
        self.change(
            site.stmt,
            f"`{model} = torch.load({path})` (a pickled module) loads the saved state into the sharded `{model}`: {how}",
            f"the save writes `{model}`'s state dict now; nothing trains `{model}` after this line, so loading into "
            "it is what rebinding it to the unpickled copy did",
            "torch.load of a DCP directory fails (IsADirectoryError); a pickled sharded module holds one rank's shards",
        )
        if not mode_set_next(site, model, facts):
            self.attention(
                site.stmt,
                f"the unpickled `{model}` came back in the train/eval mode it was saved in; the loaded state leaves "
                f"`{model}` in the mode it has here",
                f"call `{model}.eval()` (or `.train()`) after the load if dropout or batch norm must act as at the save",
            )

    # -- the config first: read it, build the model from it, then load the state ------

    def _load_config_first(self, site: LoadSite, late: cst.If, facts: ScriptFacts, editor: StatementEditor) -> None:
        """The plain values are read with dcp.load before the model is built; the model's,
        optimizer's and other states with a second dcp.load in the later `if`, after sharding."""
        path, var = code(site.path), site.var
        values: Dict[str, str] = {}
        states: Dict[str, str] = {}
        for use in site.uses:
            template = _entry_template(self.saved, use, facts, site.stmt)
            (values if use.kind == "value" else states).setdefault(use.key, template)
        options = self._run_time_options(site, facts)
        new = []
        if options is not None:  # a DCP directory or a single file, told apart at run time
            self.add_import("os")
            self.add_import(STATE_DICT_MODULE, "StateDictOptions")
            new.append(self._either_first(site, values, options, facts))
        elif values:
            new.append(self.stmt(f"{var} = {self._dict_text(values, site.stmt)}  # the values read before the model exists\n"))
            new.extend(self._dcp_load(var, path, site, facts))
        else:
            new.append(self.stmt(f"{var} = {{}}\n"))
        new[0] = new[0].with_changes(leading_lines=site.stmt.leading_lines)
        editor.replace(site.stmt, new[0])
        editor.insert_after(site.stmt, new[1:])
        moved = []
        for use in site.uses:
            if use.kind == "model" and not inside(use.stmt, late, facts):
                editor.replace(use.stmt, None)
                moved.append(self.stmt(_set_state(use, options)))
            elif use.kind in ("model", "optimizer"):
                self._replace_load(use, self.stmt(_set_state(use, options)), facts, editor)
        update = f"{var}.update({self._dict_text(states, late.body.body[0])})\n"
        if options is None:
            loads = [self.stmt(update), *self._dcp_load(var, path, site, facts)]
        else:
            loads = [self._either_late(site, update, options, facts)]
        editor.insert_before(late.body.body[0], [*loads, *moved])
        self._load_imports(site)
        self.change(
            site.stmt,
            f"read {', '.join(repr(k) for k in values) or 'nothing'} from `{path}` with dcp.load before the "
            f"model is built; the states ({', '.join(repr(k) for k in states)}) with a second dcp.load in the "
            f"later `if {code(late.test)}:`, after sharding and building the optimizer"
            + ("; a single torch.save file there (a single-GPU run's) is read whole with torch.load on every "
               "rank instead, its full states set with full_state_dict=True" if options is not None else ""),
            "the config is read first to build the model from it; DCP loads the sharded state into the state "
            "dicts of the sharded model and its optimizer, which exist only later"
            + ("; a run switched to FSDP2 resumes from the checkpoint its single-GPU run left at that path"
               + ("; the file is then renamed to `" + path + "` + \".single-gpu\" (rank 0), since this script's DCP "
                  "saves write a directory at that path" if site.path_key in self.saved.dcp_paths else "")
               if options is not None else ""),
            "torch.load of a DCP directory fails; a state loaded before fully_shard is not what the shards hold",
        )

    def _require_built(self, site: LoadSite, uses: List[LoadUse], facts: ScriptFacts) -> None:
        """DCP loads into the model's own (sharded) state dict: it must exist first."""
        for use in uses:
            if bound_only_after(use.owner, site.stmt, facts):
                self.refuse(
                    "FSR801",
                    site.call,
                    f"the checkpoint is read before `{use.owner}` is built",
                    "dcp.load fills the state dicts of the sharded model, its optimizer and scheduler, so they "
                    "must exist when the checkpoint is loaded",
                    f"build `{use.owner}` before loading, then load its state",
                )
            if use.kind == "optimizer" and not use.model:
                self.refuse(
                    "FSR802",
                    site.call,
                    f"`{use.owner}` trains several models",
                    "get_optimizer_state_dict / set_optimizer_state_dict take the one model the optimizer trains",
                    "give each model its own optimizer, and load each with its model",
                )

    def _load_dcp(self, site: LoadSite, facts: ScriptFacts, editor: StatementEditor) -> None:
        scope = facts.resolver.enclosing_function(site.stmt)
        path = code(site.path)
        new: List[cst.CSTNode] = []
        if site.var is None:  # model.load_state_dict(torch.load(path))
            use = site.uses[0]
            var = self._take_name("state_dict" if use.kind == "model" else "optim_state_dict", scope)
            new.append(self.stmt(f"{var} = {_template(use)}\n"))
            new.extend(self._dcp_load(var, path, site, facts))
            new.extend(self._reshard(use, facts))
            new.append(self.stmt(_setter(use, var)))
            editor.replace(site.stmt, new[0].with_changes(leading_lines=site.stmt.leading_lines))
            editor.insert_after(site.stmt, new[1:])
        else:
            var = site.var
            whole = [u for u in site.uses if u.key is None]
            if whole:
                template = _template(whole[0])
            else:
                entries: Dict[str, str] = {}
                for use in site.uses:
                    entries.setdefault(use.key, _entry_template(self.saved, use, facts, site.stmt))
                template = self._dict_text(entries, site.stmt)
            editor.replace(
                site.stmt, self.stmt(f"{var} = {template}\n").with_changes(leading_lines=site.stmt.leading_lines)
            )
            options = self._file_or_directory(site, facts, editor)
            for use in site.uses:
                if use.kind in ("model", "optimizer"):
                    self._replace_load(use, self.stmt(_set_state(use, options)), facts, editor)
        self._load_imports(site)
        tensors = sorted(
            {u.key for u in site.uses if u.kind == "value" and may_be_tensor(self.saved.saved_values.get(u.key), facts)
             and _value_template(self.saved, u.key, facts, site.stmt) == "None"}
        )
        rng = sorted({u.key for u in site.uses if u.kind == "value" and self.saved.saved_values.get(u.key) is not None
                      and facts.resolver.is_call_to(self.saved.saved_values[u.key], RNG_STATES)})
        if tensors:
            self.attention(
                site.stmt,
                f"{', '.join(repr(k) for k in tensors)} may be saved as a tensor: its dcp.load placeholder is None",
                "dcp.load needs a tensor of the saved shape to load a tensor into (e.g. `torch.zeros(())` "
                "for a scalar loss); save plain values with .item() or give the placeholder",
            )
        loaded = ", ".join(sorted({f"`{u.owner}`" for u in site.uses if u.kind in ("model", "optimizer")}))
        others = sorted({u.key for u in site.uses if u.kind in ("stateful", "value") and u.key})
        self.change(
            site.stmt,
            f"load `{path}` with dcp.load into the state dicts of the sharded {loaded}, then set_*_state_dict"
            + (f"; {', '.join(repr(k) for k in others)} restored from the checkpoint as saved" if others else ""),
            "the checkpoint is a DCP directory of shards: each rank reads its own, for any number of ranks "
            "(os.path.exists still finds it)"
            + (f"; the RNG state ({', '.join(repr(k) for k in rng)}) is saved once (DCP keeps one copy of a value "
               "every rank holds) and every rank restores that copy: ranks seeded alike hold the same state"
               if rng else ""),
            "torch.load of a DCP directory fails; plain tensors loaded into DTensor parameters are wrong",
        )

    def _load_imports(self, site: LoadSite) -> None:
        """dcp, and the get_/set_*_state_dict of the states the load reads (StateDictOptions
        where a load_state_dict passed `strict`)."""
        self.add_import("torch.distributed.checkpoint", asname="dcp")
        kinds = {u.kind for u in site.uses}
        for kind in ("model", "optimizer"):
            if kind in kinds:
                self.add_import(STATE_DICT_MODULE, f"get_{kind}_state_dict")
                self.add_import(STATE_DICT_MODULE, f"set_{kind}_state_dict")
        if any(strict_option(u.call) for u in site.uses if u.kind in ("model", "optimizer")):
            self.add_import(STATE_DICT_MODULE, "StateDictOptions")

    def _replace_load(self, use: LoadUse, new: cst.CSTNode, facts: ScriptFacts, editor: StatementEditor) -> None:
        """`owner.load_state_dict(...)` -> `new`, after a reshard where the model may be unsharded."""
        reshard = self._reshard(use, facts)
        if reshard:
            editor.insert_before(use.stmt, [reshard[0].with_changes(leading_lines=use.stmt.leading_lines)])
            editor.replace(use.stmt, new)
        else:
            editor.replace(use.stmt, new.with_changes(leading_lines=use.stmt.leading_lines))

    def _reshard(self, use: LoadUse, facts: ScriptFacts) -> List[cst.CSTNode]:
        """Every unit's `reshard()` before loading into a model that may have run a forward
        without a backward since (an evaluation): FSDP2 leaves the root's parameters (and,
        with reshard_after_forward=False, the last block's) unsharded then, and
        load_state_dict cannot copy DTensors into them. Not needed
        before a training loop of the same function has started."""
        if use.kind != "model":
            return []
        if before_every_loop(use.stmt, facts):
            return []
        function = facts.resolver.enclosing_function(use.stmt)
        # the root, and under the default reshard policy the last block, keep their
        # parameters gathered after a forward: reshard every unit
        var = self.fresh_name("module", function)
        self.add_import(self.options.fsdp_module, "FSDPModule")
        return [self.stmt(
            f"for {var} in {use.owner}.modules():\n    if isinstance({var}, FSDPModule):\n        {var}.reshard()\n"
        )]

    def _dcp_load(self, var: str, path: str, site: LoadSite, facts: ScriptFacts,
                  barrier: bool = True) -> List[cst.CSTNode]:
        """dcp.load, after a running async save (earlier in the same function) finishes."""
        self.__dict__.setdefault("_dcp_loaded", []).append(site)
        load = self.stmt(f"dcp.load({var}, checkpoint_id={path})\n")
        out = self._copy_barrier(site) if barrier else []
        if self.options.async_checkpoint and self.saved.async_save_before(site.stmt, facts):
            future = self.fresh_name(FUTURE, facts.resolver.enclosing_function(site.stmt))
            out.append(self.stmt(f"if {future} is not None:\n    {future}.result()\n"))
        return out + [load]

    def _async_wait(self, stmt, facts: ScriptFacts) -> List[cst.CSTNode]:
        """The wait for a running async save (earlier in the same function) before `stmt`
        reads what it writes: a copy made meanwhile holds a half-written checkpoint."""
        if not (self.options.async_checkpoint and self.saved.async_save_before(stmt, facts)):
            return []
        future = self.fresh_name(FUTURE, facts.resolver.enclosing_function(stmt))
        return [self.stmt(f"if {future} is not None:  # the copy reads the finished checkpoint\n"
                          f"    {future}.result()\n")]

    def _copy_barrier(self, site: LoadSite) -> List[cst.CSTNode]:
        """A load of a path rank 0 copies a checkpoint directory to waits until the copy is
        complete: without it another rank can read the copy's .metadata mid-copy."""
        if site.path_key not in self.saved.copy_dests:
            return []
        self.add_import("torch.distributed", asname="dist")
        return [self.stmt("dist.barrier()  # rank 0 copies this checkpoint: read it once the copy is complete\n")]

    def _dict_text(self, entries: Dict[str, str], stmt) -> str:
        items = [f'"{k}": {v}' for k, v in entries.items()]
        one_line = "{" + ", ".join(items) + "}"
        indent = self._indent_of(stmt)
        if len(indent) + len(one_line) + 12 <= 100:
            return one_line
        # continuation lines are relative to the statement's own indentation
        inner = self.config.default_indent
        return "{\n" + "".join(f"{inner}{item},\n" for item in items) + "}"

    def _indent_of(self, stmt) -> str:
        depth = sum(1 for a in self.facts.resolver.ancestors(stmt) if isinstance(a, cst.IndentedBlock))
        return self.config.default_indent * depth

    def _load_full(self, site: LoadSite, uses: List[LoadUse], facts: ScriptFacts, editor: StatementEditor) -> None:
        """A single full-state file into the sharded model: rank 0 reads it, its tensors
        are broadcast and each rank keeps its shard."""
        converted = False
        for use in uses:
            if use.kind != "model":
                self.attention(
                    use.stmt,
                    f"loads a single-file optimizer state into `{use.owner}`",
                    "use set_optimizer_state_dict(model, optimizer, state, "
                    "options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))",
                )
                continue
            if site.var is None:  # only rank 0 reads the file
                test = self.rank_zero_test(use.stmt, facts) or "dist.get_rank() == 0"
                if test.startswith("dist."):
                    self.add_import("torch.distributed", asname="dist")
                arg = f"{code(use.call.args[0].value)} if {test} else {{}}"
            else:
                arg = code(use.node)
            setter = self.stmt(f"set_model_state_dict({use.owner}, {arg}, options={BROADCAST})\n")
            self._replace_load(use, setter, facts, editor)
            self.add_import(STATE_DICT_MODULE, "set_model_state_dict")
            self.add_import(STATE_DICT_MODULE, "StateDictOptions")
            converted = True
            self.change(
                use.stmt,
                f"load the single file `{code(site.path)}` into the sharded `{use.owner}` with "
                "set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)",
                "rank 0's full tensors are broadcast and each rank keeps its shard",
                "load_state_dict of plain tensors into DTensor parameters fails",
            )
        if converted and site.var is not None and site.path_key in self.saved.full_paths:
            # every rank reads the file rank 0 wrote: wait until it is written
            barrier = self.stmt("dist.barrier()\n").with_changes(leading_lines=site.stmt.leading_lines)
            editor.insert_before(site.stmt, [barrier])
            editor.set_leading_lines(site.stmt, [])
            self.add_import("torch.distributed", asname="dist")

    # -- other readers ------------------------------------------------------------

    def _other_readers(self, facts: ScriptFacts, editor: StatementEditor) -> None:
        """A copy of a checkpoint directory becomes a copytree on rank 0, `os.path.isfile(path)` (a
        resume's `if`) `os.path.exists(path)`; other reads are reported."""
        r = facts.resolver
        guards = []  # `os.path.isfile(path)` in the test of an `if` around a load of `path` now read by dcp.load
        for site in self.__dict__.get("_dcp_loaded", []):
            for anc in r.ancestors(site.stmt):
                if isinstance(anc, cst.FunctionDef):
                    break
                if isinstance(anc, cst.If):
                    guards += [c for c in r.descendants(anc.test, cst.Call) if r.is_call_to(c, IS_FILE)
                               and len(c.args) == 1 and code(c.args[0].value) == code(site.path) and c not in guards]
        for call in guards:
            path = code(call.args[0].value)
            editor.replace_expression(call, self.expr(f"os.path.exists({path})"))
            self.add_import("os")
            self.change(
                call,
                f"`{code(call)}` -> `os.path.exists({path})`",
                "the checkpoint is now a DCP directory: isfile would be False for it, and the run would "
                "silently start over instead of resuming",
            )
        for call in calls_to(facts, READERS):
            if not call.args or path_key(call.args[0].value, facts) not in self.saved.dcp_paths:
                continue
            path = code(call.args[0].value)
            stmt = facts.resolver.statement_of(call)
            if _is_statement_call(stmt, call) and facts.resolver.is_call_to(call, COPIES) and len(call.args) == 2:
                dst = code(call.args[1].value)
                copy = self.stmt(f"if dist.get_rank() == 0:\n    shutil.copytree({path}, {dst}, dirs_exist_ok=True)\n")
                wait = self._async_wait(stmt, facts)
                new = [*wait, copy]
                editor.replace(stmt, new[0].with_changes(leading_lines=stmt.leading_lines))
                editor.insert_after(stmt, new[1:])
                self.add_import("torch.distributed", asname="dist")
                self.change(
                    stmt,
                    f"copy the checkpoint directory `{path}` with shutil.copytree, on rank 0",
                    "the checkpoint is now a directory; one rank copies it (a plain file operation)",
                    "copyfile of a directory fails",
                )
            else:
                self.attention(
                    call,
                    f"reads `{path}`, which is now a DCP checkpoint directory",
                    "load it with dcp.load into get_model_state_dict(model) and set_model_state_dict, "
                    "or copy it with shutil.copytree (on one rank)",
                )


def _template(use: LoadUse) -> str:
    """What dcp.load fills for one read of the checkpoint."""
    if use.kind == "model":
        return f"get_model_state_dict({use.owner})"
    if use.kind == "optimizer":
        return f"get_optimizer_state_dict({use.model}, {use.owner})"
    if use.kind == "stateful":
        return f"{use.owner}.state_dict()"
    return "None"  # a plain value (step, epoch): DCP restores it as saved


def _value_template(saved: CheckpointSaves, key: str, facts: ScriptFacts, load=None) -> str:
    """The dcp.load placeholder of a value that is not a model's or optimizer's state:
    None (DCP restores a plain value as saved); for a dict the save writes with keys
    fixed in the source, a dict of those keys (DCP flattens saved dicts); a tensor
    where the value may be one (DCP loads a saved tensor only into a tensor of its
    shape): for an RNG state the same call (`torch.get_rng_state()`), for a name bound
    before the load a clone of its value when that is a tensor. A wrong placeholder
    fails the load loudly (size or type mismatch); a saved plain value replaces a
    tensor placeholder."""
    value = saved.saved_values.get(key)
    if value is not None and facts.resolver.is_call_to(value, RNG_STATES) and not value.args:
        return code(value)
    keys = saved_dict_keys(value, facts)
    if keys:
        return "{" + ", ".join(f'"{k}": None' for k in keys) + "}"
    if isinstance(value, cst.Name) and load is not None and may_be_tensor(value, facts) and (
            bound_before(value.value, load, facts)):
        return f"{value.value}.clone() if torch.is_tensor({value.value}) else None"
    return "None"


def _entry_template(saved: CheckpointSaves, use: LoadUse, facts: ScriptFacts, load) -> str:
    """What dcp.load fills for one entry of a checkpoint dict."""
    return _value_template(saved, use.key, facts, load) if use.kind == "value" else _template(use)


def _set_state(use: LoadUse, options: Optional[str]) -> str:
    """The set_*_state_dict that replaces a load_state_dict of what the checkpoint holds,
    with the options named `options` where the file is told apart at run time."""
    state = code(use.node)
    return _setter(use, state) if options is None else _setter_with(use, state, options)


def _setter(use: LoadUse, state: str) -> str:
    options = strict_option(use.call)
    if use.kind == "model":
        return f"set_model_state_dict({use.owner}, {state}{options})\n"
    return f"set_optimizer_state_dict({use.model}, {use.owner}, {state}{options})\n"


def _setter_with(use: LoadUse, state: str, options: str) -> str:
    if use.kind == "model":
        return f"set_model_state_dict({use.owner}, {state}, options={options})\n"
    return f"set_optimizer_state_dict({use.model}, {use.owner}, {state}, options={options})\n"


def _is_statement_call(stmt, call) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and stmt.body[0].value is call
    )
