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
    stmt: cst.CSTNode  # the statement that runs it
    dataset: str  # the class, as the message names it


def download_sites(facts) -> List[DownloadSite]:
    """Every dataset construction that may download, in source order."""
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
            out.append(DownloadSite(call, stmt, dataset))
    return out


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
