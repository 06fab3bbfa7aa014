"""RetrofitOptions: the one set of options every rewrite stage reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple


@dataclass(frozen=True)
class RetrofitOptions:
    """What the user asked for; stages read it and never read global state."""

    # Class names (bare or dotted) whose instances become their own FSDP2 unit,
    # replacing the repeated-block detection.
    shard: Tuple[str, ...] = field(default_factory=tuple)
