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

The rule: the field is followed when at least one value shards. A value that does not (torchtitan's
graph_trainer specs hold SimpleFSDP functions beside the fully_shard ones) does not hide it: the
code that calls the field runs with each value the project stores, so a `.forward(...)` or a
`torch.save` of the state after it is wrong whenever the sharding one is chosen (until session 24 a
resolved value that does not shard turned the field off; on the six codebases of
benchmarks/check_codebases.py at their pinned commits the change added no finding, and it catches
torchtitan's two planted defects). The call then shards its first positional argument
when every sharding value shards its first parameter (whole when each does so whole; FSDP1's when
each is), and the name bound to its result when every sharding value returns a sharded module.

Files other than the one checked are read with Python's `ast` (cheaper than libcst's parse), and
what is computed per file (its record classes, the values it stores, what its imports bind) is
cached by path and content; the classes declaring a field are looked up once a process per
project and field, and a field's answer is kept until one of the files it read changes. The
files read are recorded (model_classes._record_all) for the results cache. A file added to the
project that stores a new value is not seen by a cached result until the checked file changes.
Measured on torchtitan's tree at b5bcd76c (476 files, FSDP2_RETROFIT_NO_CACHE=1, this machine's 2
CPUs): `check .` took 30-33 s of CPU before this module and 41-42 s with it, the same findings
(session 24, following mixed fields and positional constructions: 29.3-31.7 s -> 34.5-37.3 s);
linting every file in one process, 25.6-26.3 s before and 30.5-31.1 s after. Most of it is finding
the classes that declare each field called (about 600 distinct names there) and the sharders of
the modules that define the stored functions.
"""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

import libcst as cst

from .project_imports import MAX_DEPTH, locate, project_files, project_of, read
from fsdp2_retrofit.syntax.names import Resolver, attr_path


class FieldSharder(NamedTuple):
    arg: Optional[Tuple[bool, bool]]  # (whole, legacy) of the first positional argument, when sharded
    returns: Optional[bool]  # the result is sharded (whole), when every value returns it sharded


# a value stored in a field: ("name", "pkg.fn") a name to resolve, ("lambda",); None: left out
Value = Optional[Tuple[str, ...]]


class _Record(NamedTuple):
    fields: Tuple[str, ...]  # annotated fields, in order
    positional: bool  # a dataclass or a NamedTuple: constructions may pass fields by position


_TREES: Dict[str, Tuple[bytes, Optional[ast.Module]]] = {}  # path -> (bytes, its ast)
_RECORDS: Dict[str, Tuple[bytes, Dict[str, _Record]]] = {}  # path -> (bytes, {class: _Record})
_IMPORTS: Dict[str, Tuple[bytes, tuple]] = {}  # path -> (bytes, (names, modules) its imports bind)
# (path, class file, class, field) -> (bytes, the values the file stores in the field)
_STORES: Dict[Tuple[str, str, str, str], Tuple[bytes, List[Value]]] = {}
# (project, field) -> the classes declaring it, with the bytes of their files
_DECLARING: Dict[tuple, Tuple[Tuple[Tuple[str, bytes], ...], frozenset]] = {}
# (project, field, classes) -> (the files read with their bytes, the answer)
_ANSWERS: Dict[tuple, Tuple[Tuple[Tuple[str, bytes], ...], Optional[FieldSharder]]] = {}
_FILES: Dict[Tuple[str, bool], List[str]] = {}  # the project's Python files, once a process


def is_test_file(path: str) -> bool:
    parts = Path(path).parts
    name = parts[-1] if parts else ""
    return (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
            or any(p in ("tests", "test") for p in parts[:-1]))


def _tree(path: str) -> Tuple[Optional[bytes], Optional[ast.Module]]:
    data = read(path)
    if data is None:
        return None, None
    known = _TREES.get(path)
    if known is None or known[0] != data:
        try:
            tree: Optional[ast.Module] = ast.parse(data)
        except (SyntaxError, ValueError):
            tree = None
        if len(_TREES) > 2048:
            _TREES.clear()
        known = _TREES[path] = (data, tree)
    return data, known[1]


def _dotted(node) -> Optional[str]:
    parts = []
    while type(node) is ast.Attribute:
        parts.append(node.attr)
        node = node.value
    if type(node) is not ast.Name:
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _value(node, field: str) -> Value:
    """What a stored expression is for the rule: see the module's docstring."""
    if type(node) is ast.Call and node.args and (_dotted(node.func) or "").rpartition(".")[2] == "partial":
        node = node.args[0]
    if type(node) is ast.Lambda:
        return ("lambda",)
    if type(node) is ast.Attribute and node.attr == field:
        return None  # a pass-through: `FIELD=other.FIELD`
    name = _dotted(node)
    return ("name", name) if name is not None else None


def records_in(path: str) -> Dict[str, _Record]:
    """The top-level classes of a project file that declare annotated fields."""
    data, tree = _tree(path)
    if tree is None:
        return {}
    known = _RECORDS.get(path)
    if known is not None and known[0] == data:
        return known[1]
    out: Dict[str, _Record] = {}
    for cls in tree.body:
        if type(cls) is not ast.ClassDef:
            continue
        fields: List[str] = []
        for stmt in cls.body:
            if type(stmt) is ast.AnnAssign and type(stmt.target) is ast.Name:
                annotation = stmt.annotation.value if type(stmt.annotation) is ast.Subscript else stmt.annotation
                if (_dotted(annotation) or "").rpartition(".")[2] == "ClassVar":
                    continue
                fields.append(stmt.target.id)
        if fields:
            out[cls.name] = _Record(tuple(fields), _positional(cls))
    _RECORDS[path] = (data, out)
    return out


def calls_a_field(path: Optional[str], data: bytes) -> bool:
    """The prefilter's question for a file whose imports name no sharding API: does it call
    `x.FIELD(...)` for a field annotated `Callable` of a record class of its own or of a project module it
    imports (a trainer that imports only the spec's module and calls `spec.parallelize_fn(model)`,
    the values being stored by model packages it never imports)? Whether the field shards is the
    analysis's to answer (field_sharder); this only keeps the file from being skipped."""
    if not path or path == "-" or b"(" not in data:
        return False
    called = set(_ATTRIBUTE_CALL.findall(data))  # `.name(` anywhere in the text: a superset of the calls
    if not called:
        return False
    from .project_imports import imported_files

    here = os.path.realpath(path)
    for name in (here, *imported_files(here, data)):
        text = read(os.path.realpath(name)) or b""
        if b"Callable" in text and called & _callable_fields(text):
            return True
    return False


def _callable_fields(text: bytes) -> Set[bytes]:
    """The names a module's text annotates with `Callable` on an indented line that is no parameter of a
    split signature (no trailing comma), directly or through a module-level alias (`Fn = Callable[...]`,
    `Fn: TypeAlias = Callable[...]`): by text, as a prefilter reads (records_in parses; this does not)."""
    kinds = [b"Callable"] + _CALLABLE_ALIAS.findall(text)
    pattern = rb"^[ \t]+([A-Za-z_]\w*)[ \t]*:[^=\n]*\b(?:" + b"|".join(map(re.escape, kinds)) + rb")\b(?![^\n]*,[ \t]*\r?$)"
    return set(re.findall(pattern, text, re.M))


_ATTRIBUTE_CALL = re.compile(rb"\.\s*([A-Za-z_]\w*)\s*\(")
_CALLABLE_ALIAS = re.compile(rb"^([A-Za-z_]\w*)[ \t]*(?::[ \t]*(?:typing\.)?TypeAlias[ \t]*)?=[ \t]*"
                             rb"(?:typing\.|collections\.abc\.)?Callable\b", re.M)


def _positional(cls: ast.ClassDef) -> bool:
    """A dataclass (its decorator) or a NamedTuple (its base): fields are its constructor's parameters in order."""
    for deco in cls.decorator_list:
        if (_dotted(deco.func if type(deco) is ast.Call else deco) or "").rpartition(".")[2] == "dataclass":
            return True
    return any((_dotted(b) or "").rpartition(".")[2] == "NamedTuple" for b in cls.bases)


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
    classes: Optional[frozenset] = None
    if declared is not None:
        home = _home(here, declared, imports)
        if home is not None:
            record = records_in(home[0]).get(home[1])
            if record is None or field not in record.fields:
                return None  # a project class without that field: a method, not a field
            classes = frozenset([home])
    project = project_of(here)
    files = _project_files(project)
    if classes is None:
        classes = _declaring(project, files, field)
    if not classes:
        return None
    key = (project, field, classes)
    known = _ANSWERS.get(key)
    if known is not None and all(read(p) == d for p, d in known[0]):
        _record(known[0])
        return known[1]
    reads: Dict[str, bytes] = {}
    answer = _follow(files, field, classes, reads)
    _ANSWERS[key] = (tuple(reads.items()), answer)
    _record(tuple(reads.items()))
    return answer


def _declaring(project, files: List[str], field: str) -> frozenset:
    """The project's classes that declare `field` (file, class): once a process per project and
    field (again when one of their files changed)."""
    known = _DECLARING.get((project, field))
    if known is not None and all(read(p) == d for p, d in known[0]):
        return known[1]
    needle = field.encode()
    # an annotated line not ending with a comma (a parameter of a signature black splits does)
    declares = re.compile(rb"^[ \t]+" + re.escape(needle) + rb"[ \t]*:[^\n]*[^,\s][ \t]*\r?$", re.M)
    found: Set[Tuple[str, str]] = set()
    for name in files:
        data = read(name)
        if data is not None and needle in data and declares.search(data):
            found |= {(name, c) for c, r in records_in(name).items() if field in r.fields}
    out = frozenset(found)
    _DECLARING[(project, field)] = (tuple((p, read(p) or b"") for p in sorted({f for f, _ in out})), out)
    return out


def _record(reads) -> None:
    from .model_classes import _record_all

    _record_all({p for p, _ in reads})


def _project_files(project: Tuple[str, bool]) -> List[str]:
    if project not in _FILES:
        _FILES[project] = [os.path.realpath(p) for p in project_files(*project, ()) if p.endswith(".py")]
    return _FILES[project]


def _home(importer: str, name: str, imports=None, depth: int = MAX_DEPTH) -> Optional[Tuple[str, str]]:
    """(file, class) of the project record class `name` spells in `importer` (its own, or one its
    imports reach, through re-exports); None when it is none. `imports`: the importer's
    project_sharders Table (the file checked), else its imports are read here."""
    if "." not in name and _declares_class(importer, name):
        return importer, name
    found = imports.where(name) if imports is not None else _where(importer, name)
    while found is not None and depth > 0:
        target, inner = os.path.realpath(str(found[0])), found[1]
        if _declares_class(target, inner):
            return target, inner
        found = _where(target, inner)
        depth -= 1
    return None


def _declares_class(path: str, name: str) -> bool:
    """Whether the file at `path` has a top-level record class `name` (parsed only when its text
    has `class <name>`)."""
    data = read(path)
    return data is not None and b"class " + name.encode() in data and name in records_in(path)


def _where(path: str, name: str) -> Optional[Tuple[Path, str]]:
    """(the project file, the name there) `name` spelled in the file at `path` reaches through its
    imports (as project_sharders.Table.where answers it, read with ast)."""
    data, tree = _tree(path)
    if tree is None:
        return None
    known = _IMPORTS.get(path)
    if known is None or known[0] != data:
        known = _IMPORTS[path] = (data, _import_bindings(path, tree))
    names, modules = known[1]
    if name in names:
        return names[name]
    head = name.rpartition(".")[0]
    while head:
        if head in modules:
            return modules[head], name[len(head) + 1:]
        head = head.rpartition(".")[0]
    return None


def _import_bindings(path: str, tree: ast.Module) -> tuple:
    names: Dict[str, Tuple[Path, str]] = {}
    modules: Dict[str, Path] = {}
    for node in ast.walk(tree):
        if type(node) is ast.Import:
            for alias in node.names:
                target = locate(path, 0, alias.name)
                if target is not None:
                    modules[alias.asname or alias.name] = target
        elif type(node) is ast.ImportFrom:
            module = node.module or ""
            target = locate(path, node.level, module)
            for alias in node.names:
                if alias.name == "*":
                    continue
                sub = locate(path, node.level, f"{module}.{alias.name}" if module else alias.name)
                local = alias.asname or alias.name
                if sub is not None and (target is None or target.name == "__init__.py"):
                    modules[local] = sub
                elif target is not None:
                    names[local] = (target, alias.name)
    return names, modules


def _follow(files: List[str], field: str, classes: frozenset, reads: Dict[str, bytes]) -> Optional[FieldSharder]:
    """The rule of the module's docstring over every value the project stores in the field."""
    from .project_sharders import _Tables

    shard: List = []
    for cls_file, cls in sorted(classes):
        names = cls.encode()
        reads[cls_file] = read(cls_file) or b""
        record = records_in(cls_file).get(cls)
        # a dataclass or a NamedTuple may be given the field by position: its name need not be written
        spelled = field.encode() if record is None or not record.positional else b""
        for name in files:
            data = read(name)
            if data is None or names not in data or spelled not in data or is_test_file(name):
                continue
            reads[name] = data
            for value in _stored(name, data, cls_file, cls, field):
                tables = _Tables()
                verdict = _classify(name, value, tables)
                for p, d in tables.reads:
                    reads.setdefault(p, d)
                if verdict:  # False: a function of the project that does not shard (no veto)
                    shard.append(verdict)
    if not shard:
        return None
    arg = None
    if all(_first_sharded(s) is not None for s in shard):
        firsts = [_first_sharded(s) for s in shard]
        arg = (all(w for w, _ in firsts), all(legacy for _, legacy in firsts))
    returns = all(s.returns[None] for s in shard) if all(None in s.returns for s in shard) else None
    if arg is None and returns is None:
        return None
    return FieldSharder(arg, returns)


def _first_sharded(sharder) -> Optional[Tuple[bool, bool]]:
    params = [p.name.value for p in (*sharder.fn.params.posonly_params, *sharder.fn.params.params)]
    return sharder.shards.get(params[0]) if params else None


def _stored(path: str, data: bytes, cls_file: str, cls: str, field: str) -> List[Value]:
    """The values the file at `path` stores in `field` of class `cls` (of `cls_file`)."""
    key = (path, cls_file, cls, field)
    known = _STORES.get(key)
    if known is not None and known[0] == data:
        return known[1]
    _, tree = _tree(path)
    out: List[Value] = []
    record = records_in(cls_file).get(cls)
    if tree is not None:
        _Stores(path, cls_file, cls, field, record, out).visit(tree)
    _STORES[key] = (data, out)
    return out


class _Stores(ast.NodeVisitor):
    """Constructions `C(..., FIELD=value)` (or by position), `obj.FIELD = value`, and the class's
    default for the field."""

    def __init__(self, path, cls_file, cls, field, record, out) -> None:
        self.path, self.cls_file, self.cls, self.field, self.record, self.out = path, cls_file, cls, field, record, out
        self.classes: List[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if self.path == self.cls_file and node.name == self.cls and not self.classes:
            for stmt in node.body:
                if (type(stmt) is ast.AnnAssign and type(stmt.target) is ast.Name and stmt.target.id == self.field
                        and stmt.value is not None):
                    self.out.append(_value(stmt.value, self.field))
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_Call(self, node: ast.Call) -> None:
        spelled = _dotted(node.func)
        if spelled is not None and spelled.rpartition(".")[2] == self.cls and (
                _home(self.path, spelled) == (self.cls_file, self.cls)):
            position = 0
            for arg in node.args:
                if type(arg) is ast.Starred:
                    break
                record = self.record
                if (record is not None and record.positional and position < len(record.fields)
                        and record.fields[position] == self.field):
                    self.out.append(_value(arg, self.field))
                position += 1
            for kw in node.keywords:
                if kw.arg == self.field:
                    self.out.append(_value(kw.value, self.field))
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if type(target) is ast.Attribute and target.attr == self.field:
                if type(target.value) is ast.Name and target.value.id == "self" and not (
                        self.path == self.cls_file and self.classes[-1:] == [self.cls]):
                    continue  # another class's own attribute
                self.out.append(_value(node.value, self.field))
        self.generic_visit(node)


def _classify(path: str, value: Value, tables):
    """A value stored in the field: its Sharder when it shards (its first parameter, or its
    return), False for a function of the project that does not (or a lambda), None when it is
    left out."""
    if value is None:
        return None
    if value[0] == "lambda":
        return False
    name = value[1]
    if name == "None":
        return None
    found = _definition(path, name)
    if found is None:
        return None  # not a function of the project (a class, a library's, a parameter)
    sharder = tables.table_of(Path(found[0]), MAX_DEPTH).get(found[1])
    if sharder is not None and (_first_sharded(sharder) is not None or None in sharder.returns):
        return sharder
    return False


def _definition(path: str, name: str, depth: int = MAX_DEPTH) -> Optional[Tuple[str, str]]:
    """(file, function) of the top-level function of a project file `name`, spelled in the file at
    `path`, names (through its imports and re-exports); None when it names none."""
    data = read(path)
    if data is None or depth <= 0:
        return None
    if "." not in name and re.search(rb"^(?:async[ \t]+)?def[ \t]+" + re.escape(name.encode()) + rb"\b", data, re.M):
        return path, name
    found = _where(path, name)
    return _definition(os.path.realpath(str(found[0])), found[1], depth - 1) if found is not None else None
