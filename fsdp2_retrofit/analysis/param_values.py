"""Values read from a sharded module's parameters, outside its forward.

Outside forward, FSDP2's parameters are DTensors holding one shard each. An
expression *reads parameters* when it reaches `model.<...>.weight` / `.bias` of a
sharded module, or a variable of a loop or comprehension over
`model.parameters()` / `model.named_parameters()`, or a local bound to such an
expression, other than through `.full_tensor()` / `.to_local()` (plain tensors) or
`.item()`, `.shape`, `.size()`, `.numel()` (plain numbers). An expression is a *plain
tensor* when it holds a forward output of a sharded module (`loss = f(model(x), y)`)
or a tensor built by a torch factory (`torch.zeros(...)`).
"""
from __future__ import annotations

from typing import Optional

import libcst as cst

from fsdp2_retrofit.syntax.torch_api import TENSOR_FACTORIES as _FACTORIES
from .closures import sharded_here

_PARAM_ATTRS = {"weight", "bias"}
_PARAM_ITERS = {"parameters", "named_parameters"}
_PLAIN_OUT = {"full_tensor", "to_local", "item", "size", "numel", "dim", "tolist", "numpy"}
_PLAIN_ATTRS = {"shape", "dtype", "device", "ndim", "requires_grad"}
_WRAPPERS = {"enumerate", "list", "tuple", "zip", "reversed", "sorted", "iter"}


class ParamValues:
    def __init__(self, ctx):
        self.ctx = ctx
        self.r = ctx.resolver
        self.shards = ctx.shards

    def in_forward(self, node: cst.CSTNode) -> bool:
        return any(isinstance(a, cst.FunctionDef) and a.name.value == "forward" for a in self.r.ancestors(node))

    def reads_params(self, expr, depth: int = 2) -> Optional[str]:
        """The sharded root whose parameters `expr` reads (as DTensors), or None."""
        if depth < 0 or expr is None:
            return None
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _PLAIN_OUT:
            return None
        if isinstance(expr, cst.Attribute):
            if expr.attr.value in _PLAIN_ATTRS:
                return None
            if expr.attr.value in _PARAM_ATTRS:
                found = sharded_here(self.shards, expr.value, expr)
                if found is not None:
                    return found[0]
        if isinstance(expr, cst.Name):
            root = self._loop_param(expr)
            if root is not None:
                return root
            for value in self._values(expr):
                root = self.reads_params(value, depth - 1)
                if root is not None:
                    return root
            return None
        if isinstance(expr, (cst.Lambda, cst.FunctionDef)):
            return None
        for child in expr.children:
            if isinstance(child, cst.BaseExpression) or isinstance(child, (cst.Arg, cst.Element, cst.CompFor,
                                                                          cst.DictElement, cst.BaseSlice,
                                                                          cst.SubscriptElement, cst.BinaryOperation)):
                root = self.reads_params(child, depth)
                if root is not None:
                    return root
        return None

    def plain_tensor(self, expr, depth: int = 2) -> bool:
        """`expr` holds a forward output of a sharded module or a factory-made tensor."""
        if depth < 0 or expr is None:
            return False
        if isinstance(expr, cst.Call):
            if self.r.qnames(expr) & _FACTORIES:
                return True
            func = expr.func
            if not isinstance(func, cst.Attribute) or func.attr.value == "forward":
                target = func.value if isinstance(func, cst.Attribute) else func
                if self.shards.sharded_module(target, expr, unit=True) is not None:
                    return True
        if isinstance(expr, cst.Name):
            return any(self.plain_tensor(v, depth - 1) for v in self._values(expr))
        if isinstance(expr, (cst.Lambda,)):
            return False
        return any(
            self.plain_tensor(c, depth) for c in expr.children
            if isinstance(c, (cst.BaseExpression, cst.Arg, cst.Element, cst.SubscriptElement, cst.BaseSlice))
        )

    def _values(self, name: cst.Name):
        """The last value bound to `name` before it is read, not the assignment it is
        read in (`loss = loss + ...` reads the earlier `loss`)."""
        at = self.r.statement_of(name) or name
        return self.shards.bound_values(name.value, at)[-1:]

    def _loop_param(self, name: cst.Name) -> Optional[str]:
        """The root when `name` is the variable of an enclosing loop or comprehension over
        `model.parameters()` (or the value of `named_parameters()`)."""
        for anc in self.r.ancestors(name):
            if isinstance(anc, cst.FunctionDef):
                return None
            loops = []
            if isinstance(anc, (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)):
                comp = anc.for_in
                while comp is not None:
                    loops.append(comp)
                    comp = comp.inner_for_in
            elif isinstance(anc, cst.For):
                loops.append(anc)
            for loop in loops:
                root = self._param_iteration(loop, name.value)
                if root is not None:
                    return root
        return None

    def _param_iteration(self, loop, var: str) -> Optional[str]:
        it = loop.iter
        named = False
        while isinstance(it, cst.Call) and isinstance(it.func, cst.Name) and it.func.value in _WRAPPERS and it.args:
            named = named or it.func.value == "enumerate"
            it = it.args[0].value
        if not (isinstance(it, cst.Call) and isinstance(it.func, cst.Attribute) and it.func.attr.value in _PARAM_ITERS):
            return None
        target = loop.target
        wanted = target
        if it.func.attr.value == "named_parameters" or named:
            if not isinstance(target, (cst.Tuple, cst.List)) or not target.elements:
                return None
            wanted = target.elements[-1].value
            if it.func.attr.value == "named_parameters" and named:
                if not isinstance(wanted, (cst.Tuple, cst.List)) or not wanted.elements:
                    return None
                wanted = wanted.elements[-1].value
        if not (isinstance(wanted, cst.Name) and wanted.value == var):
            return None
        found = sharded_here(self.shards, it.func.value, loop)
        return found[0] if found is not None else None
