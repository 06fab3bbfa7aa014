"""Reading scripts as bytes with one-line errors, and writing results atomically.

The rewrite works on bytes: libcst detects the encoding (PEP 263 cookie, BOM,
UTF-8 by default) and renders the module back in that encoding with the file's
own newlines. So nothing here re-encodes; it only checks up front that the bytes
are a text file Python could read, so that bad input fails with a clear line
instead of a parser traceback.
"""
from __future__ import annotations

import codecs
import io
import os
import re
import stat
import tokenize
from contextlib import suppress
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

from .report import InputError
from dataclasses import dataclass

PathLike = Union[str, "os.PathLike[str]"]

# PEP 263: a comment on line 1 or 2 naming the encoding.
_COOKIE = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")


@dataclass(frozen=True)
class Source:
    """A script as read from disk: its bytes and the encoding they declare."""

    path: str
    data: bytes
    encoding: str

    def decode(self, data: Optional[bytes] = None) -> str:
        """Text of `data` (default: this source) in this source's encoding, for diffs."""
        return (self.data if data is None else data).decode(self.encoding, errors="replace")


def read_source(path: PathLike) -> Source:
    """Read a script, or raise InputError saying in one line why it cannot be rewritten."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise InputError("no such file or directory") from None
    except OSError as exc:
        raise InputError(f"cannot read: {_reason(exc)}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError("is a directory; rewrite takes script files")
    if not stat.S_ISREG(st.st_mode):
        raise InputError("not a regular file; rewrite takes script files")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read: {_reason(exc)}") from None

    nul = data.find(b"\0")
    if nul != -1:
        raise InputError("binary file (contains NUL bytes), not a Python script", _line_at(data, nul))
    if not data.lstrip(codecs.BOM_UTF8).strip():
        raise InputError("empty file: nothing to retrofit")
    encoding = check_encoding(data)
    return Source(str(path), data, encoding)


def decode(data: bytes, like: Optional[bytes] = None) -> str:
    """The text of `data` in the encoding it declares (or `like`, the file it was made
    from, declares), for diffs; undecodable bytes replaced."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(like if like is not None else data).readline)
    except SyntaxError:
        encoding = "utf-8"
    try:
        return data.decode(encoding, errors="replace")
    except LookupError:
        return data.decode("utf-8", errors="replace")


def check_encoding(data: bytes) -> str:
    """The encoding `data` declares, after checking that all of it decodes (InputError, one
    line, otherwise: `rewrite` and `check` give the same message)."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        name, line = _cookie(data)
        message = str(exc)
        if message.startswith("unknown encoding"):
            raise InputError(f"unknown encoding in coding cookie: {name}", line) from None
        if message.startswith("encoding problem"):
            raise InputError(f"coding cookie says {name} but the file starts with a UTF-8 byte-order mark", line) from None
        # The first lines are not valid UTF-8 and no cookie says otherwise.
        encoding = "utf-8"
    try:
        data.decode(encoding)
    except LookupError:  # a codec that exists but is not a text encoding, e.g. rot13
        name, line = _cookie(data)
        raise InputError(f"unknown encoding in coding cookie: {name} is not a text encoding", line) from None
    except UnicodeDecodeError as exc:
        byte = data[exc.start]
        declared = "declared" if _cookie(data)[0] else "default"
        raise InputError(
            f"cannot decode byte 0x{byte:02x} as {encoding} (the {declared} encoding); "
            "add a coding cookie such as `# -*- coding: latin-1 -*-` or re-save as UTF-8",
            _line_at(data, exc.start),
        ) from None
    return encoding


def _cookie(data: bytes):
    """(encoding name, line) of the PEP 263 cookie, or ("", 0) when there is none."""
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    for number, line in enumerate(data.splitlines()[:2], start=1):
        match = _COOKIE.match(line)
        if match:
            return match.group(1).decode("ascii", "replace"), number
        if line.strip() and not line.lstrip().startswith(b"#"):
            break  # code on line 1: a cookie on line 2 no longer counts
    return "", 0


def _line_at(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _reason(exc: OSError) -> str:
    return (exc.strerror or str(exc)).lower()


def check_writable(path: PathLike) -> None:
    """Raise InputError when `path` exists and its mode bits forbid writing it.

    Mode bits, not os.access: as root os.access allows everything, and os.replace
    would silently swap out a file the user marked read-only.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise InputError("is a directory; give a file path to write to")
    if not st.st_mode & _write_bit(st):
        raise InputError("read-only file: not rewriting it (make it writable, or write elsewhere with -o OUT)")


def _write_bit(st: os.stat_result) -> int:
    geteuid = getattr(os, "geteuid", None)
    if geteuid is None:  # Windows: only the owner bit is meaningful
        return stat.S_IWUSR
    uid = geteuid()
    if uid == 0 or uid == st.st_uid:
        return stat.S_IWUSR
    if st.st_gid in os.getgroups() or st.st_gid == os.getegid():
        return stat.S_IWGRP
    return stat.S_IWOTH


def atomic_write(path: PathLike, data: bytes) -> None:
    """Replace `path` with `data` all at once, keeping an existing file's mode.

    Writes a temporary file in the same directory, fsyncs it and renames it over
    the target, so a crash leaves either the old file or the new one. A symlink is
    followed: the file it points to is replaced, the link stays. Raises InputError
    (message only; the caller knows the path) when the write fails.
    """
    target = os.path.realpath(path)
    try:
        st: Optional[os.stat_result] = os.stat(target)
    except FileNotFoundError:
        st = None
    directory = os.path.dirname(target)
    try:
        import tempfile  # only when writing: kept off start-up (it pulls in shutil, random, bz2, lzma)

        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    except OSError as exc:
        raise InputError(f"cannot write: {_reason(exc)}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            _keep_owner(tmp, st)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException as exc:
        with suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise InputError(f"cannot write: {_reason(exc)}") from None
        raise
    _fsync_directory(directory)


# -- a set of files, all or none ----------------------------------------------

JOURNAL = ".fsdp2-retrofit-pending.json"  # in the first target's folder while a set is being renamed


def write_all(writes: Sequence[Tuple[PathLike, bytes]]) -> None:
    """Replace every (path, data) of `writes` so that the set lands whole: every new file is
    staged (written and fsynced beside its target) before any target changes; on a failure
    while staging nothing is changed. Then a journal naming each staged file, its target
    and the target's bytes as they were is written beside the first target (the commit
    point), the renames follow, and the journal goes. A run killed between two renames
    leaves the journal, and the next `rewrite` in that folder finishes the renames first
    (`finish_interrupted`). One file is `atomic_write`. Raises InputError(message, path)."""
    if len(writes) == 1:
        atomic_write(writes[0][0], writes[0][1])
        return
    import hashlib
    import json
    import tempfile

    staged: List[Tuple[str, str, Optional[str]]] = []  # (tmp, real target, sha256 of the target's bytes)
    journal = ""
    try:
        for path, data in writes:
            target = os.path.realpath(path)
            try:
                st: Optional[os.stat_result] = os.stat(target)
                with open(target, "rb") as f:
                    before: Optional[str] = hashlib.sha256(f.read()).hexdigest()
            except FileNotFoundError:
                st, before = None, None
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.",
                                       suffix=".tmp")
            staged.append((tmp, target, before))
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            if st is not None:
                os.chmod(tmp, stat.S_IMODE(st.st_mode))
                _keep_owner(tmp, st)
            else:
                os.chmod(tmp, 0o666 & ~_umask())
        journal = os.path.join(os.path.dirname(staged[0][1]), JOURNAL)
        record = [{"staged": tmp, "target": target, "before": before} for tmp, target, before in staged]
        atomic_write(journal, json.dumps(record, indent=1).encode())
    except BaseException as exc:
        for tmp, _, _ in staged:
            with suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, OSError):
            raise InputError(f"cannot write: {_reason(exc)}") from None
        raise
    try:
        for tmp, target, _ in staged:  # committed: from here on the set is finished, now or by the next run
            os.replace(tmp, target)
    except OSError as exc:
        raise InputError(f"cannot write: {_reason(exc)} (the files still to write are listed in {journal}; "
                         "the next rewrite in that folder writes them)") from None
    for folder in sorted({os.path.dirname(t) for _, t, _ in staged}):
        _fsync_directory(folder)
    with suppress(OSError):
        os.unlink(journal)


def finish_interrupted(folder: PathLike) -> List[str]:
    """Finish a set of writes `write_all` committed in `folder` but did not complete (the run
    was killed between renames): each staged file still there replaces its target, unless
    the target changed since (then it is kept, and the staged file removed). Returns one
    line per file for the report; [] when there was nothing to finish."""
    import hashlib
    import json

    journal = os.path.join(str(folder), JOURNAL)
    try:
        with open(journal, "rb") as f:
            record = json.loads(f.read())
    except (OSError, ValueError):
        return []
    done = []
    for entry in record if isinstance(record, list) else ():
        tmp, target, before = entry.get("staged"), entry.get("target"), entry.get("before")
        if not (isinstance(tmp, str) and isinstance(target, str)) or not os.path.exists(tmp):
            continue
        try:
            with open(target, "rb") as f:
                now: Optional[str] = hashlib.sha256(f.read()).hexdigest()
        except FileNotFoundError:
            now = None
        if now == before:
            os.replace(tmp, target)
            done.append(f"{target}: written (an interrupted rewrite of several files is finished)")
        else:
            with suppress(OSError):
                os.unlink(tmp)
            done.append(f"{target}: changed since an interrupted rewrite; kept as it is")
    _fsync_directory(str(folder))
    with suppress(OSError):
        os.unlink(journal)
    return done


def _keep_owner(tmp: str, st: os.stat_result) -> None:
    # Only root can give a file away; for everyone else the owner is already theirs.
    if hasattr(os, "chown") and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        with suppress(OSError):
            os.chown(tmp, st.st_uid, st.st_gid)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable (POSIX; a no-op where directories cannot be opened)."""
    with suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- discovery (check) -------------------------------------------------------

DEFAULT_EXCLUDE = (
    ".bzr", ".direnv", ".eggs", ".git", ".git-rewrite", ".hg", ".mypy_cache", ".nox", ".pants.d",
    ".pytype", ".ruff_cache", ".svn", ".tox", ".venv", "__pypackages__", "_build", "buck-out",
    "build", "dist", "node_modules", "site-packages", "venv", "__pycache__",
)


def discover(paths, exclude=(), force_exclude: bool = False):
    """The Python files under `paths`, in a stable order, ruff's way: directories are
    walked (skipping DEFAULT_EXCLUDE, `exclude` patterns and, inside a git work tree,
    what git ignores); a file named explicitly is kept unless `force_exclude`.
    Yields (path, error): error is a one-line reason for a path that cannot be used."""
    excluded = _excluder(exclude)
    seen = set()
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            yield raw, "no such file or directory"
            continue
        if p.is_file():
            if force_exclude and excluded(os.path.normpath(raw)):
                continue
            if raw not in seen:
                seen.add(raw)
                yield raw, None
            continue
        for found in sorted(_walk(p, excluded)):
            if found not in seen:
                seen.add(found)
                yield found, None


def _excluder(exclude=()):
    """Whether a path (relative to the folder walked) is excluded: DEFAULT_EXCLUDE or an
    `exclude` pattern matches one of its parts, or an `exclude` pattern the whole."""
    import fnmatch

    patterns = tuple(DEFAULT_EXCLUDE) + tuple(exclude)

    def excluded(rel: str) -> bool:
        parts = Path(rel).parts
        return any(
            fnmatch.fnmatch(part, pat) for pat in patterns for part in parts
        ) or any(fnmatch.fnmatch(rel, pat) for pat in exclude)

    return excluded


def walk_python(root, exclude=(), git: bool = True):
    """The Python files under the folder `root`, as discover walks it; with `git` False, git
    is not asked what it ignores (no subprocess: a folder known to be in no work tree)."""
    root = Path(root)
    return sorted(_walk(root, _excluder(exclude), git))


def _walk(root: Path, excluded, git: bool = True):
    listed = _git_listed(root) if git else None
    if listed is not None:
        for rel in listed:
            if rel.endswith((".py", ".pyi")) and not excluded(rel):
                yield os.path.join(str(root), rel) if str(root) != "." else rel
        return
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(
            d for d in dirnames if not excluded(os.path.normpath(os.path.join(rel_dir, d)))
        )
        for name in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if name.endswith((".py", ".pyi")) and not excluded(rel):
                yield os.path.join(dirpath, name) if str(root) != "." else rel


def _git_listed(root: Path):
    """Files under `root` that git tracks or would track (not ignored), relative to
    `root`; None when `root` is not in a git work tree or git is missing."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "."],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    names = [n for n in out.stdout.decode("utf-8", "surrogateescape").split("\0") if n]
    return [n for n in names if (root / n).is_file()]
