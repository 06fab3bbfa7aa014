"""The project files a file imports from, found from its text alone (no parse, no libcst).

`check`'s prefilter asks it whether a file without any sharding call of its own imports
one from its project (`from parallel import shard_model`, where parallel.py calls
`fully_shard`): only such a file is parsed and given the cross-module facts
(analysis.project_sharders). A module is the project's when it is a file beside the
importing one, in its package (relative imports), under the project's root (the
nearest folder above that holds .git, pyproject.toml, setup.py or setup.cfg, within
three levels), or beside the file's outermost package (the folder above the last one
up the path that holds an __init__.py: `apps/main/train.py` of package `apps.main` is
imported from there, so `from lingua.distributed import ...` finds `lingua/` there, as
Python would; a `src/` layout likewise). A library is never one: it is not a file there.

What an answer depends on (`imported_files(..., probed)`, for the caches of check/importers.py
and check/results_cache.py): besides the file found, every path looked at to find it, found or
not: the candidates tried before it (`mod.py`, `mod/__init__.py`, on each base in turn), or all
of them when none was found (a candidate below a folder that is not there is recorded as that
folder: its appearance is the change), and, for an absolute import, the project markers and
__init__.py files that chose the bases (project_root, package_base). A file created at any of
them, or one of them gone, can change the answer.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import libcst as cst

SHARDING_TRIGGERS = ("fully_shard", "FullyShardedDataParallel")
# how many imports deep a chain is followed (train.py -> parallel.py -> fsdp_utils.py)
MAX_DEPTH = 3
_PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")
_PROJECT_DEPTH = 3

# one stripped line each (only lines that start with the word are matched: no scan of the text)
_FROM = re.compile(rb"from[ \t]+(\.*)[ \t]*([\w.]*)[ \t]+import[ \t]+\(?([\w., \t*]*)")
_IMPORT = re.compile(rb"import[ \t]+([\w., \t]+)")

# path -> ((mtime_ns, size), bytes): files read once per process unless they change
_READ: Dict[str, Tuple[Tuple[int, int], bytes]] = {}
# where modules were found, per process (a check run: whether a file exists is asked once)
# folder -> (the answer, the paths asked about to find it: see the docstring's last paragraph)
_ROOTS: Dict[str, Tuple[Optional[str], Tuple[str, ...]]] = {}
_PACKAGE_BASES: Dict[str, Tuple[Optional[str], Tuple[str, ...]]] = {}
_PACKAGE_DEPTH = 8  # nested packages followed up, at most
_INSTALLED = ("site-packages", "dist-packages")
_LOCATED: Dict[Tuple[str, int, str], Tuple[Optional[str], Tuple[str, ...]]] = {}
# path -> ((mtime_ns, size), the project files it imports)
_IMPORTED: Dict[str, Tuple[Tuple[int, int], Tuple[str, ...]]] = {}


def _stat_key(path: str) -> Optional[Tuple[int, int]]:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def read(path) -> Optional[bytes]:
    """The bytes of a project file (cached while its mtime and size stay), None if unreadable."""
    path = str(path)
    key = _stat_key(path)
    if key is None:
        return None
    found = _READ.get(path)
    if found is not None and found[0] == key:
        return found[1]
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    _READ[path] = (key, data)
    return data


_TREES: Dict[Tuple[str, bytes], cst.Module] = {}  # the parsed project files, by path and content


def parse(path, data: bytes) -> cst.Module:
    """The file at `path` with the content `data`, parsed (libcst's errors raised) once in this process:
    the program (analysis/program.py) and the class registry (analysis/model_classes.py) read one tree of
    a file. Keyed by the path too: two files alike are two modules, each with its own nodes."""
    key = (os.path.realpath(str(path)), hashlib.sha1(data).digest())
    found = _TREES.get(key)
    if found is None:
        if len(_TREES) > 512:
            _TREES.clear()
        found = _TREES[key] = cst.parse_module(data)
    return found


def project_root(folder: str) -> Optional[str]:
    """The nearest folder above `folder` (within three levels) that marks a project's root."""
    return _project_root(folder)[0]


def _project_root(folder: str) -> Tuple[Optional[str], Tuple[str, ...]]:
    if folder not in _ROOTS:
        found, parent, probed = None, folder, []
        for _ in range(_PROJECT_DEPTH):
            parent = os.path.dirname(parent)
            for marker in _PROJECT_MARKERS:
                probed.append(os.path.join(parent, marker))
                if os.path.exists(probed[-1]):
                    found = parent
                    break
            if found is not None:
                break
        _ROOTS[folder] = (found, tuple(probed))
    return _ROOTS[folder]


def package_base(folder: str) -> Optional[str]:
    """The folder above the outermost package `folder` is part of (the sys.path entry its
    modules are imported from); None when `folder` holds no __init__.py."""
    return _package_base(folder)[0]


def _package_base(folder: str) -> Tuple[Optional[str], Tuple[str, ...]]:
    if folder not in _PACKAGE_BASES:
        found, current, probed = None, folder, []
        for _ in range(_PACKAGE_DEPTH):
            probed.append(os.path.join(current, "__init__.py"))
            if not os.path.isfile(probed[-1]):
                break
            parent = os.path.dirname(current)
            if parent == current:
                break
            found, current = parent, parent
        if found is not None and os.path.basename(found) in _INSTALLED:
            found = None  # an installed package: the others installed beside it are libraries
        _PACKAGE_BASES[folder] = (found, tuple(probed))
    return _PACKAGE_BASES[folder]


def locate(importer, dots: int, module: str) -> Optional[Path]:
    """The project file `from <dots><module> import ...` in `importer` names (a module file
    or a package's __init__.py), or None when it is not one (a library, or nothing)."""
    found = _located(importer, dots, module)[0]
    return Path(found) if found is not None else None


def _located(importer, dots: int, module: str) -> Tuple[Optional[str], Tuple[str, ...]]:
    """locate's answer (a str), and the paths whose presence or absence made it (the docstring's last paragraph)."""
    folder = os.path.dirname(str(importer))
    key = (folder, dots, module)
    if key not in _LOCATED:
        _LOCATED[key] = _locate(folder, dots, module)
    return _LOCATED[key]


def _locate(folder: str, dots: int, module: str) -> Tuple[Optional[str], Tuple[str, ...]]:
    parts = [p for p in module.split(".") if p]
    probed: List[str] = []
    if dots:
        base = folder
        for _ in range(dots - 1):
            base = os.path.dirname(base)
        bases: Sequence[str] = [base]
    else:
        if not parts:
            return None, ()
        root, root_probed = _project_root(folder)
        package, package_probed = _package_base(folder)
        probed.extend(root_probed)
        probed.extend(package_probed)
        bases = [folder]
        for base in (root, package):
            if base is not None and base not in bases:
                bases.append(base)
    for base in bases:
        target = os.path.join(base, *parts)
        missing = _missing_folder(base, parts)
        for candidate in ((target + ".py") if parts else None, os.path.join(target, "__init__.py")):
            if candidate is None:
                continue
            if missing is not None and candidate.startswith(missing + os.sep):
                probed.append(missing)  # nothing below a folder that is not there: it is the one asked about
                continue
            probed.append(candidate)
            if os.path.isfile(candidate):
                return candidate, tuple(dict.fromkeys(probed))
    return None, tuple(dict.fromkeys(probed))


def _missing_folder(base: str, parts: Sequence[str]) -> Optional[str]:
    """The first folder of base/parts[0]/parts[1]/... that is not one (None: all are): a candidate
    below it cannot exist until it does, so only it is recorded (`from typing import Dict, List`
    looks for typing/Dict.py and typing/List.py: one absent typing/ answers both)."""
    current = base
    for part in parts:
        current = os.path.join(current, part)
        if not os.path.isdir(current):
            return current
    return None


def imported_files(importer, data: bytes, probed: Optional[Dict[str, None]] = None) -> Iterator[Path]:
    """The project files `data` (the text of `importer`) imports from: modules, and the
    modules of `from package import module`. `probed`, when given, gets every path whose
    presence or absence the answer depends on (the module docstring's last paragraph)."""
    def find(importer, dots: int, module: str) -> Optional[Path]:
        found, looked = _located(importer, dots, module)
        if probed is not None:
            probed.update(dict.fromkeys(looked))
        return Path(found) if found is not None else None

    for line in _import_lines(data):
        if line.startswith(b"from"):
            m = _FROM.match(line)
            if m is None:
                continue
            dots, module = len(m.group(1)), m.group(2).decode()
            found = find(importer, dots, module)
            if found is not None:
                yield found
            if found is None or found.name == "__init__.py":  # `from . import parallel`
                for name in m.group(3).decode().replace("(", " ").split(","):
                    name = name.split(" as ")[0].strip()
                    if name and name != "*":
                        inner = find(importer, dots, f"{module}.{name}" if module else name)
                        if inner is not None:
                            yield inner
        elif line.startswith(b"import"):
            m = _IMPORT.match(line)
            for name in m.group(1).decode().split(",") if m is not None else ():
                name = name.split(" as ")[0].strip()
                if name:
                    found = find(importer, 0, name)
                    if found is not None:
                        yield found


def _import_lines(data: bytes) -> Iterator[bytes]:
    """The lines of `data` that mention `import`, stripped (found with bytes.find: the
    rest of the text is never looked at in Python)."""
    at = data.find(b"import")
    while at != -1:
        start = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at)
        end = len(data) if end == -1 else end
        yield data[start:end].strip()
        at = data.find(b"import", end)


def _imported(path: str, data: bytes) -> Tuple[str, ...]:
    """imported_files of a file, resolved, cached while the file stays the same."""
    key = _stat_key(path)
    found = _IMPORTED.get(path)
    if found is not None and found[0] == key:
        return found[1]
    files = _resolved(path, data)
    _IMPORTED[path] = (key, files)
    return files


def _resolved(path: str, data: bytes) -> Tuple[str, ...]:
    return tuple(dict.fromkeys(os.path.normpath(f) for f in imported_files(path, data)))


def imports_sharding(path: Optional[str], data: bytes) -> bool:
    """Whether a project module the file imports (directly, or through at most MAX_DEPTH
    project modules) mentions a sharding API: its functions may shard this file's modules."""
    if not path or path == "-" or b"import" not in data:
        return False
    start = os.path.normpath(os.path.abspath(path))
    seen = {start}
    frontier: List[Tuple[str, bytes]] = [(start, data)]
    for _ in range(MAX_DEPTH):
        following: List[Tuple[str, bytes]] = []
        for importer, text in frontier:
            if b"import" not in text:
                continue
            # the file checked is taken as given (its text may not be what is on disk yet)
            for found in _imported(importer, text) if importer != start else _resolved(importer, text):
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


# the project `check` reads beside a file (check/importers.py, analysis/record_fields.py)
_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")
_ROOT_DEPTH = 6
_PROJECTS: Dict[str, Tuple[str, bool]] = {}  # folder -> project_of, per process


def project_of(path: str) -> Tuple[str, bool]:
    """The folder whose Python files may import the file at `path` (see check/importers.py's docstring),
    and whether it is a project's root (else only its own files and its packages can)."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in _PROJECTS:
        _PROJECTS[folder] = _project_of(folder)
    return _PROJECTS[folder]


def _project_of(folder: str) -> Tuple[str, bool]:
    current = folder
    for _ in range(_ROOT_DEPTH):
        if any(os.path.exists(os.path.join(current, m)) for m in _MARKERS):
            return current, True
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return package_base(folder) or folder, False


def project_files(project: str, is_root: bool, exclude: Tuple[str, ...]) -> Iterable[str]:
    """The Python files `check` would walk in a project's root; in a folder that is none (a
    script in a home folder), only its own files and those of the packages in it: a file
    elsewhere below cannot import one of them (analysis.project_imports.locate)."""
    from fsdp2_retrofit import files

    if is_root:
        return files.walk_python(project, exclude)
    try:
        names = sorted(os.listdir(project))
    except OSError:
        return []
    excluded = files._excluder(exclude)
    found = [os.path.join(project, n) for n in names
             if n.endswith(".py") and not excluded(n) and os.path.isfile(os.path.join(project, n))]
    for name in names:  # no marker within _ROOT_DEPTH levels: not asking git (one process a folder)
        if not excluded(name) and os.path.isfile(os.path.join(project, name, "__init__.py")):
            found.extend(files.walk_python(os.path.join(project, name), exclude, git=False))
    return found
