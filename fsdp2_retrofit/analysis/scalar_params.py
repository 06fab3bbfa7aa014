"""0-dim parameters: `self.logit_scale = nn.Parameter(torch.tensor(0.5))` in a model class.

fully_shard splits every parameter it manages along dim 0 and raises on a 0-dim one
("doesn't support scalar parameters"). The shard stage keeps such parameters out of
fully_shard, whole on every rank, and averages their gradients itself; this module
says which model classes create one (read from `__init__`, parsed, never imported).

A parameter counts when `__init__` assigns `self.<name> = nn.Parameter(<value>)` or
calls `self.register_parameter("<name>", nn.Parameter(<value>))` with a value that is,
or may be, 0-dim:

- `torch.tensor(x)` / `torch.as_tensor(x)` / `torch.scalar_tensor(x)` of a number (a
  literal, arithmetic on numbers, `math.log(...)`, `float(...)`): 0-dim; of a name, an
  attribute or another call: it may be (a list would give a 1-dim tensor);
- a factory given an empty shape (`torch.ones([])`, `torch.zeros(())`, `torch.full((), v)`);
- either of those in arithmetic with numbers (`torch.ones([]) * np.log(1 / 0.07)`, CLIP's),
  through an elementwise torch function (`torch.log(torch.tensor(10.0))`) or a method
  that keeps the shape (`.float()`, `.clone()`).

The shard stage finds the parameters again when the script runs (`p.dim() == 0` over the
model's modules), so a "may be" that is not costs a loop that finds nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Set

import libcst as cst

from fsdp2_retrofit.syntax.names import Resolver, attr_path
from fsdp2_retrofit.syntax.torch_api import ELEMENTWISE, NN_PARAMETER, SHAPE_FACTORIES, TENSOR_OF_VALUE

SAME_SHAPE_METHODS = {"float", "double", "half", "bfloat16", "clone", "detach", "to", "log", "exp", "sqrt", "abs"}
NUMBER_FUNCTIONS = {"builtins.float", "builtins.int", "builtins.abs", "builtins.round", "builtins.pow"}


@dataclass
class ScalarParameter:
    """`self.<attr>` of class `owner` (global name) is, or may be, a 0-dim parameter."""

    owner: Optional[str]  # None: set on a model by the script itself (`model.temperature = nn.Parameter(...)`)
    attr: str
    node: cst.CSTNode  # the nn.Parameter(...) call, in the class's own file
    certain: bool  # False: `torch.tensor(init)` of a value that may be a list

    def describe(self) -> str:
        short = self.owner.rsplit(".", 1)[-1] if self.owner else None
        return f"`{short or ''}{'.' if short else ''}{self.attr}`" + ("" if self.certain else " (may be 0-dim)")


def scalar_parameters_of_init(init: cst.FunctionDef, resolver: Resolver, owner: str) -> List[ScalarParameter]:
    """The 0-dim parameters a class's `__init__` registers on `self`."""
    found: List[ScalarParameter] = []
    for node in resolver.descendants(init, cst.Assign):
        for target in node.targets:
            path = attr_path(target.target)
            if path and len(path) == 2 and path[0] == "self":
                found += _parameter(node.value, path[1], resolver, owner)
    for node in resolver.descendants(init, cst.Call):
        func = node.func
        if (isinstance(func, cst.Attribute) and func.attr.value == "register_parameter"
                and isinstance(func.value, cst.Name) and func.value.value == "self" and len(node.args) == 2):
            name = node.args[0].value
            attr = name.evaluated_value if isinstance(name, cst.SimpleString) else "<name>"
            found += _parameter(node.args[1].value, attr, resolver, owner)
    return found


def _parameter(value, attr: str, resolver: Resolver, owner: str) -> List[ScalarParameter]:
    if not (resolver.is_call_to(value, NN_PARAMETER) and value.args):
        return []
    dim = zero_dim(value.args[0].value, resolver)
    return [] if dim is False else [ScalarParameter(owner, attr, value, dim is True)]


def zero_dim(expr, resolver: Resolver) -> Optional[bool]:
    """True: the tensor `expr` builds is 0-dim; None: it may be; False: it is not (or unknown)."""
    if isinstance(expr, cst.BinaryOperation):
        sides = [s for s in (expr.left, expr.right) if not _number(s, resolver)]
        dims = [zero_dim(s, resolver) for s in sides]
        if not any(d is not False for d in dims):
            return False  # numbers, or no side known to be a 0-dim tensor
        unknown = [s for s, d in zip(sides, dims) if d is False]
        if any(not isinstance(s, (cst.Name, cst.Attribute, cst.Subscript)) for s in unknown):
            return False  # a tensor of another shape broadcasts the result to its own
        return True if all(d is True for d in dims) else None  # a name may hold a number or a tensor
    if isinstance(expr, cst.UnaryOperation):
        return zero_dim(expr.expression, resolver)
    if not isinstance(expr, cst.Call):
        return False
    names = resolver.qnames(expr)
    if names & TENSOR_OF_VALUE and expr.args and expr.args[0].keyword is None:
        data = expr.args[0].value
        if _number(data, resolver):
            return True
        if isinstance(data, (cst.List, cst.Tuple, cst.ListComp, cst.GeneratorExp, cst.SimpleString)):
            return False
        return None
    if names & SHAPE_FACTORIES:
        shape = next((a.value for a in expr.args if a.keyword is not None and a.keyword.value == "size"), None)
        if shape is None and expr.args and expr.args[0].keyword is None and not expr.args[0].star:
            shape = expr.args[0].value
        return isinstance(shape, (cst.List, cst.Tuple)) and not shape.elements
    if names & ELEMENTWISE and expr.args:
        return zero_dim(expr.args[0].value, resolver)
    func = expr.func
    if isinstance(func, cst.Attribute) and func.attr.value in SAME_SHAPE_METHODS and not names:
        return zero_dim(func.value, resolver)
    return False


def _number(expr, resolver: Resolver) -> bool:
    """`expr` is a Python number: a literal, arithmetic on numbers, a math/numpy function of numbers."""
    if isinstance(expr, (cst.Integer, cst.Float)):
        return True
    if isinstance(expr, cst.UnaryOperation):
        return _number(expr.expression, resolver)
    if isinstance(expr, cst.BinaryOperation):
        return _number(expr.left, resolver) and _number(expr.right, resolver)
    if isinstance(expr, cst.Call):
        names = resolver.qnames(expr)
        numeric = any(n.startswith(("math.", "numpy.")) for n in names) or bool(names & NUMBER_FUNCTIONS)
        return numeric and all(_number(a.value, resolver) for a in expr.args)
    return False


def class_tree(classes, roots: Iterable[str], depth: int = 6) -> Set[str]:
    """The classes of the registry that `roots` are built from: submodules and repeated
    blocks, transitively (a class the registry does not hold ends its branch)."""
    seen: Set[str] = set()
    todo = [(r, depth) for r in roots if r]
    while todo:
        name, left = todo.pop()
        info = classes.get(name)
        if info is None or name in seen or left == 0:
            continue
        seen.add(name)
        inner = list(info.submodules.values()) + [c.block_class for c in info.containers if c.block_class]
        todo += [(n, left - 1) for n in inner]
    return seen


def model_scalar_parameters(facts, model) -> List[ScalarParameter]:
    """The 0-dim parameters `model` may hold: those of its class and the classes it is
    built from, and those of any module class of the script or its sibling modules that
    no model's classes reach (it may be handed to a constructor, or built by a helper)."""
    classes = facts.classes
    tree = class_tree(classes, model.alternatives or [model.class_name])
    found = [p for name in sorted(tree) for p in classes.get(name).scalar_params]
    reached: Set[str] = set()
    for other in list(facts.models) + list(facts.copies) + list(facts.frozen_models):
        reached |= class_tree(classes, other.alternatives or [other.class_name])
    for name, info in sorted(classes.classes.items()):
        if info.name == name and name not in reached and info.is_module:
            found += info.scalar_params
    models = {m.name for m in list(facts.models) + list(facts.copies) + list(facts.frozen_models)}
    for target, param in script_scalar_parameters(facts.resolver):
        root = target.split(".", 1)[0]
        if root == model.name or root not in models:  # on this model, or on something that may hold it
            found.append(param)
    return found


def script_scalar_parameters(resolver: Resolver):
    """(target, parameter) for each 0-dim parameter the script sets on an object outside
    its classes: `model.temperature = nn.Parameter(torch.tensor(1.0))` on a library model,
    `model.register_parameter("t", nn.Parameter(...))`."""
    for node in resolver.nodes(cst.Assign):
        if any(isinstance(a, cst.ClassDef) for a in resolver.ancestors(node)):
            continue
        for target in node.targets:
            path = attr_path(target.target)
            if path and len(path) >= 2 and path[0] != "self":
                for param in _parameter(node.value, ".".join(path), resolver, None):
                    yield param.attr, param
    for node in resolver.nodes(cst.Call):
        func = node.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "register_parameter" and len(node.args) == 2):
            continue
        path = attr_path(func.value)
        if not path or path[0] == "self" or any(isinstance(a, cst.ClassDef) for a in resolver.ancestors(node)):
            continue
        name = node.args[0].value
        attr = name.evaluated_value if isinstance(name, cst.SimpleString) else "<name>"
        for param in _parameter(node.args[1].value, ".".join(path) + "." + attr, resolver, None):
            yield ".".join(path), param
