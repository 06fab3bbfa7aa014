"""The project files a file imports from, found from its text alone (no parse, no libcst).

`check`'s prefilter asks it whether a file without any sharding call of its own imports
one from its project (`from parallel import shard_model`, where parallel.py calls
`fully_shard`): only such a file is parsed and given the cross-module facts
(analysis.project_sharders). A module is the project's when it is a file beside the
importing one, in its package (relative imports), or under the project's root (the
nearest folder above that holds .git, pyproject.toml, setup.py or setup.cfg, within
three levels). A library is never one: it is not a file there.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

SHARDING_TRIGGERS = ("fully_shard", "FullyShardedDataParallel")
# how many imports deep a chain is followed (train.py -> parallel.py -> fsdp_utils.py)
MAX_DEPTH = 3
_PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")
_PROJECT_DEPTH = 3

_FROM = re.compile(rb"^[ \t]*from[ \t]+(\.*)[ \t]*([\w.]*)[ \t]+import[ \t]+\(?([\w., \t*]*)", re.MULTILINE)
_IMPORT = re.compile(rb"^[ \t]*import[ \t]+([\w., \t]+)", re.MULTILINE)

# path -> ((mtime_ns, size), bytes): files read once per process unless they change
_READ: Dict[str, Tuple[Tuple[int, int], bytes]] = {}


def read(path: Path) -> Optional[bytes]:
    """The bytes of a project file (cached while its mtime and size stay), None if unreadable."""
    try:
        stat = path.stat()
    except OSError:
        return None
    key = (stat.st_mtime_ns, stat.st_size)
    found = _READ.get(str(path))
    if found is not None and found[0] == key:
        return found[1]
    try:
        data = path.read_bytes()
    except OSError:
        return None
    _READ[str(path)] = (key, data)
    return data


def project_root(folder: Path) -> Optional[Path]:
    """The nearest folder above `folder` (within three levels) that marks a project's root."""
    for parent in list(folder.parents)[:_PROJECT_DEPTH]:
        if any((parent / m).exists() for m in _PROJECT_MARKERS):
            return parent
    return None


def locate(importer: Path, dots: int, module: str) -> Optional[Path]:
    """The project file `from <dots><module> import ...` in `importer` names (a module file
    or a package's __init__.py), or None when it is not one (a library, or nothing)."""
    parts = [p for p in module.split(".") if p]
    if dots:
        base = importer.parent
        for _ in range(dots - 1):
            base = base.parent
        bases: Sequence[Path] = [base]
    else:
        if not parts:
            return None
        root = project_root(importer.parent)
        bases = [importer.parent] + ([root] if root is not None and root != importer.parent else [])
    for base in bases:
        target = base.joinpath(*parts)
        for candidate in (target.with_suffix(".py") if parts else None, target / "__init__.py"):
            if candidate is not None and candidate.is_file():
                return candidate
    return None


def imported_files(importer: Path, data: bytes) -> Iterator[Path]:
    """The project files `data` (the text of `importer`) imports from: modules, and the
    modules of `from package import module`."""
    for m in _FROM.finditer(data):
        dots, module = len(m.group(1)), m.group(2).decode()
        found = locate(importer, dots, module)
        if found is not None:
            yield found
        if found is None or found.name == "__init__.py":  # `from . import parallel`
            for name in m.group(3).decode().replace("(", " ").split(","):
                name = name.split(" as ")[0].strip()
                if name and name != "*":
                    inner = locate(importer, dots, f"{module}.{name}" if module else name)
                    if inner is not None:
                        yield inner
    for m in _IMPORT.finditer(data):
        for name in m.group(1).decode().split(","):
            name = name.split(" as ")[0].strip()
            if name:
                found = locate(importer, 0, name)
                if found is not None:
                    yield found


def imports_sharding(path: Optional[str], data: bytes) -> bool:
    """Whether a project module the file imports (directly, or through at most MAX_DEPTH
    project modules) mentions a sharding API: its functions may shard this file's modules."""
    if not path or path == "-":
        return False
    start = Path(path).resolve()
    seen = {start}
    frontier: List[Tuple[Path, bytes]] = [(start, data)]
    for _ in range(MAX_DEPTH):
        following: List[Tuple[Path, bytes]] = []
        for importer, text in frontier:
            if b"import" not in text:
                continue
            for found in imported_files(importer, text):
                found = found.resolve()
                if found in seen:
                    continue
                seen.add(found)
                inner = read(found)
                if inner is None:
                    continue
                if any(t.encode() in inner for t in SHARDING_TRIGGERS):
                    return True
                following.append((found, inner))
        frontier = following
    return False
