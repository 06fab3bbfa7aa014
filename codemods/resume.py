"""resume: loads of checkpoints into the sharded model and optimizer.

A path this script saves with DCP is loaded with dcp.load into state dicts built
from the sharded model and optimizer, then set_*_state_dict; a single file (an
--export full save, or weights from elsewhere) is loaded with full_state_dict and
broadcast_from_rank0. A path this script saves that a resume may read before its first
save is told apart at run time (os.path.isdir): a single-GPU run's file there is read with
torch.load and set with full_state_dict=True, then moved aside for the DCP save. Copies of
a checkpoint directory become copytree on rank 0.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.syntax.names import assigned_names
from fsdp2_retrofit.syntax.torch_api import RNG_STATES
from fsdp2_retrofit.analysis.checkpoints import (
    LoadSite,
    LoadUse,
    calls_to,
    loads,
    may_be_tensor,
    path_key,
    read_names,
    save_format,
    saved_dict_keys,
    target_names,
    saves,
)
from fsdp2_retrofit.rewrite.edit import aside_path, with_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

from .checkpoint import FUTURE, STATE_DICT_MODULE

COPIES = {"shutil.copy", "shutil.copyfile", "shutil.copy2"}
READERS = {"shutil.move", "builtins.open", "os.path.getsize"} | COPIES
BROADCAST = "StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)"


class ConvertLoadsCommand(RetrofitStage):
    DESCRIPTION = "Load checkpoints into the sharded model and optimizer (dcp.load + set_*_state_dict)."
    CODE = "resume"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not facts.models:
            return
        self.dcp_paths: Dict[str, List] = {}
        self.full_paths: Set[str] = set()
        self.dcp_keys: Set[str] = set()
        self.dcp_whole_kinds: Set[str] = set()  # what a DCP save of a bare state dict writes
        self.async_saves: List[cst.CSTNode] = []
        self.saved_values: Dict[str, cst.BaseExpression] = {}  # dict key -> the value a DCP save writes
        self.whole_saves: Dict[str, tuple] = {}  # path of a torch.save(model, path) -> (model, "dcp" | "full")
        for site in saves(facts):
            form = save_format(site, self.options.export)
            if site.whole_model is not None and form is not None:
                self.whole_saves.setdefault(site.path_key, (site.whole_model, form))
            if form == "dcp":
                self.dcp_paths.setdefault(site.path_key, []).append(site)
                self.dcp_keys |= set(site.dict_keys)
                if isinstance(site.state, cst.Dict):
                    for e in site.state.elements:
                        if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString):
                            self.saved_values.setdefault(e.key.evaluated_value, e.value)
                self.async_saves.append(site.stmt)
                if not isinstance(site.state, cst.Dict):  # torch.save(model.state_dict(), path)
                    self.dcp_whole_kinds |= {c.kind for c in site.state_calls} | (
                        {"model"} if site.whole_model else set())
            elif form == "full":
                self.full_paths.add(site.path_key)
        # paths rank 0 copies a checkpoint directory to: every rank reads them only after a barrier
        self.copy_dests: Set[str] = {
            path_key(call.args[1].value, facts) for call in calls_to(facts, COPIES)
            if len(call.args) == 2 and path_key(call.args[0].value, facts) in self.dcp_paths
        }
        for site in loads(facts):
            self._convert_load(site, facts, editor)
        self._other_readers(facts, editor)

    # -- torch.load ---------------------------------------------------------------

    def _origin(self, site: LoadSite) -> str:
        """Where the file a load reads comes from, decided statically: "dcp" (a path this
        script saves with DCP), "full" (a single torch.save file: an --export full save
        of this script, or a file no DCP save of this script can have written: pretrained
        weights), "either" (a path the script does not save to, read in a shape one of
        its DCP saves writes: a --resume / --init-from flag may name this script's
        checkpoint directory or a single-GPU run's file)."""
        if site.path_key in self.full_paths:
            return "full"
        if site.path_key in self.dcp_paths or site.path_key in self.copy_dests:
            return "dcp"  # a path this script saves with DCP, or copies such a save to
        if not self.dcp_paths:
            return "full"
        keys = {u.key for u in site.uses if u.key is not None}
        if keys & self.dcp_keys:
            return "either"
        whole = [u for u in site.uses if u.key is None and u.kind in ("model", "optimizer")]
        if whole and {u.kind for u in whole} <= self.dcp_whole_kinds:
            return "either"
        return "full"

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
        if site.path_key in self.whole_saves and site.var is not None:
            self._whole_model_reload(site, facts, editor)
            return
        state_uses = [u for u in site.uses if u.kind in ("model", "optimizer")]
        origin = self._origin(site)
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
                and site.path_key not in self.copy_dests and not self._saved_before(site, facts)):
            # a resume at the start: the path may still hold the single-GPU run's file
            self._require_built(site, state_uses, facts)
            self._load_either(site, facts, editor, saved_here=True)
            return
        # a load kept in a variable is told apart at run time (_file_or_directory, _config_first_options)
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
        late = self._config_first(site, facts)
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
        model, form = self.whole_saves[site.path_key]
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
        problem = self._trained_after(site, facts)
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
            var = self.fresh_name(f"{model}_state", scope)
            self.__dict__["_visible"][id(scope)].add(var)
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
        if not self._mode_set_next(site, model, facts):
            self.attention(
                site.stmt,
                f"the unpickled `{model}` came back in the train/eval mode it was saved in; the loaded state leaves "
                f"`{model}` in the mode it has here",
                f"call `{model}.eval()` (or `.train()`) after the load if dropout or batch norm must act as at the save",
            )

    def _trained_after(self, site: LoadSite, facts: ScriptFacts) -> str:
        """Why loading into the live model could train it afterwards ("" when it cannot)."""
        r = facts.resolver
        function = r.enclosing_function(site.stmt)
        for anc in r.ancestors(site.stmt):
            if anc is function:
                break
            if isinstance(anc, (cst.For, cst.While)):
                return "is inside a loop"
        order = {id(s): i for i, s in enumerate(r.nodes(cst.SimpleStatementLine))}
        at = order.get(id(site.stmt), 0)
        if any(l.function is function and _last_line(l.node, order) > at for l in facts.loops):
            return "a training loop runs after it"
        return ""

    def _mode_set_next(self, site: LoadSite, model: str, facts: ScriptFacts) -> bool:
        """The next statement of the block that reads `model` is `model.eval()` / `model.train(...)`."""
        block = facts.resolver.block_of(site.stmt)
        body = list(block.body) if block is not None else []
        for stmt in body[body.index(site.stmt) + 1:] if site.stmt in body else []:
            if model not in read_names(stmt) | assigned_names(stmt):
                continue
            small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
            call = small.value if isinstance(small, cst.Expr) else None
            return (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
                    and code(call.func) in (f"{model}.eval", f"{model}.train"))
        return False

    # -- the config first: read it, build the model from it, then load the state ------

    def _config_first(self, site: LoadSite, facts: ScriptFacts) -> Optional[cst.If]:
        """nanoGPT's resume order: `if C: ckpt = torch.load(p); args = ckpt["model_args"];
        model = Net(**args); model.load_state_dict(ckpt["model"])`, then, once the
        optimizer is built, `if C: optimizer.load_state_dict(ckpt["optimizer"])`. The
        later `if C:` (the same test, in the same block) is returned when every state
        read before it is a model's load in the first `if`, whose model is built there
        after the load; None for any other shape."""
        r = facts.resolver
        block = r.block_of(site.stmt)
        first = r.parent(block) if isinstance(block, cst.IndentedBlock) else None
        if site.var is None or site.unknown_use is not None or not isinstance(first, cst.If):
            return None
        top = first  # `if A: ... elif C: <load>`: the chain's first `if` is in the block
        while isinstance(r.parent(top), cst.If) and r.parent(top).orelse is top:
            top = r.parent(top)
        outer = r.block_of(top)
        if outer is None or any(u.key is None for u in site.uses):
            return None
        body = list(outer.body)
        later = [
            s for s in body[body.index(top) + 1:]
            if isinstance(s, cst.If) and s.orelse is None and code(s.test) == code(first.test)
            and any(u.kind == "optimizer" and _inside(u.stmt, s, facts) for u in site.uses)
        ]
        if len(later) != 1:
            return None
        late = later[0]
        order = {id(st): i for i, st in enumerate(r.nodes(cst.SimpleStatementLine))}
        early = [u for u in site.uses if u.kind != "value" and not _inside(u.stmt, late, facts)]
        if not early or any(u.kind != "model" or r.block_of(u.stmt) is not block for u in early):
            return None
        for use in early:  # the model is built in the first `if`, after the load
            built = [st for st in block.body if use.owner in assigned_names(st)]
            if not built or order.get(id(built[0]), 0) < order.get(id(site.stmt), 0):
                return None
        # the path names the same file in both: nothing in between rebinds what it reads
        reads = read_names(site.path)
        for stmt in body[body.index(top) + 1: body.index(late)]:
            if reads & target_names(stmt):
                return None
        return late

    def _load_config_first(self, site: LoadSite, late: cst.If, facts: ScriptFacts, editor: StatementEditor) -> None:
        """The plain values are read with dcp.load before the model is built; the model's,
        optimizer's and other states with a second dcp.load in the later `if`, after sharding."""
        path, var = code(site.path), site.var
        values: Dict[str, str] = {}
        states: Dict[str, str] = {}
        for use in site.uses:
            template = self._value_template(use.key, facts, site.stmt) if use.kind == "value" else _template(use)
            (values if use.kind == "value" else states).setdefault(use.key, template)
        options = self._config_first_options(site, facts)
        new = []
        if options is not None:  # a DCP directory or a single file, told apart at run time
            new.append(self._either_first(site, values, options, facts))
        elif values:
            new.append(self.stmt(f"{var} = {self._dict_text(values, site.stmt)}  # the values read before the model exists\n"))
            new.extend(self._dcp_load(var, path, site, facts))
        else:
            new.append(self.stmt(f"{var} = {{}}\n"))
        new[0] = new[0].with_changes(leading_lines=site.stmt.leading_lines)
        editor.replace(site.stmt, new[0])
        editor.insert_after(site.stmt, new[1:])

        def setter(use: LoadUse) -> str:
            state = code(use.node)
            return _setter(use, state) if options is None else _setter_with(use, state, options)

        moved = []
        for use in site.uses:
            if use.kind == "model" and not _inside(use.stmt, late, facts):
                editor.replace(use.stmt, None)
                moved.append(self.stmt(setter(use)))
            elif use.kind in ("model", "optimizer"):
                self._replace_load(use, self.stmt(setter(use)), facts, editor)
        update = f"{var}.update({self._dict_text(states, late.body.body[0])})\n"
        if options is None:
            loads = [self.stmt(update), *self._dcp_load(var, path, site, facts)]
        else:
            loads = [self._either_late(site, update, options, facts)]
        editor.insert_before(late.body.body[0], [*loads, *moved])
        self.add_import("torch.distributed.checkpoint", asname="dcp")
        kinds = {u.kind for u in site.uses}
        for kind in ("model", "optimizer"):
            if kind in kinds:
                self.add_import(STATE_DICT_MODULE, f"get_{kind}_state_dict")
                self.add_import(STATE_DICT_MODULE, f"set_{kind}_state_dict")
        if any(_strict_option(u.call) for u in site.uses if u.kind in ("model", "optimizer")):
            self.add_import(STATE_DICT_MODULE, "StateDictOptions")
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
                  "saves write a directory at that path" if site.path_key in self.dcp_paths else "")
               if options is not None else ""),
            "torch.load of a DCP directory fails; a state loaded before fully_shard is not what the shards hold",
        )

    def _config_first_options(self, site: LoadSite, facts: ScriptFacts) -> Optional[str]:
        """The name of the set_*_state_dict options when the config-first load is told apart
        at run time (a DCP directory or one torch.save file); None where it stays a
        dcp.load only (as _file_or_directory decides)."""
        states = [u for u in site.uses if u.kind in ("model", "optimizer")]
        if len({_strict_value(u.call) for u in states}) > 1 or site.path_key in self.copy_dests or (
            self._saved_before(site, facts)
        ):
            return None
        scope = facts.resolver.enclosing_function(site.stmt)
        options = self.fresh_name(f"{site.var}_options", scope)
        self.__dict__["_visible"][id(scope)].add(options)
        self.add_import("os")
        self.add_import(STATE_DICT_MODULE, "StateDictOptions")
        return options

    def _either_first(self, site: LoadSite, values: Dict[str, str], options: str, facts: ScriptFacts) -> cst.CSTNode:
        """`if os.path.isdir(path):` the values with dcp.load, `else:` the whole file with
        torch.load on CPU (moved aside when this script saves a DCP directory there)."""
        var, path = site.var, code(site.path)
        strict = next(iter({_strict_value(u.call) for u in site.uses if u.kind in ("model", "optimizer")}), None)
        extra = f", strict={strict}" if strict is not None else ""
        dcp_text = ""
        if values:
            loads = self._dcp_load(var, path, site, facts)
            first = f"{var} = {self._dict_text(values, site.stmt)}  # the values read before the model exists\n"
            dcp_text = _indented(first) + "".join(f"    {code(s).strip()}\n" for s in loads)
        else:
            dcp_text = f"    {var} = {{}}\n"
        text = (
            f"if os.path.isdir({path}):  # a DCP checkpoint directory: this script's own save\n"
            + dcp_text
            + f"    {options} = StateDictOptions({extra[2:]})\n"
            "else:  # one torch.save file (a single-GPU run's): every rank reads it, the setters shard it\n"
            f"    {var} = {code(_on_cpu(site.call))}\n"
            f"    {options} = StateDictOptions(full_state_dict=True{extra})\n"
        )
        if site.path_key in self.dcp_paths:  # dcp.save makes a directory there: the file moves aside once read
            test = self.rank_zero_test(site.stmt, facts) or "dist.get_rank() == 0"
            text += (
                "    dist.barrier()  # every rank has read the file; this script saves a DCP directory there\n"
                f"    if {test}:\n"
                f"        os.replace({path}, {aside_path(site.path, path)})\n"
                "    dist.barrier()\n"
            )
            self.add_import("torch.distributed", asname="dist")
        return self.stmt(text)

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

    def _require_built(self, site: LoadSite, uses: List[LoadUse], facts: ScriptFacts) -> None:
        """DCP loads into the model's own (sharded) state dict: it must exist first."""
        order = {id(s): i for i, s in enumerate(facts.resolver.nodes(cst.SimpleStatementLine))}
        at = order.get(id(site.stmt), 0)
        function = facts.resolver.enclosing_function(site.stmt)
        for use in uses:
            bindings = [
                order.get(id(s), 0)
                for s in facts.resolver.nodes(cst.SimpleStatementLine)
                if facts.resolver.enclosing_function(s) is function and use.owner in assigned_names(s)
            ]
            if bindings and min(bindings) > at:
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
            var = self.fresh_name("state_dict" if use.kind == "model" else "optim_state_dict", scope)
            self.__dict__["_visible"][id(scope)].add(var)
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
                    entries.setdefault(use.key, self._value_template(use.key, facts, site.stmt) if use.kind == "value"
                                       else _template(use))
                template = self._dict_text(entries, site.stmt)
            editor.replace(
                site.stmt, self.stmt(f"{var} = {template}\n").with_changes(leading_lines=site.stmt.leading_lines)
            )
            options = self._file_or_directory(site, facts, editor)
            for use in site.uses:
                if use.kind in ("model", "optimizer"):
                    setter = _setter(use, code(use.node)) if options is None else _setter_with(use, code(use.node), options)
                    self._replace_load(use, self.stmt(setter), facts, editor)
        kinds = {u.kind for u in site.uses}
        if any(_strict_option(u.call) for u in site.uses if u.kind in ("model", "optimizer")):
            self.add_import(STATE_DICT_MODULE, "StateDictOptions")
        self.add_import("torch.distributed.checkpoint", asname="dcp")
        if "model" in kinds:
            self.add_import(STATE_DICT_MODULE, "get_model_state_dict")
            self.add_import(STATE_DICT_MODULE, "set_model_state_dict")
        if "optimizer" in kinds:
            self.add_import(STATE_DICT_MODULE, "get_optimizer_state_dict")
            self.add_import(STATE_DICT_MODULE, "set_optimizer_state_dict")
        tensors = sorted(
            {u.key for u in site.uses if u.kind == "value" and may_be_tensor(self.saved_values.get(u.key), facts)
             and self._value_template(u.key, facts, site.stmt) == "None"}
        )
        rng = sorted({u.key for u in site.uses if u.kind == "value" and self.saved_values.get(u.key) is not None
                      and facts.resolver.is_call_to(self.saved_values[u.key], RNG_STATES)})
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

    def _file_or_directory(self, site: LoadSite, facts: ScriptFacts, editor: StatementEditor) -> Optional[str]:
        """After `var = <template>`: `if os.path.isdir(path):` dcp.load (this script's own
        save), `else:` torch.load of one file on CPU on every rank (a single-GPU run's
        checkpoint, an --export full or `fsdp2-retrofit convert` file), whose full tensors
        the setters shard (full_state_dict=True). Returns the name of the options the
        setters take; None (a dcp.load only) where the loads disagree on `strict`, the path
        is where this script copies its checkpoint directory, or a save of it comes first."""
        var, path = site.var, code(site.path)
        states = [u for u in site.uses if u.kind in ("model", "optimizer")]
        stricts = {_strict_value(u.call) for u in states}
        # a copy this script makes of its checkpoint directory is one, and so is what it saved before
        if len(stricts) > 1 or site.path_key in self.copy_dests or self._saved_before(site, facts):
            editor.insert_after(site.stmt, self._dcp_load(var, path, site, facts))
            return None
        strict = stricts.pop() if stricts else None
        scope = facts.resolver.enclosing_function(site.stmt)
        options = self.fresh_name(f"{var}_options", scope)
        self.__dict__["_visible"][id(scope)].add(options)
        loads = self._dcp_load(var, path, site, facts)
        before, load = loads[:-1], loads[-1]
        extra = f", strict={strict}" if strict is not None else ""
        text = (
            f"if os.path.isdir({path}):  # a DCP checkpoint directory: this script's own save\n"
            f"    {code(load).strip()}\n"
            f"    {options} = StateDictOptions({extra[2:]})\n"
            "else:  # one torch.save file (a single-GPU run's): every rank reads it, the setters shard it\n"
            f"    {var} = {code(_on_cpu(site.call))}\n"
            f"    {options} = StateDictOptions(full_state_dict=True{extra})\n"
        )
        for use in states:
            if use.kind == "optimizer":
                text += _named_optimizer_state(code(use.node), use.model, use.owner, self.fresh_name, scope)
        moved = site.path_key in self.dcp_paths
        if moved:  # dcp.save makes a directory there: the file moves aside once every rank has read it
            test = self.rank_zero_test(site.stmt, facts) or "dist.get_rank() == 0"
            aside = aside_path(site.path, path)
            text += (
                "    dist.barrier()  # every rank has read the file; this script saves a DCP directory there\n"
                f"    if {test}:\n"
                f"        os.replace({path}, {aside})\n"
                "    dist.barrier()\n"
            )
            self.add_import("torch.distributed", asname="dist")
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

    def _saved_before(self, site: LoadSite, facts: ScriptFacts) -> bool:
        """A DCP save of the load's path comes before it in the same function (a reload
        of what this run saved: a directory)."""
        r = facts.resolver
        function = r.enclosing_function(site.stmt)
        order = {id(s): i for i, s in enumerate(r.nodes(cst.SimpleStatementLine))}
        at = order.get(id(site.stmt), 0)
        return any(r.enclosing_function(s.stmt) is function and order.get(id(s.stmt), at) < at
                   for s in self.dcp_paths.get(site.path_key, []))

    def _load_either(self, site: LoadSite, facts: ScriptFacts, editor: StatementEditor,
                     saved_here: bool = False) -> None:
        """`model.load_state_dict(torch.load(path))` where `path` may name this script's
        DCP directory or a single file: told apart at run time by os.path.isdir.
        `saved_here`: this script saves a DCP directory at the path later; the file
        moves aside once loaded."""
        use = site.uses[0]
        scope = facts.resolver.enclosing_function(site.stmt)
        path = code(site.path)
        var = self.fresh_name("state_dict", scope)
        self.__dict__["_visible"][id(scope)].add(var)
        test = self.rank_zero_test(use.stmt, facts) or "dist.get_rank() == 0"
        if test.startswith("dist."):
            self.add_import("torch.distributed", asname="dist")
        strict = _strict_option(use.call)
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
        function = facts.resolver.enclosing_function(use.stmt)
        order = {id(s): i for i, s in enumerate(facts.resolver.nodes(cst.SimpleStatementLine))}
        at = order.get(id(use.stmt), 0)
        loops = [l for l in facts.loops if l.function is function]
        if loops and all(_first_line(l.node, order) > at for l in loops):
            return []
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
        function = facts.resolver.enclosing_function(site.stmt)
        order = {id(s): i for i, s in enumerate(facts.resolver.nodes(cst.SimpleStatementLine))}
        earlier_save = any(
            facts.resolver.enclosing_function(s) is function and order.get(id(s), 0) < order.get(id(site.stmt), 0)
            for s in self.async_saves
        )
        load = self.stmt(f"dcp.load({var}, checkpoint_id={path})\n")
        out = self._copy_barrier(site) if barrier else []
        if self.options.async_checkpoint and earlier_save:
            future = self.fresh_name(FUTURE, function)
            out.append(self.stmt(f"if {future} is not None:\n    {future}.result()\n"))
        return out + [load]

    def _async_wait(self, stmt, facts: ScriptFacts) -> List[cst.CSTNode]:
        """The wait for a running async save (earlier in the same function) before `stmt`
        reads what it writes: a copy made meanwhile holds a half-written checkpoint."""
        function = facts.resolver.enclosing_function(stmt)
        order = {id(s): i for i, s in enumerate(facts.resolver.nodes(cst.SimpleStatementLine))}
        earlier = any(facts.resolver.enclosing_function(s) is function and order.get(id(s), 0) < order.get(id(stmt), 0)
                      for s in self.async_saves)
        if not (self.options.async_checkpoint and earlier):
            return []
        future = self.fresh_name(FUTURE, function)
        return [self.stmt(f"if {future} is not None:  # the copy reads the finished checkpoint\n"
                          f"    {future}.result()\n")]

    def _copy_barrier(self, site: LoadSite) -> List[cst.CSTNode]:
        """A load of a path rank 0 copies a checkpoint directory to waits until the copy is
        complete: without it another rank can read the copy's .metadata mid-copy."""
        if site.path_key not in self.copy_dests:
            return []
        self.add_import("torch.distributed", asname="dist")
        return [self.stmt("dist.barrier()  # rank 0 copies this checkpoint: read it once the copy is complete\n")]

    def _value_template(self, key: str, facts: ScriptFacts, load=None) -> str:
        """The dcp.load placeholder of a value that is not a model's or optimizer's state:
        None (DCP restores a plain value as saved); for a dict the save writes with keys
        fixed in the source, a dict of those keys (DCP flattens saved dicts); a tensor
        where the value may be one (DCP loads a saved tensor only into a tensor of its
        shape): for an RNG state the same call (`torch.get_rng_state()`), for a name bound
        before the load a clone of its value when that is a tensor. A wrong placeholder
        fails the load loudly (size or type mismatch); a saved plain value replaces a
        tensor placeholder."""
        value = self.saved_values.get(key)
        if value is not None and facts.resolver.is_call_to(value, RNG_STATES) and not value.args:
            return code(value)
        keys = saved_dict_keys(value, facts)
        if keys:
            return "{" + ", ".join(f'"{k}": None' for k in keys) + "}"
        if isinstance(value, cst.Name) and load is not None and may_be_tensor(value, facts) and (
                self._bound_before(value.value, load, facts)):
            return f"{value.value}.clone() if torch.is_tensor({value.value}) else None"
        return "None"

    def _bound_before(self, name: str, load, facts: ScriptFacts) -> bool:
        """`name` is assigned in the load's function before the load (in the code's order)."""
        r = facts.resolver
        function = r.enclosing_function(load)
        order = {id(s): i for i, s in enumerate(r.nodes(cst.SimpleStatementLine))}
        at = order.get(id(load), 0)
        return any(r.enclosing_function(s) is function and order.get(id(s), at) < at and name in assigned_names(s)
                   and isinstance(s.body[0], cst.Assign) for s in r.nodes(cst.SimpleStatementLine))

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
        if converted and site.var is not None and site.path_key in self.full_paths:
            # every rank reads the file rank 0 wrote: wait until it is written
            barrier = self.stmt("dist.barrier()\n").with_changes(leading_lines=site.stmt.leading_lines)
            editor.insert_before(site.stmt, [barrier])
            editor.set_leading_lines(site.stmt, [])
            self.add_import("torch.distributed", asname="dist")

    # -- other readers ------------------------------------------------------------

    def _other_readers(self, facts: ScriptFacts, editor: StatementEditor) -> None:
        """A copy of a checkpoint directory becomes a copytree on rank 0; other reads are reported."""
        for call in calls_to(facts, READERS):
            if not call.args or path_key(call.args[0].value, facts) not in self.dcp_paths:
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


def _inside(node, container, facts: ScriptFacts) -> bool:
    return any(a is container for a in facts.resolver.ancestors(node))


def _statement_positions(node, order) -> list:
    """The positions of the simple statements inside `node` (0 for one `order` lacks)."""
    found = []

    class _Positions(cst.CSTVisitor):
        def visit_SimpleStatementLine(self, n) -> bool:
            found.append(order.get(id(n), 0))
            return False

    node.visit(_Positions())
    return found


def _last_line(node, order) -> int:
    """The position of the last simple statement inside `node`."""
    return max(_statement_positions(node, order), default=0)


def _first_line(node, order) -> int:
    """The position of the first simple statement inside `node`."""
    return min(_statement_positions(node, order), default=0)


def _template(use: LoadUse) -> str:
    """What dcp.load fills for one read of the checkpoint."""
    if use.kind == "model":
        return f"get_model_state_dict({use.owner})"
    if use.kind == "optimizer":
        return f"get_optimizer_state_dict({use.model}, {use.owner})"
    if use.kind == "stateful":
        return f"{use.owner}.state_dict()"
    return "None"  # a plain value (step, epoch): DCP restores it as saved


def _setter(use: LoadUse, state: str) -> str:
    options = _strict_option(use.call)
    if use.kind == "model":
        return f"set_model_state_dict({use.owner}, {state}{options})\n"
    return f"set_optimizer_state_dict({use.model}, {use.owner}, {state}{options})\n"


def _setter_with(use: LoadUse, state: str, options: str) -> str:
    if use.kind == "model":
        return f"set_model_state_dict({use.owner}, {state}, options={options})\n"
    return f"set_optimizer_state_dict({use.model}, {use.owner}, {state}, options={options})\n"


def _strict_value(call: Optional[cst.Call]) -> Optional[str]:
    strict = next((a.value for a in call.args[1:] if a.keyword is None or a.keyword.value == "strict"), None) if call else None
    return code(strict) if strict is not None else None


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


def _strict_option(call: Optional[cst.Call]) -> str:
    strict = next((a.value for a in call.args[1:] if a.keyword is None or a.keyword.value == "strict"), None) if call else None
    return f", options=StateDictOptions(strict={code(strict)})" if strict is not None else ""


def _is_statement_call(stmt, call) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and stmt.body[0].value is call
    )
