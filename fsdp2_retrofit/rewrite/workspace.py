"""Which files one rewrite may edit: the script, and the project modules the program linked into
one analysis takes in (rewrite/link.py edits each where its sites are).

A module is editable when it lies inside the project (the script's folder, or the project's root
above it: analysis/project_imports.project_root) and outside any installed package
(site-packages, dist-packages).
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

_INSTALLED = ("site-packages", "dist-packages")


class Workspace:
    """The script's path and its project's root."""

    def __init__(self, script: str):
        self.script = script
        self._root: Optional[str] = None

    @property
    def root(self) -> str:
        """The project's root folder (looked up when first asked for)."""
        if self._root is None:
            from fsdp2_retrofit.analysis.project_imports import project_root

            folder = os.path.dirname(os.path.realpath(self.script))
            self._root = project_root(folder) or folder
        return self._root

    def not_editable(self, real: str) -> str:
        """Why the file at the real path `real` may not be edited ("" when it may)."""
        parts = real.split(os.sep)
        if any(p in _INSTALLED for p in parts):
            return "an installed package"
        root = self.root.rstrip(os.sep) + os.sep
        if not real.startswith(root):
            return f"outside the project ({self.root})"
        return ""


def project_relative(paths: List[str]) -> Tuple[str, List[str]]:
    """(the folder the files share, each file's path below it): how `-o DIR` lays out a set."""
    folders = [os.path.dirname(os.path.abspath(p)) for p in paths]
    base = os.path.commonpath(folders) if folders else os.getcwd()
    return base, [os.path.relpath(os.path.abspath(p), base) for p in paths]
