"""Optimizers: where each is built, from which models' parameters (param groups and
the statements that feed them included), and the names that hold them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import libcst as cst

from .site_analysis import Block, SiteAnalysis
from fsdp2_retrofit.syntax.names import Resolver, assigned_names, bind_args, root_name
from fsdp2_retrofit.syntax.torch_api import (  # noqa: F401  (FLATTENING_OPTIMIZERS: the shard stage imports it from here)
    FLATTENING_OPTIMIZERS,
    NOT_OPTIMIZERS,
    OPTIMIZER_BASES,
    OPTIMIZER_PREFIX,
)


@dataclass
class OptimizerSite:
    name: str
    stmt: cst.SimpleStatementLine
    block: Block
    models: List[str]
    # statements before it that turn the models' parameters into its argument (param groups)
    feeders: List[cst.SimpleStatementLine] = field(default_factory=list)
    call: Optional[cst.Call] = None
    own_class: Optional[cst.ClassDef] = None  # an optimizer class written in the script


class OptimizerAnalysis(SiteAnalysis):
    """Finds the optimizers and the models they train."""

    def _optimizers(self, stmts, bindings) -> List[OptimizerSite]:
        module_names = {b[0] for b in bindings}
        own = self._own_optimizer_classes()
        out = []
        for target, stmt, call in self._named_assignments(stmts):
            if not isinstance(call, cst.Call):
                continue
            own_class = own.get(call.func.value) if isinstance(call.func, cst.Name) else None
            is_torch_optim = (
                self.r.calls_prefix(call, OPTIMIZER_PREFIX)
                and not any(self.r.calls_prefix(call, p) for p in NOT_OPTIMIZERS)
            ) or self._is_getattr_optimizer(call) or own_class is not None
            receiver = root_name(call.func) if isinstance(call.func, cst.Attribute) else None
            feeders: List[cst.SimpleStatementLine] = []
            if is_torch_optim:
                params = [a for a in call.args if (a.keyword is None and not a.star) or (
                    a.keyword is not None and a.keyword.value == "params")][:1]
                models = self._fed_models(_ordered_names(params), stmt, module_names, feeders)
            elif receiver in module_names and "optim" in call.func.attr.value.lower():
                models = [receiver]  # model.configure_optimizers(...)
            else:
                continue
            block = self.r.block_of(stmt)
            out.append(
                OptimizerSite(target, stmt, block, models, feeders, call, own_class)
            )
        return out

    def _own_optimizer_classes(self) -> Dict[str, cst.ClassDef]:
        """Top-level classes of the script that subclass torch.optim.Optimizer."""
        return {
            node.name.value: node for node in self.module.body
            if isinstance(node, cst.ClassDef) and any(self.r.qnames(b.value) & OPTIMIZER_BASES for b in node.bases)
        }

    def _is_getattr_optimizer(self, call: cst.Call) -> bool:
        """`getattr(torch.optim, args.optim)(model.parameters(), ...)`"""
        inner = call.func
        return (
            isinstance(inner, cst.Call)
            and isinstance(inner.func, cst.Name)
            and inner.func.value == "getattr"
            and bool(inner.args)
            and "torch.optim" in self.r.qnames(inner.args[0].value)
        )

    def _fed_models(self, names, stmt, module_names, feeders, depth: int = 3) -> List[str]:
        """Models whose parameters reach the optimizer, directly or through variables
        built earlier in the same block: `decay = [...]` from `model.named_parameters()`,
        or lists filled by a loop over them."""
        found: List[str] = []
        block = self.r.block_of(stmt)
        body = list(block.body) if block is not None else []
        earlier = body[: body.index(stmt)] if stmt in body else []
        for name in names:
            if name in module_names:
                found.append(name)
                continue
            if depth == 0:
                continue
            for source, reads in _sources_of(name, earlier):
                inner = self._fed_models(_ordered_names([cst.Arg(reads)]), source, module_names, feeders, depth - 1)
                if inner:
                    if source not in feeders:
                        feeders.append(source)
                    found.extend(n for n in inner if n not in found)
        feeders.sort(key=lambda s: body.index(s) if s in body else -1)
        return found

    def _optimizer_names(self, optimizers, model_names):
        """Optimizer names per function, following calls; each mapped to its model's name there."""
        names: Dict[Optional[cst.FunctionDef], Dict[str, Optional[str]]] = {}
        for opt in optimizers:
            if opt.models:
                fn = self.r.enclosing_function(opt.stmt)
                names.setdefault(fn, {})[opt.name] = opt.models[0] if len(opt.models) == 1 else None
        changed = True
        while changed:
            changed = False
            for call, callee in self._local_calls():
                known = names.get(self.r.enclosing_function(call), {})
                bound = list(bind_args(callee, call))
                for param, arg in bound:
                    if not (isinstance(arg, cst.Name) and arg.value in known) or param in names.get(callee, {}):
                        continue
                    model = known[arg.value]
                    there = [p for p, a in bound if isinstance(a, cst.Name) and a.value == model]
                    callee_models = sorted(model_names.get(callee, set()))
                    names.setdefault(callee, {})[param] = (
                        there[0] if there else callee_models[0] if len(callee_models) == 1 else None
                    )
                    changed = True
        return names

    def _class_optimizers(self, calls) -> List[tuple]:
        out = []
        for call in calls:
            cls = self.r.enclosing_class(call)
            if cls is None or self.classes.is_module_class(cls.name.value):
                continue
            if self.r.calls_prefix(call, OPTIMIZER_PREFIX) and not any(
                self.r.calls_prefix(call, p) for p in NOT_OPTIMIZERS
            ):
                out.append((cls.name.value, call))
        return out


def optimizer_sites(module: cst.Module, resolver: Resolver, bindings) -> List[OptimizerSite]:
    """The optimizers that train a model of `bindings` (models.module_bindings)."""
    optimizers = OptimizerAnalysis(module, resolver)._optimizers(resolver.nodes(cst.SimpleStatementLine), bindings)
    return [o for o in optimizers if o.models]


# tensor methods and functions that need a whole matrix (or all of a tensor's elements in order)
WHOLE_TENSOR_CALLS = frozenset({
    "reshape", "view", "view_as", "flatten", "t", "transpose", "permute", "mm", "matmul", "bmm", "svd", "qr",
    "inverse", "pinv", "eigh", "cat", "stack", "outer", "einsum",
})


def whole_tensor_operation(cls: cst.ClassDef) -> Optional[cst.CSTNode]:
    """The first operation of an optimizer class's methods that works on whole matrices
    or flattens tensors (`@`, `.T`, `.reshape(...)`, `torch.linalg...`, ...): on a
    DTensor shard it either gathers the whole tensor or computes on a piece of it."""
    found: List[cst.CSTNode] = []

    class _W(cst.CSTVisitor):
        def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
            if isinstance(node.operator, cst.MatrixMultiply):
                found.append(node)

        def visit_Attribute(self, node: cst.Attribute) -> None:
            if node.attr.value in ("T", "mT", "H", "mH", "linalg"):
                found.append(node)

        def visit_Call(self, node: cst.Call) -> None:
            func = node.func
            name = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
            if name in WHOLE_TENSOR_CALLS:
                found.append(node)

    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value != "__init__":
            stmt.visit(_W())
    return found[0] if found else None


def _ordered_names(args) -> List[str]:
    seen: List[str] = []

    class _N(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            if n.value not in seen:
                seen.append(n.value)

    for a in args:
        a.value.visit(_N())
    return seen


def _sources_of(name: str, earlier: list):
    """(statement, expression it reads) for how `name` got its value: its last
    assignment, and loops after it that append to it."""
    out = []
    for i in range(len(earlier) - 1, -1, -1):
        stmt = earlier[i]
        if isinstance(stmt, cst.SimpleStatementLine) and name in assigned_names(stmt):
            value = stmt.body[0].value if isinstance(stmt.body[0], cst.Assign) else None
            if value is not None:
                out.append((stmt, value))
            for later in earlier[i + 1 :]:
                if isinstance(later, cst.For) and _mutates(later.body, name):
                    out.append((later, later.iter))
            break
    return out


def _mutates(node, name: str) -> bool:
    found = []

    class _M(cst.CSTVisitor):
        def visit_Call(self, n: cst.Call) -> None:
            f = n.func
            if isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and f.value.value == name:
                if f.attr.value in ("append", "extend", "add", "update"):
                    found.append(n)

    node.visit(_M())
    return bool(found)
