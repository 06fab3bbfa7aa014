"""shard: fully_shard each repeated block, then the root, with the mesh."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ModelSite, ScriptFacts, code
from fsdp2_retrofit.analysis.batchnorm import batchnorm_layer, converted_already
from fsdp2_retrofit.analysis.copies import unsafe_state_copies
from fsdp2_retrofit.analysis.forward_data_writes import forward_data_write
from fsdp2_retrofit.analysis.leaf_units import model_leaf_layout
from fsdp2_retrofit.analysis.model_classes import first_submodule, parameter_reads
from fsdp2_retrofit.analysis.no_model import no_model_blocker, nothing_found_at, unrecognised_trained_model
from fsdp2_retrofit.analysis.optimizers import FLATTENING_OPTIMIZERS, whole_tensor_operation
from fsdp2_retrofit.syntax.names import root_name
from fsdp2_retrofit.syntax.torch_api import AUTOGRAD_GRAD, GRAD_SCALER, ZERO_REDUNDANCY_OPTIMIZER
from fsdp2_retrofit.analysis.same_start import broadcast_reason
from fsdp2_retrofit.analysis.scalar_params import model_scalar_parameters
from fsdp2_retrofit.analysis.shared_modules import shared_module
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor


class ShardModelCommand(RetrofitStage):
    DESCRIPTION = "Shard each trained model bottom-up with fully_shard: repeated blocks first, then the root."
    CODE = "shard"
    LATER_STAGES_READ_IMPORTS = True  # they find the mesh, rank and fully_shard by name

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        self._refuse_unsafe(facts)
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
            hide, restore = self._scalar_parameters(model, facts)
            statements = (
                statements
                + self._sync_batchnorm(model, facts)
                + self._same_start(model, facts)
                + hide
                + self._shard_statements(model, facts, policies[0])
                + restore
            )
            editor.insert_after(model.shard_anchor, statements + self._split_compile(model, facts, editor))
            self.add_import(self.options.fsdp_module, "fully_shard")

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

    def _compiled_model(self, call: cst.Call, facts: ScriptFacts):
        """The model whose whole build statement is `name = torch.compile(<build>, ...)`."""
        for model in facts.models:
            small = model.stmt.body[0]
            if isinstance(small, cst.Assign) and small.value is call and call.args and call.args[0].keyword is None:
                return model
        return None

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

    def _refuse_old_grad_scaler(self, facts: ScriptFacts) -> None:
        """A GradScaler unscales FSDP2's DTensor gradients and reduces its inf/NaN check over
        their mesh from torch 2.5 on (pytorch#132816): before that, --torch-version 2.4 output
        would fail at the first `scaler.step` (or skip steps on some ranks only)."""
        version = self.options.torch_version
        if not version or tuple(int(p) for p in version.split(".")[:2]) >= (2, 5):
            return
        r = facts.resolver
        for call in r.nodes(cst.Call):
            if r.qnames(call) & GRAD_SCALER:
                self.refuse(
                    "FSR643",
                    call,
                    f"a GradScaler with --torch-version {version}",
                    "torch 2.4's GradScaler cannot unscale FSDP2's DTensor gradients (its inf/NaN check is reduced "
                    "over the ranks from torch 2.5 on)",
                    "target torch 2.5 or newer (--torch-version 2.5), or train in bfloat16 without a scaler",
                )

    def _refuse_unsafe(self, facts: ScriptFacts) -> None:
        for line, wrapper in facts.wrappers:
            if "FSDP1" not in wrapper:  # the migrate_ddp stage removes these before this stage runs
                self.refuse(
                    "FSR601",
                    line,
                    f"the script still uses {wrapper}",
                    "the wrapper must go before fully_shard",
                    "run the migrate_ddp stage first (the composite `rewrite` does)",
                )
            self.refuse(
                "FSR601",
                line,
                f"the script still uses {wrapper}",
                "the FSDP1 wrap must go before fully_shard",
                "run the migrate_fsdp1 stage first (the composite `rewrite` does)",
            )
        self._refuse_double_backward(facts)
        self._refuse_old_grad_scaler(facts)
        for call in facts.compiled_builds:
            if self._compiled_model(call, facts) is not None:
                continue  # `model = torch.compile(Net())`: split, see _split_compile
            self.refuse(
                "FSR604",
                call,
                "the model is compiled in the expression that builds it",
                "fully_shard must see the plain module, before torch.compile wraps it",
                "build it first (`model = Net()`), then `model = torch.compile(model)` on its own line",
            )
        for cls, call in facts.trainer_classes:
            self.refuse(
                "FSR605",
                call,
                f"the training loop lives in class {cls}, which is handed the model",
                "the class is in another file, which the script's own analysis does not convert: the program "
                "linked into one analysis does, and where it cannot be linked its loop would keep its plain "
                "sampler, saves and logging",
                "rewrite from the entry, where the program is linked (FSR970 says what stops it), or move the "
                "trainer class into the script",
            )
        copied = {id(c.copy_call) for c in facts.copies}
        for call in facts.deep_copies:
            if id(call) in copied:
                continue  # `ema = copy.deepcopy(model)` after the build: sharded like the model
            self.refuse(
                "FSR606",
                call,
                f"`{code(call)}` copies a model that gets sharded",
                "FSDP2 modules cannot be deep-copied; a copy is sharded like the model only when it is made as "
                "`name = copy.deepcopy(model)` in the block that builds the model, before the model is rebound, "
                "sharded or used in a loop",
                "make the copy right after the model is built (ema = copy.deepcopy(model))",
            )
        for what, call in facts.hidden_copies:
            if id(call) in copied:
                continue  # `ema = AveragedModel(model, ...)` after the build: its `.module` is sharded
            if what == "AveragedModel":
                self.refuse(
                    "FSR607",
                    call,
                    "`AveragedModel(...)` deep-copies a model that gets sharded, inside its constructor",
                    "its copy (`.module`) is sharded like the model only when it is made as "
                    "`name = AveragedModel(model, ...)` in the block that builds the model, before the model is "
                    "rebound, sharded or used in a loop (FSDP2 modules cannot be deep-copied after sharding)",
                    "make it right after the model is built",
                )
            self.refuse(
                "FSR608",
                call,
                f"class {what} deep-copies the model it is handed",
                "the copy is made inside a constructor, where the rewrite cannot shard it with the model's units "
                "(FSDP2 modules cannot be deep-copied after sharding), and its state would be saved unconverted",
                "keep the average as `ema = copy.deepcopy(model)` right after the build, updated with "
                "`torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)` under "
                "torch.no_grad(): it is then sharded like the model",
            )
        if self.options.meta_init and facts.copies:
            self.refuse(
                "FSR609",
                facts.copies[0].stmt,
                "--meta-init with a copy of the model",
                "the copy would be made of the model on the meta device, before its re-initialisation",
                "run without --meta-init",
            )
        if not facts.models:
            for cls, call in facts.class_optimizers:
                self.refuse(
                    "FSR610",
                    call,
                    f"the optimizer is built inside class {cls} from parameters the rewrite cannot follow to a "
                    "model the script builds",
                    "the rewrite must shard that model before the optimizer is built; an optimizer a trainer "
                    "builds from the model it is handed (`self.optimizer = model.configure_optimizers(cfg)`, "
                    "`torch.optim.AdamW(self.model.parameters())`) is followed, this one is not",
                    f"build the optimizer as one call on the model {cls} is handed, or build the model and "
                    f"optimizer in a function and pass them to {cls}",
                )
            blocker = no_model_blocker(facts) or nothing_found_at(facts)
            where, detail = blocker.at, (f": {blocker.detail}" if blocker.detail else "")
            if not facts.module_ctor_names:
                self.refuse(
                    "FSR611",
                    where,
                    f"no nn.Module is built in this script{detail}",
                    "there is no model to shard",
                    "run rewrite on the script that builds the model and its optimizer",
                )
            self.refuse(
                "FSR612",
                where,
                f"no optimizer trains a model built in this script{detail}",
                "fully_shard must come before the optimizer is built from the model's parameters",
                "build the optimizer from model.parameters() in the same script",
            )
        self._refuse_optimizers(facts)
        self._refuse_optimizers_built_before_shard(facts)
        unknown = unrecognised_trained_model(facts)
        if unknown is not None:
            self.refuse(
                "FSR625",
                unknown.at,
                f"an optimizer trains a module the rewrite does not recognise: {unknown.detail}",
                "the rewrite shards the models it recognises; this one would stay a whole module on every rank "
                "whose gradients no rank reduces, and the ranks would drift apart",
                "import the class by name (`from models import Generator`), or build the module with a class "
                "defined in the script or a sibling module",
            )
        scopes = {id(m.block) for m in facts.models}
        if len(scopes) > 1:
            self.refuse(
                "FSR613",
                facts.models[1].stmt,
                "models are built in different blocks",
                "one process group and mesh must cover every model; the rewrite needs them built in one place",
                "build all models in the same function",
            )
        shared = shared_module(facts)
        if shared is not None:
            first, second = shared.owners[0], shared.owners[1]
            self.refuse(
                "FSR626",
                second.stmt,
                f"`{shared.name}` is a submodule of both `{first.name}` (line {facts.resolver.line(first.stmt)}) "
                f"and `{second.name}`, which both get sharded",
                "fully_shard of the first model makes the shared parameters its DTensor shards, and the second "
                "model would meet them already sharded; FSDP2 lets a unit belong to one root only",
                f"put `{first.name}` and `{second.name}` under one parent module and shard that, or keep the "
                "script single-GPU",
            )
        for assign, name in facts.closure_rebinds:
            self.refuse(
                "FSR627",
                assign,
                f"a nested function rebinds `{name}` (declared nonlocal), a model of the function around it",
                "the rewrite shards the module the enclosing function built; after this assignment the name holds "
                "an object fully_shard never saw, and the optimizer, state dicts and gradient sync would follow "
                "the wrong one",
                f"return the new object and bind `{name}` in the enclosing function before the optimizer is "
                "built, or give it its own name",
            )
        for model in facts.models:
            if model.library is not None and model.library.refusal is not None and not model.sharded:
                kind, what, why, hint = model.library.refusal
                self.refuse(kind, model.library.refusal_at or model.stmt, what, why, hint)
            if model.rebound_by is not None and not model.sharded:
                self.refuse(
                    "FSR620",
                    model.rebound_by,
                    f"`{code(model.rebound_by).strip()}` rebinds the model to an object that wraps it",
                    f"fully_shard must see the finished module right before the optimizer, and calls meant for the "
                    f"sharded module (set_requires_gradient_sync, get_model_state_dict) would reach the wrapper "
                    f"under the name `{model.name}`",
                    f"give the wrapper its own name (`wrapped = Wrapper({model.name})`), or build the wrapper "
                    f"around the model in one expression and shard that",
                )
            if _declared_global(model, facts):
                self.refuse(
                    "FSR617",
                    model.stmt,
                    f"`{model.name}` is a global built inside {model.scope.name.value}()",
                    "set-up, training and saving are spread over functions that share globals; the "
                    "process group would be torn down at the end of the set-up function",
                    "build the model in the function that trains and saves it, or pass it as an argument",
                )
            # a class chosen at run time: each class the name may hold
            for info in filter(None, map(facts.classes.get, model.alternatives or [model.class_name])):
                for attr, node in info.plain_lists:
                    self.refuse(
                        "FSR618",
                        self._class_line(node, model),
                        f"`self.{attr}` keeps layers in a plain Python list",
                        "its parameters are not registered: they are neither trained nor sharded",
                        f"use nn.ModuleList for self.{attr}",
                    )
                self._refuse_block_parameter_reads(model, info, facts)
                self._refuse_forward_data_writes(model, info, facts)
                if info.optimizer_in_init:
                    self.refuse(
                        "FSR619",
                        self._class_line(info.optimizer_in_init, model),
                        f"an optimizer is built inside {info.name}.__init__",
                        "it would hold the unsharded parameters; fully_shard replaces them with DTensors",
                        "build the optimizer in the training script, after the model",
                    )

    def _refuse_block_parameter_reads(self, model: ModelSite, info, facts: ScriptFacts) -> None:
        """A method called outside forward that reads a parameter of a block that gets its
        own unit: register_fsdp_forward_method gathers only the root unit's parameters."""
        if self.options.shard:
            return  # --shard CLASS: the units are found at run time
        blocks = {c.path[0] for c in (info.containers if model.runtime_blocks else model.containers)}
        for method in facts.methods_called_on(model, info):
            for node, sub in parameter_reads(info.methods[method], info):
                owner = sub if sub is not None else first_submodule(info)
                if owner in blocks:
                    self.refuse(
                        "FSR623",
                        self._class_line(node, model),
                        f"{info.name.rsplit('.', 1)[-1]}.{method}() reads a parameter of `self.{owner}` outside forward",
                        f"`self.{owner}` holds blocks that each become an FSDP unit: outside their forward their "
                        "parameters are DTensor shards, and registering the method gathers only the root's; a tensor "
                        "built from one leaks a DTensor into forward",
                        "take dtype and device from a parameter of the root (an embedding, the head), or pass them in",
                    )

    def _refuse_forward_data_writes(self, model: ModelSite, info, facts: ScriptFacts) -> None:
        """A forward that writes a parameter through `.data` (analysis/forward_data_writes.py):
        after fully_shard the write lands in the gathered copy, not in the shards."""
        if model.copy_of is not None or any(model is f for f in facts.frozen_models):
            return  # forward only: each forward gathers and writes again, no gradient reads it
        found = forward_data_write(info.name, facts.classes)
        if found is None:
            return
        owner = facts.classes.get(found.class_name)
        line = owner.namer.resolver.line(found.node) if owner.namer is not None else 0
        where = (f"{facts.classes.shown_file(owner.namespace)}:{line}" if owner.namespace else f"line {line}")
        self.refuse(
            "FSR644",
            self._class_line(found.node, model),
            f"{found.class_name.rsplit('.', 1)[-1]}.{found.method}() ({where}) writes `{found.parameter}` through "
            f"`.data` in the forward of `{model.name}`: `{code(found.node).strip()}`",
            "after fully_shard the forward runs on a copy all-gathered from the shards and the write lands in that "
            "copy only: the backward gathers the parameter again from the shards, so it computes the gradients "
            "with the unwritten values, and the shards the optimizer steps and the checkpoint saves never hold "
            "the write",
            "apply the change without writing the parameter (multiply by a mask buffer: "
            "`F.conv2d(x, self.conv.weight * self.mask, ...)`), or write the parameter outside the forward, "
            "after optimizer.step(), where the write reaches the shards",
        )

    def _refuse_double_backward(self, facts: ScriptFacts) -> None:
        """A gradient penalty (autograd.grad with create_graph) needs a second backward
        through parameters FSDP2 has resharded after the first."""
        if not facts.models:
            return
        for call in facts.resolver.nodes(cst.Call):
            if not facts.resolver.is_call_to(call, AUTOGRAD_GRAD):
                continue
            graph = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "create_graph"),
                         None)
            if graph is None or (isinstance(graph, cst.Name) and graph.value == "False"):
                continue
            self.refuse(
                "FSR624",
                call,
                f"`{code(call.func)}(..., create_graph={code(graph)})` takes a second backward through the model",
                "FSDP2 frees each unit's gathered parameters after its backward; the graph kept for the second "
                "backward still reads them (the run fails in that backward)",
                "keep this model unsharded (DDP), or compute the penalty without a second backward through it",
            )

    def _refuse_optimizers(self, facts: ScriptFacts) -> None:
        """Optimizers whose step cannot work on DTensor shards."""
        for opt in facts.optimizers:
            if opt.call is None:
                continue
            if facts.resolver.qnames(opt.call.func) & FLATTENING_OPTIMIZERS:
                self.refuse(
                    "FSR621",
                    opt.stmt,
                    f"`{opt.name}` is {code(opt.call.func)}, which flattens every gradient into one vector",
                    "after fully_shard each parameter and gradient is a DTensor shard: its line search and "
                    "curvature pairs would be computed on pieces of the vector (or gather all of it on every rank)",
                    "train this model without sharding, or use an optimizer that works parameter by parameter",
                )
            if opt.wrapper is not None and opt.inner is None:
                self._unread_wrapper(opt, facts)
            if opt.method is not None and opt.method_builds & FLATTENING_OPTIMIZERS:
                self.refuse(
                    "FSR621",
                    opt.stmt,
                    f"`{opt.name}` is built by {opt.method.name.value}(), which builds "
                    f"{sorted(opt.method_builds & FLATTENING_OPTIMIZERS)[0]}, flattening every gradient into one vector",
                    "after fully_shard each parameter and gradient is a DTensor shard: its line search and "
                    "curvature pairs would be computed on pieces of the vector (or gather all of it on every rank)",
                    "train this model without sharding, or use an optimizer that works parameter by parameter",
                )
            if opt.method is not None and opt.method_builds & ZERO_REDUNDANCY_OPTIMIZER:
                self.attention(
                    opt.stmt,
                    f"{opt.method.name.value}() can build a ZeroRedundancyOptimizer (left as it is)",
                    "after fully_shard the optimizer state is sharded already; ZeroRedundancyOptimizer over "
                    "DTensor shards is not supported: keep the branch that builds a torch.optim optimizer",
                )
            if opt.own_class is not None:
                op = whole_tensor_operation(opt.own_class)
                if op is not None:
                    self.refuse(
                        "FSR622",
                        op,
                        f"optimizer class {opt.own_class.name.value} works on whole matrices (`{code(op)}`)",
                        "after fully_shard each parameter and gradient is a DTensor shard (rows split over the "
                        "ranks): a reshape, transpose or matrix product of it gathers the whole matrix on every "
                        "rank or computes on one piece of it",
                        "gather the gradient explicitly (`g.full_tensor()`), compute, and keep this rank's "
                        "part (distribute_tensor), or keep the script single-GPU",
                    )

    def _refuse_optimizers_built_before_shard(self, facts: ScriptFacts) -> None:
        """An optimizer of a model built, in the function that shards the model, before the
        statement fully_shard follows and outside its block (a branch of an if/else, a try): the
        optimizer stage moves only statements of that block, so it would keep the unsharded
        parameters and the model would never update."""
        r = facts.resolver
        for model in facts.models:
            anchor = model.shard_anchor
            fn = r.enclosing_function(anchor)
            body = list(r.block_of(anchor).body) if r.block_of(anchor) is not None else []
            names = model.names.get(fn, {model.name})
            for opt in facts.optimizers:
                if (r.enclosing_function(opt.stmt) is not fn or not set(opt.models) & names or opt.stmt in body
                        or r.order(opt.stmt) > r.order(anchor)):
                    continue
                self.refuse(
                    "FSR629",
                    opt.stmt,
                    f"`{opt.name}` is built from `{model.name}`'s parameters before `{model.name}` is sharded "
                    f"(fully_shard goes after line {r.line(anchor)}), inside a block the rewrite does not move",
                    "fully_shard replaces the parameters with DTensor shards: an optimizer built before it keeps "
                    "the old tensors and the model never updates; the optimizer stage moves an optimizer only "
                    "within the block that shards the model",
                    "build the model (and place it) before the if/else that builds its optimizer, or build the "
                    "optimizer after the model is placed",
                )

    def _unread_wrapper(self, opt, facts: ScriptFacts) -> None:
        """`opt = Wrapper(optim.Adam(...))` whose class is not in the script or a sibling module."""
        wrapper = code(opt.wrapper.func)
        for call in facts.resolver.nodes(cst.Call):
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value in ("state_dict", "load_state_dict")
                    and isinstance(func.value, cst.Attribute)):
                continue
            names = facts.optimizer_names.get(facts.resolver.enclosing_function(call), {})
            if root_name(func.value) in names:
                self.refuse(
                    "FSR612",
                    call,
                    f"`{code(func.value)}.{func.attr.value}()`: the optimizer is held by `{wrapper}(...)`, whose class "
                    "is not in this script or a sibling module",
                    "the rewrite cannot tell whether that attribute is the torch optimizer, whose state must be "
                    "read and written through get_optimizer_state_dict / set_optimizer_state_dict after fully_shard",
                    f"rewrite the script beside the module that defines {wrapper}",
                )
        self.attention(
            opt.stmt,
            f"`{opt.name}` is `{wrapper}(...)` around the optimizer built in its arguments; its class was not read",
            f"fully_shard comes before the whole statement; {wrapper}'s methods are taken to step and clear that "
            "optimizer (not checked)",
        )

    def _class_line(self, node, model: ModelSite) -> int:
        """The line of a node of a model class: in this script, or (for a class of a
        sibling module) the line that builds the model."""
        return self.line(node) or self.line(model.stmt)

    def _shard_statements(self, model: ModelSite, facts: ScriptFacts, policies: str = ""):
        mesh = (f", mesh={facts.mesh_name}" if facts.mesh_name else "") + policies
        out = []
        # a frozen model or a copy runs forward only: every unit, the root too, frees its
        # gathered parameters after forward (no backward would gather them again)
        forward_only = model.copy_of is not None or any(model is f for f in facts.frozen_models)
        self._report_untrained(model, facts)
        if model.late_init is not None:
            self.attention(
                model.late_init,
                f"`{code(model.late_init)}` runs on the sharded `{model.name}`: each rank initialises its own "
                "shards, not the weights the single-process run draws",
                "it is in an if/else with other work (a checkpoint load that must follow fully_shard) that the "
                "rewrite does not split (its test calls something, or the branch does more than initialise), so "
                "it cannot move before fully_shard; the initialisation is as valid, but the run does not start "
                f"from the same weights (move `{code(model.late_init)}` before the `if` for that)",
                differs=True,
            )
        if self.options.shard:
            var = self.fresh_name("module", model.scope)
            keep = ", reshard_after_forward=False" if self.options.reshard_after_forward == "never" else ""
            classes = ", ".join(f'"{c.rsplit(".", 1)[-1]}"' for c in self.options.shard)
            out.append(
                self.stmt(
                    f"for {var} in reversed(list({model.name}.modules())):\n"
                    f"    if type({var}).__name__ in ({classes},) and {var} is not {model.name}:\n"
                    f"        fully_shard({var}{mesh}{keep})\n"
                )
            )
            self.change(
                model.shard_anchor,
                f"fully_shard every {', '.join(self.options.shard)} inside `{model.name}`, innermost first",
                "--shard names the units: each one's parameters are gathered only while it runs",
            )
        elif model.library is not None and model.library.no_split_modules:
            out.extend(self._no_split_statements(model, mesh))
        elif model.runtime_blocks:
            out.extend(self._runtime_block_statements(model, mesh, forward_only))
        else:
            var = self.fresh_name("block", model.scope)
            policy = self.options.reshard_after_forward
            if model.library is not None and model.containers:
                self.change(
                    model.stmt, f"`{model.name}` is {model.library.why}",
                    "a library builds it: its layout comes from a table of known library models (never imported)",
                )
            leaves = self._leaf_layout(model, facts, forward_only)
            head_keeps = leaves is not None and any(u.last for u in leaves.units)
            for n, container in enumerate(model.containers):
                path = ".".join((model.name,) + container.path)
                if container.units_inside:
                    last = policy == "default" and n == len(model.containers) - 1 and not forward_only and not head_keeps
                    out.append(self._inner_units(model, container, path, mesh, last))
                    continue
                if policy == "default" and n == len(model.containers) - 1 and not forward_only and not head_keeps:
                    index = self.fresh_name("index", model.scope)
                    out.append(self.stmt(
                        f"for {index}, {var} in enumerate({path}):\n"
                        f"    fully_shard({var}{mesh}, reshard_after_forward={index} < len({path}) - 1)\n"
                    ))
                    self.change(
                        model.shard_anchor,
                        f"the last block of `{path}` keeps its gathered parameters after forward",
                        "backward starts with the last block: resharding it only to gather it again at once "
                        "costs a second all-gather (torchtitan's default; --reshard-after-forward always|never)",
                    )
                else:
                    keep = ", reshard_after_forward=False" if policy == "never" else ""
                    out.append(self.stmt(f"for {var} in {path}:\n    fully_shard({var}{mesh}{keep})\n"))
                self.change(
                    model.shard_anchor,
                    f"fully_shard each {container.block_class} in `{path}`",
                    "a unit per repeated block: only one block's parameters are gathered at a time",
                    "a ModuleList passed to fully_shard itself has no forward: its hooks never fire",
                )
            if leaves is not None:
                out.extend(self._leaf_statements(model, leaves, mesh))
            for container in model.tied_containers:
                path = ".".join((model.name,) + container.path)
                self.attention(
                    self._class_line(container.node, model),
                    f"`{path}` shares a parameter with another module; its blocks stay in the root unit",
                    "tied parameters must live in one FSDP unit",
                )
            if not model.containers and not model.tied_containers:
                self.attention(
                    model.stmt,
                    f"no repeated blocks found in `{model.name}`: only the root is sharded",
                    f"`{model.name}` is {model.library.why}" if model.library is not None
                    else "pass --shard CLASS to make each block of that class its own unit",
                )
        keep = ", reshard_after_forward=False" if self.options.reshard_after_forward == "never" else ""
        if forward_only and not keep:
            keep = ", reshard_after_forward=True"  # the root would otherwise keep its gathered parameters
        out.append(self.stmt(f"fully_shard({model.name}{mesh}{keep})\n"))
        self.change(
            model.shard_anchor,
            f"fully_shard the root `{model.name}` after its blocks",
            "the root unit holds what no block holds (embeddings, head); bottom-up order",
            "sharding the root first takes every parameter into one unit",
        )
        return out

    def _inner_units(self, model: ModelSite, container, path: str, mesh: str, last: bool):
        """Blocks that are containers whose forward never runs (an inner ModuleList or
        ModuleDict, or a Sequential the model takes apart): a unit per child of each block,
        the modules the forward calls."""
        layer = self.fresh_name("layer", model.scope)
        var = self.fresh_name("block", model.scope)
        children = f"{layer}.values()" if container.inner == "ModuleDict" else layer
        keep = ""
        if self.options.reshard_after_forward == "never":
            keep = ", reshard_after_forward=False"
        elif last and container.inner != "ModuleDict":
            keep = f", reshard_after_forward={var} is not {path}[-1][-1]"
        classes = ", ".join(dict.fromkeys(c.rsplit(".", 1)[-1] for c in container.inner_classes))
        self.change(
            model.shard_anchor,
            f"fully_shard each module inside each inner {container.inner} of `{path}` ({classes})",
            "the modules the forward calls are the units: an inner "
            + (f"{container.inner} has no forward of its own"
               if container.inner != "Sequential" else "Sequential that forward takes apart never runs its forward")
            + ", so FSDP2's pre-forward hook on it would never gather its parameters"
            + (f"; the last module of `{path}[-1]` keeps its gathered parameters after forward (backward starts "
               "there)" if "is not" in keep else ""),
            "fully_shard(inner ModuleList) raises (a container without forward) or, on older torch, leaves its "
            "parameters sharded when its children run",
        )
        return self.stmt(
            f"for {layer} in {path}:\n"
            f"    for {var} in {children}:\n"
            f"        fully_shard({var}{mesh}{keep})\n"
        )

    def _leaf_layout(self, model: ModelSite, facts: ScriptFacts, forward_only: bool):
        """Large leaves of a trained model outside its blocks (analysis/leaf_units.py), for the
        default unit choice only (--shard names the units itself)."""
        if forward_only or self.options.shard:
            return None
        version = self.options.torch_version
        lists = not version or tuple(int(p) for p in version.split(".")[:2]) >= (2, 5)
        return model_leaf_layout(facts, model, lists)

    def _leaf_statements(self, model: ModelSite, layout, mesh: str) -> list:
        """fully_shard each leaf unit (an embedding, `[final norm, head]`), after the blocks,
        before the root; the unit that runs last in forward keeps its parameters gathered."""
        out = []
        policy = self.options.reshard_after_forward
        for unit in layout.units:
            names = [".".join((model.name,) + p) for p in unit.paths]
            target = names[0] if len(names) == 1 else f"[{', '.join(names)}]"
            keep = ""
            if policy == "never" or policy == "default" and unit.last:
                keep = ", reshard_after_forward=False"
            out.append(self.stmt(f"fully_shard({target}{mesh}{keep})\n"))
            self.change(
                model.shard_anchor,
                f"fully_shard {' and '.join(f'`{n}`' for n in names)} as a unit of {'their' if len(names) > 1 else 'its'} own "
                f"({unit.what}; one block: {layout.block_params:,})",
                "left in the root it would stay gathered through forward and backward; as a unit it is gathered "
                "only while it runs (torchtitan's layout: embeddings, blocks, final norm with the head, root)"
                + (": it runs last in forward, so it keeps its parameters for backward, and the last block "
                   "reshards" if keep and policy == "default" else ""),
                "the root unit holds it whole on every rank for the whole step",
            )
        for path, why in layout.kept:
            self.attention(
                model.stmt,
                f"`{'.'.join((model.name,) + path)}` stays in the root unit although it holds at least one block's "
                f"parameters ({layout.block_params:,}): {why}",
                "a unit of its own would be gathered only while it runs; here that is not safe or not known",
            )
        return out

    def _no_split_statements(self, model: ModelSite, mesh: str) -> list:
        """A transformers model whose class is decided at run time: a unit per module of
        a class in `model._no_split_modules`, innermost first, found when it runs."""
        blocks = self.fresh_name("blocks", model.scope)
        var = self.fresh_name("block", model.scope)
        m = self.fresh_name("module", model.scope)
        policy = self.options.reshard_after_forward
        keep = {"default": f", reshard_after_forward={var} is not {blocks}[-1]", "never": ", reshard_after_forward=False"}
        self.change(
            model.stmt,
            f"`{model.name}` is {model.library.why}",
            "transformers lists in `_no_split_modules` the layer classes it never splits (its own device map "
            "and FSDP wrapping use them); without such classes only the root is sharded",
        )
        classes = self.fresh_name("no_split", model.scope)
        return [self.stmt(
            f"{classes} = {model.name}._no_split_modules or ()\n"
        ), self.stmt(
            f"{blocks} = [{m} for {m} in {model.name}.modules() if type({m}).__name__ in {classes}]\n"
        ), self.stmt(
            f"for {var} in reversed({blocks}):\n"
            f"    fully_shard({var}{mesh}{keep.get(policy, '')})\n"
        )]


    def _runtime_block_statements(self, model: ModelSite, mesh: str, forward_only: bool) -> list:
        """A model whose class the script chooses at run time: a unit per child of each
        ModuleList/Sequential whose children share one class, found when it runs,
        innermost first (a child that shares a parameter with another module stays in
        the root, as tied blocks do); none found: the root alone."""
        r = self.facts.resolver
        nn = r.local_name("torch.nn") or "torch.nn"
        self.add_import("torch")
        self.add_import("collections")
        uses = self.fresh_name("uses", model.scope)
        blocks = self.fresh_name("blocks", model.scope)
        container = self.fresh_name("container", model.scope)
        child = self.fresh_name("child", model.scope)
        p = self.fresh_name("p", model.scope)
        var = self.fresh_name("block", model.scope)
        policy = self.options.reshard_after_forward
        keep = {"default": f", reshard_after_forward={var} is not {blocks}[-1]", "never": ", reshard_after_forward=False"}
        if forward_only and policy != "never":
            keep = {}
        chosen = ", ".join(c.rsplit(".", 1)[-1] for c in model.alternatives)
        self.change(
            model.stmt,
            f"`{model.name}` is one of {chosen}, chosen at run time: its repeated blocks are found when it runs "
            f"(each child of a ModuleList/Sequential of one class becomes a unit; none: only the root)",
            "the classes' repeated blocks differ (or a table decides), so no one attribute path fits every choice",
        )
        return [self.stmt(
            f"{blocks} = []  # `{model.name}`'s class is chosen at run time: find its repeated blocks\n"
        ), self.stmt(
            f"for {container} in {model.name}.modules():\n"
            f"    if isinstance({container}, ({nn}.ModuleList, {nn}.Sequential)) and len(set(map(type, {container}))) == 1:\n"
            f"        {blocks} += [{child} for {child} in {container} if not isinstance({child}, ({nn}.ModuleList, {nn}.ModuleDict))]\n"
        ), self.stmt(
            f"{uses} = collections.Counter(id({p}) for _, {p} in {model.name}.named_parameters(remove_duplicate=False))\n"
        ), self.stmt(
            f"{blocks} = [{var} for {var} in {blocks} if all({uses}[id({p})] == 1 for {p} in {var}.parameters())]"
            "  # tied: in the root unit\n"
        ), self.stmt(
            f"for {var} in reversed({blocks}):  # innermost first\n"
            f"    fully_shard({var}{mesh}{keep.get(policy, '')})\n"
        )]

    def _report_untrained(self, model: ModelSite, facts: ScriptFacts) -> None:
        if model.copy_of is not None:
            self.change(
                model.stmt,
                f"shard the copy `{model.name}` exactly like `{model.copy_of}` (same units, same mesh), after "
                f"`{model.copy_of}`",
                "an EMA update over zip(ema.parameters(), model.parameters()) then pairs identically sharded "
                "DTensors: each rank averages its own shards; saves of its state go through get_model_state_dict",
                "FSDP2 modules cannot be deep-copied: the copy is made before the model is sharded",
            )
            source = facts.model(model.copy_of)
            if source is not None:
                self.change(
                    source.stmt,
                    f"`{source.name}` is sharded after `{code(model.stmt).strip()}`",
                    "the copy must be taken of the plain module, before fully_shard",
                )
        elif any(model is f for f in facts.frozen_models):
            self.change(
                model.stmt,
                f"shard the frozen `{model.name}` too (no optimizer trains it): every unit frees its gathered "
                "parameters after forward",
                "each rank keeps 1/N of it and gathers one unit at a time in its forward (no gradients, no "
                "reduce-scatter); the outputs are those of the full model. --frozen-models replicate keeps a "
                "full copy per rank instead (no communication, full memory)",
                "its forward is now a collective: every rank must run it, never under a rank-0 `if`",
            )


def _declared_global(model: ModelSite, facts: ScriptFacts) -> bool:
    if not isinstance(model.scope, cst.FunctionDef):
        return False
    found = [n.name.value for node in facts.resolver.descendants(model.scope.body, cst.Global) for n in node.names]
    return model.name in found
