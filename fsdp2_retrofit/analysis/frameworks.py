"""Training frameworks that own the distributed launch: Accelerate, Lightning (Trainer
and Fabric) and DeepSpeed.

A script that trains through one of them already starts its own process group and
wraps the model itself; adding torchrun's process group and fully_shard on top
fails at start-up ('trying to initialize the default process group twice') or,
worse, shards a model the framework then wraps again. The launch stage refuses
such scripts and points at the framework's own FSDP2 support instead.
"""
from __future__ import annotations

from typing import Optional, Tuple

import libcst as cst

# (qualified-name prefix of a call, the framework, where its FSDP2 support is switched on)
_FRAMEWORK_CALLS = (
    ("accelerate.Accelerator", "Accelerate", "`accelerate launch` with an FSDP plugin (fsdp_version: 2)"),
    ("accelerate.accelerator.Accelerator", "Accelerate", "`accelerate launch` with an FSDP plugin (fsdp_version: 2)"),
    ("lightning.fabric.Fabric", "Lightning Fabric", "Fabric(strategy=ModelParallelStrategy(...))"),
    ("lightning.Fabric", "Lightning Fabric", "Fabric(strategy=ModelParallelStrategy(...))"),
    ("lightning_fabric.Fabric", "Lightning Fabric", "Fabric(strategy=ModelParallelStrategy(...))"),
    ("lightning.Trainer", "Lightning", "Trainer(strategy=ModelParallelStrategy(...))"),
    ("lightning.pytorch.Trainer", "Lightning", "Trainer(strategy=ModelParallelStrategy(...))"),
    ("pytorch_lightning.Trainer", "Lightning", "Trainer(strategy=ModelParallelStrategy(...))"),
    ("deepspeed.initialize", "DeepSpeed", "a DeepSpeed ZeRO config (`deepspeed train.py`)"),
    ("deepspeed.init_distributed", "DeepSpeed", "a DeepSpeed ZeRO config (`deepspeed train.py`)"),
)


def training_framework(resolver) -> Optional[Tuple[cst.Call, str, str]]:
    """(the call, the framework's name, how to shard with it) of the first call that hands
    training to Accelerate, Lightning/Fabric or DeepSpeed; None when the script trains itself."""
    for call in resolver.nodes(cst.Call):
        names = resolver.qnames(call)
        if not names:  # most calls: a method of a local value (`self.fc(x)`), nothing imported
            continue
        for prefix, framework, how in _FRAMEWORK_CALLS:
            if any(n == prefix or n.startswith(prefix + ".") for n in names):
                return call, framework, how
    return None


__all__ = ["training_framework"]
