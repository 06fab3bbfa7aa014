"""DataLoaders built by a function of a sibling module: `train_loader = create_dataloader(...)`
with `from loaders import create_dataloader`. The data stage gives that DataLoader its
DistributedSampler in the sibling module (rewrite/workspace.py) when every call of the
function feeds training and no other script of the project names it (`blocker` says what
stands in the way otherwise); else it names the function and its line."""
from __future__ import annotations

import os
import re
from typing import List, Optional

import libcst as cst

from .data import loader_dataset
from .model_classes import ClassRegistry
from .project_imports import read
from .returns import own_returns
from dataclasses import dataclass
from fsdp2_retrofit.syntax.names import Resolver, calls_in
from fsdp2_retrofit.syntax.torch_api import DATALOADERS


@dataclass
class SiblingLoader:
    call: cst.Call  # the script's call of the function
    function: str  # its name
    file: str  # the sibling module, as a path relative to the script ("loaders.py", "data/loaders.py")
    line: int  # the line of the DataLoader(...) it builds
    built: cst.Call  # that DataLoader(...) call, a node of the sibling's tree
    resolver: Resolver  # the sibling module's
    path: str  # the sibling module's file, as the analysis found it
    function_def: cst.FunctionDef  # the function there

    def blocker(self, script: str, other_files: bool = True, dataset_named: bool = False) -> str:
        """Why the DataLoader cannot take a DistributedSampler where it is built ("" when it can):
        its arguments, or (`other_files`: a function of a sibling module) another file beside the
        script or the module that names the function (a script run in one process, where a
        DistributedSampler finds no process group). `dataset_named`: the caller binds an inline dataset
        to a name first (a helper of the script)."""
        call = self.built
        keywords = {a.keyword.value for a in call.args if a.keyword is not None}
        if any(a.star for a in call.args):
            return "its arguments are unpacked from `*`/`**` there"
        if keywords & {"sampler", "batch_sampler"}:
            return "it is given a sampler of its own there"
        positional = [a for a in call.args if a.keyword is None]
        if len(positional) > 2:
            return "its shuffle/sampler arguments are given by position there"
        if not dataset_named and not isinstance(loader_dataset(call), cst.Name):
            return "its dataset is not a name there (it would be built twice)"
        other = other_file_naming(self.function, [script, self.path]) if other_files else ""
        if other:
            return f"{other} names {self.function}() too (a DistributedSampler needs a process group in every " \
                   "script that calls it)"
        return ""


def other_file_naming(function: str, paths: List[str]) -> str:
    """A .py file in the folders of `paths`, not one of them, whose text names `function`."""
    mine = {os.path.realpath(p) for p in paths}
    word = re.compile(rb"\b" + re.escape(function.encode()) + rb"\b")
    for folder in sorted({os.path.dirname(p) for p in mine}):
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(".py") and name != "__init__.py" and path not in mine:  # a package's own re-export
                data = read(path)
                if data is not None and word.search(data):
                    return os.path.relpath(path)
    return ""


def sibling_loaders(resolver: Resolver, classes: ClassRegistry) -> List[SiblingLoader]:
    out = []
    for call in resolver.nodes(cst.Call):
        found = _builder(resolver, classes, call)
        if found is not None:
            out.append(found)
    return out


def _builder(resolver: Resolver, classes: ClassRegistry, call: cst.Call) -> Optional[SiblingLoader]:
    for qname in sorted(resolver.qnames(call.func)):
        namespace, _, name = qname.rpartition(".")
        fn = classes.top_level_functions.get(namespace, {}).get(name) if namespace else None
        if fn is None:
            continue
        namer = classes.top_level[namespace][1]
        built = next((c for c in calls_in(fn) if namer.resolver.is_call_to(c, DATALOADERS)), None)
        if built is None or not any(n.value is not None for n in own_returns(namer.resolver, fn)):
            continue
        return SiblingLoader(call, name, classes.shown_file(namespace), namer.resolver.line(built), built,
                             namer.resolver, classes.files[namespace], fn)
    return None

