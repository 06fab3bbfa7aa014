"""The one place that understands a training script (see ScriptFacts).

Names are loaded on first use (PEP 562): `check` imports only the submodules it
needs (sharding; names live in fsdp2_retrofit.syntax), not the rewriter's facts and class registry.
ScriptFacts (facts) assembles the per-site analyses: models, optimizers, loops, data, logs, launch.
"""
from importlib import import_module

_WHERE = {
    "ClassInfo": "model_classes",
    "ClassRegistry": "model_classes",
    "Container": "model_classes",
    "LoaderSite": "data",
    "LogSite": "logs",
    "LoopSite": "loops",
    "ModelSite": "models",
    "OptimizerSite": "optimizers",
    "Resolver": "fsdp2_retrofit.syntax.names",
    "ScriptFacts": "facts",
    "analyse": "facts",
    "code": "fsdp2_retrofit.syntax.names",
    "distributed_init": "launch",
    "distributed_wrappers": "launch",
    "launch_names": "launch",
    "log_sites": "logs",
    "module_bindings": "models",
    "optimizer_sites": "optimizers",
    "train_loops": "loops",
    "trained_models": "models",
    "training_loaders": "data",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _WHERE[name]
    value = getattr(import_module(where if "." in where else f".{where}", __name__), name)
    globals()[name] = value
    return value
