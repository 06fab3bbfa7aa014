"""DataLoaders built by a function of a sibling module: `train_loader = create_dataloader(...)`
with `from loaders import create_dataloader`. The rewrite edits one file, so such a loader
gets no DistributedSampler; the data stage names the function and its line instead of
saying that no DataLoader was found."""
from __future__ import annotations

from typing import List, Optional

import libcst as cst

from .model_classes import ClassRegistry
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
        return SiblingLoader(call, name, classes.shown_file(namespace), namer.resolver.line(built))
    return None

