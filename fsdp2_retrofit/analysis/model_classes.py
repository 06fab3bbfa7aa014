"""What the script's model classes look like: repeated blocks, submodules, tied weights.

Classes are read from the script and from sibling modules it imports from its own
folder (parsed, never imported). Names are global: a class of the script is `Net`,
one of the sibling `model.py` is `model.Block`.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.memo import per_node
from fsdp2_retrofit.syntax.names import (
    CONTAINERS, SELF_RETURNING_METHODS, TORCH_MODULE_BASES, Resolver, attr_path, bind_args, code, walk,
)
from fsdp2_retrofit.syntax.torch_api import BARE_CONTAINERS, NN_PARAMETER, is_optimizer_call

from . import project_imports
from .scalar_params import ScalarParameter, scalar_parameters_of_init

if TYPE_CHECKING:
    from .star_imports import StarNames

Path_ = Tuple[str, ...]


@dataclass
class Container:
    """A repeated-block container: `self.<path>` holds blocks of `block_class`."""

    path: Path_
    block_class: Optional[str]
    kind: str  # ModuleList, Sequential
    node: cst.CSTNode  # the assignment in __init__ (of the script or of a sibling module)
    # blocks that are containers themselves (`nn.ModuleList([nn.ModuleList([Attn(), FF()]) for ...])`):
    # the inner kind ("ModuleList", "ModuleDict", "Sequential") and the classes of the first block's children
    inner: Optional[str] = None
    inner_classes: Tuple[str, ...] = ()
    # the units are the children of each block, not the blocks: an inner ModuleList/ModuleDict has no
    # forward (fully_shard's hooks on it never fire); an inner Sequential whose forward the class does
    # not call (`for attn, ff in self.layers`) neither
    units_inside: bool = False


@dataclass
class ClassInfo:
    name: str  # global name: "Net", "model.GPT"
    node: cst.ClassDef
    file: Optional[str]
    bases: List[str]
    is_module: bool = False
    submodules: Dict[str, str] = field(default_factory=dict)  # attr -> class global name
    containers: List[Container] = field(default_factory=list)
    ties: List[Tuple[Path_, Path_]] = field(default_factory=list)
    plain_lists: List[Tuple[str, cst.CSTNode]] = field(default_factory=list)
    optimizer_in_init: Optional[cst.CSTNode] = None
    # `self.logit_scale = nn.Parameter(torch.tensor(0.5))`: 0-dim parameters (analysis/scalar_params.py)
    scalar_params: List[ScalarParameter] = field(default_factory=list)
    methods: Dict[str, cst.FunctionDef] = field(default_factory=dict)
    # resolves names in the class's own file (the script or a sibling module)
    namer: Optional["_Namer"] = field(default=None, repr=False, compare=False)
    namespace: str = ""  # "" for the script, "model" for a sibling model.py


# Methods whose call builds no module of its own (what they are handed is read separately).
_PLAIN_METHODS = frozenset({
    "__init__", "append", "extend", "insert", "register_buffer", "register_parameter", "add_module", "apply",
    "get", "items", "keys", "values", "format", "join", "split", "size", "view", "reshape", "to", "fill_",
    "zero_", "normal_", "uniform_", "copy_", "requires_grad_", "unsqueeze", "expand", "repeat", "float",
    "long", "bool", "pop", "update", "startswith", "endswith", "lower", "upper", "strip", "replace",
    "parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules", "children",
    "named_children", "numel", "transpose", "sum", "mean", "clone", "detach", "t",
})


class ClassRegistry:
    """Every class the script can see, by global name."""

    def __init__(self) -> None:
        self.classes: Dict[str, ClassInfo] = {}
        self.namespaces: Set[str] = set()  # the sibling modules read ("model", "models.resnet")
        self.top_level_functions: Dict[str, Dict[str, cst.FunctionDef]] = {}  # namespace -> name -> def
        self.files: Dict[str, str] = {}  # namespace -> the sibling module's file
        # the names the script's `from X import *` of its sibling modules bind (star_imports)
        self.star: Optional["StarNames"] = None
        # namespace ("" for the script) -> that module's top-level `NAME = value` statements, its namer
        self.top_level: Dict[str, Tuple[Dict[str, list], "_Namer"]] = {}

    def top_level_value(self, qname: Optional[str]):
        """(value, namer of its module) of the one top-level `NAME = value` that `qname`
        names: `MODELS` of the script, `policies.wrap_policy` of a sibling module read
        (parsed, never imported); None when it is bound another way or more than once."""
        if not qname:
            return None
        namespace, _, name = qname.rpartition(".")
        found = self.top_level.get(namespace)
        if found is None or len(found[0].get(name, ())) != 1:
            return None
        return found[0][name][0].value, found[1]

    def classes_built_by(self, expr, namer: "_Namer", depth: int = 2) -> List[str]:
        """The module classes a value of a table (`MODELS = {"a": Net, "b": make_b}`) builds
        when called: a class, a lambda calling one, or a top-level function of the same
        module whose every return builds one; [] when one cannot be read."""
        if isinstance(expr, cst.Lambda):
            return self._built_by_call(expr.body, namer, depth)
        name = namer.of(expr)
        if self.is_module_class(name):
            return [name]
        fn = self.top_level_functions.get(namer.namespace, {}).get(name or "")
        if fn is None or depth == 0:
            return []
        out: List[str] = []
        for ret in namer.resolver.descendants(fn, cst.Return):
            found = self._built_by_call(ret.value, namer, depth - 1)
            if not found:
                return []
            out += [c for c in found if c not in out]
        return out

    def namespace_classes(self, namespace: str) -> List[str]:
        """The module classes a call of `namespace.__dict__[name]` can build, for a module of
        the project read here: its public classes and top-level functions that build one
        (`def resnet18(): return ResNet(...)`), its own and those of the modules its
        `__init__` star-imports (`from .resnet import *`); [] when it is not such a module."""
        if namespace not in self.namespaces:
            return []
        found = self.top_level.get(namespace)
        sources = [namespace]
        package = _package_of(namespace, self.files[namespace])
        for stmt in found[1].resolver.module.body if found is not None else ():
            for imp in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
                if isinstance(imp, cst.ImportFrom) and isinstance(imp.names, cst.ImportStar):
                    source = _absolute(imp, package)
                    if source in self.namespaces and source not in sources:
                        sources.append(source)
        out: List[str] = []
        for source in sources:
            prefix = f"{source}."
            names = [c for c in self.classes if c.startswith(prefix) and "." not in c[len(prefix):]]
            names += [f"{source}.{f}" for f in self.top_level_functions.get(source, {})]
            namer = self.top_level.get(source, (None, None))[1]
            for name in sorted(names):
                if name.rpartition(".")[2].startswith("_"):
                    continue
                built = [name] if self.is_module_class(name) else (
                    self.classes_built_by(cst.Name(name.rpartition(".")[2]), namer) if namer is not None else [])
                out += [c for c in built if c not in out]
        return out

    def _built_by_call(self, value, namer: "_Namer", depth: int) -> List[str]:
        """The classes `Net(...)` / `make(...)` (also `.to(device)` after it) builds."""
        while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and (
            value.func.attr.value in SELF_RETURNING_METHODS
        ):
            value = value.func.value  # `Net(...).to(device)`
        if not isinstance(value, cst.Call) or isinstance(value.func, cst.Lambda):
            return []
        return self.classes_built_by(value.func, namer, depth)

    def shown_file(self, namespace: str) -> str:
        """A sibling module's file as a message names it: its path from the folder its import
        resolves in (`mingpt/trainer.py`, `loaders.py`), or the file's name for a package's
        `__init__.py`."""
        if namespace not in self.files:
            return namespace
        file = Path(self.files[namespace])
        dotted = Path(*namespace.split(".")).with_suffix(".py").as_posix()
        return dotted if file.as_posix().endswith("/" + dotted) or file.as_posix() == dotted else file.name

    def get(self, name: Optional[str]) -> Optional[ClassInfo]:
        return self.classes.get(name) if name else None

    def is_module_class(self, name: Optional[str]) -> bool:
        if not name:
            return False
        if name.startswith("torch.nn.") and name.rsplit(".", 1)[-1][:1].isupper():
            return True
        info = self.classes.get(name)
        return bool(info and info.is_module)

    def block_containers(self, name: Optional[str], depth: int = 3) -> List[Container]:
        """Repeated-block containers of a model class, with paths from its root.

        Looks through submodules built from known classes (an encoder holding
        its layers); does not look inside the blocks themselves.
        """
        info = self.get(name)
        if info is None or depth == 0:
            return []
        found = list(info.containers)
        for attr, sub in info.submodules.items():
            for c in self.block_containers(sub, depth - 1):
                found.append(replace(c, path=(attr,) + c.path))
        return found

    def container_kind(self, name: Optional[str], path: Sequence[str], depth: int = 4) -> Optional[str]:
        """"ModuleList" or "ModuleDict" when `self.<path>` of an instance of class `name` is one:
        built as `nn.ModuleDict(...)`/`nn.ModuleList(...)` by an assignment in the class's
        methods (whatever it holds: unlike block_containers, which keeps repeated blocks
        only), or built from a class of the project that subclasses one. The class may be in
        the script or a sibling module (read by its own file's imports); a path through a
        submodule (`self.moe.experts`) follows that submodule's class."""
        info = self.get(name)
        if info is None or not path or depth == 0:
            return None
        if len(path) > 1:
            return self.container_kind(info.submodules.get(path[0]), path[1:], depth - 1)
        for method in info.methods.values() if info.methods else ():
            for assign in (n for n in walk(method) if isinstance(n, cst.Assign)):
                if not (len(assign.targets) == 1 and tuple(attr_path(assign.targets[0].target) or ()) == ("self", path[0])):
                    continue
                if not isinstance(assign.value, cst.Call) or info.namer is None:
                    continue
                built = info.namer.of(assign.value)
                kind = self.container_class_kind(built, depth - 1)
                if kind:
                    return kind
        return None

    def container_class_kind(self, name: Optional[str], depth: int = 4) -> Optional[str]:
        """"ModuleList"/"ModuleDict" for those torch.nn classes and the project's classes built on them."""
        if not name or depth == 0:
            return None
        if name in BARE_CONTAINERS:
            return name.rsplit(".", 1)[-1]
        info = self.get(name)
        if info is None:
            return None
        return next(filter(None, (self.container_class_kind(b, depth - 1) for b in info.bases)), None)

    def mentions(self, name: Optional[str], word: str, depth: int = 4) -> bool:
        """`word` occurs in the source of the class or of a class it is built from."""
        info = self.get(name)
        if info is None or depth == 0:
            return False
        from fsdp2_retrofit.syntax.names import code

        if word in code(info.node):
            return True
        inner = set(info.submodules.values()) | {c.block_class for c in info.containers if c.block_class}
        return any(self.mentions(sub, word, depth - 1) for sub in inner)

    def built_of(self, name: Optional[str]) -> Tuple[Set[str], bool]:
        """(the module classes an instance of class `name` is built of, itself included, by
        their bare names; whether that list is complete). The classes are read from the
        `__init__` of the class and its bases of the script or its sibling modules (and the
        methods of theirs it calls on `self`), and of every class of theirs those build; a
        `torch.nn` class is a leaf. Not complete where something else is called there that may
        build a module: a class not read here (a library's), a function (`make_layers(cfg)`,
        a `partial` bound to a name), anything the analysis cannot name."""
        found: Set[str] = set()
        complete = True
        todo, seen = [name], set()
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            if current and current.startswith("torch.") and self.is_module_class(current):
                found.add(current.rsplit(".", 1)[-1])  # `model = nn.Linear(...)`
                continue
            info = self.get(current)
            if info is None or not info.is_module or info.namer is None:
                return found | ({current.rsplit(".", 1)[-1]} if current else set()), False
            found.add(current.rsplit(".", 1)[-1])
            for base in info.bases:
                if base not in TORCH_MODULE_BASES:
                    todo.append(base)
            bodies, read = [info.methods.get("__init__")], set()
            while bodies:
                body = bodies.pop()
                if body is None or id(body) in read:
                    continue
                read.add(id(body))
                for call in info.namer.resolver.descendants(body, cst.Call):
                    callee = info.namer.of(call)
                    func = call.func
                    if callee and (callee.startswith("torch.") or callee.startswith("math.")):
                        if self.is_module_class(callee) and callee not in BARE_CONTAINERS | NN_PARAMETER:
                            found.add(callee.rsplit(".", 1)[-1])
                    elif self.get(callee) is not None:
                        if self.is_module_class(callee):
                            todo.append(callee)
                    elif callee and callee.startswith("builtins."):
                        continue
                    elif isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and (
                        func.value.value == "self" and func.attr.value in info.methods
                    ):
                        bodies.append(info.methods[func.attr.value])  # ResNet's self._make_layer(...)
                    elif isinstance(func, cst.Attribute) and func.attr.value in _PLAIN_METHODS:
                        continue  # super().__init__(), layers.append(...), self.register_buffer(...)
                    else:
                        complete = False
        return found, complete

    def ties(self, name: Optional[str]) -> List[Tuple[Path_, Path_]]:
        info = self.get(name)
        return list(info.ties) if info else []

    def _resolve_modules(self) -> None:
        changed = True
        while changed:
            changed = False
            for info in self.classes.values():
                if not info.is_module and any(
                    b in TORCH_MODULE_BASES or self.is_module_class(b) for b in info.bases
                ):
                    info.is_module = True
                    changed = True


# The files the analysis looked for, found or not: what a rewrite depends on besides
# the script (its cache entry checks them). Collected while `recording_reads()` runs.
_LOOKED_AT: ContextVar[Optional[Set[str]]] = ContextVar("fsdp2_retrofit_looked_at", default=None)
# While `recording_reads()` runs (one rewrite), the file system's answers: each analysis of the
# rewrite (one per stage that edited the tree) asks the same questions. key -> (answer, paths looked at)
_ANSWERS: ContextVar[Optional[Dict[tuple, tuple]]] = ContextVar("fsdp2_retrofit_answers", default=None)


@contextmanager
def recording_reads() -> Iterator[Set[str]]:
    """Collect, into the set it yields, every file path the analysis looks for (and
    remember what the file system answered, for the analyses made meanwhile)."""
    looked_at: Set[str] = set()
    token = _LOOKED_AT.set(looked_at)
    answers = _ANSWERS.set({})
    try:
        yield looked_at
    finally:
        _ANSWERS.reset(answers)
        _LOOKED_AT.reset(token)


def _remembered(key: tuple, ask: Callable[[], object]):
    """`ask()`, once per `recording_reads()`: asked again, its answer, and the paths it
    looked at recorded again."""
    answers = _ANSWERS.get()
    if answers is None:
        return ask()
    known = answers.get(key)
    if known is None:
        token = _LOOKED_AT.set(set())
        try:
            answer = ask()
            known = answers[key] = (answer, _LOOKED_AT.get())
        finally:
            _LOOKED_AT.reset(token)
    if known[1]:
        _record_all(known[1])
    return known[0]


def _is_file(path: Path) -> bool:
    """`path.is_file()`, recorded: whether the file exists is an input too."""
    _record(path)
    return path.is_file()


def _is_dir(path: Path) -> bool:
    """`path.is_dir()`, recorded like _is_file (the cache tells a folder from a file and from nothing)."""
    _record(path)
    return path.is_dir()


def _record(path: Path) -> None:
    looked_at = _LOOKED_AT.get()
    if looked_at is not None:
        looked_at.add(str(path))


def _record_all(paths: Set[str]) -> None:
    looked_at = _LOOKED_AT.get()
    if looked_at is not None:
        looked_at |= paths


def build_registry(module: cst.Module, resolver: Resolver, path: Optional[str]) -> ClassRegistry:
    """The classes of the script and of the sibling modules it imports from. The names
    the script's star imports bind are added to `resolver` (Resolver.add_bindings)."""
    from .star_imports import star_names

    registry = ClassRegistry()
    _collect(module, resolver, namespace="", file=path, registry=registry)
    if path:
        folder = _remembered(("folder", path), lambda: Path(path).resolve().parent)
        _collect_siblings(module, resolver, folder, registry, seen=set(), depth=_SIBLING_DEPTH)
        _collect_project_packages(module, resolver, folder, registry)

    def collect(sibling, sib_resolver, namespace, file) -> None:
        if namespace not in registry.namespaces:
            _collect(sibling, sib_resolver, namespace=namespace, file=str(file), registry=registry)

    registry.star = star_names(module, resolver, path, _parse_sibling, collect, _is_file)
    _add_re_exports(registry)
    resolver.add_bindings(registry.star.names, registry.star.dropped)
    registry._resolve_modules()
    return registry


def _absolute(imp: cst.ImportFrom, package: str) -> Optional[str]:
    """The dotted module an ImportFrom names, a relative one resolved in `package` (the
    importing module's package: `from .rnn import X` in `models/__init__.py` names
    `models.rnn`). The script is in no package: its `from .x import` names its folder's
    `x`, and deeper relative imports are not followed."""
    base = _dotted(imp.module) if imp.module is not None else ""
    if not imp.relative:
        return base or None
    parts = package.split(".") if package else []
    up = len(imp.relative) - 1
    if up > len(parts) or (up and not package):
        return None
    return ".".join(parts[: len(parts) - up] + ([base] if base else [])) or None


def _package_of(namespace: str, file) -> str:
    """The package a sibling module's relative imports resolve in: a package's own
    `__init__.py` is its package, `models/rnn.py` is in `models`."""
    return namespace if str(file).endswith("__init__.py") else namespace.rpartition(".")[0]


def _imported_modules(resolver: Resolver, folder: Path, package: str = "") -> List[str]:
    """The dotted names of the modules a file imports, in the namespaces its qualified
    names use: `from model import RNNModel` and `import model` (or `import model as m`)
    give `model` (so `m.RNNModel` is `model.RNNModel`), `import pkg.model` gives
    `pkg.model`, and `from pkg import model` gives `pkg` and, when `pkg` is a folder
    here, `pkg.model`; relative imports are resolved in `package`."""
    out: List[str] = []
    for stmt in resolver.nodes(cst.ImportFrom):
        dotted = _absolute(stmt, package)
        if dotted is None:
            continue
        out.append(dotted)
        if not isinstance(stmt.names, cst.ImportStar) and _remembered(
            ("dir", folder, dotted), lambda: _is_dir(folder.joinpath(*dotted.split(".")))
        ):
            out += [f"{dotted}.{_dotted(alias.name)}" for alias in stmt.names]
    for stmt in resolver.nodes(cst.Import):
        out += [_dotted(alias.name) for alias in stmt.names]
    return out


def _module_file(folder: Path, dotted: str) -> Optional[Path]:
    """The file of module `dotted` in `folder` (a .py file or a package's __init__.py), or None."""
    candidate = folder.joinpath(*dotted.split(".")).with_suffix(".py")
    if not _is_file(candidate):
        candidate = folder.joinpath(*dotted.split("."), "__init__.py")
    return candidate if _is_file(candidate) else None


def _collect_siblings(module, resolver, folder: Path, registry, seen, depth, package: str = "") -> None:
    if depth == 0:
        return
    for dotted in _imported_modules(resolver, folder, package):
        if dotted in seen:
            continue
        candidate = _remembered(("module", folder, dotted), lambda: _module_file(folder, dotted))
        if candidate is None:
            continue
        seen.add(dotted)
        parsed = _parse_sibling(candidate)
        if parsed is None:
            continue
        sibling, sib_resolver = parsed
        _collect(sibling, sib_resolver, namespace=dotted, file=str(candidate), registry=registry)
        _collect_siblings(sibling, sib_resolver, folder, registry, seen, depth - 1, _package_of(dotted, candidate))


# The files that mark a project's root folder: a package of the project imported by a script
# in a subfolder (`projects/chargpt/chargpt.py`: `from mingpt.model import GPT`) lives there.
_PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")
_PROJECT_DEPTH = 3  # folders above the script's own, at most


def _project_root(folder: Path) -> Optional[Path]:
    """The nearest folder above `folder` (within _PROJECT_DEPTH) that holds a project marker."""
    for parent in list(folder.parents)[:_PROJECT_DEPTH]:
        if any(_is_file(parent / m) or _is_dir(parent / m) for m in _PROJECT_MARKERS):
            return parent
    return None


def _package_base(folder: Path) -> Optional[Path]:
    from .project_imports import package_base

    found = package_base(str(folder))
    return Path(found) if found is not None else None


def _collect_project_packages(module, resolver, folder: Path, registry) -> None:
    """`from mingpt.model import GPT` in a script below the project's root: the package is
    the project's own (installed with `pip install -e .`) when the root holds `mingpt/`.
    Without a root marker within reach, the folder above the script's outermost package
    (where `python -m pkg.sub.script` imports from: project_imports.package_base). Only
    imports the script's folder does not resolve are looked up there."""
    heads = {_dotted(s.module).split(".")[0] for s in resolver.nodes(cst.ImportFrom)
             if s.module is not None and not s.relative}
    heads |= {_dotted(a.name).split(".")[0] for s in resolver.nodes(cst.Import) for a in s.names}
    heads -= {n.split(".")[0] for n in registry.namespaces}
    if not heads:
        return
    root = _remembered(("root", folder), lambda: _project_root(folder) or _package_base(folder))
    if root is None:
        return
    if not _remembered(("heads", root, frozenset(heads)), lambda: any((root / h).is_dir() for h in heads)):
        return
    _collect_siblings(module, resolver, root, registry, seen=set(registry.namespaces), depth=2)


# Sibling modules are read here, never rewritten: each tree resolved once per process.
# How far imports are followed from the script: a package's __init__ re-exporting a class of one of its
# modules built of classes of another (`pkg/__init__.py` -> `pkg/model.py` -> `pkg/parts.py`) is three.
_RESOLVERS: Dict[int, Tuple[cst.Module, Resolver]] = {}
_SIBLING_DEPTH = 3


def _add_re_exports(registry: ClassRegistry) -> None:
    """A class a sibling module imports at its top level is that module's name too:
    `from .rnn import RNNModel` in `models/__init__.py` makes `models.RNNModel` (the
    name the script's `from models import RNNModel` gives it) the class of
    `models/rnn.py`. Chains of packages re-exporting are followed."""
    changed = True
    while changed:
        changed = False
        for namespace in sorted(registry.namespaces):
            package = _package_of(namespace, registry.files[namespace])
            for stmt in registry.top_level[namespace][1].resolver.module.body:
                for imp in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
                    if not isinstance(imp, cst.ImportFrom) or isinstance(imp.names, cst.ImportStar):
                        continue
                    source = _absolute(imp, package)
                    for alias in imp.names if source else ():
                        found = registry.classes.get(f"{source}.{_dotted(alias.name)}")
                        local = f"{namespace}.{_dotted((alias.asname or alias).name)}"
                        if found is not None and local not in registry.classes:
                            registry.classes[local] = found
                            changed = True


def _parse_sibling(path: Path) -> Optional[Tuple[cst.Module, Resolver]]:
    """The tree of a sibling module (parsed once per content: project_imports.parse, the tree the
    program reads too) and its resolver, made once per tree."""
    data = project_imports.read(path)
    if data is None:
        return None
    try:
        module = project_imports.parse(path, data)
    except (cst.ParserSyntaxError, UnicodeDecodeError, LookupError, SyntaxError):
        return None
    return module, per_node(_RESOLVERS, module, lambda: Resolver(module), limit=512)


def _dotted(expr) -> str:
    if isinstance(expr, cst.Name):
        return expr.value
    return _dotted(expr.value) + "." + expr.attr.value


class _Namer:
    """Turns a resolver's qualified names into global names for one namespace."""

    def __init__(self, resolver: Resolver, namespace: str, local_classes: Iterable[str], package: str = "",
                 registry: Optional["ClassRegistry"] = None):
        self.resolver = resolver
        self.namespace = namespace
        self.local = set(local_classes)
        self.registry = registry
        self.stars: List[str] = []  # the modules its star imports read (`from .parts import *`: `pkg.parts`)
        # a relative import's module as the resolver names it (`from .parts import Block`: `parts`) -> the
        # module it is in the project (`pkg.parts`), for a module of a package
        self.relative: Dict[str, str] = {}
        for imp in resolver.nodes(cst.ImportFrom) if namespace else ():
            source = _absolute(imp, package) if imp.relative else None
            if isinstance(imp.names, cst.ImportStar):
                self.stars += [source or _absolute(imp, package)] if (source or _absolute(imp, package)) else []
                continue
            if source is None:
                continue
            if imp.module is not None:
                self.relative[_dotted(imp.module)] = source
            else:  # `from . import parts`
                self.relative.update({_dotted(a.name): f"{source}.{_dotted(a.name)}" for a in imp.names})

    def of(self, node: cst.CSTNode) -> Optional[str]:
        names = sorted(self.resolver.qnames(node))
        if not names and type(node) is cst.Name and self.stars:
            names = [node.value]  # bound by none of its own statements: a star import's, perhaps
        if not names:
            return None
        name = names[0]
        if self.namespace and name in self.local:
            return f"{self.namespace}.{name}"
        head, _, rest = name.rpartition(".")
        if head in self.relative:
            return f"{self.relative[head]}.{rest}"
        if not head and self.registry is not None:  # a bare name a star import of this module may give
            found = next((f"{m}.{name}" for m in self.stars if f"{m}.{name}" in self.registry.classes), None)
            if found is not None:
                return found
        return name


def _collect(module, resolver: Resolver, namespace: str, file, registry: ClassRegistry) -> None:
    if namespace:
        registry.namespaces.add(namespace)
        registry.files[namespace] = str(file)
    top_classes = [s for s in module.body if isinstance(s, cst.ClassDef)]
    top_functions = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}
    namer = _Namer(resolver, namespace, [c.name.value for c in top_classes],
                   _package_of(namespace, file) if namespace else "", registry)
    assigns: Dict[str, list] = {}
    for stmt in module.body:
        for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
            if isinstance(small, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
                for target in small.targets if isinstance(small, cst.Assign) else [small]:
                    target = target.target
                    if isinstance(target, cst.Name):
                        bound = small if not isinstance(small, cst.AugAssign) and small.value is not None else None
                        assigns.setdefault(target.value, []).append(bound)
    registry.top_level[namespace] = ({k: v for k, v in assigns.items() if all(v)}, namer)
    registry.top_level_functions[namespace] = top_functions
    for cls in top_classes:
        name = f"{namespace}.{cls.name.value}" if namespace else cls.name.value
        info = ClassInfo(
            name=name,
            node=cls,
            file=file,
            bases=[n for n in (namer.of(b.value) for b in cls.bases) if n],
            namer=namer,
            namespace=namespace,
        )
        for stmt in cls.body.body:
            if isinstance(stmt, cst.FunctionDef):
                info.methods[stmt.name.value] = stmt
        init = info.methods.get("__init__")
        if init is not None:
            _read_init(init, namer, info)
            info.scalar_params = scalar_parameters_of_init(init, resolver, name)
        registry.classes[name] = info


def _read_init(init: cst.FunctionDef, namer: _Namer, info: ClassInfo) -> None:
    appended: Dict[str, List[cst.Call]] = {}
    resolver = namer.resolver
    for node in resolver.descendants(init, cst.Assign):
        for target in node.targets:
            tpath = attr_path(target.target)
            if not tpath or tpath[0] != "self" or len(tpath) < 2:
                continue
            _read_self_assign(tpath[1:], node.value, node, namer, info)
    for node in resolver.descendants(init, cst.Call):
        # self.layers.append(Block(...)) inside a loop of __init__
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value in ("append", "extend") and node.args:
            tpath = attr_path(func.value)
            if tpath and tpath[0] == "self" and len(tpath) == 2:
                value = node.args[0].value
                if isinstance(value, cst.Call):
                    appended.setdefault(tpath[1], []).append(value)
        if is_optimizer_call(resolver, node):
            info.optimizer_in_init = info.optimizer_in_init or node
    registered = _registered_lists(init)
    for attr, node in info.plain_lists:
        if attr in registered:  # registered layer by layer: blocks like a ModuleList's
            container = Container((attr,), None, "ModuleList", node)
            if _set_blocks(container, _list_elements(node.value) or [], namer) and container.block_class:
                info.containers.append(container)
    info.plain_lists = [(attr, node) for attr, node in info.plain_lists if attr not in registered]
    for attr, calls in appended.items():
        for c in info.containers:
            if c.path == (attr,) and c.block_class is None:
                _set_blocks(c, calls[:1], namer, unknown="?")
    for c in info.containers:
        c.units_inside = c.inner in ("ModuleList", "ModuleDict") or (
            c.inner == "Sequential" and not blocks_called(info, c.path)
        )


_REGISTERS = frozenset({"add_module", "register_module"})


def _registered_lists(init: cst.FunctionDef) -> Set[str]:
    """The attributes `self.<attr>` of plain lists whose every element `__init__` registers as a
    submodule: a loop, a statement of `__init__`'s own body, over the list (`for layer in self.<attr>`,
    `for i, layer in enumerate(self.<attr>)`, `for i in range(len(self.<attr>))` with `self.<attr>[i]`)
    whose body calls `self.add_module(name, layer)`, `self.register_module(name, layer)` or
    `setattr(self, name, layer)` on each element, unconditionally; and nothing in `__init__` adds to the
    list (`.append`, `.extend`, `.insert`, `+=`) or rebinds it. Their parameters are the module's."""
    out: Set[str] = set()
    for loop in init.body.body:
        if type(loop) is not cst.For or type(loop.body) is not cst.IndentedBlock or loop.orelse is not None:
            continue
        found = _list_loop(loop)
        if found is None:
            continue
        attr, element = found
        if any(_registers(stmt, element) for stmt in loop.body.body):
            out.add(attr)
    return {attr for attr in out if not _grows(init, attr)}


def _list_elements(value) -> Optional[List[cst.Call]]:
    """The block calls of a plain list `[Block() for _ in ...]` / `[Block(), Block()]` (repeated blocks:
    one call, or two or more)."""
    if type(value) is cst.ListComp:
        return [value.elt] if type(value.elt) is cst.Call else None
    calls = [e.value for e in value.elements]
    return calls if len(calls) >= 2 and all(type(c) is cst.Call for c in calls) else None


def _list_loop(loop: cst.For):
    """(attr, the element each pass reads) for a loop over `self.<attr>`; the element is a name, or for
    `for i in range(len(self.<attr>))` the subscript `self.<attr>[i]` (as its code)."""
    it, target = loop.iter, loop.target
    if type(it) is cst.Call and type(it.func) is cst.Name and it.func.value == "enumerate" and it.args:
        if type(target) not in (cst.Tuple, cst.List) or len(target.elements) != 2:
            return None
        it, target = it.args[0].value, target.elements[1].value
    path = attr_path(it)
    if path is not None and len(path) == 2 and path[0] == "self" and type(target) is cst.Name:
        return path[1], target.value
    if (type(it) is cst.Call and type(it.func) is cst.Name and it.func.value == "range" and len(it.args) == 1
            and type(target) is cst.Name):
        length = it.args[0].value
        if type(length) is cst.Call and type(length.func) is cst.Name and length.func.value == "len" \
                and len(length.args) == 1:
            path = attr_path(length.args[0].value)
            if path is not None and len(path) == 2 and path[0] == "self":
                return path[1], f"self.{path[1]}[{target.value}]"
    return None


def _registers(stmt, element: str) -> bool:
    """`self.add_module(name, <element>)`, `self.register_module(...)` or `setattr(self, name, <element>)`
    as a statement of its own."""
    if type(stmt) is not cst.SimpleStatementLine:
        return False
    for small in stmt.body:
        call = small.value if type(small) is cst.Expr else None
        if type(call) is not cst.Call or len(call.args) != 2 + (type(call.func) is cst.Name) or any(
                a.keyword is not None or a.star for a in call.args):
            continue
        func = call.func
        if type(func) is cst.Attribute and func.attr.value in _REGISTERS and attr_path(func.value) == ("self",):
            handed = call.args[1].value
        elif type(func) is cst.Name and func.value == "setattr" and attr_path(call.args[0].value) == ("self",):
            handed = call.args[2].value
        else:
            continue
        if code(handed) == element:
            return True
    return False


def _grows(init: cst.FunctionDef, attr: str) -> bool:
    """`self.<attr>` gains elements in `__init__` after its list is built, or is bound again."""
    bound = 0
    for node in walk(init):
        if type(node) is cst.Call and type(node.func) is cst.Attribute \
                and node.func.attr.value in ("append", "extend", "insert") \
                and attr_path(node.func.value) == ("self", attr):
            return True
        if type(node) is cst.AugAssign and attr_path(node.target) == ("self", attr):
            return True
        if type(node) is cst.AssignTarget and attr_path(node.target) == ("self", attr):
            bound += 1
    return bound > 1


def _read_self_assign(path, value, node, namer: _Namer, info: ClassInfo) -> None:
    vpath = attr_path(value)
    if vpath and vpath[0] == "self" and len(path) >= 2 and len(vpath) >= 3:
        info.ties.append((tuple(path), tuple(vpath[1:])))
        return
    if len(path) != 1:
        return
    attr = path[0]
    if isinstance(value, (cst.ListComp, cst.List)):
        element = value.elt if isinstance(value, cst.ListComp) else (
            value.elements[0].value if value.elements else None
        )
        if isinstance(element, cst.Call) and _is_module_ctor(element, namer):
            info.plain_lists.append((attr, node))
        return
    if not isinstance(value, cst.Call):
        return
    callee = namer.of(value)
    if callee in CONTAINERS:
        _read_container((attr,), value, callee, namer, info, node)
    elif callee:
        info.submodules[attr] = callee


def _is_module_ctor(call: cst.Call, namer: _Namer) -> bool:
    name = namer.of(call)
    return bool(name) and (name.startswith("torch.nn.") or name.split(".")[-1][:1].isupper())


def _read_container(path, call: cst.Call, kind_name: str, namer: _Namer, info: ClassInfo, node) -> None:
    kind = kind_name.rsplit(".", 1)[-1]
    if kind == "ModuleDict":
        for key, value in _dict_items(call, namer):
            if isinstance(value, cst.Call):
                inner = namer.of(value)
                if inner in CONTAINERS:
                    _read_container(path + (key,), value, inner, namer, info, node)
        return
    elements = _repeated_elements(call)
    if elements is None:
        return
    container = Container(path, None, kind, node)
    if _set_blocks(container, elements, namer):
        info.containers.append(container)


def _set_blocks(container: Container, calls: List[cst.Call], namer: _Namer, unknown: Optional[str] = None) -> bool:
    """Fill in the block class (and, for blocks that are containers, their children's
    classes) from the calls that build the blocks; False when they are not repeated
    blocks: calls of several classes, or inner containers whose children are containers
    again (three levels deep: not read)."""
    classes = {namer.of(e) for e in calls}
    if len(classes) > 1:
        return False
    if not classes:
        return True  # `nn.ModuleList()`: the blocks are appended later
    container.block_class = classes.pop() or unknown
    if container.block_class not in CONTAINERS:
        return True
    container.inner = container.block_class.rsplit(".", 1)[-1]
    children = [v for _, v in _dict_items(calls[0], namer)] if container.inner == "ModuleDict" else (
        _repeated_elements(calls[0]) if len(calls[0].args) != 1 else _inner_elements(calls[0])
    )
    if not children or not all(isinstance(c, cst.Call) for c in children):
        return False
    inner = [namer.of(c) or "?" for c in children]
    if any(c in CONTAINERS for c in inner):
        return False
    container.inner_classes = tuple(inner)
    return True


def _inner_elements(call: cst.Call) -> Optional[list]:
    """The children of an inner `nn.ModuleList([Attn(), FF()])` / `nn.Sequential(Block())`: one
    call or a list of calls of any classes (they are not repeated blocks)."""
    value = call.args[0].value
    if isinstance(value, (cst.List, cst.Tuple)):
        return [e.value for e in value.elements]
    if isinstance(value, (cst.ListComp, cst.GeneratorExp)):
        return [value.elt]
    return [value] if isinstance(value, cst.Call) and not call.args[0].star else None


def blocks_called(info: ClassInfo, path: Path_) -> bool:
    """Whether the class's methods call the blocks of its container `self.<path>` as
    modules (their forward runs): `for layer in self.layers: x = layer(x)`,
    `self.layers[i](x)`, or `self.layers(x)` of a Sequential (its forward calls each block).
    False when a method takes a block apart (`for attn, ff in self.layers`), hands one on,
    or uses the container any other way (`len(...)` aside), or never uses it."""
    resolver = info.namer.resolver if info.namer is not None else None
    if resolver is None:
        return False
    target = ("self",) + tuple(path)
    called = False
    for name, method in info.methods.items():
        if name == "__init__":
            continue
        for node in resolver.descendants(method, cst.Attribute):
            if attr_path(node) != target:
                continue
            parent = resolver.parent(node)
            if isinstance(parent, cst.Call) and parent.func is node:
                called = True
                continue
            if isinstance(parent, cst.Arg):
                call = resolver.parent(parent)
                if isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == "len":
                    continue
                if isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and (
                    call.func.value in ("enumerate", "reversed") and len(call.args) == 1
                ):
                    loop = resolver.parent(call)
                    if isinstance(loop, cst.For) and loop.iter is call:
                        element = loop.target
                        if call.func.value == "enumerate":
                            element = element.elements[1].value if (
                                isinstance(element, cst.Tuple) and len(element.elements) == 2
                            ) else None
                        if _only_called(element, loop.body, resolver):
                            called = True
                            continue
                return False
            if isinstance(parent, cst.For) and parent.iter is node and _only_called(parent.target, parent.body, resolver):
                called = True
                continue
            if isinstance(parent, cst.Subscript) and parent.value is node:
                outer = resolver.parent(parent)
                if isinstance(outer, cst.Call) and outer.func is parent:
                    called = True
                    continue
            return False
    return called


def _only_called(element, body, resolver: Resolver) -> bool:
    """`element` is a name the loop body reads only as a callee: `x = layer(x)`."""
    if not isinstance(element, cst.Name):
        return False
    uses = [n for n in resolver.descendants(body, cst.Name) if n.value == element.value]
    return bool(uses) and all(
        isinstance(resolver.parent(n), cst.Call) and resolver.parent(n).func is n for n in uses
    )


def _repeated_elements(call: cst.Call) -> Optional[List[cst.Call]]:
    """The block constructor calls inside ModuleList([...])/Sequential(*[...]); [] if empty."""
    if not call.args:
        return []
    if len(call.args) == 1:
        value = call.args[0].value
        while isinstance(value, cst.Subscript):  # `[Block() for ...][::-1]`: a slice of the blocks
            value = value.value
        named = _ordered_dict_values(value)
        if named is not None:
            return named if len(named) >= 2 and all(isinstance(c, cst.Call) for c in named) else None
        if isinstance(value, (cst.ListComp, cst.GeneratorExp)):
            return [value.elt] if isinstance(value.elt, cst.Call) else None
        if isinstance(value, (cst.List, cst.Tuple)):
            calls = [e.value for e in value.elements]
            if not calls:
                return []  # `nn.ModuleList([])`: the blocks are appended later
            return calls if len(calls) >= 2 and all(isinstance(c, cst.Call) for c in calls) else None
        return None
    calls = [a.value for a in call.args]
    if all(isinstance(c, cst.Call) and not a.star for c, a in zip(calls, call.args)) and len(calls) >= 2:
        return calls
    return None


def _ordered_dict_values(value) -> Optional[list]:
    """The modules of `OrderedDict([("a", A()), ...])` or `{"a": A(), ...}`; None otherwise."""
    if isinstance(value, cst.Dict):
        return [e.value for e in value.elements if isinstance(e, cst.DictElement)]
    if (
        isinstance(value, cst.Call)
        and (isinstance(value.func, cst.Name) and value.func.value == "OrderedDict"
             or isinstance(value.func, cst.Attribute) and value.func.attr.value == "OrderedDict")
        and len(value.args) == 1
        and isinstance(value.args[0].value, (cst.List, cst.Tuple))
    ):
        pairs = [e.value for e in value.args[0].value.elements]
        if all(isinstance(p, cst.Tuple) and len(p.elements) == 2 for p in pairs):
            return [p.elements[1].value for p in pairs]
    return None


def _dict_items(call: cst.Call, namer: _Namer):
    if len(call.args) != 1:
        return
    arg = call.args[0].value
    if isinstance(arg, cst.Call) and isinstance(arg.func, cst.Name) and arg.func.value == "dict":
        for a in arg.args:
            if a.keyword is not None:
                yield a.keyword.value, a.value
    elif isinstance(arg, cst.Dict):
        for el in arg.elements:
            if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString):
                yield el.key.evaluated_value, el.value


PARAMETER_ITERATORS = {"parameters", "named_parameters"}


def parameter_reads(method: cst.FunctionDef, info: ClassInfo) -> List[Tuple[cst.CSTNode, Optional[str]]]:
    """(node, submodule) for each place `method` takes the value of one of the module's
    parameters: `next(self.parameters())` (submodule None: the first one registered),
    `self.head.weight.new_zeros(...)` / `.data` / `.clone()` (submodule "head"). Outside
    forward such a parameter is a DTensor shard after fully_shard, and so is what is
    built from it. Handing `self.parameters()` to an optimizer does not count, nor reading
    only its `.device` or `.dtype` (`next(self.parameters()).device`), which a shard shares."""
    containers = {c.path[0] for c in info.containers}
    found: List[Tuple[cst.CSTNode, Optional[str]]] = []
    metadata_only = set()  # `next(self.parameters()).device` / `.dtype`: a shard's are the parameter's

    def own_parameters(node) -> bool:
        f = node.func if isinstance(node, cst.Call) else None
        return (isinstance(f, cst.Attribute) and f.attr.value in PARAMETER_ITERATORS
                and isinstance(f.value, cst.Name) and f.value.value == "self")

    class _P(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if (isinstance(node.func, cst.Name) and node.func.value == "next" and node.args
                    and own_parameters(node.args[0].value)):
                found.append((node, None))

        def visit_Attribute(self, node: cst.Attribute) -> None:
            if node.attr.value in METADATA_READS and isinstance(node.value, cst.Call):
                metadata_only.add(id(node.value))
            param, inner = node.value, getattr(node.value, "value", None)
            if (node.attr.value.startswith("new_") or node.attr.value in VALUE_READS) \
                    and isinstance(param, cst.Attribute) and param.attr.value in ("weight", "bias") \
                    and isinstance(inner, cst.Attribute) and isinstance(inner.value, cst.Name) \
                    and inner.value.value == "self" \
                    and (inner.attr.value in info.submodules or inner.attr.value in containers):
                found.append((node, inner.attr.value))

    method.body.visit(_P())
    return [(node, sub) for node, sub in found if id(node) not in metadata_only]


# what a parameter tells without its values: the same for a DTensor shard as for the whole tensor
METADATA_READS = {"device", "dtype", "is_cuda"}
VALUE_READS = {"data", "clone", "detach", "expand", "expand_as", "view", "reshape", "t", "T"}


def first_submodule(info: ClassInfo) -> Optional[str]:
    """The attribute of the first submodule `__init__` registers (whose parameters
    `next(self.parameters())` returns first)."""
    init = info.methods.get("__init__")
    if init is None:
        return None
    known = set(info.submodules) | {c.path[0] for c in info.containers}
    for node in walk(init.body):
        if isinstance(node, cst.Assign):
            for t in node.targets:
                target = t.target
                if (isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name)
                        and target.value.value == "self" and target.attr.value in known):
                    return target.attr.value
    return None


def runs_self(method: cst.FunctionDef, info, handed: Iterable[str] = ()) -> bool:
    """The method runs the model's computation: it calls `self(...)`, `self.forward(...)`
    or one of its submodules (`self.blocks[0](x)`, `self.head(x)`; `handed`: attributes that
    hold a module the build handed `__init__`, see handed_submodules), or a block of a
    repeated container in a loop. Methods that only read parameters
    (`configure_optimizers`) do not count."""
    submodules = set(info.submodules) | {c.path[0] for c in info.containers} | set(handed)
    found = []

    class _V(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            f = node.func
            while isinstance(f, cst.Subscript):
                f = f.value
            if isinstance(f, cst.Name) and f.value == "self":
                found.append(node)
            elif isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and f.value.value == "self":
                if f.attr.value == "forward" or f.attr.value in submodules:
                    found.append(node)

        def visit_For(self, node: cst.For) -> None:
            it = node.iter
            if isinstance(it, cst.Attribute) and isinstance(it.value, cst.Name) and it.value.value == "self":
                if it.attr.value in submodules:
                    found.append(node)

    method.body.visit(_V())
    return bool(found)


def handed_submodules(info: ClassInfo, build: Optional[cst.Call], resolver: Resolver, registry) -> Set[str]:
    """The attributes of `info`'s instance that hold a module the build call handed its
    `__init__`: `self.eps_model = eps_model` in `__init__(self, eps_model, ...)`, built as
    `DDPM(eps_model=NaiveUnet(...), ...)` (`resolver` resolves the build's names). A module
    class of the project or of torch.nn counts; anything else (a loss function handed in, a
    value) does not."""
    init = info.methods.get("__init__")
    if init is None or build is None:
        return set()
    handed: Dict[str, cst.CSTNode] = dict(bind_args(init, build, skip=1))
    out: Set[str] = set()
    for node in walk(init.body):
        if type(node) is not cst.Assign or type(node.value) is not cst.Name or node.value.value not in handed:
            continue
        value = handed[node.value.value]
        if type(value) is not cst.Call or not any(registry.is_module_class(q) for q in resolver.qnames(value)):
            continue
        for target in node.targets:
            t = target.target
            if isinstance(t, cst.Attribute) and isinstance(t.value, cst.Name) and t.value.value == "self":
                out.add(t.attr.value)
    return out


# nn.Module's own API: calling these on a sharded model needs no forward hooks.
MODULE_API = {
    "parameters", "named_parameters", "buffers", "named_buffers", "children", "named_children",
    "modules", "named_modules", "state_dict", "load_state_dict", "train", "eval", "to", "cuda", "cpu",
    "zero_grad", "apply", "requires_grad_", "half", "float", "double", "bfloat16", "forward",
    "register_buffer", "register_parameter", "register_forward_hook", "register_forward_pre_hook",
    "register_full_backward_hook", "add_module", "get_submodule", "get_parameter", "extra_repr",
    "set_requires_gradient_sync", "reshard", "unshard", "set_reshard_after_backward",
}


def called_methods(holds, info: ClassInfo, resolver: Resolver) -> List[str]:
    """Public methods of the model's own class (not nn.Module's API) the script calls on
    it; `holds(receiver, call)` says whether a call's receiver holds the model there (any
    name bound to it: an alias, a parameter handed it)."""
    called: List[str] = []
    for node in resolver.nodes(cst.Call):
        func = node.func
        if (
            isinstance(func, cst.Attribute)
            and func.attr.value in info.methods
            and func.attr.value not in MODULE_API
            and not func.attr.value.startswith("_")
            and func.attr.value not in called
            and holds(func.value, node)
        ):
            called.append(func.attr.value)
    return called
