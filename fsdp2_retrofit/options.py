"""RetrofitOptions: the one set of options every rewrite stage reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

EXPORTS = ("dcp", "full")


@dataclass(frozen=True)
class RetrofitOptions:
    """What the user asked for; stages read it and never read global state."""

    # Class names (bare or dotted) whose instances become their own FSDP2 unit,
    # replacing the repeated-block detection.
    shard: Tuple[str, ...] = field(default_factory=tuple)
    # "last": with gradient accumulation, reduce once per optimizer step
    # (set_requires_gradient_sync); "every": reduce each micro-batch.
    accumulation_sync: str = "last"
    # "hold": with gradient accumulation, the micro-batches before the last keep their gathered
    # parameters after backward (set_reshard_after_backward), so the next forward does not
    # all-gather them again; "reshard": free them after every backward (less memory)
    accumulation_params: str = "hold"
    # divide each training DataLoader's batch size by the world size (the run is
    # then numerically the single-process run at the same arguments)
    keep_global_batch: bool = False
    # "none" | "auto" (the script's autocast dtype) | "bf16" | "fp16": FSDP2 MixedPrecisionPolicy
    mixed_precision: str = "none"
    # the MixedPrecisionPolicy's reduce_dtype (a torch dtype attribute); FSDP1 scripts carry theirs over
    mp_reduce_dtype: str = "float32"
    # shard parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy)
    cpu_offload: bool = False
    # HSDP: replicate over this many groups, shard within each (2-D mesh); 0 = plain FSDP
    hsdp: int = 0
    # set by migrate_fsdp1 from the script's ShardingStrategy, when --hsdp is not given: "per_node" (HYBRID_SHARD:
    # shard within each node's LOCAL_WORLD_SIZE ranks, replicate across nodes, read at run time), "replicate"
    # (NO_SHARD: a (world, 1) mesh, parameters whole on every rank, gradients all-reduced); "" = from hsdp
    mesh_layout: str = ""
    # "default": blocks free their gathered parameters after forward except the last one
    # (torchtitan's rule); "always": every unit does (fully_shard's own default); "never": none does
    reshard_after_forward: str = "default"
    # average the losses that rank 0 logs over all ranks (an all_reduce before the print)
    reduce_logs: bool = True
    # the torch the output must run on, "X.Y" ("" = 2.6 and newer): before 2.6 FSDP2 lives
    # in torch.distributed._composable.fsdp
    torch_version: str = ""
    # How model-only saves are written: "dcp" (a sharded checkpoint directory) or
    # "full" (one torch.save file of the full state dict, written by rank 0).
    export: str = "dcp"
    # dcp.async_save instead of dcp.save (the process group gets a CPU backend too).
    async_checkpoint: bool = False

    # "shard": models the script freezes and never trains (a distillation teacher) are sharded
    # like the trained ones, every unit resharding after forward; "replicate": left whole on every rank
    frozen_models: str = "shard"

    # build the model on the meta device, shard it, then to_empty and re-run its
    # initialisation: each rank only allocates its shards; values are fresh draws
    meta_init: bool = False
    @property
    def fsdp_module(self) -> str:
        """Where fully_shard and its policies are imported from for `torch_version`."""
        if self.torch_version:
            major, minor = (int(p) for p in self.torch_version.split(".")[:2])
            if (major, minor) < (2, 6):
                return "torch.distributed._composable.fsdp"
        return "torch.distributed.fsdp"

    def __post_init__(self) -> None:
        if self.export not in EXPORTS:
            raise ValueError(f"export must be one of {', '.join(EXPORTS)}, not {self.export!r}")


# -- [tool.fsdp2-retrofit] in pyproject.toml -----------------------------------

CONFIG_KEYS = {
    # check
    "select", "ignore", "extend-select", "exclude", "extend-exclude", "unsafe-fixes", "output-format",
    # rewrite
    "shard",
}


class ConfigError(Exception):
    """A pyproject.toml that cannot be used; the message names the file."""


def find_pyproject(start: str = ".") -> Optional[str]:
    """The nearest pyproject.toml at or above `start`."""
    import os

    here = os.path.abspath(start)
    while True:
        candidate = os.path.join(here, "pyproject.toml")
        if os.path.isfile(candidate):
            return candidate
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def load_config(start: str = ".") -> Tuple[Optional[str], dict]:
    """(path, settings) of `[tool.fsdp2-retrofit]` in the nearest pyproject.toml."""
    path = find_pyproject(start)
    if path is None:
        return None, {}
    try:
        import tomllib  # type: ignore[import-not-found]
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    section = data.get("tool", {}).get("fsdp2-retrofit", {})
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: [tool.fsdp2-retrofit] must be a table")
    unknown = sorted(set(section) - CONFIG_KEYS)
    if unknown:
        raise ConfigError(
            f"{path}: unknown option `{unknown[0]}` in [tool.fsdp2-retrofit] (known: {', '.join(sorted(CONFIG_KEYS))})"
        )
    for key in ("select", "ignore", "extend-select", "exclude", "extend-exclude", "shard"):
        value = section.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{path}: `{key}` in [tool.fsdp2-retrofit] must be a list of strings")
    return path, section
