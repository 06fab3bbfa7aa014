"""A per-file cache of `check` results (ruff's model): a warm run answers from here, unparsed.

A file's FileResult (its findings with their fix records, the sharded modules it hands other
files, its bare `# noqa` count, or its syntax error) is kept for the next run, and given back
when everything it was made from is the same:

- the tool: its version and source (rewrite.cache.source_stamp) and the Python that runs it
  (whether a file compiles, and the names its code uses, are the interpreter's answers);
- the selected rules (their codes: --select/--ignore/--extend-select and pyproject.toml's
  settings all end there);
- the file: its path (as given, and resolved) and a hash of its bytes;
- what the second pass hands it (checker._lint_receivers: the Handed records of the run's
  other files and of the project's files outside it): a hash of them, so that a change in
  train.py, which shards the model handed to trainer.py, is a miss for trainer.py;
- the project files its analysis read or looked for (its imports and every path their
  resolution probed, found or not, project markers and __init__.py files included:
  importers._reads; and every path model_classes recorded while it was analysed), each with a
  hash of its bytes, "folder", or null where absent: any difference is a miss (a module created
  where an import was looked for and not found, or a project marker created above, included).
  Each path is checked once a run, an absent one with one stat.

Never used while fixing (--fix, --diff): a fixed file is written, and its result is what the
fix left. `--no-cache` or FSDP2_RETROFIT_NO_CACHE=1 reads and writes nothing.

Entries are JSON files in check/results/ of the folder rewrite's cache uses
(rewrite.cache.cache_dir(); importers.py keeps its summaries, bounded the same way, in check/). The cache is bounded
like ruff's `.ruff_cache`: an entry's name is a hash of the rule selection, the file's path
and which pass made it (the first, or the second with records handed to it), not of its bytes
or the tool's version; the next result for that file and selection replaces it. So it holds
at most two entries per file checked per rule selection; delete the folder to empty it. A
corrupt, foreign (another tool version, another Python) or unreadable entry is a miss, never
an error; one that cannot be written is skipped.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Iterable, Optional, Sequence

from fsdp2_retrofit.report import InputError
from .importers import Fingerprints, _cache_folder, _digest, _fingerprints, _reads, cache_disabled, write_entry

FORMAT = 1  # of the entries
_INTERNAL = "internal error:"  # a bug in a rule: never kept (FSDP2_RETROFIT_TRACEBACK must see it again)


class ResultsCache:
    """The cached results of one run's rule selection (one per process)."""

    def __init__(self, rules: Sequence, folder: str) -> None:
        from fsdp2_retrofit import __version__
        from fsdp2_retrofit.rewrite.cache import source_stamp

        self.folder = folder
        self.selection = ",".join(sorted(r.CODE for r in rules))
        self.stamp = f"{FORMAT}\0{__version__}\0{source_stamp()}\0{sys.version}"
        self.known = Fingerprints()  # the read files' fingerprints, once a run

    @classmethod
    def for_job(cls, job) -> Optional["ResultsCache"]:
        """The cache of a CheckJob; None when it is off (fixing, --no-cache, the environment)."""
        if job.fix or not job.cache or cache_disabled():
            return None
        folder = _cache_folder()
        return cls(job.rules, os.path.join(folder, "results")) if folder is not None else None

    def load(self, path: str, data: bytes, received: Sequence = ()):
        """The FileResult kept for `path` with these bytes and records handed to it; None: a miss."""
        from .checker import FileResult

        try:
            with open(self._target(path, received), encoding="utf-8") as f:
                entry = json.load(f)
            if (entry["stamp"] != self.stamp or entry["data"] != _digest(data)
                    or entry["received"] != _received(received) or not self.known.same(entry["reads"])):
                return None
            error = entry["error"]
            return FileResult(
                path,
                findings=[_finding(f) for f in entry["findings"]],
                bare_noqa=int(entry["bare_noqa"]),
                error=None if error is None else InputError(str(error[0]), int(error[1]), int(error[2])),
                handed=[_handed(h) for h in entry["handed"]],
            )
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None  # absent, corrupt, or of another shape: computed again

    def store(self, path: str, data: bytes, received: Sequence, result, looked_at: Iterable[str] = ()) -> None:
        """Keep `result`, made from `data` (and `received`); `looked_at`: the paths its
        analysis looked for (model_classes.recording_reads), beside its imports."""
        if result.fixed is not None or (result.error is not None and result.error.message.startswith(_INTERNAL)):
            return
        real = os.path.realpath(path)
        reads = dict.fromkeys(_reads(real, data))
        reads.update(dict.fromkeys(os.path.realpath(p) for p in looked_at))
        reads.pop(real, None)  # its own bytes are in the entry
        error = result.error
        entry = {
            "stamp": self.stamp,
            "data": _digest(data),
            "received": _received(received),
            "reads": _fingerprints(reads),
            "findings": [[f.code, f.name, f.message, f.path, f.line, f.col, f.end_line, f.end_col, f.fix_record]
                         for f in result.findings],
            "bare_noqa": result.bare_noqa,
            "error": None if error is None else [error.message, error.line, error.col],
            "handed": [list(h) for h in result.handed],
        }
        write_entry(self._target(path, received), entry)

    def _target(self, path: str, received: Sequence) -> str:
        which = "received" if received else "first"
        name = hashlib.sha256(
            f"{self.selection}\0{path}\0{os.path.realpath(path)}\0{which}".encode()).hexdigest()
        return os.path.join(self.folder, name + ".json")


def _received(received: Sequence) -> str:
    """A hash of the records handed to a file ("" for none)."""
    if not received:
        return ""
    return hashlib.sha256(json.dumps([list(h) for h in received]).encode()).hexdigest()


def _finding(f: list):
    from .rules import Finding

    code, name, message, path, line, col, end_line, end_col, record = f
    if record is not None and not isinstance(record, dict):
        raise TypeError("fix record")
    return Finding(str(code), str(name), str(message), str(path), int(line), int(col), int(end_line), int(end_col),
                   fix_record=record)


def _handed(h: list):
    from fsdp2_retrofit.analysis.sharding import Handed

    file, name, key, where, whole, legacy = h
    if not isinstance(key, (int, str)):
        raise TypeError("key")
    return Handed(str(file), str(name), key, str(where), bool(whole), bool(legacy))
