"""Whether a model being sharded has BatchNorm layers, and where the first one is.

Once the batch is split over the ranks, each rank's BatchNorm normalises with the
mean and variance of its own part of the batch, and updates its running statistics
from them: the losses and the running statistics are no longer those of the
single-process run. SyncBatchNorm shares the statistics between the ranks (an
all-gather in forward, an all-reduce in backward), but runs on GPUs only.

Read from the script's text and its sibling modules (never imported): the model's
class and every class and top-level function of the script its class refers to
(submodules, blocks, a block class passed as an argument, a helper that builds a
part), the model's constructor arguments (`norm_layer=nn.BatchNorm2d`), a model that
is itself a BatchNorm, and the library models whose table entry says they have
BatchNorm (a torchvision ResNet, unless its `norm_layer=` is something else), built
as the model or anywhere in those classes and functions
(`self.backbone = torchvision.models.resnet18()`), known by the qualified name of
the call through the imports of the file it is in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import code
from fsdp2_retrofit.syntax.torch_api import BATCHNORM, CONVERT_SYNC_BATCHNORM

_DEPTH = 5


@dataclass(frozen=True)
class BatchNormLayer:
    """The first BatchNorm layer found in a model."""

    what: str  # the source that builds or names it (`nn.BatchNorm2d(16)`), or the library model
    line: int  # its line in the script; for one in a sibling module, the line that builds the model
    file: Optional[str] = None  # the sibling module it is in, if not the script
    file_line: int = 0  # its line in that module

    def where(self) -> str:
        if self.file is None:
            return f"line {self.line}"
        from pathlib import Path

        return f"{Path(self.file).name}:{self.file_line}"


def batchnorm_layer(model, facts) -> Optional[BatchNormLayer]:
    """The first BatchNorm of `model` (a ModelSite), or None when none is found."""
    from .flow import innermost_call as _innermost_call

    r = facts.resolver
    small = model.stmt.body[0] if isinstance(model.stmt, cst.SimpleStatementLine) else None
    value = getattr(small, "value", None)
    ctor = _innermost_call(value) if value is not None else None
    if model.class_name in BATCHNORM:
        return BatchNormLayer(code(ctor if ctor is not None else model.stmt).strip(), r.line(model.stmt))
    if ctor is not None:
        for arg in ctor.args:  # `resnet18(norm_layer=nn.BatchNorm2d)`, `ResNet(Block, ...)`
            found = _named(arg.value, r, lambda n: r.qnames(n))
            if found is not None:
                return BatchNormLayer(code(found), r.line(found))
            for node in _references(arg.value, r):
                hit = _library_at(node, r, r)
                for q in sorted(r.qnames(node)):
                    hit = hit or class_batchnorm(facts.classes, q, r)
                if hit is not None:
                    return hit
    if model.library is not None:
        what = _library_batchnorm(model.library, ctor)
        return BatchNormLayer(what, r.line(model.stmt)) if what else None
    hit = None
    for cls in model.alternatives or [model.class_name]:  # a class chosen at run time: any of them
        hit = hit or class_batchnorm(facts.classes, cls, r)
    if hit is not None and hit.file is not None:
        return BatchNormLayer(hit.what, r.line(model.stmt), hit.file, hit.file_line)
    return hit


def converted_already(facts, name: str) -> bool:
    """The script calls SyncBatchNorm.convert_sync_batchnorm on `name` itself (a DDP script)."""
    r = facts.resolver
    return any(
        r.is_call_to(call, CONVERT_SYNC_BATCHNORM)
        and call.args
        and isinstance(call.args[0].value, cst.Name)
        and call.args[0].value.value == name
        for call in r.nodes(cst.Call)
    )


def class_batchnorm(classes, name: Optional[str], script) -> Optional[BatchNormLayer]:
    """The first BatchNorm of the script's (or a sibling module's) class `name`, or None:
    a BatchNorm class it builds or names, a library model with BatchNorm it builds
    (`self.backbone = torchvision.models.resnet18()`, also inside a Sequential or a
    ModuleList), or one in a class or a top-level function it refers to (a helper that
    builds the backbone). `script`: the script's resolver (a layer in a sibling module
    is named by file and line)."""
    return _in_class(classes, name, script, set(), _DEPTH)


def _in_class(classes, name: Optional[str], script, seen: set, depth: int) -> Optional[BatchNormLayer]:
    info = classes.get(name)
    if info is None or depth == 0 or name in seen:
        return None
    seen.add(name)
    return _in_definition(classes, info.node, info.namer, info.file, script, seen, depth)


def _in_definition(classes, node, namer, file, script, seen: set, depth: int) -> Optional[BatchNormLayer]:
    """The first BatchNorm under `node` (a class or a top-level function of the module
    `namer` reads), or in a class or top-level function it refers to."""
    resolver = namer.resolver
    found = _named(node, resolver, lambda n: {namer.of(n)} - {None})
    if found is not None:
        return _layer(code(found), found, resolver, script, file)
    for ref in _references(node, resolver):
        hit = _library_at(ref, resolver, script, file)
        other = namer.of(ref)
        if hit is None and other and classes.get(other) is not None:
            hit = _in_class(classes, other, script, seen, depth - 1)
        elif hit is None and other and depth > 1 and ("def", other) not in seen:
            seen.add(("def", other))
            hit = _in_function(classes, namer, other, script, seen, depth - 1)
        if hit is not None:
            return hit
    return None


def _in_function(classes, namer, qname: str, script, seen: set, depth: int) -> Optional[BatchNormLayer]:
    """The first BatchNorm of the top-level function `qname` names (of the script or of
    a sibling module read, resolved from the module `namer` reads), if it is one."""
    namespace, _, bare = qname.rpartition(".")
    if not namespace:
        namespace = namer.namespace  # a function of the same module
    fn = classes.top_level_functions.get(namespace, {}).get(bare)
    module = classes.top_level.get(namespace)
    if fn is None or module is None:
        return None
    return _in_definition(classes, fn, module[1], classes.files.get(namespace), script, seen, depth)


def _layer(what: str, node: cst.CSTNode, resolver, script, file: Optional[str]) -> BatchNormLayer:
    """A layer found at `node`: by its line in the script, else by its file and line."""
    if resolver is script:
        return BatchNormLayer(what, resolver.line(node))
    return BatchNormLayer(what, 0, file, resolver.line(node))


def _library_at(node: cst.CSTNode, resolver, script, file: Optional[str] = None) -> Optional[BatchNormLayer]:
    """`node` names a library model whose table entry has BatchNorm (`torchvision.models.resnet18`,
    resolved through the imports of its own file): the call that builds it, or the name."""
    from .library_models import is_library_builder, library_model

    for q in sorted(resolver.qnames(node)):
        if not is_library_builder(q):
            continue
        parent = resolver.parent(node)
        call = parent if isinstance(parent, cst.Call) and parent.func is node else None
        what = _library_batchnorm(library_model(q, call, resolver), call)
        if what:
            return _layer(what, call or node, resolver, script, file)
    return None


def _library_batchnorm(library, call: Optional[cst.Call]) -> Optional[str]:
    """How a library model with BatchNorm layers is named, None when its table entry has
    none or `call` passes a `norm_layer=` of its own; one whose architecture is not known
    may have them."""
    norm = next((a for a in (call.args if call else ()) if a.keyword and a.keyword.value == "norm_layer"), None)
    if library is None or library.batchnorm is False or norm is not None:
        return None
    if library.batchnorm is None:  # an architecture chosen at run time, or missing from the table
        return f"a {library.library} model whose architecture is not known here (it may have BatchNorm layers)"
    return f"{library.library} `{library.architecture}` (its BatchNorm layers)"


def _named(root: cst.CSTNode, resolver, names_of) -> Optional[cst.CSTNode]:
    """The first call of a BatchNorm class under `root` (else the first mention of one):
    `nn.BatchNorm2d(16)`, `norm_layer=nn.BatchNorm2d`."""
    mentions = [n for n in _references(root, resolver) if names_of(n) & BATCHNORM]
    if not mentions:
        return None
    for node in mentions:
        parent = resolver.parent(node) if resolver is not None else None
        if isinstance(parent, cst.Call) and parent.func is node:
            return parent
    return mentions[0]


def _references(root: cst.CSTNode, resolver=None) -> list:
    """The names and dotted attributes under `root` (not the `.attr` part of one), in order."""
    from fsdp2_retrofit.syntax.names import walk

    out = []
    inner = set()
    for node in walk(root):
        kind = type(node)  # exact types: an ABC isinstance costs a Python call per node
        if kind is cst.Attribute:
            inner.add(id(node.attr))
            inner.add(id(node.value))
            out.append(node)
        elif kind is cst.Name and id(node) not in inner:
            out.append(node)
    return out
