"""A forward that writes into one of its module's parameters through `.data`.

`self.vert_stack.weight.data[:, :, -1].zero_()` in a forward (pytorch-vqvae's Gated PixelCNN
masks its first convolution this way in every forward, in a method its forward calls) changes
the weight the layer is about to read. In one process the write reaches the parameter itself.
After fully_shard, the forward runs on the unsharded copy FSDP2 all-gathered from the shards,
and the write lands in that copy only: the backward gathers the parameter again from the
shards (reshard_after_forward), so the input's gradient is computed with the unmasked weight
(measured on a toy: the layers before it train differently), and the shards, which the
optimizer steps and the checkpoint saves, never hold the write.

Found: in the `forward` of a trained model's class, or of a module class built in the
`__init__` of one (recursively, classes of the script and of the modules it imports from its
folder), and in the methods of that class the forward calls on `self` (transitively): an
in-place call (`zero_()`, `fill_()`, `copy_()`, `mul_()`, ...) on `P.data` or on a slice of
it, or an assignment to `P.data` or `P.data[...]`, where P is a parameter of the module:
`self.<submodule>....weight` / `.bias`, or `self.<name>` that `__init__` binds to
`nn.Parameter(...)`. Writes outside the forward (weight clipping after `optimizer.step()`,
an init method) act on the shards and are not found.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Set

import libcst as cst

from .model_classes import ClassInfo
from fsdp2_retrofit.syntax.names import code, walk


@dataclass(frozen=True)
class ForwardDataWrite:
    node: cst.CSTNode  # the statement's call or assignment that writes
    class_name: str  # the global name of the class whose method writes
    method: str  # the method it is in ("forward", or one forward calls)
    parameter: str  # the source of the parameter written (`self.vert_stack.weight`)


def forward_data_write(model_class: str, classes) -> Optional[ForwardDataWrite]:
    """The first write through `.data` into a parameter in the forward of `model_class` or of a
    module class its `__init__` builds (recursively)."""
    for name in _reachable(model_class, classes):
        info = classes.get(name)
        for method in _forward_methods(info):
            for node in walk(info.methods[method].body):
                parameter = _written_parameter(node, info)
                if parameter is not None:
                    return ForwardDataWrite(node, name, method, parameter)
    return None


def _reachable(model_class: str, classes) -> List[str]:
    """`model_class` and the module classes built in the `__init__` of the classes found (those
    with a definition the rewrite reads: the script's and its sibling modules')."""
    out: List[str] = []
    todo = [model_class]
    while todo:
        name = todo.pop(0)
        info = classes.get(name)
        if name in out or info is None or not info.is_module:
            continue
        out.append(name)
        todo.extend(info.submodules.values())
        todo.extend(c.block_class for c in info.containers if c.block_class)
        init = info.methods.get("__init__")
        if init is not None and info.namer is not None:
            todo.extend(filter(None, (info.namer.of(call.func) for call in walk(init.body) if type(call) is cst.Call)))
    return out


def _forward_methods(info: ClassInfo) -> List[str]:
    """`forward` and the methods of the class it calls on `self`, transitively."""
    if "forward" not in info.methods:
        return []
    out: List[str] = []
    todo = ["forward"]
    while todo:
        name = todo.pop(0)
        if name in out or name not in info.methods:
            continue
        out.append(name)
        for node in walk(info.methods[name].body):
            if type(node) is cst.Call and _is_self_attr(node.func):
                todo.append(node.func.attr.value)
    return out


def _is_self_attr(node) -> bool:
    return isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self"


def _parameter_attrs(info: ClassInfo) -> Set[str]:
    """The attributes `__init__` binds to `nn.Parameter(...)` (`self.scale = nn.Parameter(...)`)."""
    init = info.methods.get("__init__")
    out: Set[str] = set()
    if init is None:
        return out
    for node in walk(init.body):
        if type(node) is cst.Assign and type(node.value) is cst.Call:
            func = node.value.func
            called = func.attr.value if isinstance(func, cst.Attribute) else getattr(func, "value", "")
            if called == "Parameter":
                for target in node.targets:
                    if _is_self_attr(target.target):
                        out.add(target.target.attr.value)
    return out


def _parameter(node, info: ClassInfo) -> bool:
    """`node` names a parameter of the module: `self.<sub>[...]....weight|bias` where `<sub>` is a
    submodule or a container of blocks, or `self.<name>` bound to nn.Parameter in `__init__`."""
    if _is_self_attr(node):
        return node.attr.value in _parameter_attrs(info)
    if not (isinstance(node, cst.Attribute) and node.attr.value in ("weight", "bias")):
        return False
    holders = set(info.submodules) | {c.path[0] for c in info.containers}
    inner = node.value
    while isinstance(inner, (cst.Attribute, cst.Subscript)):
        if _is_self_attr(inner):
            return inner.attr.value in holders
        inner = inner.value
    return False


def _data_of(node) -> Optional[cst.CSTNode]:
    """P when `node` is `P.data` or a slice of it (`P.data[:, :, -1]`)."""
    while isinstance(node, cst.Subscript):
        node = node.value
    if isinstance(node, cst.Attribute) and node.attr.value == "data":
        return node.value
    return None


def _written_parameter(node, info: ClassInfo) -> Optional[str]:
    """The parameter's source when `node` writes into it through `.data`."""
    targets: List[cst.CSTNode] = []
    if type(node) is cst.Call and isinstance(node.func, cst.Attribute):
        name = node.func.attr.value
        if name.endswith("_") and not name.startswith("_") and name != "requires_grad_":
            targets.append(node.func.value)
    elif type(node) is cst.Assign:
        targets.extend(t.target for t in node.targets)
    elif type(node) is cst.AugAssign:
        targets.append(node.target)
    for target in targets:
        parameter = _data_of(target)
        if parameter is not None and _parameter(parameter, info):
            return code(parameter)
    return None

