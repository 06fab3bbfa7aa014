"""Datasets built with `download=True`: every rank would download into the same folder at once.

`datasets.MNIST(root, train=True, download=True)` checks whether its files are in `root`
and fetches them if not. Under torchrun every rank runs that check at the same moment:
each finds nothing and downloads, and they write the same files together (a truncated
archive, a rank reading a file another is still writing). Found by value: the callee is a
dataset class of torchvision, torchaudio or torchtext (by qualified name, also through a
name bound to one), or a class of the script or of its sibling modules built on
`torch.utils.data.Dataset` (or on a library's dataset class) whose `__init__` takes
`download`; the call hands `download=` something other than a literal False.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import libcst as cst

from fsdp2_retrofit.syntax.torch_api import DATASET_BASES

LIBRARY_DATASETS = ("torchvision.datasets.", "torchaudio.datasets.", "torchtext.datasets.")


@dataclass
class DownloadSite:
    call: cst.Call  # `datasets.MNIST(root, download=True)`
    stmt: cst.CSTNode  # the statement that runs it: the call's own, or that of `via`
    dataset: str  # the class, as the message names it
    # the call that runs the download from outside the function holding it (`Pairs(root)` of a
    # Dataset whose `__init__` builds `MNIST(root, download=True)`, `get_data(args)` of a helper
    # function): the barriers go around its statement
    via: Optional[cst.Call] = None
    # the function around the download whose callers are not known (the barriers cannot follow it)
    unplaced: Optional[cst.FunctionDef] = None


_MAX_CALLERS = 4  # functions followed outward from a download: `__init__` <- helper <- main


def download_sites(facts) -> List[DownloadSite]:
    """Every dataset construction that may download, in source order; one inside a Dataset's
    `__init__` or a function of the script is placed at each call that runs it (callers_of)."""
    r = facts.resolver
    out: List[DownloadSite] = []
    for call in r.nodes(cst.Call):
        download = next((a for a in call.args if a.keyword is not None and a.keyword.value == "download"), None)
        if download is None or _literally_false(download.value, facts):
            continue
        dataset = _dataset_class(call, facts)
        if dataset is None:
            continue
        stmt = r.statement_of(call)
        if stmt is not None:
            out += [DownloadSite(call, at, dataset, via, unplaced) for at, via, unplaced in _placements(stmt, facts)]
    for call in r.nodes(cst.Call):  # `Windows(root)` of a sibling module's Dataset whose __init__ downloads
        inner = _sibling_init_download(call, facts)
        stmt = r.statement_of(call) if inner is not None else None
        if stmt is not None:
            out += [DownloadSite(call, at, inner, via or call, unplaced)
                    for at, via, unplaced in _placements(stmt, facts)]
    out.sort(key=lambda site: r.order(site.stmt))
    return out


def _sibling_init_download(call: cst.Call, facts) -> Optional[str]:
    """The dataset class a call builds, with `download=` anything but a literal False, in the `__init__`
    of the class `call` builds when that class is a Dataset of a sibling module (`Windows(root)` with
    `Letters(root, download=True)` in corpus_data.py's `Windows.__init__`); None otherwise. The class's
    own file is read with its own names (a download it runs is not this file's statement)."""
    info = next((found for q in sorted(facts.resolver.qnames(call)) for found in [facts.classes.get(q)]
                 if found is not None), None)
    if info is None or not info.namespace or info.namer is None or not _project_dataset(info.name, facts.classes, 4):
        return None
    init = info.methods.get("__init__")
    if init is None:
        return None
    names = info.namer.resolver
    for inner in names.descendants(init, cst.Call):
        download = next((a for a in inner.args if a.keyword is not None and a.keyword.value == "download"), None)
        if download is None or type(download.value) is cst.Name and download.value.value == "False":
            continue
        for name in sorted(names.qnames(inner)):
            if name.startswith(LIBRARY_DATASETS):
                return name
            found = facts.classes.get(name) or facts.classes.get(f"{info.namespace}.{name}")
            if found is not None and _project_dataset(found.name, facts.classes, 4):
                return found.name
    return None


def _placements(stmt, facts, depth: int = _MAX_CALLERS, seen=()) -> List[tuple]:
    """(statement, call, unplaced) for each place a download statement runs from: itself in the entry
    code (module level, the entry function, or a function that is no Dataset `__init__` or
    top-level function of the script), else the statements of the calls that run its function
    (`Pairs(...)` for `Pairs.__init__`, `get_data(...)` for a top-level `def get_data`), followed
    outward. A function whose callers are not known stays where it is, with `unplaced` set."""
    r = facts.resolver
    fn = r.enclosing_function(stmt)
    if fn is None or fn is facts.entry_scope or not _followed(fn, facts) or depth == 0:
        return [(stmt, None, None)]
    calls = [c for c, _ in facts.analysis.flow.bound_calls(fn) if r.enclosing_function(c) not in (fn, *seen)]
    if not calls:
        return [(stmt, None, fn)]
    out = []
    for call in calls:
        outer = r.statement_of(call)
        for at, via, unplaced in (_placements(outer, facts, depth - 1, (*seen, fn)) if outer is not None else []):
            out.append((at, via or call, unplaced))
    return out


def _followed(fn: cst.FunctionDef, facts) -> bool:
    """A Dataset class's `__init__`, or a top-level function of the script that runs nothing the
    ranks must run together (it holds no model or optimizer, calls no `torch.distributed` function,
    no `backward()`): its calls are where a download it runs can be put behind a barrier (around a
    call that ran a collective, rank 0 would wait in it for ranks held at the barrier)."""
    r = facts.resolver
    cls = r.enclosing_class(fn)
    if cls is not None:
        return (fn.name.value == "__init__" and cls in facts.module.body
                and _project_dataset(cls.name.value, facts.classes, 4))
    if not any(fn is top for top in facts.module.body) or facts.model_names.get(fn) or facts.optimizer_names.get(fn):
        return False
    return not any(
        type(c.func) is cst.Attribute and c.func.attr.value == "backward"
        or any(q.startswith("torch.distributed.") for q in r.qnames(c))
        for c in r.descendants(fn, cst.Call))


def _literally_false(value, facts) -> bool:
    origins = facts.analysis.flow.values(value)
    return bool(origins) and all(isinstance(o, cst.Name) and o.value == "False" for o in origins)


def _dataset_class(call: cst.Call, facts) -> Optional[str]:
    r = facts.resolver
    names = set(r.qnames(call))
    for origin in facts.analysis.flow.values(call.func):
        if isinstance(origin, (cst.Name, cst.Attribute)):
            names |= r.qnames(origin)  # `make = datasets.MNIST if a else datasets.KMNIST; make(...)`
    for name in sorted(names):
        if name.startswith(LIBRARY_DATASETS):
            return name
        if _project_dataset(name, facts.classes, 4):
            info = facts.classes.get(name)
            init = info.methods.get("__init__") if info is not None else None
            if init is not None and any(p.name.value == "download" for p in init.params.params):
                return name
    return None


def _project_dataset(name: Optional[str], classes, depth: int) -> bool:
    """A class of the project built (through its bases) on a torch or library dataset class."""
    info = classes.get(name)
    if info is None or depth == 0:
        return False
    return any(b in DATASET_BASES or b.startswith(LIBRARY_DATASETS) or _project_dataset(b, classes, depth - 1)
               for b in info.bases)
