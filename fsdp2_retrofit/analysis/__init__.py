"""The one place that understands a training script (see ScriptFacts).

Names are loaded on first use (PEP 562): `check` imports only the submodules it
needs (sharding; names live in fsdp2_retrofit.syntax), not the rewriter's facts and class registry.
"""
from importlib import import_module

_WHERE = {
    "ClassInfo": "model_classes",
    "ClassRegistry": "model_classes",
    "Container": "model_classes",
    "LoaderSite": "facts",
    "LogSite": "facts",
    "LoopSite": "facts",
    "ModelSite": "facts",
    "OptimizerSite": "facts",
    "Resolver": "fsdp2_retrofit.syntax.names",
    "ScriptFacts": "facts",
    "analyse": "facts",
    "code": "fsdp2_retrofit.syntax.names",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _WHERE[name]
    value = getattr(import_module(where if "." in where else f".{where}", __name__), name)
    globals()[name] = value
    return value
