"""RetrofitOptions: the one set of options every rewrite stage reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

EXPORTS = ("dcp", "full")


@dataclass(frozen=True)
class RetrofitOptions:
    """What the user asked for; stages read it and never read global state."""

    # Class names (bare or dotted) whose instances become their own FSDP2 unit,
    # replacing the repeated-block detection.
    shard: Tuple[str, ...] = field(default_factory=tuple)
    # How model-only saves are written: "dcp" (a sharded checkpoint directory) or
    # "full" (one torch.save file of the full state dict, written by rank 0).
    export: str = "dcp"
    # dcp.async_save instead of dcp.save (the process group gets a CPU backend too).
    async_checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.export not in EXPORTS:
            raise ValueError(f"export must be one of {', '.join(EXPORTS)}, not {self.export!r}")
