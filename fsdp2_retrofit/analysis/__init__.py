"""The one place that understands a training script (see ScriptFacts)."""
from .facts import LoaderSite, LogSite, LoopSite, ModelSite, OptimizerSite, ScriptFacts, analyse
from .model_classes import ClassInfo, ClassRegistry, Container
from .names import Resolver, code

__all__ = [
    "ClassInfo",
    "ClassRegistry",
    "Container",
    "LoaderSite",
    "LogSite",
    "LoopSite",
    "ModelSite",
    "OptimizerSite",
    "Resolver",
    "ScriptFacts",
    "analyse",
    "code",
]
