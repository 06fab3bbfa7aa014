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
  lint in a run, the rules not run), from a per-file summary cache. An entry is named by the
  selected rules and the file's path (not its bytes): one per file and rule selection, replaced
  when the file changes (ruff's model, as results_cache.py), so edits leave nothing behind. It
  holds the tool's version and source stamp, a hash of the file's bytes, and `reads`: every path
  the file's analysis depends on (_reads: the project files its imports reach, MAX_DEPTH deep,
  with a hash each; and every path their resolution looked at, found or not: the candidates
  tried before the one found, or all of them when none was, on each base of the search, and the
  project markers and __init__.py files that chose those bases: project_imports.imported_files'
  `probed`). Any difference is a miss: a module created where an import was looked for (the
  `helpers.py` a `from helpers import shard` found nothing for, a package folder's new
  __init__.py, a module beside the importer that shadows the project root's) or a marker created
  above (a new project root: its folder becomes a base of the search). Absent paths are checked
  with one stat each, nothing read; a marker found is fingerprinted like a module (.git:
  "folder"; an edited pyproject.toml is a miss too); each path is checked once a run. Entries
  are JSON files in check/ of the folder rewrite's cache uses (rewrite.cache.cache_dir()),
  written atomically (a parallel batch reads the old entry or the new one); `--no-cache` or
  FSDP2_RETROFIT_NO_CACHE=1 turns it off; a corrupt, foreign (another tool version) or
  unwritable entry is a miss, never an error. (Entries of earlier versions, named by the bytes too, are never read again: delete
  the folder to drop them.)

Which project a file belongs to (project_of, and so which files are its importers) is found
anew each run (memoized per process only), so a marker created or removed above is seen by the
next run; it is never part of an entry.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
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
    """The Handed records of project files, cached on disk: one entry per file and rule
    selection, replaced when the file or anything its analysis depends on changes."""

    def __init__(self, rules: Sequence, use_cache: bool) -> None:
        self.rules = tuple(rules)
        self.folder = _cache_folder() if use_cache else None
        self.selection = ",".join(sorted(r.CODE for r in self.rules))
        self.known = Fingerprints()  # the read files' fingerprints, once a run

    @functools.cached_property
    def stamp(self) -> str:
        """The tool's: an entry of another version or source is a miss."""
        from fsdp2_retrofit import __version__
        from fsdp2_retrofit.rewrite.cache import source_stamp

        return f"{FORMAT}\0{__version__}\0{source_stamp()}"

    def handed(self, path: str, data: bytes) -> list:
        target = self._target(path) if self.folder is not None else None
        if target is not None:
            found = self._load(target, data)
            if found is not None:
                return found
        from .lint import handed_out

        handed = handed_out(data, path, self.rules)
        if target is not None:
            entry = {"stamp": self.stamp, "data": _digest(data), "reads": _fingerprints(_reads(path, data)),
                     "handed": [list(h) for h in handed]}
            write_entry(target, entry)
        return handed

    def _target(self, path: str) -> str:
        """The entry's file: named by the rule selection and the path, not the bytes (replaced, not piled up)."""
        name = hashlib.sha256(f"summary\0{self.selection}\0{path}".encode()).hexdigest()
        return os.path.join(self.folder, name + ".json")

    def _load(self, target: str, data: bytes) -> Optional[list]:
        from fsdp2_retrofit.analysis.sharding import Handed

        try:
            with open(target, encoding="utf-8") as f:
                entry = json.load(f)
            if entry["stamp"] != self.stamp or entry["data"] != _digest(data) or not self.known.same(entry["reads"]):
                return None  # another tool, other bytes, or a module its analysis reads changed
            return [Handed(str(h[0]), str(h[1]), h[2], str(h[3]), bool(h[4]), bool(h[5])) for h in entry["handed"]]
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None  # absent, corrupt, or of another shape: computed again


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


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _reads(path: str, data: bytes) -> List[str]:
    """The project files the analysis of `path` may read (its imports, MAX_DEPTH deep), then
    every other path their resolution looked at (project_imports.imported_files' `probed`:
    the candidates not found, before the one found, on each base of the search; the project
    markers and __init__.py files that chose the bases). Absent ones fingerprint None: a module
    that appears where an import was looked for is a miss."""
    seen: Dict[str, None] = {}
    probed: Dict[str, None] = {}
    frontier: List[Tuple[str, bytes]] = [(path, data)]
    for _ in range(MAX_DEPTH):
        following = []
        for importer, text in frontier:
            for found in imported_files(importer, text, probed):
                found = os.path.realpath(found)
                if found in seen or found == path:
                    continue
                seen[found] = None
                inner = read(found)
                if inner is not None:
                    following.append((found, inner))
        frontier = following
    for name in probed:
        seen.setdefault(name, None)
    return list(seen)


def _fingerprint(name: str) -> Optional[str]:
    """A file's content hash; "folder" for a folder (a package looked for); None where it is
    absent or unreadable (one stat, nothing read)."""
    try:
        mode = os.stat(name).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISDIR(mode):
        return "folder"
    data = read(name)
    return hashlib.sha1(data).hexdigest() if data is not None else None


def _fingerprints(paths: Iterable[str]) -> Dict[str, Optional[str]]:
    """Each path's _fingerprint."""
    return {name: _fingerprint(name) for name in paths}


class Fingerprints:
    """The fingerprints of one run (each path's asked once): whether an entry's still hold."""

    def __init__(self) -> None:
        self._known: Dict[str, Optional[str]] = {}

    def same(self, reads: dict) -> bool:
        """Whether every path an entry recorded (`reads`: path -> fingerprint) is as it was."""
        if not isinstance(reads, dict):
            return False
        known = self._known
        for name, then in reads.items():
            if name not in known:
                known[name] = _fingerprint(name)
            if known[name] != then:
                return False
        return True
