"""shard: fully_shard each repeated block, then the root, with the mesh."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ModelSite, ScriptFacts, code
from fsdp2_retrofit.analysis.batchnorm import batchnorm_layer, converted_already
from fsdp2_retrofit.analysis.copies import unsafe_state_copies
from fsdp2_retrofit.syntax.torch_api import ZERO_REDUNDANCY_OPTIMIZER
from fsdp2_retrofit.analysis.same_start import broadcast_reason
from fsdp2_retrofit.analysis.scalar_params import model_scalar_parameters
from fsdp2_retrofit.analysis.shard_anchors import _is_placement_chain
from fsdp2_retrofit.rewrite.blockers import shard as shard_blockers
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor

from .shard_units import ShardUnits


class ShardModelCommand(RetrofitStage):
    DESCRIPTION = "Shard each trained model bottom-up with fully_shard: repeated blocks first, then the root."
    CODE = "shard"
    LATER_STAGES_READ_IMPORTS = True  # they find the mesh, rank and fully_shard by name

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        self.refuse_found(shard_blockers.find(facts, self.options))
        self._optimizer_notes(facts)
        for unsafe in unsafe_state_copies(facts):
            self.attention(unsafe.node, unsafe.what, unsafe.why)
        policies = None
        self._check_shard_classes(facts)
        for model in self._to_shard(facts):
            if model.sharded:
                continue
            if policies is None:
                policies = self._policies(model, facts)
                statements = list(policies[1])
            else:
                statements = []
            self._contiguous_layout(model, facts, editor)
            hide, restore = self._scalar_parameters(model, facts)
            statements = (
                statements
                + self._sync_batchnorm(model, facts)
                + self._same_start(model, facts)
                + hide
                + ShardUnits(self).statements(model, facts, policies[0])
                + restore
            )
            editor.insert_after(model.shard_anchor, statements + self._split_compile(model, facts, editor))
            self.add_import(self.options.fsdp_module, "fully_shard")

    def _contiguous_layout(self, model: ModelSite, facts: ScriptFacts, editor: StatementEditor) -> None:
        """`model = model.to(memory_format=torch.channels_last)` before fully_shard: the conv weights become
        non-contiguous, which fully_shard refuses at start-up ('FSDP does not support non-contiguous
        parameters yet'). The model keeps the default layout (`torch.contiguous_format`); the same numbers,
        the inputs may stay channels_last."""
        block = facts.resolver.block_of(model.stmt)
        body = list(block.body) if block is not None else []
        if model.stmt not in body or model.shard_anchor not in body:
            return
        names = {model.name} | set(model.names.get(facts.resolver.enclosing_function(model.stmt), ()))
        for stmt in body[body.index(model.stmt): body.index(model.shard_anchor) + 1]:
            for call in facts.resolver.descendants(stmt, cst.Call):
                layout = next((a for a in call.args if a.keyword is not None and a.keyword.value == "memory_format"
                               and code(a.value).rsplit(".", 1)[-1] in ("channels_last", "channels_last_3d")), None)
                if (layout is None or not isinstance(call.func, cst.Attribute) or call.func.attr.value != "to"
                        or not any(_is_placement_chain(call.func.value, n) for n in names)):
                    continue
                contiguous = self.expr(code(layout.value).rsplit(".", 1)[0] + ".contiguous_format"
                                       if "." in code(layout.value) else "torch.contiguous_format")
                editor.replace_expression(layout.value, lambda _old, new=contiguous: new)
                self.change(
                    call,
                    f"`memory_format={code(layout.value)}` -> `{code(contiguous)}` for `{model.name}`",
                    "channels_last makes the convolution weights non-contiguous, and fully_shard refuses "
                    "non-contiguous parameters ('FSDP does not support non-contiguous parameters yet'); the "
                    "model computes the same in the default layout, the inputs may stay channels_last",
                )

    def _check_shard_classes(self, facts: ScriptFacts) -> None:
        """--shard CLASS names a class some model is built of. Where every class the models
        are built of is read here, a name that is none of them is refused (the loop would
        shard only the root); where a model is built from classes not read here (a library's),
        the name is matched when the script runs, and a note says so."""
        if not self.options.shard:
            return
        found, complete = set(), True
        models = [m for m in self._to_shard(facts) if not m.sharded] if facts.models else []
        for model in models:
            for name in model.alternatives or [model.class_name]:
                classes, whole = facts.classes.built_of(name)
                found |= classes
                complete = complete and whole and model.library is None
        missing = [c for c in self.options.shard if c.rsplit(".", 1)[-1] not in found]
        if not missing or not models:
            return
        named = ", ".join(missing)
        if complete:
            self.refuse(
                "FSR630",
                models[0].stmt,
                f"--shard {named}: no module of {', '.join(f'`{m.name}`' for m in models)} is of that class "
                f"(its classes: {', '.join(sorted(found))})",
                "the generated loop matches module classes by name; with none of that class it would shard "
                "only the root, one unit holding every parameter",
                "name one of the classes the model is built of (its repeated block)",
            )
        self.attention(
            models[0].stmt,
            f"--shard {named}: not a class the rewrite reads in {', '.join(f'`{m.name}`' for m in models)} "
            "(built from classes it does not read); it is matched by name when the script runs",
            "where no module is of that class, only the root is sharded: one unit holding every parameter",
        )

    def _to_shard(self, facts: ScriptFacts) -> list:
        """The trained models, their copies (EMA) and the frozen models sharded with them,
        in the order their fully_shard calls are inserted (the policies come first)."""
        sites = list(facts.models) + list(facts.copies)
        for frozen in facts.frozen_models:
            if frozen.sharded:
                continue
            if self.options.frozen_models == "replicate":
                self.attention(
                    frozen.stmt,
                    f"frozen `{frozen.name}` stays replicated (--frozen-models replicate): every rank holds all of it",
                    "its forward needs no communication; sharding it would keep 1/N of it per rank",
                )
            elif not facts.models or frozen.block is not facts.models[0].block:
                self.attention(
                    frozen.stmt,
                    f"frozen `{frozen.name}` stays replicated: it is built outside the block that builds the trained "
                    "models",
                    "the device mesh exists only there; build it next to them to shard it",
                )
            elif frozen.top is not frozen.stmt:
                self.attention(
                    frozen.stmt,
                    f"frozen `{frozen.name}` stays replicated: it is built inside an `if` or another block",
                    "where it may not exist, a fully_shard after that block would fail; build it unconditionally "
                    "to shard it",
                )
            else:
                sites.append(frozen)
        body = list(facts.models[0].block.body) if facts.models else []
        return sorted(sites, key=lambda m: body.index(m.shard_anchor) if m.shard_anchor in body else -1)

    def _sync_batchnorm(self, model: ModelSite, facts: ScriptFacts) -> list:
        """A trained model with BatchNorm layers: `model = nn.SyncBatchNorm.convert_sync_batchnorm(model)`
        where CUDA is present, before fully_shard and the optimizer; on CPU the statistics stay per rank."""
        if model.copy_of is not None or any(model is f for f in facts.frozen_models):
            return []  # a copy or a frozen model runs forward only (an EMA, a teacher in eval mode)
        layer = batchnorm_layer(model, facts)
        if layer is None or converted_already(facts, model.name):
            return []
        r = facts.resolver
        if r.local_name("torch.nn.SyncBatchNorm"):
            sync = r.local_name("torch.nn.SyncBatchNorm")
        elif r.local_name("torch.nn"):
            sync = f"{r.local_name('torch.nn')}.SyncBatchNorm"
        else:
            sync = "torch.nn.SyncBatchNorm"
        self.add_import("torch")
        where = layer.where()
        self.change(
            model.shard_anchor,
            f"`{model.name} = {sync}.convert_sync_batchnorm({model.name})` when CUDA is present, before "
            f"fully_shard: `{model.name}` has BatchNorm layers (`{layer.what}`, {where})",
            "with the batch split over the ranks each BatchNorm would normalise with its own rank's part of it; "
            "SyncBatchNorm shares the mean and variance between the ranks, so the loss and the running statistics "
            "are those of the global batch, as in the single-process run",
            "per-rank batch statistics: losses and running statistics that differ from the single-process run",
        )
        self.attention(
            layer.line,
            f"on CPU (gloo) each rank's BatchNorm normalises with its own part of the batch (`{layer.what}`, {where})",
            "SyncBatchNorm runs on GPUs only (its forward raises on CPU tensors), so without CUDA the layers stay "
            "per rank: the losses and running statistics differ from the single-process run; on GPUs the "
            "converted layers match it",
            differs=True,
        )
        return [self.stmt(
            f"if torch.cuda.is_available():  # SyncBatchNorm (GPUs only): batch statistics of all ranks\n"
            f"    {model.name} = {sync}.convert_sync_batchnorm({model.name})\n"
        )]

    def _same_start(self, model: ModelSite, facts: ScriptFacts) -> list:
        """Rank 0's parameters and buffers broadcast to every rank before fully_shard, unless
        a literal seed makes every rank build the same weights (analysis/same_start.py)."""
        reason = None if self.options.meta_init else broadcast_reason(facts, model)
        if reason is None:
            return []
        tensor = self.fresh_name("tensor", model.scope)
        on_device = self.fresh_name("on_device", model.scope)
        self.add_import("torch")
        self.add_import("torch.distributed", asname="dist")
        self.change(
            model.shard_anchor,
            f"broadcast rank 0's parameters and buffers of `{model.name}` to every rank before fully_shard",
            f"{reason}; fully_shard keeps each rank's own slice of what it built (DDP used to copy rank 0's): "
            "the sharded model would mix initialisations (seed the build with a literal to drop the broadcast)",
        )
        return [self.stmt(
            f"with torch.no_grad():  # every rank starts from rank 0's weights\n"
            f"    for {tensor} in [*{model.name}.parameters(), *{model.name}.buffers()]:\n"
            f"        {on_device} = {tensor}.to(\"cuda\" if torch.cuda.is_available() else \"cpu\")\n"
            f"        dist.broadcast({on_device}, src=0)\n"
            f"        {tensor}.copy_({on_device})\n"
        )]

    def _scalar_parameters(self, model: ModelSite, facts: ScriptFacts):
        """(statements before the fully_shard calls, statements after them) for a model
        that may hold 0-dim parameters (analysis/scalar_params.py): fully_shard cannot
        split them, so they leave their modules while it runs, come back whole, on the
        mesh's device, and a hook averages their gradients over the ranks in backward."""
        found = model_scalar_parameters(facts, model)
        if not found:
            return [], []
        where = ", ".join(f"{p.describe()} ({self._scalar_line(p, facts)})" for p in found)
        if self.options.meta_init:
            first = found[0]
            self.refuse(
                "FSR628",
                self._class_line(first.node, model),
                f"--meta-init with a 0-dim parameter: {where}",
                "fully_shard cannot split a 0-dim parameter, so it stays a plain tensor outside fully_shard; "
                "to_empty replaces such a tensor with a new, uninitialised one after the fully_shard calls, "
                "and the hook that averages its gradient over the ranks would be left on the old one",
                "drop --meta-init: the default rewrite builds the model as written and keeps the 0-dim "
                "parameters whole on every rank",
            )
        self.add_import("torch.distributed", asname="dist")
        scalars = self.fresh_name("scalar_params", model.scope)
        module = self.fresh_name("module", model.scope)
        name = self.fresh_name("name", model.scope)
        param = self.fresh_name("param", model.scope)
        if facts.mesh_name:
            device = f"{facts.mesh_name}.device_type"
        else:
            self.add_import("torch")
            device = '"cuda" if torch.cuda.is_available() else "cpu"'
        self.change(
            model.shard_anchor,
            f"0-dim parameters of `{model.name}` ({where}) stay whole on every rank, outside fully_shard; "
            "a hook averages their gradients over the ranks in backward",
            "fully_shard splits each parameter along dim 0 and raises on a 0-dim one; they leave their "
            "modules while it runs (found when the script runs: `p.dim() == 0`), then come back on the mesh's "
            "device, and since FSDP reduces no gradient of a parameter it does not manage, each gets an "
            "all-reduce averaging its gradient as FSDP averages the others (rank 0's starting values: see the "
            "broadcast rule above)",
            "fully_shard raises \"doesn't support scalar parameters\"; a parameter left out without its own "
            "all-reduce trains differently on each rank",
        )
        hide = [self.stmt(
            "# fully_shard splits each parameter along dim 0: the 0-dim ones leave their modules while it runs\n"
            f"{scalars} = [\n"
            f"    ({module}, {name}, {param})\n"
            f"    for {module} in {model.name}.modules()\n"
            f"    for {name}, {param} in {module}.named_parameters(recurse=False)\n"
            f"    if {param}.dim() == 0\n"
            "]\n"
        ), self.stmt(
            f"for {module}, {name}, {param} in {scalars}:\n"
            f"    {module}.register_parameter({name}, None)\n"
        )]
        restore = [self.stmt(
            f"for {module}, {name}, {param} in {scalars}:  # back, whole on every rank\n"
            f"    {param}.data = {param}.data.to({device})  # fully_shard moves only what it shards\n"
            f"    {module}.register_parameter({name}, {param})\n"
            f"    if {param}.requires_grad:  # FSDP reduces no gradient of theirs: average it over the ranks\n"
            f"        {param}.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad.div_(dist.get_world_size())))\n"
        )]
        return hide, restore

    def _scalar_line(self, param, facts: ScriptFacts) -> str:
        """Where a 0-dim parameter is created: `line 25` in the script, `models.py:25` in a sibling module."""
        if param.owner is None:
            return f"line {self.line(param.node)}"
        info = facts.classes.get(param.owner)
        line = info.namer.resolver.line(param.node)
        return f"{facts.classes.shown_file(info.namespace)}:{line}" if info.namespace else f"line {line}"

    def _split_compile(self, model: ModelSite, facts: ScriptFacts, editor: StatementEditor) -> list:
        """`model = torch.compile(Net())` becomes `model = Net()`, the shards, then
        `model = torch.compile(model)`: fully_shard must see the plain module."""
        small = model.stmt.body[0]
        call = small.value if isinstance(small, cst.Assign) else None
        if call is None or call not in facts.compiled_builds:
            return []
        editor.replace(model.stmt, model.stmt.with_changes(body=[small.with_changes(value=call.args[0].value)]))
        args = ", ".join([model.name] + [code(a).rstrip(",").strip() for a in call.args[1:]])
        self.change(
            model.stmt,
            f"`torch.compile` moves after fully_shard: `{model.name} = {code(call.func)}({args})`",
            "fully_shard registers its hooks on the plain module; compiling the sharded module keeps them "
            "(checkpoints from get_model_state_dict name parameters without torch.compile's `_orig_mod.` prefix)",
        )
        return [self.stmt(f"{model.name} = {code(call.func)}({args})\n")]

    def _policies(self, model: ModelSite, facts: ScriptFacts):
        """(the keyword arguments every fully_shard gets besides the mesh, the statements
        that define them): the mixed-precision and CPU-offload policies asked for."""
        kwargs, statements = "", []
        dtype = self._precision(model, facts)
        if dtype:
            name = self.fresh_name("mp_policy", model.scope)
            torch_dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
            statements.append(self.stmt(
                f"{name} = MixedPrecisionPolicy(param_dtype={torch_dtype}, reduce_dtype=torch.{self.options.mp_reduce_dtype})\n"
            ))
            kwargs += f", mp_policy={name}"
            self.add_import(self.options.fsdp_module, "MixedPrecisionPolicy")
            self.add_import("torch")
            self.change(
                model.shard_anchor,
                f"MixedPrecisionPolicy({torch_dtype} parameters, {self.options.mp_reduce_dtype} gradient reduction) on every fully_shard",
                f"each unit's parameters are all-gathered and used in {torch_dtype} (half the communication "
                "and memory of fp32), gradients are reduce-scattered in float32 and the optimizer keeps float32 "
                "shards; results differ from an fp32 run by the rounding of the parameters to "
                + torch_dtype,
            )
        if self.options.cpu_offload:
            name = self.fresh_name("offload_policy", model.scope)
            statements.append(self.stmt(f"{name} = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())\n"))
            kwargs += f", offload_policy={name}"
            self.add_import(self.options.fsdp_module, "CPUOffloadPolicy")
            self.change(
                model.shard_anchor,
                "CPUOffloadPolicy on every fully_shard: parameter, gradient and optimizer-state shards live in "
                "CPU memory (pinned when CUDA is present)",
                "each unit is copied to the GPU for its forward/backward and the optimizer steps on the CPU: "
                "GPU memory for the model drops to about one unit, at the cost of host-device copies; the "
                "numbers are those of the run without offload",
            )
        return kwargs, statements

    def _precision(self, model: ModelSite, facts: ScriptFacts) -> str:
        """"bf16", "fp16" or "" for --mixed-precision (auto: the script's autocast dtype)."""
        from fsdp2_retrofit.analysis.facts import autocast_dtypes

        wanted = self.options.mixed_precision
        if wanted == "none":
            return ""
        if wanted == "auto":
            found = autocast_dtypes(facts.resolver)
            if not found:
                self.attention(
                    model.stmt,
                    "--mixed-precision auto: the script uses no autocast; training stays in float32",
                    "name a dtype (--mixed-precision bf16) to compute in lower precision anyway",
                )
                return ""
            if len(found) > 1 or "unknown" in found:
                self.refuse(
                    "FSR602",
                    model.stmt,
                    "--mixed-precision auto: the script's autocast dtype is not one known dtype",
                    f"found {', '.join(sorted(found))}; FSDP2 takes one parameter dtype per unit",
                    "name it: --mixed-precision bf16 or fp16",
                )
            wanted = found.pop()
        if any(facts.classes.mentions(c, "BatchNorm") for c in model.alternatives or [model.class_name]) or (
            model.library and model.library.batchnorm
        ) or batchnorm_layer(model, facts) is not None:  # also a library model held by the model's class
            self.refuse(
                "FSR603",
                model.stmt,
                f"--mixed-precision {wanted}: `{model.name}` has BatchNorm layers",
                "FSDP2 would cast their parameters and running statistics to the low-precision dtype with the rest "
                "of the unit; a separate float32 unit for them only works when the whole forward runs under autocast",
                "run without --mixed-precision (autocast alone keeps BatchNorm in float32)",
            )
        if wanted == "fp16" and not any(
            "GradScaler" in q for c in facts.resolver.nodes(cst.Call) for q in facts.resolver.qnames(c)
        ):
            self.attention(
                model.stmt,
                "--mixed-precision fp16 without a GradScaler: small gradients underflow in float16",
                "scale the loss with torch.amp.GradScaler (works unchanged with FSDP2; not the FSDP1 ShardedGradScaler)",
            )
        return wanted

    def _optimizer_notes(self, facts: ScriptFacts) -> None:
        """What the rewrite takes on trust about an optimizer it cannot read all of."""
        for opt in facts.optimizers:
            if opt.call is None:
                continue
            if opt.wrapper is not None and opt.inner is None:
                wrapper = code(opt.wrapper.func)
                self.attention(
                    opt.stmt,
                    f"`{opt.name}` is `{wrapper}(...)` around the optimizer built in its arguments; its class was "
                    "not read",
                    f"fully_shard comes before the whole statement; {wrapper}'s methods are taken to step and clear "
                    "that optimizer (not checked)",
                )
            if opt.method is not None and opt.method_builds & ZERO_REDUNDANCY_OPTIMIZER:
                self.attention(
                    opt.stmt,
                    f"{opt.method.name.value}() can build a ZeroRedundancyOptimizer (left as it is)",
                    "after fully_shard the optimizer state is sharded already; ZeroRedundancyOptimizer over "
                    "DTensor shards is not supported: keep the branch that builds a torch.optim optimizer",
                )

    def _class_line(self, node, model: ModelSite) -> int:
        """The line of a node of a model class: in this script, or (for a class of a
        sibling module) the line that builds the model."""
        return self.line(node) or self.line(model.stmt)
