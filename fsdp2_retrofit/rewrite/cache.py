"""A cache of rewrite results, keyed by everything the result depends on.

Like black's cache: a pre-commit or CI run of `rewrite --check` over unchanged
files answers from here without loading libcst. The key is the tool's version,
the options, the script's bytes and path, and the size and mtime of every Python
file beside it; the tool's own source counts too (the size and mtime of each .py
file of fsdp2_retrofit/ and codemods/: a changed checkout of the same version
misses). The entry also lists every file the analysis looked for (modules
the script imports, in its folder or in packages below it: RewriteResult.inputs)
with a hash of its bytes, or null where it was absent; a lookup re-hashes them, and
any difference is a miss. The other files a rewrite edits are stored with it (their new
bytes, records and a hash of the bytes they were made from, checked on lookup). Entries are JSON files under $FSDP2_RETROFIT_CACHE_DIR,
else $XDG_CACHE_HOME/fsdp2-retrofit, else ~/.cache/fsdp2-retrofit. Any problem
with the cache means a miss, never an error.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Dict, Iterable, Optional

from fsdp2_retrofit import __version__
from fsdp2_retrofit.options import RetrofitOptions
from dataclasses import asdict
from fsdp2_retrofit.report import Attention, Change, Refusal, RewriteResult


def cache_dir() -> Path:
    explicit = os.environ.get("FSDP2_RETROFIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fsdp2-retrofit"


FORMAT = 3  # of the entries: 2 added inputs and refusal codes, 3 the other files a rewrite edits

_PACKAGES = ("fsdp2_retrofit", "codemods")  # the tool's own code, beside each other
_source_stamp: Optional[str] = None


def source_stamp(root: Optional[Path] = None) -> str:
    """A hash of the relative path, size and mtime of every .py file of the tool's
    packages under `root` (default: where this package lives): it changes when the
    tool's code does, at the cost of one stat per file (no reads). Computed once a
    process for the default root."""
    global _source_stamp
    if root is None and _source_stamp is not None:
        return _source_stamp
    base = root if root is not None else Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    stack = list(_PACKAGES)  # folders relative to base
    entries = []
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(os.path.join(base, folder)) as found:
                for entry in found:
                    name = entry.name
                    if name.endswith(".py"):
                        st = entry.stat()
                        entries.append(f"{folder}/{name}\0{st.st_size}\0{st.st_mtime_ns}")
                    elif name != "__pycache__" and "." not in name and entry.is_dir(follow_symlinks=False):
                        stack.append(f"{folder}/{name}")
        except OSError:
            continue
    for line in sorted(entries):
        digest.update(line.encode() + b"\0")
    stamp = digest.hexdigest()
    if root is None:
        _source_stamp = stamp
    return stamp


def _key(path: str, source: bytes, options: RetrofitOptions) -> str:
    digest = hashlib.sha256()
    digest.update(f"{__version__}\0{source_stamp()}\0{FORMAT}\0{os.path.abspath(path)}\0{options!r}\0".encode())
    digest.update(source)
    folder = Path(path).resolve().parent
    try:
        siblings = sorted(p for p in folder.iterdir() if p.suffix == ".py" and p.name != Path(path).name)
    except OSError:
        siblings = []
    for sibling in siblings:
        try:
            st = sibling.stat()
        except OSError:
            continue
        digest.update(f"\0{sibling.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return digest.hexdigest()


def _fingerprints(paths: Iterable[str]) -> Dict[str, Optional[str]]:
    """Each file's content hash; "folder" for a folder (a project marker such as `.git`);
    None for a path that is absent (or unreadable)."""
    found: Dict[str, Optional[str]] = {}
    for name in paths:
        try:
            found[name] = hashlib.sha256(Path(name).read_bytes()).hexdigest()
        except IsADirectoryError:
            found[name] = "folder"
        except OSError:
            found[name] = None
    return found


def lookup(path: str, source: bytes, options: RetrofitOptions) -> Optional[RewriteResult]:
    try:
        entry = json.loads((cache_dir() / _key(path, source, options)).read_text())
        if _fingerprints(entry["inputs"]) != entry["inputs"]:
            return None  # a file the analysis read (or looked for) changed
        return RewriteResult(
            path=path,
            original=source,
            code=base64.b64decode(entry["code"]) if entry["code"] is not None else source,
            changes=[Change(**c) for c in entry["changes"]],
            attention=[Attention(**a) for a in entry["attention"]],
            refusals=[Refusal(**r) for r in entry["refusals"]],
            inputs=sorted(entry["inputs"]),
            siblings=[_sibling(s) for s in entry["siblings"]],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sibling(entry: dict) -> RewriteResult:
    """Another file of the project the rewrite edits, as stored: its bytes on disk must be
    the ones it was rewritten from (else KeyError: a miss)."""
    original = Path(entry["path"]).read_bytes()
    if hashlib.sha256(original).hexdigest() != entry["original"]:
        raise KeyError(entry["path"])
    return RewriteResult(
        path=entry["path"],
        original=original,
        code=base64.b64decode(entry["code"]),
        changes=[Change(**c) for c in entry["changes"]],
        attention=[Attention(**a) for a in entry["attention"]],
        refusals=[],
    )


def store(result: RewriteResult, options: RetrofitOptions) -> None:
    entry = {
        "code": None if result.code == result.original else base64.b64encode(result.code).decode(),
        "changes": [asdict(c) for c in result.changes],
        "attention": [asdict(a) for a in result.attention],
        "refusals": [asdict(r) for r in result.refusals],
        "inputs": _fingerprints(result.inputs),
        "siblings": [
            {
                "path": s.path,
                "original": hashlib.sha256(s.original).hexdigest(),
                "code": base64.b64encode(s.code).decode(),
                "changes": [asdict(c) for c in s.changes],
                "attention": [asdict(a) for a in s.attention],
            }
            for s in result.siblings
        ],
    }
    target = cache_dir() / _key(result.path, result.original, options)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, target)
    except OSError:
        pass
