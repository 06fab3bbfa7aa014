"""The program linked into one text for one analysis, and taken apart again file by file.

A project's training step is rarely in the entry: `engine.train(model, loaders, ...)`, a
`Solver(config).train()` of `solver.py`, `train(config)` of a package. The stages follow values
through one module's functions, classes and `self.` attributes; `link` gives them the whole
program as one module, so a loader returned by `data_setup.create_dataloaders()`, the loop of
`engine.train`, the save in `utils.save_model` and the model built in `Solver.__init__` are
sites of one analysis, and each edit lands in the file that holds its site:

    entry:   imports ... import engine, utils ................ rest of the entry
    linked:  imports ... +their imports  [engine's body] [utils' body] ... rest of the entry

Each module's body sits between two marker statements (`__fsdp2_link__("begin", k)` and
`("end", k)`); its import statements, and an `if __name__ == "__main__":` block that never runs
on import, wait behind `("keep", j)` markers, while the imports are hoisted to the entry's (the
names they bind are the same in every module, or the program is not linked). An access through
a module (`engine.train(...)`) reads the name itself (`train(...)`), and is put back when the
text is taken apart. Every line of the linked text maps to a line of one file, so each record
names its own file and line.

Taking it apart: the statements between a module's markers are its new body, its kept
statements go back in their places, and it gets the imports its new code reads (from the linked
text's own imports); the entry keeps its own imports and those its new code reads. A program is
linked only where that is sound: one encoding and newline style, no top-level name bound by two
files to different things, modules used only as `module.name`; `plan` says why otherwise.
"""
from __future__ import annotations

import builtins
import os
import re
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Set, Tuple, Union

import libcst as cst

from fsdp2_retrofit.analysis.program import ModuleFile, Program
from fsdp2_retrofit.report import RewriteResult
from fsdp2_retrofit.syntax.names import (
    _module_bindings, attr_path, dotted, import_bindings, is_main_guard, names_read, render, render_statements,
    walk,
)

from fsdp2_retrofit.syntax.memo import per_node

from .imports import add_imports
from .workspace import Workspace

MARKER = "__fsdp2_link__"


@dataclass
class Linked:
    """A linked program and what taking it apart needs."""

    text: str
    program: Program
    lines: Dict[int, Tuple[str, int]]  # line of the linked text -> (file, line there)
    kept: List[cst.BaseStatement]  # the statements standing behind ("keep", j) markers
    entry_imports: Dict[int, cst.BaseStatement]  # ("import", i): the entry's own statement i
    restore: Dict[str, Dict[str, str]]  # file -> {name: "module.name" it was read as}
    shown: Dict[str, str] = field(default_factory=dict)  # file -> its path as the report names it
    nested: List[cst.SimpleStatementLine] = field(default_factory=list)  # behind ("nested", j) markers
    unmangle: Dict[str, str] = field(default_factory=dict)  # a name renamed apart -> the name its file wrote
    module: Optional[cst.Module] = None  # the linked tree, whose code is `text` (its files' nodes, not copied)

    def where(self, line: int) -> Tuple[str, int]:
        return self.lines.get(line, (self.program.entry, 0))


def _marker(kind: str, index: int) -> cst.SimpleStatementLine:
    return cst.SimpleStatementLine([cst.Expr(cst.Call(cst.Name(MARKER), [
        cst.Arg(cst.SimpleString(f'"{kind}"')), cst.Arg(cst.Integer(str(index)))]))])


def _read_marker(stmt) -> Optional[Tuple[str, int]]:
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr)):
        return None
    call = stmt.body[0].value
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == MARKER):
        return None
    kind, index = call.args[0].value, call.args[1].value
    return kind.value.strip('"'), int(index.value)


def outside_modules(module: cst.Module, stmt):
    """`stmt` (a top-level statement where a stage would insert the entry's code, the process group's
    start) or, where it is a statement of a linked module's body, the first statement of the entry
    after the modules: what the entry starts belongs to the entry's file."""
    body = list(module.body)
    if stmt not in body:
        return stmt
    depth, last_end = 0, None
    inside = False
    for i, node in enumerate(body):
        marker = _read_marker(node)
        if marker is not None and marker[0] == "begin":
            depth += 1
        elif marker is not None and marker[0] == "end":
            depth -= 1
            last_end = i
        elif node is stmt:
            inside = depth > 0
    if not inside or last_end is None:
        return stmt
    for node in body[last_end + 1:]:  # past the entry's own imports that follow the modules
        marker = _read_marker(node)
        if not _is_import(node) and (marker is None or marker[0] != "import"):
            return node
    return stmt


def _is_import(stmt) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)


def _library_imports(mod: ModuleFile) -> Dict[str, Tuple[str, str]]:
    """name -> (what it binds, the import as one canonical statement) of the module's top-level imports
    that bind no project module (a relative import binds a project module, or nothing the program has)."""
    out: Dict[str, Tuple[str, str]] = {}
    for index, stmt in enumerate(mod.module.body):
        if not _is_import(stmt):
            continue
        project = {imp.local.split(".")[0] for imp in mod.imports.get(index, [])}
        for small in stmt.body:
            targets = _import_targets(cst.Module(body=[cst.SimpleStatementLine([small])])) or {}
            out.update((local, found) for local, found in targets.items() if local not in project)
    return out


class _ModuleAccesses(cst.CSTTransformer):
    """`alias.name` of a linked module read as `name`; what cannot be (the module used as a value,
    an attribute stored through it) is collected as a problem."""

    def __init__(self, aliases: Dict[str, str], names_of: Dict[str, Set[str]], renamed: Dict[str, Dict[str, str]]):
        self.aliases = aliases  # dotted alias -> module path
        self.names_of = names_of
        self.renamed = renamed  # module path -> {its name: the name it has in the linked text}
        self.read: Dict[str, str] = {}  # name in the linked text -> the `alias.name` it was read as
        self.problems: List[str] = []
        self._targets: List[cst.CSTNode] = []

    def visit_Assign(self, node: cst.Assign) -> None:
        self._targets.extend(t.target for t in node.targets)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._targets.append(node.target)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        path = attr_path(original.value)
        alias = ".".join(path) if path else None
        if alias is None or alias not in self.aliases:
            return updated
        name = original.attr.value
        if any(t is original for t in self._targets):
            self.problems.append(f"`{alias}.{name}` is assigned")
            return updated
        if name not in self.names_of[self.aliases[alias]]:
            self.problems.append(f"`{alias}.{name}` is not a top-level name of the module")
            return updated
        linked = self.renamed.get(self.aliases[alias], {}).get(name, name)
        if self.read.get(linked, f"{alias}.{name}") != f"{alias}.{name}":
            self.problems.append(f"`{name}` is read through two modules")
            return updated
        self.read[linked] = f"{alias}.{name}"
        return cst.Name(linked)


def _names_outside_imports(mod: ModuleFile) -> Set[str]:
    """The names a module's code reads or binds, its top-level project imports left out."""
    return names_read(cst.Module(body=[s for i, s in enumerate(mod.module.body) if i not in mod.imports]))


class _Restore(cst.CSTTransformer):
    """A name of the linked text back to what the file wrote: `alias.name` where a module was read
    through its alias, the module's own name where it was renamed apart from another module's (`F` of
    `from torchvision.transforms import functional as F` beside another file's `import
    torch.nn.functional as F`); with the map the other way, the file's names to the linked text's."""

    def __init__(self, restore: Dict[str, str]):
        self.restore = restore

    def visit_Import(self, node: cst.Import) -> bool:
        return False  # an import statement stays as the file wrote it (its names are what the others mean)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return True

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg):
        return updated.with_changes(keyword=original.keyword)

    def leave_Name(self, original: cst.Name, updated: cst.Name):
        written = self.restore.get(original.value)
        if written is None:
            return updated
        return cst.parse_expression(written) if "." in written else cst.Name(written)


def _restored(module: cst.Module, restore: Dict[str, str]) -> cst.Module:
    """`module` through _Restore: only its top-level statements that read a name of `restore` (a libcst
    transformer rebuilds every node it passes)."""
    transform = _Restore(restore)
    return module.with_changes(body=[
        stmt.visit(transform) if any(type(n) is cst.Name and n.value in restore for n in walk(stmt)) else stmt
        for stmt in module.body])


def plan(entry_path: str, source: bytes, module: cst.Module, program: Optional[Program] = None
         ) -> Union[Linked, str, None]:
    """The linked program of the entry at `entry_path` (`program`, read when not given), or why it
    cannot be linked (a sentence), or None when the entry imports no project module."""
    program = program or Program.read(entry_path, module, source)
    mods = program.modules
    if not mods:
        return None
    if program.problems:
        return f"the program cannot be read whole: {program.problems[0]}"
    files = [program.files[program.entry]] + mods
    for mod in mods:
        m = mod.module
        # another newline style links: each statement is written back into its own module, whose
        # default newline (`\r\n`) it renders with again
        if m.encoding != module.encoding:
            return f"{_rel(mod.path)} is written in another encoding than the script"
    own, libraries, meanings = _top_level_names(files)
    renamed = _renamed_apart(meanings, files, program)
    if isinstance(renamed, str):
        return renamed
    # each file's body as the linked text holds it, and the names taking it apart puts back
    restore: Dict[str, Dict[str, str]] = {}
    bodies: Dict[str, List[cst.BaseStatement]] = {}
    nested: List[cst.SimpleStatementLine] = []  # the statements behind ("nested", j) markers
    holders: Dict[str, Set[int]] = {}  # file -> the top-level statements holding a nested project import
    for mod in files:
        body = _module_body(mod, own, renamed, nested, holders, restore)
        if isinstance(body, str):
            return body
        bodies[mod.path] = body
    # the linked body: the entry, with the hoisted imports and every module's body at its first project import
    entry = files[0]
    kept: List[cst.BaseStatement] = []
    entry_imports: Dict[int, cst.BaseStatement] = {}
    origin: List[Tuple[str, Optional[cst.CSTNode]]] = []  # per linked statement: (file, the statement it stands for)
    linked: List[cst.BaseStatement] = []
    hoisted = _hoisted_imports(entry, mods, libraries, renamed)
    placed = False
    for index, stmt in enumerate(bodies[entry.path]):
        imports = index in entry.imports
        if not placed and (imports or index in holders.get(entry.path, ())):
            # the first project import (or the statement holding it): the modules go here, after the imports
            # they need, the entry's own import behind its marker first
            linked.extend(cst.parse_statement(text) for text in hoisted)
            origin.extend((entry.path, None) for _ in hoisted)
            if imports:
                entry_imports[index] = entry.module.body[index]
                linked.append(_marker("import", index))
                origin.append((entry.path, entry.module.body[index]))
            _place_blocks(mods, bodies, kept, linked, origin)
            placed = True
            if imports:
                continue
        elif imports:
            entry_imports[index] = entry.module.body[index]
            stmt = _marker("import", index)
        linked.append(stmt)
        origin.append((entry.path, entry.module.body[index]))
    if not placed:
        return None
    linked_module = module.with_changes(body=linked)
    text, lines = _line_map(linked_module, origin, {m.path: m.module for m in files})
    shown = {m.path: (os.path.abspath(m.path) if os.path.isabs(entry_path) else os.path.relpath(m.path))
             for m in mods}
    shown[entry.path] = entry_path
    unmangle = {new: old for names in renamed.values() for old, new in names.items()}
    return Linked(text, program, lines, kept, entry_imports, restore, shown, nested, unmangle, linked_module)


def _top_level_names(files: List[ModuleFile]):
    """(own, libraries, meanings): the names each file binds at its top level, its library
    imports ({name: (what it is bound to, the import's text)}), and for each name the files
    binding it, by what they bind it to."""
    own: Dict[str, Set[str]] = {}
    libraries: Dict[str, Dict[str, Tuple[str, str]]] = {}
    meanings: Dict[str, Dict[object, List[str]]] = {}  # name -> {what it is bound to: the files binding it so}
    for mod in files:
        bound = set(_module_bindings(mod.module.body))
        libraries[mod.path] = _library_imports(mod)
        own[mod.path] = bound | set(libraries[mod.path])
        for name in bound:
            meanings.setdefault(name, {}).setdefault(("code", mod.path), []).append(mod.path)
        for name, (target, _) in libraries[mod.path].items():
            if name not in bound:
                meanings.setdefault(name, {}).setdefault(target, []).append(mod.path)
    return own, libraries, meanings


def _project_imports(mod: ModuleFile, renamed) -> Union[Tuple[Dict[str, str], Dict[str, str]], str]:
    """(aliases, names): the project modules `mod` reads through a name ({alias: path}), and its
    names for project names it imports under another name or that are renamed apart ({name in
    the file: name in the linked text}); or why the program cannot be linked."""
    aliases = {}
    names = dict(renamed.get(mod.path, {}))  # this file's names -> their names in the linked text
    for line, imp, stmt in mod.nested:
        if _librarynames_read(stmt, imp):
            return (f"{_rel(mod.path)} line {line} imports a project module and a library in one statement "
                    "inside a function or a block")
    for imps in list(mod.imports.values()) + [[imp for _, imp, _ in mod.nested]]:
        for imp in imps:
            if imp.star:
                continue
            if imp.obj is None:
                aliases[imp.local] = imp.path
            elif imp.local != imp.obj:  # `from mingpt.utils import CfgNode as CN`: read as the name itself
                linked_name = renamed.get(imp.path, {}).get(imp.obj, imp.obj)
                if names.setdefault(imp.local, linked_name) != linked_name or (
                        linked_name in _names_outside_imports(mod) and linked_name != imp.local):
                    return (f"{_rel(mod.path)} imports `{imp.obj}` as `{imp.local}` from {_rel(imp.path)}, "
                            f"and reads `{linked_name}` as another name too")
    return aliases, names


def _module_body(mod: ModuleFile, own, renamed, nested: List[cst.SimpleStatementLine],
                 holders: Dict[str, Set[int]], restore: Dict[str, Dict[str, str]]
                 ) -> Union[List[cst.BaseStatement], str]:
    """`mod`'s body as the linked text holds it, or why the program cannot be linked: its nested
    project imports behind markers (kept in `nested`, the top-level statements holding them in
    `holders`), its names renamed apart and its reads through a module read as the names
    themselves (`restore` records both, to put them back)."""
    found = _project_imports(mod, renamed)
    if isinstance(found, str):
        return found
    aliases, names = found
    body = list(mod.module.body)
    if mod.nested:  # each nested project import behind a marker, where it stands
        marking = _MarkNested({id(stmt) for _, _, stmt in mod.nested}, nested)
        for i, stmt in enumerate(body):
            before = len(nested)
            body[i] = stmt.visit(marking)
            if len(nested) > before:
                holders.setdefault(mod.path, set()).add(i)
    if names:
        body = _restored(cst.Module(body=body), names).body  # the same transform, the other way
        restore.setdefault(mod.path, {}).update({new: old for old, new in names.items()})
    if aliases:
        counts = names_read(cst.Module(body=body))
        transformer = _ModuleAccesses(aliases, own, renamed)
        roots = {alias.split(".")[0] for alias in aliases}  # a statement naming none is not rebuilt
        body = [s.visit(transformer) if any(type(n) is cst.Name and n.value in roots for n in walk(s)) else s
                for s in body]
        if transformer.problems:
            return f"in {_rel(mod.path)}: {transformer.problems[0]}"
        for name in transformer.read:
            if name in counts:
                return f"`{name}` is read in {_rel(mod.path)} both as a name and through a module"
        left = names_read(cst.Module(body=[s for i, s in enumerate(body) if i not in mod.imports]))
        for alias in aliases:
            if alias.split(".")[0] in left:
                return f"in {_rel(mod.path)}: the module `{alias}` is used as a value, not only as `{alias}.name`"
        restore.setdefault(mod.path, {}).update(transformer.read)
    return body


def _hoisted_imports(entry: ModuleFile, mods: List[ModuleFile], libraries, renamed) -> List[str]:
    """The modules' library imports the entry lacks (under a module's renamed-apart name), once each."""
    have = {text for _, text in libraries[entry.path].values()}
    hoisted = []
    for mod in mods:
        for name, (_, text) in libraries[mod.path].items():
            if name in renamed.get(mod.path, {}):
                text = _import_as(text, renamed[mod.path][name])
            if text not in have:
                have.add(text)
                hoisted.append(text)
    return hoisted


def _renamed_apart(meanings, files: List[ModuleFile], program: Program):
    """{module path: {name: its name in the linked text}} for the top-level names two files bind to
    different things (`F`, `logger`, `device` in the entry and in engine.py): the entry keeps its own (or,
    where it binds none, the first module to bind it), each other module gets a name of its own. A
    sentence where a name cannot be renamed apart: another module imports it by name or with `*`."""
    out: Dict[str, Dict[str, str]] = {}
    taken = set()
    for mod in files:
        taken |= names_read(mod.module)
    entry = files[0].path
    for name, by in sorted(meanings.items()):
        if len(by) < 2:
            continue
        groups = sorted(by.values(), key=lambda paths: (entry not in paths, [f.path for f in files].index(paths[0])))
        for paths in groups[1:]:
            for path in paths:
                if path == entry:
                    continue
                for other in files:
                    for imps in list(other.imports.values()) + [[i for _, i, _ in other.nested]]:
                        for imp in imps:
                            if imp.path == path and (imp.star or imp.obj == name):
                                return (f"`{name}` is bound at the top level of both {_rel(groups[0][0])} and "
                                        f"{_rel(path)}, and {_rel(other.path)} imports it from {_rel(path)}: "
                                        "one analysis of the program would take one for the other")
                stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
                new, i = f"{name}__{stem}", 1
                while new in taken:
                    new, i = f"{name}__{stem}{i}", i + 1
                taken.add(new)
                out.setdefault(path, {})[name] = new
    return out


def _import_as(text: str, local: str) -> str:
    """A canonical import statement (`import a.b`, `import a.b as c`, `from a import b as c`) binding `local`."""
    words = text.split()
    if words[0] == "import":
        return f"import {words[1]} as {local}"
    return f"from {words[1]} import {words[3]} as {local}"


def _place_blocks(mods: List[ModuleFile], bodies, kept, linked, origin) -> None:
    """Each module's body between its markers, its imports and `__main__` block behind keep markers."""
    for k, mod in enumerate(mods):
        linked.append(_marker("begin", k))
        origin.append((mod.path, None))
        for i, stmt in enumerate(bodies[mod.path]):
            if i in mod.imports or _is_import(stmt) or is_main_guard(stmt):
                kept.append(mod.module.body[i])
                linked.append(_marker("keep", len(kept) - 1))
            else:
                linked.append(stmt)
            origin.append((mod.path, mod.module.body[i]))
        linked.append(_marker("end", k))
        origin.append((mod.path, None))


class _MarkNested(cst.CSTTransformer):
    """The nested project import statements `ids` replaced by ("nested", j) markers; the originals go to `kept`."""

    def __init__(self, ids: Set[int], kept: List[cst.SimpleStatementLine]):
        self.ids = ids
        self.kept = kept

    def leave_SimpleStatementLine(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine):
        if id(original) not in self.ids:
            return updated
        self.kept.append(original)
        return _marker("nested", len(self.kept) - 1).with_changes(leading_lines=original.leading_lines)


class _UnmarkNested(cst.CSTTransformer):
    """("nested", j) markers back to the import statements they stand for."""

    def __init__(self, kept: List[cst.SimpleStatementLine]):
        self.kept = kept

    def leave_SimpleStatementLine(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine):
        marker = _read_marker(updated)
        if marker is None or marker[0] != "nested":
            return updated
        return self.kept[marker[1]]


def _librarynames_read(stmt: cst.SimpleStatementLine, imp) -> bool:
    """The import statement binds names besides the project import `imp` (`import os, engine`)."""
    count = 0
    for small in stmt.body:
        if isinstance(small, cst.Import):
            count += len(small.names)
        elif isinstance(small, cst.ImportFrom):
            count += 1
    return count > 1


def _line_map(linked: cst.Module, origin, modules: Dict[str, cst.Module]) -> Tuple[str, Dict[int, Tuple[str, int]]]:
    """The linked text, and for each of its lines (file, line there): from the lines each top-level
    statement's code takes in the linked module and in its own (the same node renders to the same lines
    in both)."""
    starts = {path: _statement_lines(m) for path, m in modules.items()}
    out: Dict[int, Tuple[str, int]] = {}
    at = 1 + _header_lines(linked)
    text, parts = render_statements(linked)
    for stmt, part, (path, node) in zip(linked.body, parts, origin):
        count = part.count("\n") or 1
        lead = len(stmt.leading_lines) if hasattr(stmt, "leading_lines") else 0
        first = at + lead  # the statement's own first line, after its blank and comment lines
        if node is None:
            for line in range(at, at + count):
                out[line] = (path, 0)
        else:
            start, span = starts[path][id(node)]
            for i in range(count - lead):
                out[first + i] = (path, start + min(i, span))
            for line in range(at, first):
                out[line] = (path, start)
        at += count
    return text, out


def _header_lines(module: cst.Module) -> int:
    return len(module.header)  # the blank and comment lines before the first statement, one line each


def _statement_lines(module: cst.Module) -> Dict[int, Tuple[int, int]]:
    """id(top-level statement) -> (its first line, after its leading blank and comment lines; how many lines
    more it takes)."""
    out: Dict[int, Tuple[int, int]] = {}
    at = 1 + _header_lines(module)
    for stmt, text in zip(module.body, render_statements(module)[1]):
        count = text.count("\n") or 1
        lead = len(stmt.leading_lines) if hasattr(stmt, "leading_lines") else 0
        out[id(stmt)] = (at + lead, max(0, count - lead - 1))
        at += count
    return out


def split(linked: Linked, result: RewriteResult, tree: cst.Module, source: bytes,
          other_scripts: bool = False) -> Union[RewriteResult, str]:
    """The result of the linked program taken apart: the entry's own result, with every module it
    changed (or has records for) as a sibling; or why it cannot be taken apart (a sentence).
    `other_scripts`: refuse to give a helper another script beside the program calls a DistributedSampler
    (where the script alone is the fallback, as for a program linked for its loaders only). `tree`: the
    converted tree, whose text is `result.code`."""
    program = linked.program
    out = tree
    entry = program.entry
    parts: Dict[str, List[cst.BaseStatement]] = {entry: []}
    stack = [entry]
    mods = program.modules
    for stmt in out.body:
        marker = _read_marker(stmt)
        if marker is None:
            parts.setdefault(stack[-1], []).append(stmt)
            continue
        kind, index = marker
        if kind == "begin":
            stack.append(mods[index].path)
            parts.setdefault(mods[index].path, [])
        elif kind == "end":
            if len(stack) < 2 or stack[-1] != mods[index].path:
                return "the converted program's module markers were moved"
            stack.pop()
        elif kind == "keep":
            parts[stack[-1]].append(linked.kept[index])
        elif kind == "import":
            parts[stack[-1]].append(linked.entry_imports[index])
    if stack != [entry]:
        return "the converted program's module markers were moved"
    table = _import_targets(out)
    if table is None:
        return "the converted program has a relative import at its top level"
    results: Dict[str, bytes] = {}
    for path, body in parts.items():
        original = program.files[path].module
        new = original.with_changes(body=body)
        if linked.nested:
            new = new.visit(_UnmarkNested(linked.nested))
        if linked.restore.get(path):
            new = _restored(new, linked.restore[path])
        if path == entry:
            new = _without_unused_new_imports(new, original)
        new = _without_dropped_imports(new, original, table)
        new = _first_statement_as_before(new, original)
        text = render(new)
        data = program.files[path].data
        if text.encode(new.encoding) == data:  # the conversion left it as it was (libcst round-trips: its bytes)
            results[path] = data
            continue
        wanted = _imports_needed(new, original, table)
        if isinstance(wanted, str):
            return f"the converted {_rel(path)} {wanted}"
        shared = (_sampler_for_other_scripts(new, original, [entry] + list(program.files))
                  if other_scripts and path != entry else "")
        if shared:
            return f"the conversion gives a DataLoader of {_rel(path)} {shared}"
        if wanted:
            new = add_imports(new, wanted)
            text = render(new)
        code = text.encode(new.encoding)
        try:
            compile(code, path, "exec", dont_inherit=True)
        except SyntaxError as err:
            return f"the converted {_rel(path)} does not compile ({err.msg})"
        results[path] = code
    records: Dict[str, Tuple[list, list, list]] = {p: ([], [], []) for p in program.files}
    for i, group in enumerate((result.changes, result.attention, result.refusals)):
        for record in group:
            records[linked.where(record.line)[0]][i].append(_mapped(linked, record))
    project = Workspace(linked.shown[entry])
    for mod in mods:
        if results.get(mod.path, mod.data) != mod.data:
            why = project.not_editable(os.path.realpath(mod.path))
            if why:
                return f"the conversion edits {_rel(mod.path)}, {why}"
    siblings = []
    changes, attention, refusals = records[entry]
    for mod in mods:
        code = results.get(mod.path, mod.data)
        if code != mod.data:
            siblings.append(RewriteResult(linked.shown[mod.path], mod.data, code, *records[mod.path][:2], []))
        else:  # a module left as it was: its records (attention items) are the entry's, each at its own path
            changes.extend(records[mod.path][0])
            attention.extend(records[mod.path][1])
        refusals.extend(records[mod.path][2])
    inputs = sorted(set(result.inputs) | {m.path for m in mods})
    return RewriteResult(linked.shown[entry], source, results[entry], changes, attention, refusals, inputs,
                         list(result.siblings) + siblings)


def _sampler_for_other_scripts(new: cst.Module, original: cst.Module, program_files: List[str]) -> str:
    """Where the conversion gives the DataLoader a helper of this module builds and returns a DistributedSampler
    and a file beside the program's names that helper too (another script, run in one process, where the
    sampler finds no process group): what it is, as a sentence's end; "" otherwise."""
    from fsdp2_retrofit.analysis.sibling_loaders import other_file_naming

    before = {s.name.value: render(s, original) for s in original.body if isinstance(s, cst.FunctionDef)}
    for stmt in new.body:
        if not isinstance(stmt, cst.FunctionDef) or stmt.name.value not in before:
            continue
        text = render(stmt, new)
        returns = any(isinstance(small, cst.Return) and small.value is not None
                      for line in stmt.body.body if isinstance(line, cst.SimpleStatementLine) for small in line.body)
        if returns and "DistributedSampler" in text and "DistributedSampler" not in before[stmt.name.value]:
            other = other_file_naming(stmt.name.value, program_files)
            if other:
                return (f"a DistributedSampler in {stmt.name.value}(), which {other} calls too (a DistributedSampler "
                        "needs a process group in every script that builds it)")
    return ""


def refusal_records(linked: Linked, result: RewriteResult) -> list:
    """The refusals of a linked run, each at its own file and line."""
    return [_mapped(linked, record) for record in result.refusals]


_LINE = re.compile(r"\b(lines?) (\d+)(?:([-–]|, | and | to )(\d+))?")


def _mapped(linked: Linked, record):
    """`record` of the linked text at its own file and line, and the lines its sentences name
    (`line 40`) as lines of their files (`line 12`, or `engine.py:12` in another file)."""
    path, line = linked.where(record.line)

    def one(number: str) -> str:
        there, at = linked.where(int(number))
        if at == 0:
            return number
        # another file, named as from the entry's folder (`modules.py:231`), however the entry was given
        return str(at) if there == path else f"{os.path.relpath(there, os.path.dirname(linked.program.entry))}:{at}"

    def sub(match) -> str:
        first = one(match.group(2))
        word = "" if ":" in first else f"{match.group(1)} "  # `net.py:12` says the line itself
        if match.group(4) is None:
            return f"{word}{first}"
        return f"{word}{first}{match.group(3)}{one(match.group(4))}"

    def plain(text: str) -> str:
        text = _LINE.sub(sub, text)
        for mangled, name in linked.unmangle.items():
            text = re.sub(rf"\b{re.escape(mangled)}\b", name, text)
        return text

    texts = {name: plain(getattr(record, name)) for name in ("what", "why", "hint", "pitfall")
             if isinstance(getattr(record, name, None), str)}
    return replace(record, line=line, path=linked.shown.get(path, path), **texts)


def _target_names(node, names: Set[str]) -> None:
    if isinstance(node, cst.Name):
        names.add(node.value)
    elif isinstance(node, (cst.Tuple, cst.List)):
        for el in node.elements:
            _target_names(el.value, names)
    elif isinstance(node, cst.StarredElement):
        _target_names(node.value, names)


# node type -> the attribute holding the target it binds
_TARGET_OF = {cst.AssignTarget: "target", cst.AnnAssign: "target", cst.AugAssign: "target", cst.For: "target",
              cst.CompFor: "target", cst.NamedExpr: "target", cst.AsName: "name"}


def _stored_names(module: cst.CSTNode) -> Set[str]:
    """Every name a module's (or a statement's) code binds, in any scope (targets, loop and comprehension variables,
    parameters, defs, classes, `as` names, imports): read syntactically, no scope analysis; from
    the nodes themselves (walk), not a libcst visitor, which rebuilds every node it passes."""
    names: Set[str] = set()
    for node in walk(module):
        kind = type(node)
        attribute = _TARGET_OF.get(kind)
        if attribute is not None:
            _target_names(getattr(node, attribute), names)
        elif kind is cst.Param or kind is cst.FunctionDef or kind is cst.ClassDef:
            names.add(node.name.value)
        elif kind is cst.Import or (kind is cst.ImportFrom and not isinstance(node.names, cst.ImportStar)):
            names.update(local for local, _ in import_bindings(node))
    return names


_STATEMENT_NAMES: Dict[int, tuple] = {}  # id(top-level statement) -> (it, (names it reads, names it binds))


def _reads_unbound(module: cst.Module) -> Set[str]:
    """The names `module` reads that none of its code binds (module-level imports and builtins among
    them): what it takes from its imports, its star imports or the builtins. Read statement by statement,
    each once (a converted module shares most of its statements with the file's own)."""
    read: Set[str] = set()
    stored: Set[str] = set()
    for stmt in module.body:
        reads, binds = per_node(_STATEMENT_NAMES, stmt, lambda: (names_read(stmt), _stored_names(stmt)))
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            # what a function binds (its parameters, locals, a local `import torch`) serves its own reads only:
            # another function of the file that now reads `torch` needs the module to import it
            read |= reads - binds
            stored.add(stmt.name.value)
            continue
        if not (isinstance(stmt, cst.SimpleStatementLine)  # `import torch.nn.functional as F` reads no `torch`
                and all(isinstance(small, (cst.Import, cst.ImportFrom)) for small in stmt.body)):
            read |= reads
        stored |= binds
    return read - stored


def _bound(module: cst.Module) -> Set[str]:
    out = set(_module_bindings(module.body))
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    out.update(local for local, _ in import_bindings(small))
    return out


def _imports_needed(new: cst.Module, original: cst.Module, table: Dict[str, Tuple[str, str]]):
    """The imports the converted module reads that it lacks (as add_imports wants them), from the
    linked program's import table; a sentence when a name it reads is bound by another file's code."""
    fresh = _reads_unbound(new) - _reads_unbound(original) - _bound(new)
    wanted = []
    for used in sorted(fresh):
        if hasattr(builtins, used):
            continue
        if used not in table:
            return f"reads `{used}`, bound by the code of another file"
        _, text = table[used]
        words = text.split()
        if words[0] == "import":
            wanted.append((words[1], None, used if " as " in text else None))
        else:
            wanted.append((words[1], words[3], used if " as " in text else None))
    return wanted


def _first_statement_as_before(new: cst.Module, original: cst.Module) -> cst.Module:
    """The blank lines above the first statement as the file had them, where that statement is the file's
    own first one (an import the rewrite added above it and the file does not need left them behind)."""
    if not new.body or not original.body:
        return new
    first, was = new.body[0], original.body[0]
    if not hasattr(first, "leading_lines") or first.leading_lines == was.leading_lines:
        return new
    if render(first.with_changes(leading_lines=[]), new) != render(was.with_changes(leading_lines=[]), original):
        return new
    return new.with_changes(body=[first.with_changes(leading_lines=was.leading_lines), *new.body[1:]])


def _rel(path: str) -> str:
    """A module's path in a sentence: below the working folder relative, else absolute."""
    rel = os.path.relpath(path)
    return os.path.abspath(path) if rel.startswith("..") else rel


def _import_targets(module: cst.Module) -> Optional[Dict[str, Tuple[str, str]]]:
    """name -> (what it imports, the statement as written) for the top-level imports of
    `module`; None when one is relative (the script could not spell it the same way)."""
    out: Dict[str, Tuple[str, str]] = {}
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for imp in stmt.body:
            if isinstance(imp, cst.Import):
                for alias in imp.names:
                    full = dotted(alias.name)
                    local = dotted(alias.asname.name) if alias.asname else full.split(".")[0]
                    target = full if alias.asname else local
                    text = f"import {full} as {local}" if alias.asname else f"import {full}"
                    out[local] = (target, text)
            elif isinstance(imp, cst.ImportFrom):
                if imp.relative:
                    return None
                if isinstance(imp.names, cst.ImportStar) or imp.module is None:
                    continue
                source = dotted(imp.module)
                for alias in imp.names:
                    obj = dotted(alias.name)
                    local = dotted(alias.asname.name) if alias.asname else obj
                    text = f"from {source} import {obj} as {local}" if alias.asname else f"from {source} import {obj}"
                    out[local] = (f"{source}.{obj}", text)
    return out


def _without_unused_new_imports(module: cst.Module, original: cst.Module) -> cst.Module:
    """`module` without the names of its top-level imports that `original` did not import and
    nothing in it reads (those hoisted or added for another file of the program)."""
    before = {text for _, text in (_import_targets(original) or {}).values()}
    read = names_read(module.with_changes(body=[s for s in module.body if not _is_import(s)]))
    body = []
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(
                stmt.body[0], (cst.Import, cst.ImportFrom)) and not isinstance(stmt.body[0].names, cst.ImportStar):
            one = cst.Module(body=[stmt])
            targets = _import_targets(one) or {}
            drop = {local for local, (_, text) in targets.items() if text not in before and local not in read}
            if drop:
                kept = [a for a in stmt.body[0].names if _local(a) not in drop]
                if not kept:
                    continue
                kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                stmt = stmt.with_changes(body=[stmt.body[0].with_changes(names=kept)])
        body.append(stmt)
    return module.with_changes(body=body)


def _without_dropped_imports(module: cst.Module, original: cst.Module, table: Dict[str, Tuple[str, str]]) -> cst.Module:
    """`module` without the names of its own top-level imports that the conversion removed from the
    linked text (migrate_ddp's DistributedDataParallel, once no file reads it) and that `original`
    read but `module` no longer does: a file's imports go back as it wrote them, so the removal
    must be repeated in it."""
    def code_reads(m: cst.Module) -> Set[str]:
        return names_read(m.with_changes(body=[s for s in m.body if not _is_import(s)]))

    read, read_before = code_reads(module), code_reads(original)
    body = []
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(
                stmt.body[0], (cst.Import, cst.ImportFrom)) and not isinstance(stmt.body[0].names, cst.ImportStar):
            targets = _import_targets(cst.Module(body=[stmt])) or {}
            drop = {local for local, (what, _) in targets.items()
                    if local in read_before and local not in read and table.get(local, (None,))[0] != what}
            if drop:
                kept = [a for a in stmt.body[0].names if _local(a) not in drop]
                if not kept:
                    continue
                kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                stmt = stmt.with_changes(body=[stmt.body[0].with_changes(names=kept)])
        body.append(stmt)
    return module.with_changes(body=body)


def _local(alias: cst.ImportAlias) -> str:
    if alias.asname is not None:
        return dotted(alias.asname.name)
    return dotted(alias.name).split(".")[0] if isinstance(alias.name, cst.Attribute) else dotted(alias.name)
