"""The resume stage's loads of a path that may hold this script's DCP checkpoint
directory or one torch.save file (a single-GPU run's, an --export full or `fsdp2-retrofit
convert` file, pretrained weights): told apart at run time with os.path.isdir. The
directory is read with dcp.load into the sharded state dicts; the file whole, its full
tensors set with full_state_dict=True (each rank keeps its shards), and moved aside
(`path` + ".single-gpu") where this script's DCP saves write a directory at that path."""
from __future__ import annotations

from typing import Dict, Optional

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.checkpoints import LoadSite
from fsdp2_retrofit.rewrite.edit import aside_path, with_keyword
from fsdp2_retrofit.rewrite.stage import StatementEditor

from .checkpoint import STATE_DICT_MODULE

BROADCAST = "StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)"


class RunTimeFormatLoads:
    """Mixin of the resume stage (a RetrofitStage): its `saved` (analysis/resume_loads.py),
    `_take_name`, `_dcp_load`, `_reshard`, `_copy_barrier` and `_dict_text` build the parts
    these loads share with the others."""

    def _run_time_options(self, site: LoadSite, facts: ScriptFacts) -> Optional[str]:
        """The name of the set_*_state_dict options when a load kept in a variable is told
        apart at run time (a DCP directory or one torch.save file); None where it stays a
        dcp.load only: the loads disagree on `strict`, or the path holds a DCP directory
        for sure (where this script copies its checkpoint directory, or after a save of it)."""
        states = [u for u in site.uses if u.kind in ("model", "optimizer")]
        if len({strict_value(u.call) for u in states}) > 1 or site.path_key in self.saved.copy_dests or (
            self.saved.saved_before(site, facts)
        ):
            return None
        return self._take_name(f"{site.var}_options", facts.resolver.enclosing_function(site.stmt))

    def _either_first(self, site: LoadSite, values: Dict[str, str], options: str, facts: ScriptFacts) -> cst.CSTNode:
        """`if os.path.isdir(path):` the values with dcp.load, `else:` the whole file with
        torch.load on CPU (moved aside when this script saves a DCP directory there)."""
        var, path = site.var, code(site.path)
        if values:
            loads = self._dcp_load(var, path, site, facts)
            first = f"{var} = {self._dict_text(values, site.stmt)}  # the values read before the model exists\n"
            dcp_text = _indented(first) + "".join(f"    {code(s).strip()}\n" for s in loads)
        else:
            dcp_text = f"    {var} = {{}}\n"
        text = _isdir_text(site, dcp_text, options)
        if site.path_key in self.saved.dcp_paths:  # dcp.save makes a directory there: the file moves aside once read
            text += self._move_aside(site, facts)
        return self.stmt(text)

    def _move_aside(self, site: LoadSite, facts: ScriptFacts) -> str:
        """The end of the `else:` that read a single file where this script saves a DCP
        directory: once every rank has read it, rank 0 renames it (`path` + ".single-gpu")."""
        path = code(site.path)
        test = self.rank_zero_test(site.stmt, facts) or "dist.get_rank() == 0"
        self.add_import("torch.distributed", asname="dist")
        return (
            "    dist.barrier()  # every rank has read the file; this script saves a DCP directory there\n"
            f"    if {test}:\n"
            f"        os.replace({path}, {aside_path(site.path, path)})\n"
            "    dist.barrier()\n"
        )

    def _either_late(self, site: LoadSite, update: str, options: str, facts: ScriptFacts) -> cst.CSTNode:
        """In the later `if`: the states with dcp.load from a directory; from a single file
        they are in memory already (a numbered optimizer state keyed by parameter name)."""
        var, path = site.var, code(site.path)
        loads = self._dcp_load(var, path, site, facts)
        text = (
            f"if not {options}.full_state_dict:  # this script's DCP checkpoint: the sharded states\n"
            + _indented(update)
            + "".join(f"    {code(s).strip()}\n" for s in loads)
        )
        scope = facts.resolver.enclosing_function(site.stmt)
        rekeys = "".join(
            _named_optimizer_state(code(u.node), u.model, u.owner, self.fresh_name, scope)
            for u in site.uses if u.kind == "optimizer"
        )
        if rekeys:
            text += "else:  # the single file's full states, as the single-GPU run saved them\n" + rekeys
        return self.stmt(text)

    def _file_or_directory(self, site: LoadSite, facts: ScriptFacts, editor: StatementEditor) -> Optional[str]:
        """After `var = <template>`: `if os.path.isdir(path):` dcp.load (this script's own
        save), `else:` torch.load of one file on CPU on every rank (a single-GPU run's
        checkpoint, an --export full or `fsdp2-retrofit convert` file), whose full tensors
        the setters shard (full_state_dict=True). Returns the name of the options the
        setters take; None (a dcp.load only) where the loads disagree on `strict`, the path
        is where this script copies its checkpoint directory, or a save of it comes first."""
        var, path = site.var, code(site.path)
        states = [u for u in site.uses if u.kind in ("model", "optimizer")]
        options = self._run_time_options(site, facts)
        if options is None:
            editor.insert_after(site.stmt, self._dcp_load(var, path, site, facts))
            return None
        scope = facts.resolver.enclosing_function(site.stmt)
        loads = self._dcp_load(var, path, site, facts)
        before, load = loads[:-1], loads[-1]
        text = _isdir_text(site, f"    {code(load).strip()}\n", options)
        for use in states:
            if use.kind == "optimizer":
                text += _named_optimizer_state(code(use.node), use.model, use.owner, self.fresh_name, scope)
        moved = site.path_key in self.saved.dcp_paths
        if moved:  # dcp.save makes a directory there: the file moves aside once every rank has read it
            text += self._move_aside(site, facts)
        editor.insert_after(site.stmt, [*before, self.stmt(text)])
        self.add_import("os")
        self.add_import(STATE_DICT_MODULE, "StateDictOptions")
        self.change(
            site.stmt,
            f"`{path}` is loaded by what it is at run time: a directory (this script's DCP save) with dcp.load; "
            "a single file (the single-GPU script's torch.save, an --export full or `fsdp2-retrofit convert` "
            "file) with torch.load on CPU on every rank, its full tensors set with "
            "set_*_state_dict(full_state_dict=True), each rank keeping its shards",
            "a run switched to FSDP2 resumes from the checkpoint its single-GPU run left at that path"
            + ("; the single-GPU optimizer state numbers parameters in the optimizer's order, and is keyed by "
               "parameter name before it is set" if any(u.kind == "optimizer" for u in states) else "")
            + (f"; the file is then renamed to `{path}` + \".single-gpu\" (rank 0), since this script's DCP saves "
               "write a directory at that path (the original overwrote the file)" if moved else ""),
            "dcp.load of a single file fails (NotADirectoryError); torch.load of a DCP directory fails",
        )
        return options

    def _load_either(self, site: LoadSite, facts: ScriptFacts, editor: StatementEditor,
                     saved_here: bool = False) -> None:
        """`model.load_state_dict(torch.load(path))` where `path` may name this script's
        DCP directory or a single file: told apart at run time by os.path.isdir.
        `saved_here`: this script saves a DCP directory at the path later; the file
        moves aside once loaded."""
        use = site.uses[0]
        scope = facts.resolver.enclosing_function(site.stmt)
        path = code(site.path)
        var = self._take_name("state_dict", scope)
        test = self.rank_zero_test(use.stmt, facts) or "dist.get_rank() == 0"
        if test.startswith("dist."):
            self.add_import("torch.distributed", asname="dist")
        strict = strict_option(use.call)
        options = BROADCAST if not strict else BROADCAST[:-1] + ", " + strict[len(", options=StateDictOptions("):]
        load = "".join(
            "".join(f"    {line}\n" for line in code(s).rstrip("\n").splitlines())
            for s in self._dcp_load(var, path, site, facts, barrier=False)
        )
        text = (
            f"if os.path.isdir({path}):  # a DCP checkpoint directory: this script's own save\n"
            f"    {var} = get_model_state_dict({use.owner})\n"
            + load
            + f"    set_model_state_dict({use.owner}, {var}{strict})\n"
            "else:  # one torch.save file: the single-GPU script's, or weights from elsewhere\n"
            f"    set_model_state_dict({use.owner}, {code(use.call.args[0].value)} if {test} else {{}}, "
            f"options={options})\n"
        )
        if saved_here:  # every rank has its shards once the broadcast is done
            text += (f"    if {test}:  # this script saves a DCP directory there\n"
                     f"        os.replace({path}, {aside_path(site.path, path)})\n"
                     "    dist.barrier()\n")
            self.add_import("torch.distributed", asname="dist")
        new = [*self._copy_barrier(site), *self._reshard(use, facts), self.stmt(text)]
        new[0] = new[0].with_changes(leading_lines=site.stmt.leading_lines)
        editor.replace(site.stmt, new[0])
        editor.insert_after(site.stmt, new[1:])
        self.add_import("os")
        self.add_import("torch.distributed.checkpoint", asname="dcp")
        for name in ("StateDictOptions", "get_model_state_dict", "set_model_state_dict"):
            self.add_import(STATE_DICT_MODULE, name)
        self.change(
            site.stmt,
            f"load `{path}` into the sharded `{use.owner}`, by what it is at run time: a directory (this "
            "script's DCP save) with dcp.load + set_model_state_dict; a single file (a single-GPU run's, "
            "pretrained weights) with set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)",
            ("this script saves a DCP directory there later, and before that the path may hold the file a "
             "single-GPU run left (a run switched to FSDP2 resumes from it); the file is then renamed to "
             f"`{path}` + \".single-gpu\" (rank 0)" if saved_here else
             "the path is not one this script saves to, and this script writes model state dicts as DCP "
             "directories: the flag may name either"),
            "torch.load of a DCP directory fails (IsADirectoryError); dcp.load of a single file fails",
        )


def _isdir_text(site: LoadSite, dcp_text: str, options: str) -> str:
    """`if os.path.isdir(path):` `dcp_text` (this script's DCP directory), `else:` the whole
    file read with torch.load on CPU on every rank; each branch sets the options its setters
    take (full_state_dict=True for the file's full tensors)."""
    strict = next(iter({strict_value(u.call) for u in site.uses if u.kind in ("model", "optimizer")}), None)
    extra = f", strict={strict}" if strict is not None else ""
    return (
        f"if os.path.isdir({code(site.path)}):  # a DCP checkpoint directory: this script's own save\n"
        + dcp_text
        + f"    {options} = StateDictOptions({extra[2:]})\n"
        "else:  # one torch.save file (a single-GPU run's): every rank reads it, the setters shard it\n"
        f"    {site.var} = {code(_on_cpu(site.call))}\n"
        f"    {options} = StateDictOptions(full_state_dict=True{extra})\n"
    )


def _on_cpu(call: cst.Call) -> cst.Call:
    """`torch.load(path, ...)` with map_location="cpu" (the setters move the shards)."""
    cpu = cst.SimpleString('"cpu"')
    args = [a for i, a in enumerate(call.args) if not (i == 1 and a.keyword is None)
            and not (a.keyword is not None and a.keyword.value == "map_location")]
    args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return with_keyword(call.with_changes(args=args), "map_location", cpu)


def _indented(text: str) -> str:
    """`text` (statements, continuation lines included) one block deeper."""
    return "".join("    " + line if line.strip() else line for line in text.splitlines(keepends=True))


def _named_optimizer_state(state: str, model: str, optimizer: str, fresh, scope) -> str:
    """Lines of the `else:` that key a single-GPU optimizer state (parameters numbered in
    the optimizer's order) by parameter name, as set_optimizer_state_dict reads it."""
    by_param, names, group = fresh("name_of", scope), fresh("param_names", scope), fresh("param_group", scope)
    return (
        f"    if all(isinstance(k, int) for k in {state}[\"state\"]):  # numbered: key it by parameter name\n"
        f"        {by_param} = {{p: n for n, p in {model}.named_parameters()}}\n"
        f"        {names} = [{by_param}[p] for group in {optimizer}.param_groups for p in group[\"params\"]]\n"
        f"        {state}[\"state\"] = {{{names}[i]: s for i, s in {state}[\"state\"].items()}}\n"
        f"        for {group} in {state}[\"param_groups\"]:\n"
        f"            {group}[\"params\"] = [{names}[i] for i in {group}[\"params\"]]\n"
    )


def strict_option(call: Optional[cst.Call]) -> str:
    """`, options=StateDictOptions(strict=...)` for a setter where the load_state_dict
    passes `strict`, else ""."""
    strict = strict_value(call)
    return f", options=StateDictOptions(strict={strict})" if strict is not None else ""


def strict_value(call: Optional[cst.Call]) -> Optional[str]:
    """The `strict` a load_state_dict call passes (its source), or None."""
    strict = next((a.value for a in call.args[1:] if a.keyword is None or a.keyword.value == "strict"),
                  None) if call else None
    return code(strict) if strict is not None else None
