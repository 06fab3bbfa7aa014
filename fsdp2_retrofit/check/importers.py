"""What the project's other files hand a file checked without them (pre-commit's batches).

A whole-tree `check .` lints a file whose class or function another file of the run hands a
sharded module (`Trainer(model)` after `fully_shard(model)` in train.py) knowing it
(checker._lint_receivers). Pre-commit passes only the changed files, in parallel batches:
trainer.py committed alone, or in the other half of `pre-commit run --all-files`, would never
be told. So for each file of a run, the project's files outside the run that import it are
found and asked what they hand it, exactly as if they were in the run:

- the project: the nearest folder at or above the file (within _ROOT_DEPTH levels) that holds
  .git, pyproject.toml, setup.py or setup.cfg, and the Python files `check` would walk there
  (files.discover, with the run's excludes); else the folder above the file's outermost package,
  or its own folder, and only the files there and in its packages (project_files);
- an importer: a file that mentions the module's name (a bytes search, nothing parsed), names
  a sharding API or imports a project module that does (what a file must do to hand a sharded
  module over), and whose imports resolve to the file (analysis.project_imports);
- what it hands: its Handed records (lint.handed_out: the same prefilter and analysis as its
  lint in a run, the rules not run), from a per-file summary cache keyed by the tool's version
  and source, the selected rules, the file's path and its bytes; an entry also lists the
  project files its analysis could read (its imports, MAX_DEPTH deep) with a hash of each, and
  any change is a miss. Entries are JSON files under the cache folder rewrite uses
  (rewrite.cache.cache_dir(), in check/); `--no-cache` or FSDP2_RETROFIT_NO_CACHE=1 turns it
  off; a corrupt or unwritable entry is a miss, never an error.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from fsdp2_retrofit.analysis.project_imports import MAX_DEPTH, SHARDING_TRIGGERS, imported_files, imports_sharding
from fsdp2_retrofit.analysis.project_imports import project_files, project_of, read  # noqa: F401 (re-exported)

FORMAT = 1  # of the entries


def cache_disabled() -> bool:
    return os.environ.get("FSDP2_RETROFIT_NO_CACHE", "") not in ("", "0")


def module_name(path: str) -> bytes:
    """The name an import of the file must spell: its stem, or its package's for an __init__.py."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem == "__init__":
        stem = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return stem.encode()


def received_from_outside(rules: Sequence, paths: Sequence[str], exclude: Tuple[str, ...] = (),
                          use_cache: bool = True, receivers: Optional[Sequence[str]] = None) -> Dict[str, list]:
    """realpath of a file of the run (`paths`; only `receivers` of them, when given) -> the
    Handed records the project's files outside the run hand it (in the order of their paths)."""
    if not any(r.NEEDS_SHARDING for r in rules):
        return {}
    in_run = {os.path.realpath(p) for p in paths}
    by_project: Dict[Tuple[str, bool], Dict[str, bytes]] = {}  # project -> {a file of the run, resolved: its module name}
    for path in paths if receivers is None else receivers:
        if path != "-" and path.endswith(".py"):
            by_project.setdefault(project_of(path), {})[os.path.realpath(path)] = module_name(path)
    summaries = _Summaries(rules, use_cache and not cache_disabled())
    out: Dict[str, list] = {}
    for project, targets in by_project.items():
        names = set(targets.values())
        for other in project_files(*project, exclude):
            real = os.path.realpath(other)
            if real in in_run or not other.endswith(".py"):
                continue
            data = read(real)
            if data is None or not any(n in data for n in names) or not _may_hand(real, data):
                continue
            if not any(os.path.realpath(f) in targets for f in imported_files(real, data)):
                continue
            for handed in summaries.handed(real, data):
                if os.path.realpath(handed.file) in targets:
                    out.setdefault(os.path.realpath(handed.file), []).append(handed)
    return out


def _may_hand(path: str, data: bytes) -> bool:
    """Whether a file can hand a sharded module over: it shards, or imports what does."""
    return any(t.encode() in data for t in SHARDING_TRIGGERS) or imports_sharding(path, data)


class _Summaries:
    """The Handed records of project files, cached on disk by content."""

    def __init__(self, rules: Sequence, use_cache: bool) -> None:
        self.rules = tuple(rules)
        self.folder = _cache_folder() if use_cache else None
        self.selection = ",".join(sorted(r.CODE for r in self.rules))

    def handed(self, path: str, data: bytes) -> list:
        key = self._key(path, data) if self.folder is not None else None
        if key is not None:
            found = self._load(key)
            if found is not None:
                return found
        from .lint import handed_out

        handed = handed_out(data, path, self.rules)
        if key is not None:
            self._store(key, path, data, handed)
        return handed

    def _key(self, path: str, data: bytes) -> str:
        from fsdp2_retrofit import __version__
        from fsdp2_retrofit.rewrite.cache import source_stamp

        digest = hashlib.sha256(f"{__version__}\0{source_stamp()}\0{FORMAT}\0{self.selection}\0{path}\0".encode())
        digest.update(data)
        return digest.hexdigest()

    def _load(self, key: str) -> Optional[list]:
        from fsdp2_retrofit.analysis.sharding import Handed

        try:
            with open(os.path.join(self.folder, key + ".json"), encoding="utf-8") as f:
                entry = json.load(f)
            if _fingerprints(entry["reads"]) != entry["reads"]:
                return None  # a module its analysis reads changed
            return [Handed(str(h[0]), str(h[1]), h[2], str(h[3]), bool(h[4]), bool(h[5])) for h in entry["handed"]]
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None  # absent, corrupt, or of another shape: computed again

    def _store(self, key: str, path: str, data: bytes, handed: list) -> None:
        entry = {"reads": _fingerprints(_reads(path, data)), "handed": [list(h) for h in handed]}
        write_entry(os.path.join(self.folder, key + ".json"), entry)


def write_entry(target: str, entry: dict) -> None:
    """`entry` as JSON at `target`, atomically (a parallel batch reads the old entry or this
    one); its folder made first. Nothing written, and no error, when that fails."""
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(entry, f)
        os.replace(tmp, target)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _cache_folder() -> Optional[str]:
    """The check caches' folder (check/ in rewrite's cache folder); None without a home folder."""
    from fsdp2_retrofit.rewrite.cache import cache_dir

    try:
        return str(cache_dir() / "check")
    except (OSError, RuntimeError):  # no home folder
        return None


def _reads(path: str, data: bytes) -> List[str]:
    """The project files the analysis of `path` may read: its imports, MAX_DEPTH deep."""
    seen: Dict[str, None] = {}
    frontier: List[Tuple[str, bytes]] = [(path, data)]
    for _ in range(MAX_DEPTH):
        following = []
        for importer, text in frontier:
            for found in imported_files(importer, text):
                found = os.path.realpath(found)
                if found in seen or found == path:
                    continue
                seen[found] = None
                inner = read(found)
                if inner is not None:
                    following.append((found, inner))
        frontier = following
    return list(seen)


def _fingerprints(paths: Iterable[str]) -> Dict[str, Optional[str]]:
    """Each file's content hash; "folder" for a folder (a package looked for); None where it is
    absent or unreadable."""
    out: Dict[str, Optional[str]] = {}
    for name in paths:
        data = read(name)
        out[name] = hashlib.sha1(data).hexdigest() if data is not None else "folder" if os.path.isdir(name) else None
    return out
