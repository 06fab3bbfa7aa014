"""RetrofitOptions: the one set of options every rewrite stage reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple


@dataclass(frozen=True)
class RetrofitOptions:
    """What the user asked for; stages read it and never read global state."""

    # Class names (bare or dotted) whose instances become their own FSDP2 unit,
    # replacing the repeated-block detection.
    shard: Tuple[str, ...] = field(default_factory=tuple)
    # "last": with gradient accumulation, reduce once per optimizer step
    # (set_requires_gradient_sync); "every": reduce each micro-batch.
    accumulation_sync: str = "last"
    # divide each training DataLoader's batch size by the world size (the run is
    # then numerically the single-process run at the same arguments)
    keep_global_batch: bool = False
    # build the model on the meta device, shard it, then to_empty and re-run its
    # initialisation: each rank only allocates its shards; values are fresh draws
    meta_init: bool = False


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
