"""A trainer class of a sibling module, converted where it lives.

`from trainer import Trainer` in the script, `Trainer(model, loader, optimizer, ...).train(n)`:
the loop, its saves and its logging are in trainer.py. A trainer class of the script itself is
converted by the stages (one analysis follows the model, the optimizer and the loader into its
methods), so the sibling's class is converted the same way: its text takes the place of the
import that binds it in the script (with the imports of trainer.py it needs and the script
lacks), the pipeline rewrites that one file, and the class is put back where it came from.

    script lines ............ import of Trainer ................ rest of the script
    spliced   lines ... +imports ... class Trainer (from trainer.py) ... rest of the script

Every line of the spliced text maps to a line of one of the two files (`Segments`), so each
record names its own file and line. The split takes the converted class out of the result, puts
the script's import back (and drops the imports added for the class), writes the class over its
old text in trainer.py and adds there the imports its new code reads (`dist`, `dcp`, ...), taken
from the converted script's own import statements.

The splice is tried only after the pipeline refused the script for the sibling trainer
(FSR605), and only where it is sound: the class's file is a project module, the script binds it
by one `from <module> import <Class>` statement of its own, and every module-level name the
class reads is an import the script has the same way (or lacks, then it is added) or a builtin;
anything else keeps the refusal.
"""
from __future__ import annotations

import builtins
import os
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider, ScopeProvider

from fsdp2_retrofit.report import RewriteResult
from fsdp2_retrofit.syntax.names import dotted

from .imports import add_imports


@dataclass
class Segment:
    first: int  # first line in the spliced text (1-based)
    count: int
    path: str  # the file these lines come from
    start: int  # their first line there


@dataclass
class Splice:
    """A spliced script and how to take it apart again."""

    text: str  # the spliced source
    segments: List[Segment]
    class_name: str
    sibling_path: str  # as the report shows it
    sibling_text: str
    sibling_bytes: bytes
    class_lines: Tuple[int, int]  # first and last line of the class in the sibling (1-based)
    import_text: str  # the script's statement that imported the class, as written
    added: List[str] = field(default_factory=list)  # the import statements added for the class

    def where(self, line: int) -> Tuple[str, int]:
        """(file, line there) of a line of the spliced text (a line added: the script's line 0)."""
        for seg in self.segments:
            if seg.first <= line < seg.first + seg.count:
                return seg.path, seg.start + line - seg.first
        return "", 0


def plan(script_path: str, source: bytes, module: cst.Module, info) -> Optional[Splice]:
    """The splice of `info` (analysis.model_classes.ClassInfo of a sibling module's trainer class)
    into the script, or None where it is not sound."""
    if not info.file or info.namer is None:
        return None
    sibling = info.namer.resolver.module
    name = info.node.name.value
    if (sibling.encoding, sibling.default_newline, sibling.default_indent) != (
            module.encoding, module.default_newline, module.default_indent):
        return None  # the class's new lines are written in the script's style
    found = _importing_statement(module, info.namespace, name)
    if found is None:
        return None
    index, stmt = found
    script_imports = _import_targets(module)
    if script_imports is None:
        return None
    sibling_imports = _import_targets(sibling)
    if sibling_imports is None:
        return None
    needed = _globals_read(sibling, info.node)
    sibling_bound = set(_top_level_names(sibling))
    script_bound = set(_top_level_names(module))
    added: List[str] = []
    for used in sorted(needed - {name}):
        if used in sibling_imports:
            target, text = sibling_imports[used]
            if used in script_imports:
                if script_imports[used][0] != target:
                    return None  # the script binds that name to something else
                continue
            if used in script_bound:
                return None
            added.append(text)
        elif used in sibling_bound or not hasattr(builtins, used):
            return None  # a function or value of trainer.py the script does not have
    wrapper = MetadataWrapper(sibling, unsafe_skip_copy=True)
    pos = wrapper.resolve(PositionProvider)[info.node]
    sibling_text = sibling.code
    lines = sibling_text.splitlines(keepends=True)
    class_text = "".join(lines[pos.start.line - 1:pos.end.line])
    if not class_text.endswith("\n"):
        class_text += "\n"

    text = source.decode(module.encoding)
    script_lines = text.splitlines(keepends=True)
    spos = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)[stmt]
    first, last = spos.start.line, spos.end.line
    if "".join(script_lines[first - 1:last]).strip() != module.code_for_node(stmt.with_changes(leading_lines=[])).strip():
        return None
    added_text = "".join(t if t.endswith("\n") else t + "\n" for t in added)
    spliced = "".join(script_lines[:first - 1]) + added_text + class_text + "".join(script_lines[last:])
    n_added, n_class = added_text.count("\n"), class_text.count("\n")
    shown = os.path.relpath(info.file) if not os.path.isabs(script_path) else os.path.abspath(info.file)
    segments = [
        Segment(1, first - 1, script_path, 1),
        Segment(first + n_added, n_class, shown, pos.start.line),
        Segment(first + n_added + n_class, len(script_lines) - last, script_path, last + 1),
    ]
    return Splice(spliced, segments, name, shown, sibling_text, sibling.bytes, (pos.start.line, pos.end.line),
                  "".join(script_lines[first - 1:last]), added)


def split(splice: Splice, result: RewriteResult, script_path: str, original: bytes,
          encoding: str) -> Optional[RewriteResult]:
    """The result of the spliced script taken apart: the script's own result, with the class's
    file as a sibling. None where the converted text cannot be taken apart soundly."""
    mine = os.path.realpath(splice.sibling_path)
    if any(os.path.realpath(s.path) == mine for s in result.siblings):
        return None  # another stage edits that file too: one edit of it at a time
    out = cst.parse_module(result.code)
    classes = [s for s in out.body if isinstance(s, cst.ClassDef) and s.name.value == splice.class_name]
    if len(classes) != 1:
        return None
    new_class = classes[0]
    class_code = out.code_for_node(new_class.with_changes(leading_lines=[]))
    if not class_code.endswith("\n"):
        class_code += "\n"
    kept_import = cst.parse_statement(splice.import_text.lstrip("\n"))
    body = []
    added = {a.strip() for a in splice.added}
    spliced_in = []  # the imports spliced in for the class: after the script's import, unless unread
    for stmt in out.body:
        if stmt is new_class:
            leading = spliced_in[0].leading_lines if spliced_in else new_class.leading_lines
            body.append(kept_import.with_changes(leading_lines=leading))
            body.extend(s.with_changes(leading_lines=[]) for s in spliced_in)
        elif out.code_for_node(stmt.with_changes(leading_lines=[])).strip() in added:
            spliced_in.append(stmt)
        else:
            body.append(stmt)
    script_module = _without_unused_new_imports(out.with_changes(body=body), cst.parse_module(original))
    script_code = script_module.bytes
    # the sibling: the class's new text over its old one, and the imports its new code reads
    lines = splice.sibling_text.splitlines(keepends=True)
    first, last = splice.class_lines
    sibling_new = "".join(lines[:first - 1]) + class_code + "".join(lines[last:])
    sibling_module = cst.parse_module(sibling_new.encode(encoding))
    wanted = _imports_read(out, new_class, sibling_module)
    if wanted is None:
        return None
    sibling_module = add_imports(sibling_module, wanted)
    sibling_code = sibling_module.bytes
    try:
        for code, path in ((script_code, script_path), (sibling_code, splice.sibling_path)):
            compile(code, path, "exec", dont_inherit=True)
    except SyntaxError:
        return None
    script_records, sibling_records = ([], [], []), ([], [], [])
    for i, records in enumerate((result.changes, result.attention, result.refusals)):
        for record in records:
            path, line = splice.where(record.line)
            moved = replace(record, line=line, path=path or script_path)
            (sibling_records if path == splice.sibling_path else script_records)[i].append(moved)
    sibling = RewriteResult(splice.sibling_path, splice.sibling_bytes, sibling_code,
                            sibling_records[0], sibling_records[1], [])
    edited = [sibling] if sibling.code != sibling.original else []
    return RewriteResult(script_path, original, script_code, script_records[0], script_records[1],
                         script_records[2], result.inputs, result.siblings + edited)


def _importing_statement(module: cst.Module, namespace: str, name: str) -> Optional[Tuple[int, cst.CSTNode]]:
    """(index, statement) of the script's one top-level `from <namespace> import <name>` (alone)."""
    found = None
    for i, stmt in enumerate(module.body):
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            continue
        imp = stmt.body[0]
        if not isinstance(imp, cst.ImportFrom) or isinstance(imp.names, cst.ImportStar) or imp.relative:
            continue
        if imp.module is None or dotted(imp.module) != namespace:
            continue
        if len(imp.names) == 1 and imp.names[0].asname is None and dotted(imp.names[0].name) == name:
            if found is not None:
                return None
            found = (i, stmt)
    return found


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


def _top_level_names(module: cst.Module):
    from fsdp2_retrofit.syntax.names import _module_bindings

    return _module_bindings(module.body)


def _globals_read(module: cst.Module, cls: cst.ClassDef) -> set:
    """The module-level (and builtin) names the class's code reads."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    scopes = wrapper.resolve(ScopeProvider)
    inside = set()

    class _Collect(cst.CSTVisitor):
        def visit_Name(self, node: cst.Name) -> None:
            inside.add(node)

    cls.visit(_Collect())
    names = set()
    for node in inside:
        scope = scopes.get(node)
        if scope is None:
            continue
        for access in scope.accesses[node.value] if node.value in scope.accesses else ():
            if access.node is node and all(
                isinstance(a.scope, (cst.metadata.GlobalScope, cst.metadata.BuiltinScope)) or a.scope is None
                for a in access.referents
            ):
                names.add(node.value)
    return names


def _imports_read(spliced: cst.Module, cls: cst.ClassDef, sibling: cst.Module):
    """The imports the converted class reads that the sibling module lacks, as add_imports
    wants them, taken from the converted script's top-level imports; None when the class reads
    a module-level name that is no import there."""
    targets = _import_targets(spliced)
    if targets is None:
        return None
    have = set(_top_level_names(sibling)) | set((_import_targets(sibling) or {}))
    wanted = []
    for used in sorted(_globals_read(spliced, cls) - {cls.name.value}):
        if used in have or hasattr(builtins, used):
            continue
        if used not in targets:
            return None
        target, text = targets[used]
        if text.startswith("import "):
            full = text.split()[1]
            wanted.append((full, None, used if " as " in text else None))
        else:
            source, obj = text.split()[1], text.split()[3]
            wanted.append((source, obj, used if " as " in text else None))
    return wanted


def _without_unused_new_imports(module: cst.Module, original: cst.Module) -> cst.Module:
    """`module` without the names of its top-level imports that `original` did not import and
    nothing in it reads (those the rewrite added for the class that went back to its file)."""
    before = {text for _, text in (_import_targets(original) or {}).values()}
    read = set()

    class _Reads(cst.CSTVisitor):
        def visit_Import(self, node) -> bool:
            return False

        def visit_ImportFrom(self, node) -> bool:
            return False

        def visit_Attribute(self, node: cst.Attribute) -> bool:
            node.value.visit(self)  # `torch.nn.Linear` reads `torch`, not a name `nn`
            return False

        def visit_Name(self, node: cst.Name) -> None:
            read.add(node.value)

    module.visit(_Reads())
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


def _local(alias: cst.ImportAlias) -> str:
    if alias.asname is not None:
        return dotted(alias.asname.name)
    return dotted(alias.name).split(".")[0] if isinstance(alias.name, cst.Attribute) else dotted(alias.name)
