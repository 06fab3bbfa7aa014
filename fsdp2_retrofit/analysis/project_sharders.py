"""The functions of other project modules that shard what they are handed.

Expert code bases shard in a module of their own (torchtitan's `parallelize`, torchtune's
`shard_model`, lingua's `parallelize_model`) and call it from the training script:

    from parallel import shard_model
    model = shard_model(Transformer(cfg), mesh)

`imported_sharders` answers, for a file, which names it can call (`shard_model`,
`parallel.shard_model`, an alias, a name a `from parallel import *` binds) reach a
function of a project module (analysis.project_imports.locate) that shards one of its
parameters, itself or its parts, directly or through another project function (the
imported module's own ShardFacts, computed the same way, with its own imports), or
returns a sharded module. analysis.sharding then treats each call of one like a
`fully_shard` of its argument and of the name bound to its result. A table also lists the
module's classes whose methods shard `self` (`Transformer.apply_fsdp`: `fully_shard(self)`),
so that `model.apply_fsdp(mesh)` shards `model` where its class is known
(_Collector._method_call).

Modules are parsed on demand, never imported, and only when their text (or a module
they import, see project_imports.imports_sharding) names a sharding API; their tables
are cached by content (the module's bytes and those of every module it was computed
from).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import libcst as cst

from .project_imports import MAX_DEPTH, SHARDING_TRIGGERS, imports_sharding, locate, read
from .sharding import Sharder, _Collector
from .site_analysis import SiteAnalysis
from fsdp2_retrofit.syntax.names import Resolver, _module_bindings, dotted

# resolved path -> (the bytes of every file it was computed from, how deep, the table)
_TABLES: Dict[str, Tuple[Tuple[Tuple[str, bytes], ...], int, "Table"]] = {}


class Table:
    """The sharders a module binds, by the name a call spells: its own functions (`own`),
    and the names its imports bind, looked up in the module they come from only when a
    call asks for one (a module is parsed when one of its names is called)."""

    def __init__(self, tables: "_Tables", depth: int) -> None:
        self.tables, self.depth = tables, depth
        self.own: Dict[str, Sharder] = {}
        self.names: Dict[str, Tuple[Path, str]] = {}  # `from parallel import shard_model as sm`
        self.modules: Dict[str, Path] = {}  # `import parallel as par`, `from pkg import parallel`
        self.stars: List[Path] = []  # `from parallel import *`
        self.all: Optional[set] = None  # a literal `__all__` of the module
        # its classes whose methods shard `self`: class -> {method: (whole, legacy)} (_Collector.shard_methods)
        self.classes: Dict[str, Dict[str, Tuple[bool, bool]]] = {}

    def __bool__(self) -> bool:
        return bool(self.own or self.classes or self.names or self.modules or self.stars)

    def shard_methods(self, name: str) -> Optional[Dict[str, Tuple[bool, bool]]]:
        """The methods sharding `self` of the class a name spells (`Transformer`, `nn.Transformer`),
        its own or imported (as get() finds a function); None when the class is not the project's."""
        if name in self.classes:
            return self.classes[name]
        if name in self.names:
            path, inner = self.names[name]
            return self.tables.table_of(path, self.depth).shard_methods(inner)
        head = name.rpartition(".")[0]
        while head:
            if head in self.modules:
                return self.tables.table_of(self.modules[head], self.depth).shard_methods(name[len(head) + 1:])
            head = head.rpartition(".")[0]
        for path in reversed(self.stars):
            table = self.tables.table_of(path, self.depth)
            if "." not in name and (name in table.all if table.all is not None else not name.startswith("_")):
                found = table.shard_methods(name)
                if found is not None:
                    return found
        return None

    def where(self, name: str) -> Optional[Tuple[Path, str]]:
        """(the project file, the name there) a name a call spells reaches through an import of
        this module (`Trainer` of `from trainer import Trainer`, `trainer.Trainer`); None for its
        own names, star imports and what no import binds. Nothing is parsed."""
        if name in self.names:
            return self.names[name]
        head = name.rpartition(".")[0]
        while head:
            if head in self.modules:
                return self.modules[head], name[len(head) + 1:]
            head = head.rpartition(".")[0]
        return None

    def get(self, name: str) -> Optional[Sharder]:
        if name in self.own:
            return self.own[name]
        if name in self.names:
            path, inner = self.names[name]
            return self.tables.table_of(path, self.depth).get(inner)
        head, _, rest = name.rpartition(".")
        while head:
            if head in self.modules:
                return self.tables.table_of(self.modules[head], self.depth).get(name[len(head) + 1:])
            head = head.rpartition(".")[0]
        for path in reversed(self.stars):
            found = self.tables.exported(path, self.depth, name)
            if found is not None:
                return found
        return None


def imported_sharders(module: cst.Module, resolver: Resolver, path: str) -> Optional[Table]:
    """The sharders `module` (the file at `path`) reaches through its imports of project modules."""
    if not _imports(resolver):
        return None
    return _Tables().imports_of(Path(path).resolve(), resolver, MAX_DEPTH) or None


def _imports(resolver: Resolver) -> List[cst.CSTNode]:
    return resolver.nodes(cst.ImportFrom) + resolver.nodes(cst.Import)


class _Tables:
    """One lookup: the tables of the files it reads, and the files each one read."""

    def __init__(self) -> None:
        self.visiting: set = set()
        self.reads: List[Tuple[str, bytes]] = []

    def table_of(self, path: Path, depth: int) -> Table:
        """What the module at `path` binds to sharders (its own functions and what it imports)."""
        key = str(path)
        cached = _TABLES.get(key)
        if cached is not None and cached[1] >= depth and all(read(p) == data for p, data in cached[0]):
            self.reads.extend(cached[0])
            return cached[2]
        data = read(path)
        if data is None or key in self.visiting or depth <= 0:
            return Table(self, 0)
        outer, self.reads = self.reads, [(key, data)]
        self.visiting.add(key)
        try:
            table = self._compute(path, data, depth)
        finally:
            self.visiting.discard(key)
            reads, self.reads = self.reads, outer
            self.reads.extend(reads)
        _TABLES[key] = (tuple(dict.fromkeys(reads)), depth, table)
        return table

    def _compute(self, path: Path, data: bytes, depth: int) -> Table:
        if not any(t.encode() in data for t in SHARDING_TRIGGERS) and not imports_sharding(str(path), data):
            return Table(self, 0)  # nothing it reaches shards: not parsed
        try:
            module = cst.parse_module(data)
        except (cst.ParserSyntaxError, UnicodeDecodeError, LookupError, SyntaxError):
            return Table(self, 0)
        resolver = Resolver(module)
        table = self.imports_of(path, resolver, depth - 1)
        collector = _Collector(SiteAnalysis(module, resolver, path=str(path)), table)
        collector.follow_fields = False  # see _Collector._field_call
        collector.run()
        table.own.update(collector.sharders())
        table.classes.update(collector.shard_methods())
        table.all = _all_names(module) if b"__all__" in data else None
        return table

    def imports_of(self, importer: Path, resolver: Resolver, depth: int) -> Table:
        """The names the imports of the file at `importer` bind to project modules."""
        table = Table(self, depth)
        for imp in _imports(resolver):
            if isinstance(imp, cst.Import):
                for alias in imp.names:
                    full = dotted(alias.name)
                    target = locate(importer, 0, full)
                    if target is not None:
                        table.modules[dotted(alias.asname.name) if alias.asname is not None else full] = target
                continue
            dots = len(imp.relative)
            module = dotted(imp.module) if imp.module is not None else ""
            target = locate(importer, dots, module)
            if isinstance(imp.names, cst.ImportStar):
                if target is not None:
                    table.stars.append(target)
                continue
            for alias in imp.names:
                name = dotted(alias.name)
                local = dotted(alias.asname.name) if alias.asname is not None else name
                sub = locate(importer, dots, f"{module}.{name}" if module else name)  # `from pkg import parallel`
                if sub is not None and (target is None or target.name == "__init__.py"):
                    table.modules[local] = sub
                elif target is not None:
                    table.names[local] = (target, name)
        return table

    def exported(self, path: Path, depth: int, name: str) -> Optional[Sharder]:
        """What `from <module> import *` binds `name` to: a name in a literal `__all__`,
        else one without a leading underscore."""
        table = self.table_of(path, depth)
        listed = table.all
        if "." in name or (name not in listed if listed is not None else name.startswith("_")):
            return None
        return table.get(name)


def _all_names(module: cst.Module) -> Optional[set]:
    """The names a literal `__all__` lists (None: no such list)."""
    from .star_imports import Exports, _restrict_to_all

    bound = {n: n for n in _module_bindings(module.body)}
    kept = _restrict_to_all(module, Exports(names=bound), "")
    return set(kept.names) if any(isinstance(t, cst.Name) and t.value == "__all__" for t in _all_targets(module)) else None


def _all_targets(module: cst.Module):
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Assign):
                    yield from (t.target for t in small.targets)
                elif isinstance(small, cst.AugAssign):
                    yield small.target
