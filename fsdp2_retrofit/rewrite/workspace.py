"""The files one rewrite edits: the script, and the project modules it reads that need an edit
too (a DataLoader built by a helper of `loaders.py`).

The analysis reads a project module once per process (analysis/model_classes.py keeps its
tree and resolver); a stage that must change that module asks the workspace for its `Unit`
and keys its edits on the nodes it analysed there, as it does in the script. The edits of
every stage to one module share one editor, applied once after the script's last stage, so
the module is parsed once and never re-analysed in between. Its records (changes, attention
items, refusals) carry its path.

A module is editable when it lies inside the project (the script's folder, or the project's
root above it: analysis/project_imports.project_root) and outside any installed package
(site-packages, dist-packages): anything else is refused, naming the file and line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import libcst as cst

from fsdp2_retrofit.report import Attention, Change, Refusal, RefusedError, RewriteResult
from fsdp2_retrofit.syntax.names import Resolver

from .editor import StatementEditor
from .imports import add_imports

WORKSPACE_KEY = "fsdp2_retrofit.workspace"  # in every stage's scratch: the Workspace of the run

_INSTALLED = ("site-packages", "dist-packages")


@dataclass
class Unit:
    """One project module besides the script that this rewrite edits."""

    path: str  # as the report shows it (relative when the script's path is)
    resolver: Resolver  # of the tree the analysis read; edits are keyed on its nodes
    editor: StatementEditor = field(default_factory=StatementEditor)
    imports: List[Tuple[str, Optional[str], Optional[str]]] = field(default_factory=list)
    changes: List[Change] = field(default_factory=list)
    attention: List[Attention] = field(default_factory=list)

    @property
    def module(self) -> cst.Module:
        return self.resolver.module

    def line(self, node: cst.CSTNode) -> int:
        return self.resolver.line(node)

    def change(self, stage: str, node: cst.CSTNode, what: str, why: str, pitfall: str = "") -> None:
        self.changes.append(Change(self.line(node), stage, what, why, pitfall, path=self.path))

    def note(self, stage: str, node: cst.CSTNode, what: str, why: str, differs: bool = False) -> None:
        self.attention.append(Attention(self.line(node), stage, what, why, differs, path=self.path))

    def add_import(self, module: str, obj: Optional[str] = None, asname: Optional[str] = None) -> None:
        self.imports.append((module, obj, asname))

    def render(self) -> RewriteResult:
        """The module with its edits and imports, checked to compile."""
        original = self.module.bytes
        editor = self.editor
        editor.resolver = self.resolver
        new = self.module.visit(editor) if editor.has_work() else self.module
        new = add_imports(new, self.imports)
        code = new.bytes
        try:
            compile(code, self.path, "exec", dont_inherit=True)
        except SyntaxError as err:  # the pipeline is wrong: said as such, never written
            raise AssertionError(f"the edit of {self.path} does not compile: {err}") from None
        return RewriteResult(self.path, original, code, sorted(self.changes, key=lambda c: c.line),
                             sorted(self.attention, key=lambda a: a.line), [])


class Workspace:
    """The script's path and the units of the other files this rewrite edits, by real path."""

    def __init__(self, script: str):
        self.script = script
        self._root: Optional[str] = None
        self._units: Dict[str, Unit] = {}

    @property
    def root(self) -> str:
        """The project's root folder (looked up when a unit is first asked for)."""
        if self._root is None:
            from fsdp2_retrofit.analysis.project_imports import project_root

            folder = os.path.dirname(os.path.realpath(self.script))
            self._root = project_root(folder) or folder
        return self._root

    def unit(self, file: str, resolver: Resolver, node: cst.CSTNode, stage: str, refusal: str) -> Unit:
        """The unit of the project module `file` (analysed as `resolver`), to edit at `node`;
        refused (with `refusal`, a code of the catalogue) when the file may not be edited."""
        real = os.path.realpath(file)
        found = self._units.get(real)
        if found is not None:
            return found
        why = self.not_editable(real)
        if why:
            raise RefusedError(Refusal(
                resolver.line(node), f"{stage}: the edit this needs is in {file}, {why}",
                "the rewrite edits only the script and the project's own modules",
                "copy the code into the project (or the script), or make the change there by hand",
                refusal, path=file))
        self._units[real] = Unit(self._shown(file), resolver)
        return self._units[real]

    def not_editable(self, real: str) -> str:
        """Why the file at the real path `real` may not be edited ("" when it may)."""
        parts = real.split(os.sep)
        if any(p in _INSTALLED for p in parts):
            return "an installed package"
        root = self.root.rstrip(os.sep) + os.sep
        if not real.startswith(root):
            return f"outside the project ({self.root})"
        return ""

    def _shown(self, file: str) -> str:
        """`file` as the report names it: relative to the working folder when the script's path is."""
        if os.path.isabs(self.script):
            return os.path.abspath(file)
        return os.path.relpath(os.path.abspath(file))

    def results(self) -> List[RewriteResult]:
        """Every unit rendered, in the order of their paths."""
        return [u.render() for _, u in sorted(self._units.items())]


def project_relative(paths: List[str]) -> Tuple[str, List[str]]:
    """(the folder the files share, each file's path below it): how `-o DIR` lays out a set."""
    folders = [os.path.dirname(os.path.abspath(p)) for p in paths]
    base = os.path.commonpath(folders) if folders else os.getcwd()
    return base, [os.path.relpath(os.path.abspath(p), base) for p in paths]

