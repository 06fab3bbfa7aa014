"""Sharding functions held in a field of a project record class (a model spec, a registry entry).

torchtitan's trainer never names its sharding function: each model package registers a record,

    # spec.py                      # models/llama/__init__.py
    @dataclass                     spec = ModelSpec(name="llama", parallelize_fn=parallelize_llama)
    class ModelSpec:
        parallelize_fn: Callable

and the trainer calls the field: `model = model_spec.parallelize_fn(model, mesh)`. `field_sharder`
answers, for such a call `x.FIELD(arg, ...)` (x not `self`, not bound by an import), whether it
shards `arg` and returns it sharded, by following the VALUES the project stores in that field,
never by names:

- the record classes: the class x is known to hold (an annotated parameter, `x = C(...)`;
  _Collector._declared) when it is a project class, else every project class that declares
  FIELD with an annotation in its body (a dataclass, a NamedTuple, a plain class with annotated
  fields: found by a bytes search of the project's files, then parsed);
- the values: in every project file, tests aside, that spells the class's name and the field's
  (a bytes search first), the keyword FIELD= (or the field's position, for a dataclass or a
  NamedTuple) of each construction `C(...)` the file's imports resolve to that class, each
  attribute assignment `obj.FIELD = value` (`self.FIELD = ...` only in the class itself), and a
  default in the class body;
- each value: a project function, resolved through the file's imports as project_sharders
  resolves a call (`functools.partial(f, ...)` as `f`): it shards when its Sharder shards its
  first parameter or returns a sharded module; a function of the project that does neither (or a
  lambda) does not shard; a pass-through (`FIELD=other.FIELD`), None, and whatever cannot be
  resolved (a parameter, a call's result, a library's function) are left out.

The rule (precision over recall: a false finding in expert code is worse than a miss): the field
is followed when at least one value shards and no value is a resolved function that does not.
The call then shards its first positional argument when every sharding value shards its first
parameter (whole when each does so whole; FSDP1's when each is), and the name bound to its
result when every sharding value returns a sharded module.

What is computed per file (its record classes, the values it stores) is cached by path and
content; a field's answer is cached per process until one of the files it read changes. The
files read are recorded (model_classes._record_all) for the results cache. A file added to the
project that stores a new value is not seen by a cached result until the checked file changes.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

import libcst as cst

from .project_imports import MAX_DEPTH, parse, project_files, project_of, read
from fsdp2_retrofit.syntax.names import Resolver, attr_path

_PARTIAL = {"functools.partial", "partial"}


class FieldSharder(NamedTuple):
    arg: Optional[Tuple[bool, bool]]  # (whole, legacy) of the first positional argument, when sharded
    returns: Optional[bool]  # the result is sharded (whole), when every value returns it sharded


class _Record(NamedTuple):
    fields: Tuple[str, ...]  # annotated fields, in order
    positional: bool  # a dataclass or a NamedTuple: constructions may pass fields by position
    defaults: Dict[str, cst.BaseExpression]


# path -> (bytes, {class name: _Record}) of its top-level classes with annotated fields
_RECORDS: Dict[str, Tuple[bytes, Dict[str, _Record]]] = {}
# (path, class file, class, field) -> (bytes, [value expressions], the parsed module, its resolver)
_STORES: Dict[Tuple[str, str, str, str], Tuple[bytes, list]] = {}
# (project, field, classes) -> (the files read with their bytes, the answer)
_ANSWERS: Dict[tuple, Tuple[Tuple[Tuple[str, bytes], ...], Optional[FieldSharder]]] = {}
_FILES: Dict[Tuple[str, bool], List[str]] = {}  # the project's Python files, once a process


def is_test_file(path: str) -> bool:
    parts = Path(path).parts
    name = parts[-1] if parts else ""
    return (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
            or any(p in ("tests", "test") for p in parts[:-1]))


def records_in(path: str) -> Dict[str, _Record]:
    """The top-level classes of a project file that declare annotated fields."""
    data = read(path)
    if data is None or b":" not in data or b"class" not in data:
        return {}
    known = _RECORDS.get(path)
    if known is not None and known[0] == data:
        return known[1]
    out: Dict[str, _Record] = {}
    try:
        module = parse(path, data)
    except Exception:  # libcst's parse errors (and a file that does not decode)
        module = None
    for cls in module.body if module is not None else ():
        if type(cls) is not cst.ClassDef:
            continue
        fields: List[str] = []
        defaults: Dict[str, cst.BaseExpression] = {}
        for stmt in cls.body.body:
            if type(stmt) is cst.SimpleStatementLine:
                for small in stmt.body:
                    if type(small) is cst.AnnAssign and type(small.target) is cst.Name:
                        if "ClassVar" in (attr_path(_unsubscript(small.annotation.annotation)) or ()):
                            continue
                        fields.append(small.target.value)
                        if small.value is not None:
                            defaults[small.target.value] = small.value
        if fields:
            out[cls.name.value] = _Record(tuple(fields), _positional(cls), defaults)
    _RECORDS[path] = (data, out)
    return out


def _unsubscript(expr: cst.BaseExpression) -> cst.BaseExpression:
    return expr.value if type(expr) is cst.Subscript else expr


def _positional(cls: cst.ClassDef) -> bool:
    """A dataclass (its decorator) or a NamedTuple (its base): fields are its constructor's parameters in order."""
    for deco in cls.decorators:
        target = deco.decorator.func if type(deco.decorator) is cst.Call else deco.decorator
        path = attr_path(target)
        if path is not None and path[-1] == "dataclass":
            return True
    return any((attr_path(b.value) or ("",))[-1] == "NamedTuple" for b in cls.bases)


def field_sharder(path: Optional[str], call: cst.Call, resolver: Resolver, declared: Optional[str],
                  imports) -> Optional[FieldSharder]:
    """What `call` (`x.FIELD(arg, ...)` in the file at `path`) does to its argument: see the module's
    docstring. `declared`: the class x holds, as the file spells it (None: not known); `imports`:
    the file's project_sharders Table (its imports)."""
    func = call.func
    if path is None or path == "-" or type(func) is not cst.Attribute or resolver.qnames(call):
        return None
    base = attr_path(func.value)
    if base is None or base[0] == "self" and len(base) == 1:
        return None
    field = func.attr.value
    here = os.path.realpath(path)
    classes: Optional[Set[Tuple[str, str]]] = None
    if declared is not None:
        home = _home(here, declared, imports)
        if home is not None:
            record = records_in(home[0]).get(home[1])
            if record is None or field not in record.fields:
                return None  # a project class without that field: a method, not a field
            classes = {home}
    project = project_of(here)
    files = _project_files(project)
    needle = field.encode()
    if classes is None:
        declares = re.compile(rb"^[ \t]+" + re.escape(needle) + rb"[ \t]*:", re.M)
        classes = set()
        for name in files:
            data = read(name)
            if data is not None and needle in data and declares.search(data):
                classes |= {(name, c) for c, r in records_in(name).items() if field in r.fields}
    if not classes:
        return None
    key = (project, field, tuple(sorted(classes)))
    known = _ANSWERS.get(key)
    if known is not None and all(read(p) == d for p, d in known[0]):
        _record(known[0])
        return known[1]
    reads: Dict[str, bytes] = {}
    answer = _follow(files, field, classes, reads)
    _ANSWERS[key] = (tuple(reads.items()), answer)
    _record(tuple(reads.items()))
    return answer


def _record(reads) -> None:
    from .model_classes import _record_all

    _record_all({p for p, _ in reads})


def _project_files(project: Tuple[str, bool]) -> List[str]:
    if project not in _FILES:
        _FILES[project] = [os.path.realpath(p) for p in project_files(*project, ()) if p.endswith(".py")]
    return _FILES[project]


def _home(importer: str, name: str, imports, depth: int = MAX_DEPTH) -> Optional[Tuple[str, str]]:
    """(file, class) of the project record class `name` spells in `importer` (its own, or one its
    imports reach, through re-exports); None when it is none."""
    if name in records_in(importer):
        return importer, name
    found = imports.where(name) if imports is not None else None
    while found is not None and depth > 0:
        target, inner = os.path.realpath(str(found[0])), found[1]
        if inner in records_in(target):
            return target, inner
        found = _imports_of(target).where(inner)
        depth -= 1
    return None


_IMPORTS: Dict[str, tuple] = {}  # path -> (bytes, its Table of imports)


def _imports_of(path: str, module: Optional[cst.Module] = None):
    """The project_sharders Table of what a file's imports bind (its sharders unread), by content."""
    from .project_sharders import Table, _Tables

    data = read(path)
    known = _IMPORTS.get(path)
    if known is not None and data is not None and known[0] == data:
        return known[1]
    try:
        if module is None and data is not None:
            module = parse(path, data)
    except Exception:
        module = None
    table = Table(_Tables(), 0) if module is None else _Tables().imports_of(Path(path), Resolver(module), MAX_DEPTH)
    if data is not None:
        _IMPORTS[path] = (data, table)
    return table


def _follow(files: List[str], field: str, classes: Set[Tuple[str, str]], reads: Dict[str, bytes]) -> Optional[FieldSharder]:
    """The rule of the module's docstring over every value the project stores in the field."""
    from .project_sharders import _Tables

    shard: List = []
    vetoed = False
    for cls_file, cls in sorted(classes):
        names = cls.encode()
        reads[cls_file] = read(cls_file) or b""
        for name in files:
            data = read(name)
            if data is None or names not in data or field.encode() not in data or is_test_file(name):
                continue
            reads[name] = data
            for value in _stored(name, data, cls_file, cls, field):
                tables = _Tables()
                verdict = _classify(name, value, field, tables)
                for p, d in tables.reads:
                    reads.setdefault(p, d)
                if verdict is False:
                    vetoed = True  # a function of the project that does not shard
                if verdict is not None:
                    shard.append(verdict)
    if not shard or vetoed:
        return None
    arg = None
    if all(_first_sharded(s) is not None for s in shard):
        firsts = [_first_sharded(s) for s in shard]
        arg = (all(w for w, _ in firsts), all(legacy for _, legacy in firsts))
    returns = all(w for s in shard for w in [s.returns[None]]) if all(None in s.returns for s in shard) else None
    if arg is None and returns is None:
        return None
    return FieldSharder(arg, returns)


def _first_sharded(sharder) -> Optional[Tuple[bool, bool]]:
    params = [p.name.value for p in (*sharder.fn.params.posonly_params, *sharder.fn.params.params)]
    return sharder.shards.get(params[0]) if params else None


def _stored(path: str, data: bytes, cls_file: str, cls: str, field: str) -> list:
    """The values the file at `path` stores in `field` of class `cls` (of `cls_file`)."""
    key = (path, cls_file, cls, field)
    known = _STORES.get(key)
    if known is not None and known[0] == data:
        return known[1]
    out: list = []
    try:
        module = parse(path, data)
    except Exception:
        module = None
    if module is not None:
        record = records_in(cls_file).get(cls)
        resolver = Resolver(module)
        imports = None
        if path == cls_file and record is not None and field in record.defaults:
            out.append(record.defaults[field])
        for node in resolver.nodes(cst.Call):
            spelled = attr_path(node.func)
            if spelled is None or spelled[-1] != cls:
                continue
            if imports is None:
                imports = _imports_of(path, module)
            if _home(path, ".".join(spelled), imports) != (cls_file, cls):
                continue
            position = 0
            for arg in node.args:
                if arg.star:
                    break
                if arg.keyword is not None:
                    if arg.keyword.value == field:
                        out.append(arg.value)
                    continue
                if record is not None and record.positional and position < len(record.fields) \
                        and record.fields[position] == field:
                    out.append(arg.value)
                position += 1
        for assign in resolver.nodes(cst.Assign):
            for t in assign.targets:
                target = t.target
                if type(target) is not cst.Attribute or target.attr.value != field:
                    continue
                if type(target.value) is cst.Name and target.value.value == "self":
                    around = resolver.enclosing_class(assign)
                    if not (path == cls_file and around is not None and around.name.value == cls):
                        continue
                out.append(assign.value)
    _STORES[key] = (data, out)
    return out


def _classify(path: str, value: cst.BaseExpression, field: str, tables):
    """A value stored in the field: its Sharder when it shards (its first parameter, or its
    return), False for a function of the project that does not, None when it is left out."""
    if type(value) is cst.Call and value.args and (attr_path(value.func) or ("",))[-1] == "partial":
        value = value.args[0].value
    if type(value) is cst.Lambda:
        return False
    if type(value) is cst.Attribute and value.attr.value == field:
        return None  # a pass-through: `FIELD=other.FIELD`
    spelled = attr_path(value)
    if spelled is None or spelled == ("None",):
        return None
    name = ".".join(spelled)
    table = tables.table_of(Path(path), MAX_DEPTH)
    sharder = table.get(name)
    if sharder is not None:
        shards = _first_sharded(sharder) is not None or None in sharder.returns
        return sharder if shards else False
    return False if _defines(path, name) else None


def _defines(path: str, name: str, depth: int = MAX_DEPTH) -> bool:
    """Whether `name`, spelled in the file at `path`, is a top-level function of a project file."""
    data = read(path)
    if data is None or depth <= 0:
        return False
    if "." not in name and re.search(rb"^(?:async[ \t]+)?def[ \t]+" + re.escape(name.encode()) + rb"\b", data, re.M):
        return True
    found = _imports_of(path).where(name)
    return found is not None and _defines(os.path.realpath(str(found[0])), found[1], depth - 1)
