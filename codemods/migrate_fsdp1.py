"""migrate_fsdp1: take an FSDP1 script back to what the FSDP2 stages read.

`model = FullyShardedDataParallel(model, auto_wrap_policy=..., ...)` goes; its
settings become the options of the later stages (the classes to shard, mixed
precision, CPU offload, reshard-after-forward, HSDP), so that shard writes the
fully_shard calls exactly as for a single-GPU script. FSDP1's state-dict API,
`model.clip_grad_norm_` and ShardedGradScaler become their FSDP2 forms here.
"""
from __future__ import annotations

from typing import Dict, List, Set

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.syntax.names import walk
from fsdp2_retrofit.analysis.checkpoints import SAVE, rank_gate
from fsdp2_retrofit.analysis.fsdp1 import (
    Fsdp1Wrap,
    StateDictBlock,
    fsdp1_alias_names,
    fsdp1_uses,
    is_fsdp1_name,
    leftover,
    wrapped_name,
)
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.torch_api import STATE_DICT_MODULE
from dataclasses import replace

PRECISION = {"bfloat16": "bf16", "float16": "fp16"}
BUFFER_NOTE = (
    "FSDP2 does not cast buffers: they keep the dtype the model gives them "
    "(cast them in the model, or with .to(dtype), before sharding if they must be low precision)"
)


class MigrateFsdp1Command(RetrofitStage):
    DESCRIPTION = "Migrate FSDP1 (FullyShardedDataParallel) to FSDP2: its wrap becomes the shard stage's fully_shard calls."
    CODE = "fsdp1"
    LATER_STAGES_READ_IMPORTS = True  # removed FSDP1 imports must be gone before the others analyse

    def _remove(self, stmt, editor: StatementEditor) -> None:
        """Drop a statement; its blank lines and comments go to the statement after it."""
        editor.replace(stmt, None)
        block = self.facts.resolver.block_of(stmt)
        body = list(block.body) if block is not None else []
        if stmt.leading_lines and stmt in body and body.index(stmt) + 1 < len(body):
            self._carried.setdefault(body[body.index(stmt) + 1], []).extend(stmt.leading_lines)

    def _lead(self, editor: StatementEditor) -> None:
        """Give the carried lines to the statements that stay."""
        for node, lines in self._carried.items():
            if node in editor.replacement and editor.replacement[node] is None:
                continue
            editor.set_leading_lines(node, list(lines) + list(node.leading_lines))

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        uses = fsdp1_uses(facts)
        if not uses.any:
            return
        for problem in uses.problems:
            self.refuse(problem.code, problem.node, problem.what, problem.why, problem.hint)
        handled: Set[int] = set()
        self._carried: Dict[cst.CSTNode, list] = {}
        self._hoisted: Set[str] = set()  # names given to gathered state dicts
        for wrap in uses.wraps:
            self._unwrap(wrap, editor)
            handled.add(id(wrap.stmt))
            handled.update(id(s) for s in wrap.consumed)
        self.options_for_later = self._options(uses.wraps, facts, editor)
        for block in uses.blocks:
            self._block(block, facts, editor, handled)
        for call in uses.default_state_dicts:
            self._default_state_dict(call, facts, editor)
        for call in uses.clips:
            self._clip(call, editor)
        state_owners = {id(c.func.value) for c in uses.default_state_dicts}
        for attr in uses.module_attrs:
            if id(attr) in state_owners:
                continue  # the whole call is replaced
            editor.replace_expression(attr, attr.value)
            self.change(attr, f"`{code(attr)}` -> `{attr.value.value}`",
                        "fully_shard keeps the model itself (no wrapper): its `.module` is the model")
        for call in uses.scalers:
            self._scaler(call, editor)
            handled.add(id(call))
        # values read when rewriting stay as written (those of statements the migration removes go with them)
        removed = {id(n) for w in uses.wraps for s in [w.stmt] + w.consumed for n in walk(s)}
        removed |= {id(n) for b in uses.blocks for s in [b.node] + b.consumed for n in walk(s)}
        kept = [v for v in uses.read_values if id(v) not in removed]
        handled.update(id(v) for v in kept)
        node = leftover(facts, handled)
        if node is not None:
            stmt = facts.resolver.statement_of(node)
            self.refuse(
                "FSR306",
                node,
                f"`{code(stmt).strip().splitlines()[0]}` uses FSDP1 API the rewrite does not convert",
                "no FSDP1 API may be left in an FSDP2 script (the two cannot be mixed on one model)",
                "migrate this use by hand (FSDP2: get_model_state_dict / DTensor.full_tensor / the fully_shard API)",
            )
        still_read = {n.value for v in kept for n in walk(v) if isinstance(n, cst.Name)}
        for stmt in uses.imports:
            self._drop_imports(stmt, editor, still_read)
        self._lead(editor)

    # -- the wrap ------------------------------------------------------------------

    def _unwrap(self, wrap: Fsdp1Wrap, editor: StatementEditor) -> None:
        if isinstance(wrap.wrapped, cst.Name) and wrap.wrapped.value == wrap.target:
            self._remove(wrap.stmt, editor)
        else:
            editor.replace(wrap.stmt, self.stmt(f"{wrap.target} = {code(wrap.wrapped)}\n").with_changes(
                leading_lines=wrap.stmt.leading_lines))
        for stmt in wrap.consumed:
            self._remove(stmt, editor)
        units = {
            "transformer": "transformer_auto_wrap_policy",
            "module": "ModuleWrapPolicy",
            "lambda": "the lambda policy",
        }
        if wrap.policy in units:
            how = f"each {', '.join(wrap.classes)} ({units[wrap.policy]}'s classes), then the root"
        elif wrap.policy == "size":
            how = ("the repeated blocks the shard stage finds, then the root (size_based_auto_wrap_policy "
                   "wraps by parameter count; FSDP2 units are modules: one per block)")
        else:
            how = ("the repeated blocks the shard stage finds, then the root (FSDP1 without auto_wrap_policy "
                   "had one unit; a unit per block gathers one block at a time)")
        self.change(
            wrap.stmt,
            f"`{wrap.target} = {code(wrap.call.func)}({code(wrap.wrapped)}, ...)` -> fully_shard of {how}",
            "FSDP2 shards module by module with fully_shard (DTensor per parameter, no FlatParameter, no wrapper "
            "class: the model keeps its type and attribute names)",
            "the optimizer must be built after fully_shard (it is moved there if needed)",
        )
        for key, why in wrap.dropped:
            self.change(wrap.stmt, f"dropped `{key}`", why)

    def _options(self, wraps: List[Fsdp1Wrap], facts: ScriptFacts, editor: StatementEditor):
        """The options the later stages run with: the wrap's settings."""
        options = self.options
        if not wraps:
            return options
        first = wraps[0]
        settings = lambda w: (w.policy, w.classes, w.strategy, w.param_dtype, w.reduce_dtype, w.offload)  # noqa: E731
        for other in wraps[1:]:
            if settings(other) != settings(first):
                self.refuse(
                    "FSR307",
                    other.stmt, "several FSDP(...) wraps with different settings",
                    "the rewrite gives every fully_shard the same policy and unit rule",
                    "use the same FSDP settings for every model",
                )
        changes = {}
        if first.classes and not options.shard:
            changes["shard"] = tuple(c.rsplit(".", 1)[-1] for c in first.classes)
        param, reduce = first.param_dtype, first.reduce_dtype
        if param in PRECISION and options.mixed_precision not in ("none", "auto"):
            self.attention(first.settings_node["mixed_precision"],
                           f"--mixed-precision {options.mixed_precision} replaces the script's MixedPrecision",
                           "the option given on the command line wins over the FSDP1 settings")
        elif param in PRECISION:
            changes["mixed_precision"] = PRECISION[param]
            changes["mp_reduce_dtype"] = reduce or param
            self.change(
                first.settings_node["mixed_precision"],
                f"MixedPrecision(param_dtype=torch.{param}, reduce_dtype=torch.{reduce or param}) -> "
                f"MixedPrecisionPolicy(param_dtype=torch.{param}, reduce_dtype=torch.{reduce or param})",
                "the same compute and gradient-reduction dtypes, per fully_shard unit"
                + ("" if reduce else " (FSDP1 without reduce_dtype reduced in param_dtype; so does FSDP2)"),
            )
        elif param not in (None, "float32") or reduce not in (None, "float32", param):
            self.refuse(
                "FSR308",
                first.settings_node["mixed_precision"], "MixedPrecision(...) with this combination of dtypes",
                "the rewrite maps a bfloat16/float16 param_dtype (and its reduce_dtype) only",
                "use param_dtype=torch.bfloat16 or torch.float16",
            )
        if first.buffer_dtype:
            self.change(first.settings_node["mixed_precision"], f"dropped buffer_dtype=torch.{first.buffer_dtype}",
                        BUFFER_NOTE)
        if first.offload:
            changes["cpu_offload"] = True
            self._offload_backend(facts, editor)
        strategy = first.strategy
        if strategy in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2"):
            changes["reshard_after_forward"] = "never"
        hybrid = strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
        if hybrid and not options.hsdp:
            changes["mesh_layout"] = "per_node"  # FSDP1's groups: shard within a node, replicate across nodes
        if strategy == "NO_SHARD":
            changes["mesh_layout"] = "replicate"
        replicas = f"{options.hsdp} replicas" if options.hsdp else "one replica per node (read at run time)"
        if "sharding_strategy" in first.settings_node:
            self.change(
                first.settings_node["sharding_strategy"],
                f"ShardingStrategy.{strategy} -> " + {
                    "FULL_SHARD": "fully_shard (parameters resharded after forward; the last block keeps them)",
                    "SHARD_GRAD_OP": "fully_shard(..., reshard_after_forward=False)",
                    "HYBRID_SHARD": f"fully_shard on a 2-D (replicate, shard) mesh of {replicas} (HSDP)",
                    "_HYBRID_SHARD_ZERO2": f"fully_shard(..., reshard_after_forward=False) on a 2-D mesh of {replicas}",
                    "NO_SHARD": "fully_shard on a (world, 1) mesh: every rank a replica holding whole parameters, "
                                "gradients all-reduced (DDP's data parallelism)",
                }[strategy],
                "FSDP2 spells the sharding strategy as reshard_after_forward and the mesh's shape"
                + ("" if not hybrid or options.hsdp else
                   "; FSDP1's HYBRID_SHARD sharded within each node and replicated across nodes: the mesh reads "
                   "LOCAL_WORLD_SIZE (ranks per node) from torchrun; --hsdp N fixes the replica count instead"),
            )
        return replace(options, **changes) if changes else options

    def _offload_backend(self, facts: ScriptFacts, editor: StatementEditor) -> None:
        """CPU offload steps the optimizer on CPU tensors: the process group needs gloo too."""
        init = facts.distributed_init
        if init is None:
            return  # the launch stage starts one with cpu:gloo,cuda:nccl
        backend = init.args[0].value if init.args and init.args[0].keyword in (None,) else None
        for a in init.args:
            if a.keyword is not None and a.keyword.value == "backend":
                backend = a.value
        if backend is None:
            return  # the default backend has gloo for CPU tensors and nccl for CUDA ones
        if isinstance(backend, cst.SimpleString) and backend.evaluated_value == "nccl":
            editor.replace_expression(init, init.with_changes(args=[
                a.with_changes(value=self.expr('"cpu:gloo,cuda:nccl"')) if a.value is backend else a for a in init.args
            ]))
            self.change(init, 'the process group backend "nccl" -> "cpu:gloo,cuda:nccl"',
                        "with CPUOffloadPolicy the optimizer step and clipping run on CPU tensors")
        elif not (isinstance(backend, cst.SimpleString) and "gloo" in backend.evaluated_value):
            self.attention(init, f"CPU offload with the backend {code(backend)}",
                           'CPU tensors need gloo: use "cpu:gloo,cuda:nccl" when CUDA is present')

    # -- with FSDP.state_dict_type(...) -------------------------------------------

    def _block(self, block: StateDictBlock, facts: ScriptFacts, editor: StatementEditor, handled: Set[int]) -> None:
        node = block.node
        handled.add(id(node.items[0]))
        for stmt in block.consumed:
            self._remove(stmt, editor)
            handled.add(id(stmt))
        full = block.kind == "FULL_STATE_DICT"
        options = ("StateDictOptions(full_state_dict=True, cpu_offload=True)" if block.cpu_offload
                   else "StateDictOptions(full_state_dict=True)") if full else ""
        load_options = "StateDictOptions(full_state_dict=True)" if full else ""
        model = block.model
        r = facts.resolver
        body = list(node.body.body)
        inside = [c for c in r.nodes(cst.Call) if node.body in r.ancestors(c)]
        converted = []
        gathered: Dict[cst.Call, tuple] = {}  # call -> (its replacement, the model or optimizer)
        for call in inside:
            func = call.func
            names = r.qnames(call)
            replacement, owner = None, model
            if (isinstance(func, cst.Attribute) and code(func.value) == model
                    and func.attr.value == "state_dict" and not call.args):
                replacement = f"get_model_state_dict({model}{_opt(options)})"
                self.add_import(STATE_DICT_MODULE, "get_model_state_dict")
            elif any(n.endswith(".optim_state_dict") and is_fsdp1_name(n) for n in names) and len(call.args) == 2:
                m, o = (code(a.value) for a in call.args)
                owner = o
                replacement = f"get_optimizer_state_dict({m}, {o}{_opt(options)})"
                self.add_import(STATE_DICT_MODULE, "get_optimizer_state_dict")
            elif (isinstance(func, cst.Attribute) and code(func.value) == model
                    and func.attr.value == "load_state_dict" and len(call.args) == 1):
                replacement = f"set_model_state_dict({model}, {code(call.args[0].value)}{_opt(load_options)})"
                self.add_import(STATE_DICT_MODULE, "set_model_state_dict")
            elif (isinstance(func, cst.Attribute) and func.attr.value == "load_state_dict" and len(call.args) == 1
                    and isinstance(call.args[0].value, cst.Call)
                    and any(n.endswith(".optim_state_dict_to_load") and is_fsdp1_name(n)
                            for n in r.qnames(call.args[0].value))
                    and len(call.args[0].value.args) == 3):
                m, o, sd = (code(a.value) for a in call.args[0].value.args)
                replacement = f"set_optimizer_state_dict({m}, {o}, {sd}{_opt(load_options)})"
                self.add_import(STATE_DICT_MODULE, "set_optimizer_state_dict")
                handled.add(id(call.args[0].value))
            if replacement is None:
                continue
            if rank_gate(call, facts) is not None:
                self.refuse("FSR310", call, f"`{code(call)}` runs under a rank-0 `if`",
                            "gathering or scattering a state dict is a collective: every rank must call it",
                            "take it on every rank, then write the file under the rank-0 `if`")
            editor.replace_expression(call, self.expr(replacement))
            handled.add(id(call))
            converted.append(replacement.split("(")[0])
            gathered[call] = (replacement, owner)
        if options or load_options:
            self.add_import(STATE_DICT_MODULE, "StateDictOptions")
        # the body takes the place of the `with`
        editor.replace(node, None)
        moved = []
        for stmt in body:
            if full and _saves(stmt, facts) and rank_gate(stmt, facts) is None and not _is_rank_if(stmt, facts):
                test = self.rank_zero_test(node, facts) or "dist.get_rank() == 0"
                if test.startswith("dist."):
                    self.add_import("torch.distributed", asname="dist")
                for call, (replacement, owner) in gathered.items():
                    if stmt in r.ancestors(call):  # the collective stays on every rank, before the `if`
                        name = self.fresh_name(f"{owner.rsplit('.', 1)[-1]}_state", r.enclosing_function(node))
                        while name in self._hoisted:
                            name = self.fresh_name(f"{name}_", r.enclosing_function(node))
                        self._hoisted.add(name)
                        moved.append(self.stmt(f"{name} = {replacement}\n"))
                        editor.replace_expression(call, cst.Name(name))
                gated = cst.If(test=self.expr(test), body=cst.IndentedBlock(body=[stmt]))
                self.change(stmt, "the torch.save of the full state dict runs on rank 0 only",
                            "the full state dict is gathered to rank 0 (cpu_offload); every rank writing the "
                            "same file races")
                moved.append(gated)
            else:
                moved.append(stmt)
        editor.relead[moved[0]] = self._carried.pop(node, []) + list(node.leading_lines)
        editor.insert_before(node, moved)
        if full:
            what = f"`with FSDP.state_dict_type(..., FULL_STATE_DICT)` -> {', '.join(sorted(set(converted)))} " \
                   f"with {options or load_options}, on every rank"
            why = ("the full (unsharded) state dict is gathered by a collective on every rank"
                   + ("; with cpu_offload rank 0 gets it in CPU memory, the others an empty dict (as FSDP1's "
                      "rank0_only)" if block.cpu_offload else ""))
        else:
            what = f"`with FSDP.state_dict_type(..., SHARDED_STATE_DICT)` -> {', '.join(sorted(set(converted)))}"
            why = "each rank's DTensor shards, as DCP (torch.distributed.checkpoint) saves and loads them"
            if any(_saves(s, facts) for s in body):
                self.attention(node, "a sharded state dict is written with torch.save",
                               "each rank writes its own shards; torch.distributed.checkpoint (dcp.save) writes "
                               "one checkpoint that can be loaded on any number of ranks")
        self.change(node, what, why, "gathering a state dict under a rank-0 `if` deadlocks")

    def _default_state_dict(self, call: cst.Call, facts: ScriptFacts, editor: StatementEditor) -> None:
        model = wrapped_name(call.func.value)
        if rank_gate(call, facts) is not None:
            self.refuse("FSR310", call, f"`{model}.state_dict()` of the FSDP1 model runs under a rank-0 `if`",
                        "it gathers the full state dict: a collective every rank must call (a deadlock in FSDP1 too)",
                        "take it on every rank, then write the file under the rank-0 `if`")
        editor.replace_expression(call, self.expr(f"get_model_state_dict({model}, options=StateDictOptions(full_state_dict=True))"))
        self.add_import(STATE_DICT_MODULE, "get_model_state_dict")
        self.add_import(STATE_DICT_MODULE, "StateDictOptions")
        self.change(
            call,
            f"`{code(call.func.value)}.state_dict()` -> get_model_state_dict({model}, options=StateDictOptions(full_state_dict=True)), "
            "on every rank",
            "FSDP1's default state dict type is FULL_STATE_DICT: every rank got the full state dict; an FSDP2 "
            "module's state_dict() holds DTensor shards",
        )

    # -- clip_grad_norm_ and ShardedGradScaler -----------------------------------

    def _clip(self, call: cst.Call, editor: StatementEditor) -> None:
        model = code(call.func.value)
        args = [cst.Arg(self.expr(f"{model}.parameters()"), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))]
        editor.replace_expression(call, call.with_changes(func=self.expr("torch.nn.utils.clip_grad_norm_"), args=args + list(call.args)))
        self.add_import("torch")
        self.change(call, f"`{model}.clip_grad_norm_(...)` -> `torch.nn.utils.clip_grad_norm_({model}.parameters(), ...)`",
                    "FSDP2 modules have no clip_grad_norm_ method; the torch function works on DTensor gradients "
                    "and returns the global norm as a DTensor")

    def _scaler(self, call: cst.Call, editor: StatementEditor) -> None:
        args = [a for a in call.args if not (a.keyword is not None and a.keyword.value == "process_group")]
        if args and isinstance(args[-1].comma, cst.Comma) and len(args) < len(call.args):
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        editor.replace_expression(call, call.with_changes(func=self.expr("torch.amp.GradScaler"), args=args))
        self.add_import("torch")
        self.change(call, "ShardedGradScaler -> torch.amp.GradScaler"
                    + (" (process_group dropped)" if len(args) < len(call.args) else ""),
                    "GradScaler takes FSDP2's DTensor gradients and all-reduces its inf check over their mesh")

    # -- imports ----------------------------------------------------------------

    def _drop_imports(self, stmt: cst.SimpleStatementLine, editor: StatementEditor, still_read: Set[str]) -> None:
        """Drop the FSDP1 names an import binds, but those that values left as written still read."""
        body = []
        for small in stmt.body:
            if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                gone = set(fsdp1_alias_names(small)) - still_read
                names = [a for a in small.names if code(a.name) not in gone]
                if not names:
                    continue
                names[-1] = names[-1].with_changes(comma=small.names[-1].comma)  # a trailing comma stays
                small = small.with_changes(names=names)
            body.append(small)
        if not body:
            editor.replace(stmt, None)
        else:
            editor.replace(stmt, stmt.with_changes(body=body))


def _opt(options: str) -> str:
    return f", options={options}" if options else ""


def _saves(stmt, facts: ScriptFacts) -> bool:
    r = facts.resolver
    return any(r.is_call_to(c, SAVE) and (c is stmt or stmt in r.ancestors(c)) for c in r.nodes(cst.Call))


def _is_rank_if(stmt, facts: ScriptFacts) -> bool:
    from fsdp2_retrofit.analysis.checkpoints import mentions_rank_test

    return isinstance(stmt, cst.If) and mentions_rank_test(stmt.test)
