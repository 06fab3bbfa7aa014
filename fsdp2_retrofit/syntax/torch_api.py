"""Every torch API the analyses recognise, by qualified name: one table for rewrite and check.

Each set holds every spelling a script can reach the API by once imports are resolved
(`torch.nn.parallel.DistributedDataParallel` and the private module it is defined in,
`...parallel.distributed.DistributedDataParallel`), so a rewrite stage and a lint rule
that ask about the same API always agree. Word lists that belong to one analysis
(FSDP1 keywords, init-function tables) stay with that analysis.
"""
from __future__ import annotations

# -- modules -----------------------------------------------------------------

TORCH_MODULE_BASES = frozenset({"torch.nn.Module", "torch.nn.modules.module.Module"})
MODULE_LIST = frozenset({"torch.nn.ModuleList", "torch.nn.modules.container.ModuleList"})
MODULE_DICT = frozenset({"torch.nn.ModuleDict", "torch.nn.modules.container.ModuleDict"})
SEQUENTIAL = frozenset({"torch.nn.Sequential"})
# containers without a forward of their own (fully_shard of one never runs its hooks)
BARE_CONTAINERS = MODULE_LIST | MODULE_DICT
CONTAINERS = BARE_CONTAINERS | SEQUENTIAL
NN_PARAMETER = frozenset({"torch.nn.Parameter", "torch.nn.parameter.Parameter"})
# leaf modules whose parameter count analysis/leaf_units.py reads from their constructor's arguments
NN_NORMS = frozenset({"torch.nn.LayerNorm", "torch.nn.RMSNorm"})
NN_SIZED_LEAVES = NN_NORMS | {"torch.nn.Embedding", "torch.nn.Linear"}
# torch.nn classes without parameters (0 in a block's parameter count)
NN_NO_PARAMETERS = frozenset({
    f"torch.nn.{c}" for c in (
        "GELU", "ReLU", "SiLU", "Tanh", "Sigmoid", "Dropout", "Identity", "Softmax", "LeakyReLU", "Mish",
        "Flatten", "Unflatten", "ReLU6", "ELU", "Hardswish", "Softplus",
    )
})
# tensor factories whose positional arguments are the shape (`nn.Parameter(torch.zeros(a, b))`)
TENSOR_FACTORIES = frozenset({"torch.zeros", "torch.ones", "torch.randn", "torch.rand", "torch.empty"})
TORCH_COMPILE = frozenset({"torch.compile"})
TORCH_DEVICE = frozenset({"torch.device"})
MANUAL_SEED = frozenset({"torch.manual_seed", "torch.random.manual_seed", "torch.cuda.manual_seed_all"})
# seed every device's generator (what a model build draws from)
SEEDS_EVERY_DEVICE = frozenset({"torch.manual_seed", "torch.random.manual_seed"})
# any call that (re)seeds torch's generators
ALL_SEEDS = MANUAL_SEED | {"torch.cuda.manual_seed", "torch.seed", "torch.random.seed"}

# -- optimizers --------------------------------------------------------------

OPTIMIZER_PREFIX = "torch.optim."  # a call under it builds an optimizer...
OPTIMIZER_BASES = frozenset({"torch.optim.Optimizer", "torch.optim.optimizer.Optimizer"})
# torch optimizers that flatten every gradient into one vector (a DTensor shard is not one)
FLATTENING_OPTIMIZERS = frozenset({"torch.optim.LBFGS", "torch.optim.lbfgs.LBFGS"})
NOT_OPTIMIZERS = ("torch.optim.lr_scheduler.", "torch.optim.swa_utils.")  # ...unless under one of these
AVERAGED_MODEL = frozenset({"torch.optim.swa_utils.AveragedModel"})


def is_optimizer_call(resolver, call) -> bool:
    """Whether `call` builds a torch optimizer (under OPTIMIZER_PREFIX, not NOT_OPTIMIZERS),
    by the qualified names `resolver` (a syntax.names.Resolver) gives it, or one picked by
    name: `getattr(torch.optim, args.optim)(model.parameters(), ...)`."""
    import libcst as cst  # this table module loads no parser itself

    if resolver.calls_prefix(call, OPTIMIZER_PREFIX):
        return not any(resolver.calls_prefix(call, p) for p in NOT_OPTIMIZERS)
    inner = call.func if isinstance(call, cst.Call) else None
    return (
        isinstance(inner, cst.Call)
        and isinstance(inner.func, cst.Name)
        and inner.func.value == "getattr"
        and bool(inner.args)
        and OPTIMIZER_PREFIX[:-1] in resolver.qnames(inner.args[0].value)
    )

# -- data --------------------------------------------------------------------

DATALOADERS = frozenset({
    "torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader",
    # torchdata's resumable DataLoader (a DataLoader subclass, same arguments)
    "torchdata.stateful_dataloader.StatefulDataLoader",
    "torchdata.stateful_dataloader.stateful_dataloader.StatefulDataLoader",
})
# samplers a DistributedSampler replaces one for one: (qualified names) -> its shuffle
PLAIN_SAMPLERS = {
    "torch.utils.data.RandomSampler": "True", "torch.utils.data.sampler.RandomSampler": "True",
    "torch.utils.data.SequentialSampler": "False", "torch.utils.data.sampler.SequentialSampler": "False",
}
DISTRIBUTED_SAMPLERS = frozenset({
    "torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler",
    # torchdata's DistributedSampler subclass whose position is saved with the StatefulDataLoader's state
    "torchdata.stateful_dataloader.sampler.StatefulDistributedSampler",
})
ITERABLE_DATASETS = frozenset({"torch.utils.data.IterableDataset", "torch.utils.data.dataset.IterableDataset"})
DATASET_BASES = ITERABLE_DATASETS | frozenset({"torch.utils.data.Dataset", "torch.utils.data.dataset.Dataset"})

# -- precision and gradients -------------------------------------------------

AUTOCAST = frozenset({
    "torch.autocast", "torch.amp.autocast", "torch.amp.autocast_mode.autocast",
    "torch.cuda.amp.autocast", "torch.cpu.amp.autocast",
})
CLIP_GRAD_NORM = frozenset({"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_norm_"})

# -- process group and devices -----------------------------------------------

INIT_PROCESS_GROUP = frozenset({
    "torch.distributed.init_process_group", "torch.distributed.distributed_c10d.init_process_group",
})
DESTROY_PROCESS_GROUP = frozenset({
    "torch.distributed.destroy_process_group", "torch.distributed.distributed_c10d.destroy_process_group",
})
GET_RANK = frozenset({"torch.distributed.get_rank", "torch.distributed.distributed_c10d.get_rank"})
GET_WORLD_SIZE = frozenset({"torch.distributed.get_world_size", "torch.distributed.distributed_c10d.get_world_size"})
CUDA_SET_DEVICE = frozenset({"torch.cuda.set_device"})
# every call that picks this process's device: torch.cuda.set_device and its
# counterparts for other accelerators (what FSD106 accepts before init_process_group)
DEVICE_SELECTORS = CUDA_SET_DEVICE | {
    "torch.accelerator.set_device_index",
    "torch.xpu.set_device",
    "torch.npu.set_device",
    "torch.set_default_device",
}
INIT_DEVICE_MESH = frozenset({"torch.distributed.device_mesh.init_device_mesh"})
# library classes that are never trained modules (data pipelines): the models analysis
# does not take a class from these for a model when an optimizer's tensors trace back to it
NOT_MODULE_LIBRARIES = ("torchvision.transforms.", "torchvision.datasets.")
BROADCAST = frozenset({"torch.distributed.broadcast", "torch.distributed.distributed_c10d.broadcast"})
BROADCAST_OBJECT_LIST = frozenset({
    "torch.distributed.broadcast_object_list", "torch.distributed.distributed_c10d.broadcast_object_list",
})
COLLECTIVES = frozenset(
    "torch.distributed." + name
    for name in (
        "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
        "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
        "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
        "monitored_barrier",
    )
)
SPAWN = frozenset({
    "torch.multiprocessing.spawn", "torch.multiprocessing.spawn.spawn", "torch.multiprocessing.start_processes",
})

# -- sharding and other wrappers ---------------------------------------------

FULLY_SHARD = frozenset({
    "torch.distributed.fsdp.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard.fully_shard",
    "torch.distributed.fsdp._fully_shard.fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard.fully_shard",
})
FSDP1_CLASS = "torch.distributed.fsdp.FullyShardedDataParallel"
FSDP1_CLASSES = frozenset({FSDP1_CLASS, "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel"})
SHARDED_GRAD_SCALER = frozenset({
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler", "torch.distributed.fsdp.ShardedGradScaler",
})
# amp's loss scalers (the cuda one is a deprecated subclass of torch.amp.GradScaler)
GRAD_SCALER = frozenset({
    "torch.amp.GradScaler", "torch.amp.grad_scaler.GradScaler",
    "torch.cuda.amp.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler",
    "torch.cpu.amp.GradScaler", "torch.cpu.amp.grad_scaler.GradScaler",
}) | SHARDED_GRAD_SCALER
# FSDP2's module class: every module fully_shard shards becomes an instance of it
FSDP_MODULE = frozenset({
    "torch.distributed.fsdp.FSDPModule",
    "torch.distributed._composable.fsdp.FSDPModule",
    "torch.distributed._composable.fsdp.fully_shard.FSDPModule",
    "torch.distributed.fsdp._fully_shard.FSDPModule",
    "torch.distributed.fsdp._fully_shard._fully_shard.FSDPModule",
})
DDP = frozenset({
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
})
DATA_PARALLEL = frozenset({
    "torch.nn.DataParallel",
    "torch.nn.parallel.DataParallel",
    "torch.nn.parallel.data_parallel.DataParallel",
})

# -- saving and loading ------------------------------------------------------

TORCH_SAVE = frozenset({"torch.save", "torch.serialization.save"})
TORCH_LOAD = frozenset({"torch.load", "torch.serialization.load"})
# the RNG states a checkpoint keeps; each call also gives a tensor of the saved shape (a dcp.load placeholder)
RNG_STATES = frozenset({"torch.get_rng_state", "torch.random.get_rng_state", "torch.cuda.get_rng_state"})
DCP_CALLS = frozenset({
    "torch.distributed.checkpoint.save",
    "torch.distributed.checkpoint.load",
    "torch.distributed.checkpoint.async_save",
    "torch.distributed.checkpoint.save_state_dict",
    "torch.distributed.checkpoint.load_state_dict",
    "torch.distributed.checkpoint.state_dict_saver.save",
    "torch.distributed.checkpoint.state_dict_saver.async_save",
    "torch.distributed.checkpoint.state_dict_loader.load",
})
# torch calls writing at a path they are handed (analysis/rank_local.py: a path every rank uses)
TORCH_PATH_WRITERS = TORCH_SAVE | DCP_CALLS | frozenset({
    "torch.utils.tensorboard.SummaryWriter", "torch.utils.tensorboard.writer.SummaryWriter",
})
STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"  # the getters' and setters' public home
GET_MODEL_STATE_DICT = frozenset({"torch.distributed.checkpoint.state_dict.get_model_state_dict"})
GET_OPTIMIZER_STATE_DICT = frozenset({"torch.distributed.checkpoint.state_dict.get_optimizer_state_dict"})
GET_STATE_DICT = frozenset({"torch.distributed.checkpoint.state_dict.get_state_dict"})
STATE_DICT_GETTERS = GET_MODEL_STATE_DICT | GET_OPTIMIZER_STATE_DICT | GET_STATE_DICT
STATE_DICT_SETTERS = frozenset({
    "torch.distributed.checkpoint.state_dict.set_model_state_dict",
    "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict",
    "torch.distributed.checkpoint.state_dict.set_state_dict",
})

# -- check rules of issue 17 -------------------------------------------------

# optimizers that flatten the parameters or gradients into one vector (LBFGS) or into
# buckets they partition themselves (ZeRO): not written for DTensor shards
LBFGS = frozenset({"torch.optim.LBFGS", "torch.optim.lbfgs.LBFGS"})
ZERO_REDUNDANCY_OPTIMIZER = frozenset({
    "torch.distributed.optim.ZeroRedundancyOptimizer",
    "torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer",
})
# calls that build a new plain tensor (not the *_like ones: those follow their argument)
TENSOR_FACTORIES = frozenset(
    "torch." + name for name in (
        "tensor", "as_tensor", "zeros", "ones", "randn", "rand", "randint", "arange", "full", "empty", "linspace",
        "from_numpy", "eye",
    )
)
# a dimension given to these sizes a new tensor (the factories) or a batch reshaped (the methods)
BATCH_SHAPE_FACTORIES = frozenset(
    "torch." + name for name in ("zeros", "ones", "randn", "rand", "randint", "full", "empty")
)
BATCH_SHAPE_METHODS = frozenset({"reshape", "view", "expand", "new_zeros", "new_ones", "new_empty", "new_full"})
# the legacy constructors: `torch.FloatTensor(n, 1)` preallocates an n x 1 tensor (its int arguments are
# sizes; a list argument is data)
LEGACY_TENSORS = frozenset(
    prefix + name for prefix in ("torch.", "torch.cuda.") for name in (
        "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "LongTensor", "IntTensor", "ByteTensor", "BoolTensor",
    )
)
# tensorboard's writers: each makes an event file in its folder and writes to it (analysis/logs.py)
SUMMARY_WRITERS = frozenset({"torch.utils.tensorboard.SummaryWriter", "torch.utils.tensorboard.writer.SummaryWriter",
                             "tensorboardX.SummaryWriter"})
# factories whose values are drawn from the generator: sized by the batch outside the step, they change how
# much of the random stream the run takes before its steps
RANDOM_FACTORIES = frozenset({"torch.randn", "torch.rand", "torch.randint"})

# gradients with a graph of their own (create_graph=True): a double backward
AUTOGRAD_GRAD = frozenset({"torch.autograd.grad"})
# torch functions of one batch tensor (their first argument) that keep one row per sample (batch_coupling)
ROW_FUNCTIONS = frozenset({
    "torch.sigmoid", "torch.tanh", "torch.relu", "torch.exp", "torch.log", "torch.abs", "torch.sqrt",
    "torch.pow", "torch.clamp", "torch.flatten", "torch.squeeze", "torch.unsqueeze", "torch.reshape",
    "torch.nn.functional.normalize", "torch.nn.functional.softmax", "torch.nn.functional.log_softmax",
    "torch.nn.functional.relu", "torch.nn.functional.leaky_relu", "torch.nn.functional.sigmoid",
    "torch.nn.functional.tanh", "torch.autograd.Variable", "torch.rand_like", "torch.randn_like",
    "torch.div", "torch.mul",
})
# statistics a batch tensor may be reduced with over its batch dimension; matrix products of two tensors
BATCH_STATISTICS = frozenset({"torch.mean", "torch.std", "torch.var", "torch.sum"})
# losses whose "mean" reduction divides by the total class weight of the batch's targets (given weight=)
WEIGHTED_MEAN_LOSSES = frozenset({
    "torch.nn.CrossEntropyLoss", "torch.nn.NLLLoss", "torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss",
    "torch.nn.modules.loss.CrossEntropyLoss", "torch.nn.modules.loss.NLLLoss",
})
MATMULS = frozenset({"torch.matmul", "torch.mm"})
CDIST = frozenset({"torch.cdist"})
EINSUM = frozenset({"torch.einsum"})
COSINE_SIMILARITY = frozenset({"torch.nn.functional.cosine_similarity"})
UNIFORM_DRAWS = frozenset({"torch.rand", "torch.randn"})  # a draw of a given shape

# -- losses (analysis/loss_reduction.py) ---------------------------------------------

# torch.nn.functional's losses and their nn.Module classes: all reduce by "mean" by default
_LOSSES = {
    "cross_entropy": "CrossEntropyLoss", "nll_loss": "NLLLoss", "mse_loss": "MSELoss", "l1_loss": "L1Loss",
    "smooth_l1_loss": "SmoothL1Loss", "huber_loss": "HuberLoss", "binary_cross_entropy": "BCELoss",
    "binary_cross_entropy_with_logits": "BCEWithLogitsLoss", "kl_div": "KLDivLoss",
    "poisson_nll_loss": "PoissonNLLLoss", "gaussian_nll_loss": "GaussianNLLLoss",
    "hinge_embedding_loss": "HingeEmbeddingLoss", "margin_ranking_loss": "MarginRankingLoss",
    "multilabel_margin_loss": "MultiLabelMarginLoss", "multilabel_soft_margin_loss": "MultiLabelSoftMarginLoss",
    "multi_margin_loss": "MultiMarginLoss", "soft_margin_loss": "SoftMarginLoss",
    "cosine_embedding_loss": "CosineEmbeddingLoss", "triplet_margin_loss": "TripletMarginLoss",
    "triplet_margin_with_distance_loss": "TripletMarginWithDistanceLoss", "ctc_loss": "CTCLoss",
}
LOSS_FUNCTIONS = frozenset(f"torch.nn.functional.{f}" for f in _LOSSES)
LOSS_CLASSES = frozenset(f"torch.nn.{c}" for c in _LOSSES.values()) | frozenset(
    f"torch.nn.modules.loss.{c}" for c in _LOSSES.values()
)
SUMS = frozenset({"torch.sum"})
MEANS = frozenset({"torch.mean"})
# tensors built from a list (of losses already reduced, per head or per scale)
STACKS = frozenset({"torch.stack", "torch.cat", "torch.tensor", "torch.as_tensor"})

# -- batches a script draws itself (analysis/batch_draws.py) ---------------------------
RANDINT = frozenset({"torch.randint"})
# calls that build a batch from rows made one per index, keeping their order
ROW_STACKS = frozenset({"torch.stack", "numpy.stack", "torch.from_numpy", "torch.as_tensor", "torch.tensor"})
# joins along dim 0 (the default): rows of the parts, in order (`torch.cat([s[None] for s in rows])`)
ROW_CONCATS = frozenset({"torch.cat", "torch.concat", "torch.concatenate"})
# contexts (and decorators) under which no gradient is recorded: evaluation
NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode"})

# -- batch norm (analysis/batchnorm.py) ------------------------------------------------

_BN_CLASSES = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d")
# the layers SyncBatchNorm.convert_sync_batchnorm converts (subclasses of _BatchNorm)
BATCHNORM = frozenset(f"torch.nn.{c}" for c in _BN_CLASSES) | frozenset(
    f"torch.nn.modules.batchnorm.{c}" for c in _BN_CLASSES
)
SYNC_BATCHNORM = frozenset({"torch.nn.SyncBatchNorm", "torch.nn.modules.batchnorm.SyncBatchNorm"})
CONVERT_SYNC_BATCHNORM = frozenset(f"{c}.convert_sync_batchnorm" for c in SYNC_BATCHNORM)

# -- 0-dim parameters (analysis/scalar_params.py) -------------------------------------

# a tensor of the value given: 0-dim for a number
TENSOR_OF_VALUE = frozenset({"torch.tensor", "torch.as_tensor", "torch.scalar_tensor"})
# factories whose first argument (or `size=`) is the shape: `torch.ones([])` is 0-dim
SHAPE_FACTORIES = frozenset({"torch.ones", "torch.zeros", "torch.empty", "torch.randn", "torch.rand", "torch.full"})
# elementwise: the shape of their argument
ELEMENTWISE = frozenset({"torch.log", "torch.exp", "torch.sqrt", "torch.abs", "torch.sigmoid", "torch.tanh", "torch.log1p"})
