"""The refusal catalogue: every construct `rewrite` refuses to convert, with a stable code.

A refusal leaves the whole file unchanged (exit 2). Codes are `FSR` + three digits,
the first digit the stage that refuses, in pipeline order: 1 migrate_spawn,
2 migrate_ddp, 3 migrate_fsdp1, 4 launch, 5 meta_init (--meta-init), 6 shard,
7 checkpoint and library_saves, 8 resume, 9 data, zero_grad (FSR95x) and loss_scale
(FSR96x), 97x the program (a step in a module the entry reaches). A code names one kind of refusal; the message names the construct in the
script (`fsdp2-retrofit rules FSR101`).
Codes are never reused for something else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

STAGES = {
    "1": "migrate_spawn",
    "2": "migrate_ddp",
    "3": "migrate_fsdp1",
    "4": "launch",
    "5": "meta_init",
    "6": "shard",
    "7": "checkpoint",
    "8": "resume",
    "9": "data",
}


@dataclass(frozen=True)
class RefusalRule:
    """One kind of refusal: what is refused, why, and what to do."""

    code: str
    name: str
    summary: str  # what is refused, one line
    why: str
    fix: str
    stage_name: str = ""  # where it is not the code's stage (library_saves among the 7xx)

    @property
    def stage(self) -> str:
        return self.stage_name or STAGES[self.code[3]]

    def doc(self) -> str:
        """The documentation `fsdp2-retrofit rules CODE` shows, in ruff's shape."""
        return "\n".join([
            f"# {self.code} {self.name}", "",
            f"Refused by the {self.stage} stage: the file is left unchanged (exit 2).", "",
            "## What is refused", self.summary, "",
            "## Why", self.why, "",
            "## What to do", self.fix,
        ]) + "\n"


_RULES = [
    # -- 1xx migrate_spawn ---------------------------------------------------------
    RefusalRule("FSR101", "spawn-more-than-once", "The script calls mp.spawn more than once.",
                "torchrun starts one set of processes per run.", "Launch one worker function."),
    RefusalRule("FSR102", "spawn-worker-not-top-level",
                "The function mp.spawn starts is not a top-level function of the script.",
                "The rewrite must call it once per torchrun process and rewrite its process group.",
                "Spawn a function defined at the top level of the script."),
    RefusalRule("FSR103", "spawn-args-not-literal", "The args of mp.spawn are not a tuple written in the call.",
                "Each argument is mapped to one of the worker's parameters (the world size to WORLD_SIZE).",
                "Write `args=(a, b, ...)` in the call."),
    RefusalRule("FSR104", "spawn-result-used", "The value mp.spawn returns is used.",
                "torchrun workers return nothing to a launcher: there is no spawn context or return value.",
                "Call mp.spawn(...) as a statement of its own."),
    RefusalRule("FSR105", "spawn-launcher-option", "mp.spawn is given `join=False` or another launcher option.",
                "The launching process would keep working alongside its workers; under torchrun there is none.",
                "Join the workers (the default) and run rewrite again."),
    RefusalRule("FSR106", "spawn-shared-object", "A queue, pipe, manager or shared value is handed to the workers.",
                "These live in the launching process; torchrun workers are separate programs and cannot receive them.",
                "Exchange results through files or collectives (dist.gather_object) instead."),
    RefusalRule("FSR107", "spawn-worker-signature",
                "The worker does not take exactly the spawn index plus the spawn args.",
                "The rewrite maps each spawn argument to one parameter.", "Give the worker plain parameters."),
    RefusalRule("FSR108", "spawn-worker-without-process-group", "The spawned worker starts no process group.",
                "An mp.spawn worker without init_process_group cannot become a torchrun worker automatically.",
                "Call dist.init_process_group in the worker."),
    RefusalRule("FSR109", "spawn-init-store", "init_process_group is given a store.",
                "torchrun's env:// rendezvous replaces the store.", "Drop `store=` and run rewrite again."),
    RefusalRule("FSR110", "spawn-computed-rank", "The worker computes its global rank for init_process_group.",
                "torchrun's RANK replaces it, but the script's own rank arithmetic would stay in use elsewhere.",
                "Pass the spawn index as the rank."),
    RefusalRule("FSR111", "spawn-init-positional",
                "init_process_group takes positional arguments after the backend.",
                "init_method, world_size and rank must be recognised to be dropped.", "Pass them by keyword."),
    # -- 2xx migrate_ddp ---------------------------------------------------------
    RefusalRule("FSR201", "ddp-wrap-in-expression",
                "A DDP/DataParallel wrapper is built inside another expression, not `model = DDP(model, ...)`.",
                "The migration replaces wrap statements; a wrapper returned, passed on or stored in an attribute "
                "cannot be followed.", "Wrap the model on its own line: `model = DDP(model, device_ids=[local_rank])`."),
    RefusalRule("FSR202", "ddp-wrapper-class-used", "The script uses the wrapper class itself (isinstance, subclass).",
                "After the migration no model is a DDP/DataParallel: the test or subclass would change meaning.",
                "Drop the test (the model is never wrapped after the rewrite) and run rewrite again."),
    RefusalRule("FSR203", "ddp-no-sync-shape",
                "`no_sync()` is used in a shape the migration does not convert.",
                "FSDP2 has no no_sync context; the migration turns `with model.no_sync():` (on lines of its own) and "
                "`ctx = model.no_sync() if ... else nullcontext()` into set_requires_gradient_sync.",
                "Use `with model.no_sync():` around the backward of the micro-batches that must not sync."),
    RefusalRule("FSR204", "ddp-rank-seed", "The random seed of a DDP script depends on the rank.",
                "DDP copies rank 0's weights when it wraps; fully_shard keeps each rank's own slice of its own "
                "weights, so a per-rank seed would mix initialisations.",
                "Seed the model build with the same value on every rank (seed data augmentation separately)."),
    RefusalRule("FSR205", "ddp-and-data-parallel", "The script uses both DataParallel and DistributedDataParallel.",
                "One process per device cannot be derived from both.", "Keep one of them."),
    RefusalRule("FSR206", "ddp-unknown-argument", "A DDP/DataParallel argument has no FSDP2 counterpart the rewrite knows.",
                "Dropping it could change what the script does (e.g. a process_group other than the world).",
                "Remove the argument (or build the mesh by hand) and run rewrite again."),
    # -- 3xx migrate_fsdp1 ---------------------------------------------------------
    RefusalRule("FSR301", "fsdp1-wrap-shape",
                "An FSDP(...) wrap is not `name = FSDP(module, key=...)` on its own line.",
                "The rewrite replaces the wrap statement by fully_shard calls on the model it names and reads "
                "FSDP1's settings by keyword.", "Write `model = FSDP(model, ...)` on its own line, settings by keyword."),
    RefusalRule("FSR302", "fsdp1-unknown-argument", "FSDP(...) is given an argument the rewrite cannot migrate.",
                "The rewrite does not know how FSDP2 does what the argument does.",
                "Remove the argument, or migrate this part by hand."),
    RefusalRule("FSR303", "fsdp1-unreadable-setting",
                "An FSDP1 setting (auto_wrap_policy, sharding_strategy, MixedPrecision, CPUOffload) cannot be read.",
                "Each setting becomes an FSDP2 option (units, reshard_after_forward, MixedPrecisionPolicy, "
                "CPUOffloadPolicy); its value must be known when rewriting.",
                "Write the setting in the call (or one assignment) with literal values and known members."),
    RefusalRule("FSR304", "fsdp1-no-shard", "sharding_strategy=ShardingStrategy.NO_SHARD.",
                "NO_SHARD is data parallelism without sharding (DDP); FSDP2 always shards over the mesh.",
                "Use DistributedDataParallel (or let the rewrite shard: remove sharding_strategy)."),
    RefusalRule("FSR305", "fsdp1-state-dict-type",
                "A state dict type the rewrite does not convert (set_state_dict_type, LOCAL_STATE_DICT, a shared "
                "`with`, an unreadable config).",
                "The rewrite converts FULL_STATE_DICT and SHARDED_STATE_DICT blocks of their own "
                "(`with FSDP.state_dict_type(model, ...):`) into get_/set_*_state_dict calls.",
                "Take the state dicts inside `with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):`."),
    RefusalRule("FSR306", "fsdp1-unconverted-api", "FSDP1 API the rewrite does not convert is left in the script.",
                "No FSDP1 API may be left in an FSDP2 script (the two cannot be mixed on one model).",
                "Migrate this use by hand (FSDP2: get_model_state_dict, DTensor.full_tensor, set_requires_gradient_sync)."),
    RefusalRule("FSR307", "fsdp1-mixed-wrap-settings", "Several FSDP(...) wraps with different settings.",
                "The rewrite gives every fully_shard the same policy and unit rule.",
                "Use the same FSDP settings for every model."),
    RefusalRule("FSR308", "fsdp1-precision-combination", "MixedPrecision(...) with a combination of dtypes the rewrite does not map.",
                "The rewrite maps a bfloat16/float16 param_dtype (and its reduce_dtype) only.",
                "Use param_dtype=torch.bfloat16 or torch.float16."),
    RefusalRule("FSR309", "fsdp1-hybrid-without-hsdp", "ShardingStrategy.HYBRID_SHARD without `--hsdp`.",
                "FSDP2's HSDP is a 2-D (replicate, shard) mesh whose shape the rewrite cannot know.",
                "Pass --hsdp N (N = the number of nodes, i.e. replicas)."),
    RefusalRule("FSR310", "fsdp1-state-dict-rank-gated", "An FSDP1 state dict is taken under a rank-0 `if`.",
                "Gathering or scattering a state dict is a collective every rank must call.",
                "Take it on every rank, then write the file under the rank-0 `if`."),
    # -- 4xx launch --------------------------------------------------------------------
    RefusalRule("FSR401", "launch-conditional-process-group", "The process group is started under a condition.",
                "fully_shard needs the process group and a device mesh on every run.",
                "Start it directly under one `if` (`if ddp: init_process_group(backend)`, no init_method or "
                "rank arguments; the other branch then gets a process group of one process), or unconditionally."),
    RefusalRule("FSR402", "launch-model-before-process-group",
                "The model is built before the script starts its process group.",
                "fully_shard needs the device mesh, which needs the process group; sharding must follow the build.",
                "Start the process group (init_process_group) before building the model."),
    RefusalRule("FSR403", "launch-training-framework",
                "The script trains through Accelerate, Lightning (Trainer or Fabric) or DeepSpeed.",
                "The framework starts the process group and wraps the model itself; a torchrun process group and "
                "fully_shard added on top fail at start-up (the default process group initialised twice).",
                "Use the framework's own FSDP2 support (Accelerate's FSDP plugin, Lightning's "
                "ModelParallelStrategy, a DeepSpeed ZeRO config), or drop the framework first."),
    RefusalRule("FSR404", "launch-returned-model-unfollowed",
                "A helper builds the model and returns it in a way the rewrite does not follow.",
                "The process group must start before the helper runs and end after its caller is done with the "
                "model; the rewrite follows `return model, optimizer` (plain names) into one "
                "`model, optimizer = build(...)`.",
                "Return plain names and call the helper once, as `model = build(...)` or "
                "`model, optimizer = build(...)`."),
    RefusalRule("FSR405", "launch-dist-name-taken",
                "The script binds the name `dist` to something other than torch.distributed.",
                "Every line the rewrite writes calls torch.distributed as `dist` (`dist.init_process_group`, "
                "`dist.get_rank()`) and imports it as `import torch.distributed as dist`; with the script's own "
                "`dist` (`import torch.distributions as dist`) one import rebinds the other and the process group "
                "or the script's own `dist.<name>` raises AttributeError at run time.",
                "Give the script's value another name (`import torch.distributions as D`, and `D.Categorical` "
                "where it is used), then rewrite again."),
    # -- 5xx meta_init -------------------------------------------------------------------
    RefusalRule("FSR501", "meta-init-library-model", "--meta-init with a model built by a library (transformers, timm, ...).",
                "Its initialisation or pretrained weights live in the library, which the rewrite never reads.",
                "Run without --meta-init."),
    RefusalRule("FSR502", "meta-init-compound-build", "--meta-init with a model built inside a compound statement.",
                "The meta build, to_empty and re-initialisation need the model built by one plain statement.",
                "Build the model in one plain statement, or run without --meta-init."),
    RefusalRule("FSR503", "meta-init-cannot-replay", "--meta-init where the model's initialisation cannot be re-created.",
                "After to_empty the memory holds garbage: every parameter and buffer must be re-initialised exactly "
                "as the constructor did, and the analysis cannot follow this part of it.",
                "Run without --meta-init, or follow the message's hint."),
    RefusalRule("FSR504", "meta-init-not-built-by-class", "--meta-init with a model not built by calling its class.",
                "The re-initialisation is read from the constructor call and the class's __init__.",
                "Call the model's class in the training script, or run without --meta-init."),
    RefusalRule("FSR505", "meta-init-use-before-shard", "--meta-init with a statement using the model between its build and fully_shard.",
                "The model has no values until to_empty and the re-initialisation, which would also overwrite it.",
                "Load weights after sharding (set_model_state_dict / dcp.load), or run without --meta-init."),
    # -- 6xx shard ---------------------------------------------------------------------
    RefusalRule("FSR601", "shard-wrapper-left", "The shard stage runs on a script that still uses DDP/FSDP1 wrappers.",
                "The wrapper must go before fully_shard.",
                "Run the migrate stages first (the composite `rewrite` does)."),
    RefusalRule("FSR602", "shard-autocast-dtype-unknown", "--mixed-precision auto with several or unknown autocast dtypes.",
                "FSDP2 takes one parameter dtype per unit.", "Name it: --mixed-precision bf16 or fp16."),
    RefusalRule("FSR603", "shard-batchnorm-low-precision", "Mixed precision for a model with BatchNorm layers.",
                "FSDP2 would cast their parameters and running statistics to the low-precision dtype.",
                "Run without --mixed-precision (autocast alone keeps BatchNorm in float32)."),
    RefusalRule("FSR604", "shard-compiled-in-build", "The model is compiled in the expression that builds it.",
                "fully_shard must see the plain module, before torch.compile wraps it.",
                "Build it first (`model = Net()`), then `model = torch.compile(model)` on its own line."),
    RefusalRule("FSR605", "shard-trainer-class-loop",
                "The training loop lives in a class of a sibling module that the script alone cannot convert.",
                "A trainer class of the script is converted in its methods, and one of a sibling module in its own "
                "file, with the program linked into one analysis; the script alone (where the program cannot be "
                "linked, FSR970 says why at the class's backward()) would leave its loop with its plain sampler, "
                "saves and logging.",
                "Make the program linkable as FSR970 says, or move the trainer class into the script."),
    RefusalRule("FSR606", "shard-copy-elsewhere", "A sharded model is copied other than right after its build.",
                "FSDP2 modules cannot be deep-copied; a copy is sharded like the model only when made as "
                "`name = copy.deepcopy(model)` in the block that builds it.",
                "Make the copy right after the model is built (ema = copy.deepcopy(model))."),
    RefusalRule("FSR607", "shard-averaged-model-in-constructor", "`AveragedModel(...)` of a sharded model inside a constructor.",
                "Its copy is sharded like the model only when made in the block that builds the model.",
                "Make it right after the model is built."),
    RefusalRule("FSR608", "shard-class-copies-model", "A class deep-copies the model it is handed.",
                "The copy is made inside a constructor, where the rewrite cannot shard it with the model's units.",
                "Keep the copy as `ema = copy.deepcopy(model)` right after the build."),
    RefusalRule("FSR609", "shard-meta-init-with-copy", "--meta-init with a copy of the model.",
                "The copy would be made of the model on the meta device, before its re-initialisation.",
                "Run without --meta-init."),
    RefusalRule("FSR610", "shard-optimizer-in-class",
                "The optimizer is built inside a trainer class from parameters that cannot be followed to a model.",
                "The rewrite must shard the model before that optimizer is built; one a trainer builds from the "
                "model it is handed (`model.configure_optimizers(cfg)` in its run()) is followed.",
                "Build the optimizer as one call on the model the class is handed, or build the model and "
                "optimizer in a function and pass them to the class."),
    RefusalRule("FSR611", "shard-no-model", "No nn.Module is built in the script.", "There is no model to shard.",
                "Run rewrite on the script that builds the model and its optimizer."),
    RefusalRule("FSR612", "shard-no-optimizer", "No optimizer trains a model built in the script.",
                "fully_shard must come before the optimizer is built from the model's parameters.",
                "Build the optimizer from model.parameters() in the same script."),
    RefusalRule("FSR613", "shard-models-in-different-blocks", "Models are built in different blocks.",
                "One process group and mesh must cover every model; the rewrite needs them built in one place.",
                "Build all models in the same function."),
    RefusalRule("FSR614", "shard-library-placement-argument",
                "A library model is loaded with device_map= or quantization (load_in_8bit/4bit, quantization_config).",
                "Placed or quantized weights are not plain trainable parameters FSDP2 can shard and reduce.",
                "Drop the argument (train in bf16 with --mixed-precision bf16), or keep the script single-GPU."),
    RefusalRule("FSR615", "shard-library-push-to-hub", "push_to_hub of a model the rewrite shards.",
                "Each rank holds only its shards: the library would upload one rank's pieces.",
                "Save with save_pretrained(dir) (the rewrite gathers the full state) and upload that folder on rank 0."),
    RefusalRule("FSR616", "shard-library-peft", "The model is wrapped by PEFT after it is built.",
                "The adapters would stay plain tensors whose gradients no rank reduces: the ranks drift apart.",
                "Train without PEFT, or keep the script single-GPU."),
    RefusalRule("FSR617", "shard-global-built-in-function", "The model is a global built inside a set-up function.",
                "The process group would be torn down at the end of the set-up function.",
                "Build the model in the function that trains and saves it, or pass it as an argument."),
    RefusalRule("FSR618", "shard-plain-list-of-layers", "A model keeps layers in a plain Python list.",
                "Their parameters are not registered: they are neither trained nor sharded.",
                "Use nn.ModuleList."),
    RefusalRule("FSR619", "shard-optimizer-in-init", "An optimizer is built inside the model's __init__.",
                "It would hold the unsharded parameters; fully_shard replaces them with DTensors.",
                "Build the optimizer in the training script, after the model."),
    RefusalRule("FSR620", "shard-model-rebound-to-wrapper",
                "The model's name is rebound to an object wrapping it (`model = Wrapper(model)`) after the build.",
                "fully_shard must come after the last change to the module, right before the optimizer; calls meant "
                "for the sharded module (set_requires_gradient_sync, state dicts) would reach the wrapper instead.",
                "Give the wrapper its own name, or build the wrapped model in one expression (`model = Wrapper(Net())`)."),
    RefusalRule("FSR621", "shard-flattening-optimizer", "The model is trained by LBFGS, which flattens every gradient into one vector.",
                "After fully_shard gradients are DTensor shards: the flat vector, its line search and curvature "
                "pairs would be built from pieces, or gather everything on every rank.",
                "Train without sharding, or use an optimizer that works parameter by parameter."),
    RefusalRule("FSR622", "shard-optimizer-whole-matrices",
                "An optimizer class of the script reshapes, transposes or multiplies whole matrices (Newton-Schulz, Muon, Shampoo).",
                "After fully_shard each parameter is a DTensor shard: such an operation gathers the whole matrix "
                "on every rank or computes on one piece of it.",
                "Gather explicitly (full_tensor), compute, keep this rank's part; or keep the script single-GPU."),
    RefusalRule("FSR623", "shard-block-parameter-outside-forward",
                "A method of the model called outside forward reads a parameter of a block that becomes its own FSDP unit.",
                "Outside forward that parameter is a DTensor shard; registering the method (register_fsdp_forward_method) "
                "gathers only the root unit's, so a tensor built from it leaks a DTensor into forward.",
                "Take dtype and device from a root parameter (embedding, head), or pass them in."),
    RefusalRule("FSR624", "shard-double-backward",
                "`torch.autograd.grad(..., create_graph=True)` (a gradient penalty: WGAN-GP, DRAGAN, R1) in a script "
                "whose model is sharded.",
                "FSDP2 reshards a unit's parameters after its backward: the graph that create_graph=True keeps for "
                "the second backward still reads the gathered parameters, which are freed by then (the run fails "
                "in that backward, or reads freed memory).",
                "Keep this model unsharded (DDP), or compute the penalty without a second backward through the "
                "sharded model."),
    RefusalRule("FSR625", "shard-unrecognised-trained-model",
                "An optimizer trains a module the rewrite does not recognise, beside models it does.",
                "Only the recognised models are sharded: this one would stay whole on every rank, its gradients "
                "never reduced, and the ranks would drift apart.",
                "Import the class by name (`from models import Generator`, not only `from models import *` of two "
                "modules that both define it), or build it with a class of the script or a sibling module."),
    RefusalRule("FSR626", "shard-module-shared-by-models",
                "One module is handed to the constructors of two models that get sharded (layers shared between "
                "two encoders).",
                "fully_shard of the first model turns the shared parameters into its DTensor shards; the second "
                "model then meets parameters that are already sharded (the rank-0 broadcast before it fails), and "
                "FSDP2 lets a unit belong to one root only, so the shared module cannot be its own unit either.",
                "Put both models under one parent module and shard that (one root), or keep the script single-GPU."),
    RefusalRule("FSR627", "shard-model-rebound-in-nested-function",
                "A function nested in the one that builds the model declares the model's name `nonlocal` and "
                "binds it to another object.",
                "The rewrite shards the module the enclosing function built; after the nested function runs, the "
                "name holds an object fully_shard never saw (unsharded, or a wrapper around the sharded module), "
                "and the optimizer, state dicts and gradient sync would follow the wrong one.",
                "Return the new object from the nested function and bind it in the enclosing function before the "
                "optimizer is built, or give it its own name."),
    RefusalRule("FSR628", "shard-scalar-parameter-meta-init",
                "--meta-init with a model whose classes create a 0-dim parameter (`nn.Parameter(torch.zeros(()))`, "
                "a learned temperature or gate).",
                "fully_shard splits each parameter along dim 0 and cannot take a 0-dim one, so the rewrite keeps it "
                "out of fully_shard, whole on every rank, with a hook that averages its gradient; `to_empty` after "
                "the fully_shard calls replaces such a plain tensor with a new, uninitialised one, which the "
                "re-initialisation does not know and the hook is not on.",
                "Drop --meta-init: the default rewrite builds the model as written and keeps the 0-dim parameters "
                "whole on every rank."),
    RefusalRule("FSR629", "shard-optimizer-before-shard-in-branch",
                "An optimizer is built from a model's parameters before the model is sharded, inside a branch "
                "(an if/else, a try) the rewrite does not move.",
                "fully_shard replaces the parameters with DTensor shards: an optimizer built before it keeps the "
                "old tensors and the model never updates. The optimizer stage moves optimizers only within the "
                "block that shards the model (an if/else that only picks the optimizer, after the model's build, "
                "is sharded before).",
                "Build (and place) the model before the if/else that builds its optimizer, or build the optimizer "
                "after the model is placed."),
    RefusalRule("FSR630", "shard-option-class-not-found",
                "--shard names a class that no module of the model is built of.",
                "The generated loop shards the modules of the named classes; with none of them it shards only "
                "the root, one unit holding every parameter: the option would do nothing, without a word.",
                "Name one of the classes the message lists (the model's repeated block); a model built from a "
                "library's classes is not checked (its classes are matched when the script runs)."),
    RefusalRule("FSR635", "shared-name-before-process-group",
                "A path every rank uses is named from the clock or a uuid before the process group starts "
                "(at module level, in a function called before init_process_group, or read before it).",
                "Each rank reads its own clock and gets another name: each would write into a path of its own "
                "(a collective DCP save split over folders, logs scattered). Rank 0's value can be broadcast only "
                "once the process group runs.",
                "Name the run after the process group starts, in the function that starts it, or pass the name "
                "in as an argument.", stage_name="shared_names"),
    RefusalRule("FSR636", "shared-name-unnamed",
                "A path every rank uses is made from the clock or a uuid without a name to hand over: inline in "
                "the call, stored in `self.attr`, a function's result used in place.",
                "Each rank reads its own clock and gets another name; the rewrite broadcasts rank 0's value by "
                "binding a plain name (or `obj.attr`) again right after it is made, and here there is none.",
                "Bind the value to a name first (`run_dir = ...`) in the function that uses it.",
                stage_name="shared_names"),
    RefusalRule("FSR637", "download-before-process-group",
                "A dataset built with `download=True` where no rank test can go: before the process group "
                "starts (module level, a function called before init_process_group).",
                "Every rank finds the files missing and downloads into the same folder at once (a truncated "
                "archive, a rank reading a file still being written). Rank 0 can download first, the others "
                "waiting at a barrier, only once the process group runs.",
                "Build the dataset after the process group starts, in the function that starts it, or download "
                "it before the run and pass download=False.", stage_name="shared_downloads"),
    RefusalRule("FSR639", "loop-sums-under-rank-local-condition",
                "Figures summed in a loop over a split DataLoader (an evaluation's loss and correct count) and read "
                "after it, where the loop runs under a condition not known to be the same on every rank.",
                "After the retrofit each rank sums over its own part of the data; the sums are combined over the "
                "ranks after the loop (a collective every rank must join). Under a condition each rank decides "
                "for itself, the ranks that enter would wait for the others: a hang.",
                "Make the condition one every rank decides alike (a step or epoch count, an argument), or combine "
                "the sums yourself (all_reduce) where every rank runs.",
                stage_name="loop_sums"),
    RefusalRule("FSR640", "rank-local-decision-gates-collective",
                "A condition (an `if`, a `break`) that reads a value of one rank's own part of the data (its "
                "loss, a sum over its part of a split DataLoader) decides whether a collective runs: a checkpoint "
                "save, a forward of the sharded model, the training loop's next step.",
                "Each rank decides from its own value: some ranks enter the collective (or leave the loop) and the "
                "others do not, and the run hangs. A figure the rewrite combines over the ranks (a loop's sums, "
                "codemods/loop_sums.py) is the same on every rank and is not refused.",
                "Decide from a value every rank shares: average it over the ranks first (dist.all_reduce, then "
                "divide by the world size), or broadcast rank 0's decision (dist.broadcast_object_list).",
                stage_name="rank_decisions"),
    RefusalRule("FSR641", "random-control-flow-in-forward",
                "The forward of the sharded model decides its control flow (a loop's length, an `if`) from a "
                "random draw (`random.*`, `numpy.random.*`, `torch.rand*`) of a generator the script does not "
                "seed with a value every rank shares, directly or through a parameter the training loop binds "
                "under an `if` on such a draw (`if np.random.random() < 0.1: labels = None`).",
                "Each rank draws its own number: the ranks run different layers (or the same layer a different "
                "number of times), so the all-gathers and reduce-scatters fully_shard issues per layer no longer "
                "pair up between the ranks: a size mismatch error (gloo) or a hang (NCCL).",
                "Seed that generator with the same value on every rank before training (`random.seed(0)`, "
                "`np.random.seed(0)`, `torch.manual_seed(0)`), or draw the number on rank 0 and broadcast it "
                "(dist.broadcast_object_list) before the forward.",
                stage_name="rank_decisions"),
    RefusalRule("FSR643", "shard-grad-scaler-before-torch-2-5",
                "A GradScaler in a script retrofitted for torch 2.4 (--torch-version 2.4).",
                "fully_shard's gradients are DTensors; GradScaler unscales them and reduces its inf/NaN check over "
                "every rank's shards only from torch 2.5 on: on 2.4 the first scaler.step fails.",
                "Target torch 2.5 or newer, or train in bfloat16 without a loss scaler."),
    # -- 7xx checkpoint and library saves ------------------------------------------------
    RefusalRule("FSR644", "shard-forward-writes-parameter-data",
                "The forward of a trained model (or a method its forward calls on self) writes into one of its "
                "module's parameters through `.data`: an in-place call (`self.conv.weight.data[:, :, -1].zero_()`) "
                "or an assignment to `P.data` / `P.data[...]`.",
                "After fully_shard the forward runs on a copy FSDP2 all-gathered from the shards, and the write "
                "lands in that copy only: the backward gathers the parameter again from the shards and computes "
                "the gradients with the unwritten values, and the shards (what the optimizer steps and the "
                "checkpoint saves) never hold the write. The run trains differently from one process, silently.",
                "Apply the change without writing the parameter (multiply the weight by a mask buffer in the "
                "forward: `F.conv2d(x, self.conv.weight * self.mask, ...)`), or write the parameter outside the "
                "forward, after optimizer.step(), where the write reaches the shards.",
                stage_name="shard"),
    RefusalRule("FSR701", "checkpoint-unsplittable-rank-branch",
                "A checkpoint save inside a rank-0 branch that cannot be split (an else branch, an `or`).",
                "The save is collective now: other ranks would never join it and the run would hang.",
                "Save on every rank and keep only plain-file writes under the rank-0 `if`."),
    RefusalRule("FSR702", "library-save-own-state-dict", "save_pretrained is given its own state_dict.",
                "Which state it writes is for the script to say; a sharded model's state dict holds one rank's shards.",
                "Pass a full state dict gathered on every rank (get_model_state_dict with full_state_dict=True).",
                "library_saves"),
    RefusalRule("FSR703", "library-save-rank-gated", "save_pretrained of a sharded model under a rank test.",
                "Gathering the full state dict is a collective every rank must join (deadlock).",
                "Call save_pretrained outside the rank test; the rewrite gates the write itself.", "library_saves"),
    RefusalRule("FSR704", "checkpoint-name-bound-on-rank-zero",
                "A save that now runs on every rank reads a name bound only under a rank-0 `if` the rewrite cannot "
                "broadcast from (an else branch, another condition, a nested block, after the save).",
                "The other ranks would stop with a NameError at the first checkpoint.",
                "Bind the name on every rank (compute the path everywhere; create directories under the rank-0 `if`)."),
    RefusalRule("FSR705", "checkpoint-file-object",
                "Model or optimizer state saved to a file object the tool cannot replace by its path.",
                "The save becomes dcp.save of a checkpoint directory, which takes a path: a file object fails.",
                "Save by path: torch.save(state, path) (or `with open(path, \"wb\") as f: torch.save(state, f)` alone).",
                "checkpoint_files"),
    RefusalRule("FSR706", "checkpoint-optimizer-not-followed",
                "An optimizer's state_dict() is saved where the tool cannot tell which optimizer it is, or which "
                "model it trains: a function or object handed different values by its calls (the refusal names "
                "the call), or an optimizer of several models.",
                "The save becomes dcp.save of get_optimizer_state_dict(model, optimizer), which needs the one model "
                "that optimizer trains; left as optimizer.state_dict() it would write numbered state the resume "
                "cannot read.",
                "Hand the helper the same optimizer (and its model) at every call, or save where the optimizer is "
                "built."),
    RefusalRule("FSR707", "checkpoint-module-pickled-in-state",
                "A saved dict, list or tuple holds a sharded model itself (`{\"net\": net}`), not its state dict.",
                "Pickling a sharded module writes one rank's DTensor shards with FSDP2's hooks, every rank to the "
                "same file; nothing can load it back as the model (and the script's reload of it would unpickle "
                "those shards).",
                "Save the model's state dict (`\"net\": net.state_dict()`) and reload it into a built model with "
                "load_state_dict; the rewrite then turns both into DCP."),
    RefusalRule("FSR708", "checkpoint-state-through-helper",
                "A torch.save in a helper saves its parameter, and a call hands that parameter a sharded model's "
                "or its optimizer's state (`save_checkpoint({\"state_dict\": model.state_dict()}, path)`).",
                "The rewrite converts a save where it sees the state dict; behind a parameter, the torch.save would "
                "stay, and every rank would write its own DTensor shards into the one file: a checkpoint nothing "
                "can load as the model.",
                "Save where the state is built, with the state dict inline in the torch.save call; the rewrite "
                "then turns it into DCP on every rank."),
    # -- 8xx resume ---------------------------------------------------------------------
    RefusalRule("FSR801", "resume-load-before-build", "A checkpoint is read before the model or optimizer it fills is built.",
                "dcp.load fills the state dicts of the sharded model, its optimizer and scheduler: they must exist.",
                "Build them before loading, then load their state."),
    RefusalRule("FSR802", "resume-optimizer-of-several-models", "A loaded optimizer trains several models.",
                "get_/set_optimizer_state_dict take the one model the optimizer trains.",
                "Give each model its own optimizer."),
    RefusalRule("FSR803", "resume-file-object",
                "Model or optimizer state loaded from a file object the tool cannot replace by its path.",
                "A checkpoint of this script is now a DCP directory read with dcp.load, which takes a path.",
                "Load by path: torch.load(path) (or `with open(path, \"rb\") as f: torch.load(f)` alone).",
                "checkpoint_files"),
    RefusalRule("FSR804", "resume-pickled-module-reload",
                "A pickled module (torch.save(model, path)) is reloaded where the tool cannot load it into the "
                "sharded model: into another name, inside a loop, or before training goes on.",
                "The save now writes the model's state dict as a DCP directory, so torch.load of it fails. Loading "
                "into the live sharded model does what the reload did only when nothing trains the model after it "
                "(the original's optimizer keeps training the module it held); a second model needs its own build "
                "and sharding.",
                "Keep a state dict instead: torch.save(model.state_dict(), path), and to reload, build the model "
                "(or reuse it) and load_state_dict(torch.load(path))."),
    RefusalRule("FSR805", "resume-optimizer-not-followed",
                "An optimizer state is loaded where the tool cannot tell which optimizer receives it: a function "
                "or object handed different values by its calls (the refusal names the call).",
                "The load becomes set_optimizer_state_dict(model, optimizer, ...), which needs the one model that "
                "optimizer trains.",
                "Hand the helper the same optimizer (and its model) at every call, or load where the optimizer is "
                "built."),
    # -- 9xx data -----------------------------------------------------------------------
    RefusalRule("FSR901", "data-sampler-not-distributable",
                "A training DataLoader is given a batch_sampler, or a sampler other than RandomSampler/SequentialSampler.",
                "Such a sampler draws indices of the whole dataset on every rank: each rank would train on the same "
                "batches, and no DistributedSampler reproduces a subset, weighted or custom order.",
                "Split the indices by rank yourself (indices[rank::world_size]), or use shuffle=True / RandomSampler."),
    RefusalRule("FSR902", "data-loader-not-followed",
                "No training loop reads a named DataLoader, and one is built where it cannot be followed (inline in a "
                "`for`, on an attribute, returned by a helper).",
                "The rewrite gives the training DataLoader a DistributedSampler; left as is, every rank would train "
                "on the same batches.",
                "Bind the training DataLoader to a name in the function that trains, then loop over that name."),
    RefusalRule("FSR903", "data-batch-size-read-elsewhere",
                "--keep-global-batch: the training DataLoader's batch size is a name (or attribute) the script also "
                "reads to size batch tensors, and it cannot be rebound once to the per-rank size (bound several "
                "times or in another scope, read for something else too, or the loader is built in a loop).",
                "Divided in the DataLoader only, the other reads keep the global size and disagree with the per-rank "
                "batch: a shape error, or a silent broadcast.",
                "Bind the per-rank size to a name of its own, read by the DataLoader and the batch tensors, or run "
                "without --keep-global-batch."),
    RefusalRule("FSR904", "data-loader-outside-project",
                "The training DataLoader is built in a module outside the project (an installed package, or a folder "
                "above the project's root).",
                "The DataLoader needs a DistributedSampler where it is built, and the rewrite edits only the script "
                "and the project's own modules.",
                "Build the DataLoader in the script or a module of the project, or give it its DistributedSampler "
                "there by hand."),
    RefusalRule("FSR905", "data-global-batch-of-one",
                "--keep-global-batch with a training batch size of 1.",
                "The option keeps the global batch as written and divides it between the ranks: one sample has no "
                "part for a second rank.",
                "Run without --keep-global-batch (each rank reads one sample a step; the global batch is "
                "world_size samples)."),
    # -- 95x zero_grad (a stage of its own, numbered among the 9xx) ---------------------
    RefusalRule("FSR950", "zero-grad-between-forward-and-backward",
                "`model.zero_grad()` between the model's forward and backward() with no one optimizer to clear "
                "through (none, several, or one built over part of the model).",
                "After the forward FSDP2 keeps the root's and the last block's parameters gathered: the call clears "
                "the gathered tensors, not the sharded parameters holding the gradients, which add up every step; "
                "the rewrite clears through the one optimizer that trains the whole model, and here there is none.",
                "Call `model.zero_grad()` before the forward, or clear through the optimizer (`optimizer.zero_grad()`).",
                stage_name="zero_grad"),
    # -- 96x loss_scale (a stage of its own, numbered among the 9xx) --------------------
    RefusalRule("FSR960", "loss-mixed-reduction",
                "A loss that reaches backward() adds a term summed over the batch (`reduction=\"sum\"`, "
                "`size_average=False`, `torch.sum(...)`) to a term averaged over it.",
                "FSDP2 averages gradients over the ranks: an averaged term then has the gradient of the "
                "single-process run at the same global batch, a summed term 1/world_size of it (the rewrite scales "
                "the backward of a loss whose every term is a sum by the world size); no one scale makes both right.",
                "Reduce every term the same way (divide the summed term by the batch size, or sum the averaged "
                "one), or scale the summed term by dist.get_world_size() yourself.",
                stage_name="loss_scale"),
    # -- 97x program (the entry and the project modules it reaches) ---------------------
    RefusalRule("FSR970", "training-step-not-reached",
                "A training step (`loss.backward()`) in a project module the script reaches, which the rewrite "
                "cannot take into its analysis (the program cannot be linked: the reason is named).",
                "Converting the script alone would shard the model while the loop elsewhere keeps its plain "
                "DataLoader, its saves and its logging: every rank would train on the same batches and write its "
                "shards into one file, and the rewrite would call that converted.",
                "Remove what the reason names (a top-level name bound in two modules, a module used as a value, "
                "an import renamed with `as`), or run rewrite on the module that holds the training loop.",
                stage_name="program"),
]

CATALOGUE: Dict[str, RefusalRule] = {r.code: r for r in _RULES}


def all_refusals() -> List[RefusalRule]:
    return list(_RULES)


def refusal_by_code(code: str) -> Optional[RefusalRule]:
    return CATALOGUE.get(code.upper())
