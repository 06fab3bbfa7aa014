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
`fully_shard` of its argument and of the name bound to its result.

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
from fsdp2_retrofit.syntax.names import Resolver, dotted

Table = Dict[str, Sharder]  # the name a call spells -> what the function it reaches does

# resolved path -> (the bytes of every file the table was computed from, the table)
_TABLES: Dict[str, Tuple[Tuple[Tuple[str, bytes], ...], Table]] = {}


def imported_sharders(module: cst.Module, resolver: Resolver, path: str) -> Table:
    """The sharders `module` (the file at `path`) reaches through its imports of project modules."""
    if not any(isinstance(n, (cst.Import, cst.ImportFrom)) for n in _imports(resolver)):
        return {}
    return _Tables().imports_of(Path(path).resolve(), resolver, MAX_DEPTH)


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
        if cached is not None and all(read(Path(p)) == data for p, data in cached[0]):
            self.reads.extend(cached[0])
            return cached[1]
        data = read(path)
        if data is None or key in self.visiting or depth <= 0:
            return {}
        outer, self.reads = self.reads, [(key, data)]
        self.visiting.add(key)
        try:
            table = self._compute(path, data, depth)
        finally:
            self.visiting.discard(key)
            reads, self.reads = self.reads, outer
            self.reads.extend(reads)
        if depth == MAX_DEPTH:  # a table computed deeper in a chain may be cut short
            _TABLES[key] = (tuple(dict.fromkeys(reads)), table)
        return table

    def _compute(self, path: Path, data: bytes, depth: int) -> Table:
        if not any(t.encode() in data for t in SHARDING_TRIGGERS) and not imports_sharding(str(path), data):
            return {}  # nothing it reaches shards: not parsed
        try:
            module = cst.parse_module(data)
        except (cst.ParserSyntaxError, UnicodeDecodeError, LookupError, SyntaxError):
            return {}
        resolver = Resolver(module)
        table = self.imports_of(path, resolver, depth - 1)
        collector = _Collector(module, resolver, table)
        collector.run()
        table.update(collector.sharders())
        return table

    def imports_of(self, importer: Path, resolver: Resolver, depth: int) -> Table:
        """The sharders the imports of the file at `importer` bind, by the name a call spells."""
        table: Table = {}
        for imp in _imports(resolver):
            if isinstance(imp, cst.Import):
                for alias in imp.names:
                    full = dotted(alias.name)
                    target = locate(importer, 0, full)
                    if target is not None:
                        prefix = dotted(alias.asname.name) if alias.asname is not None else full
                        table.update({f"{prefix}.{n}": s for n, s in self.table_of(target, depth).items()})
                continue
            dots = len(imp.relative)
            module = dotted(imp.module) if imp.module is not None else ""
            target = locate(importer, dots, module)
            if isinstance(imp.names, cst.ImportStar):
                if target is not None:
                    table.update(self._exported(target, depth))
                continue
            for alias in imp.names:
                name = dotted(alias.name)
                local = dotted(alias.asname.name) if alias.asname is not None else name
                found = self.table_of(target, depth).get(name) if target is not None else None
                if found is not None:
                    table[local] = found
                    continue
                sub = locate(importer, dots, f"{module}.{name}" if module else name)  # `from pkg import parallel`
                if sub is not None:
                    table.update({f"{local}.{n}": s for n, s in self.table_of(sub, depth).items()})
        return table

    def _exported(self, path: Path, depth: int) -> Table:
        """What `from <module> import *` binds of its table: the names in a literal `__all__`,
        else those without a leading underscore."""
        from .star_imports import Exports, _restrict_to_all

        table = {n: s for n, s in self.table_of(path, depth).items() if "." not in n}
        data = read(path)
        if not table or data is None or b"__all__" not in data:
            return {n: s for n, s in table.items() if not n.startswith("_")}
        try:
            module = cst.parse_module(data)
        except (cst.ParserSyntaxError, UnicodeDecodeError, LookupError, SyntaxError):
            return {}
        kept = _restrict_to_all(module, Exports(names={n: n for n in table}), str(path))
        return {n: table[n] for n in kept.names}
