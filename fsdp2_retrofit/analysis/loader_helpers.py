"""DataLoaders a training loop reaches through a helper function or a class.

analysis/data.py finds `loader = DataLoader(...)` statements and the loops reading
those names. Scripts also build the loader elsewhere: `return DataLoader(...)` in a
helper (`for x, y in make_loader(ds):`, `loader = make_loader(ds)`), a method
(`data.train_loader()`), or an attribute set in a constructor
(`self.loader = DataLoader(...)`, read as `data.loader`). `helper_loaders` follows a
training loop's iterable back to such a DataLoader call.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import bind_args, parameter_names
from fsdp2_retrofit.syntax.torch_api import DATALOADERS
from .loops import train_loops
from dataclasses import dataclass

# calls that iterate what they are given: `enumerate(loader)`, `tqdm(loader)`
_WRAPPERS = {"enumerate", "iter", "tqdm", "trange", "zip", "islice", "cycle", "chain", "list", "tuple"}


@dataclass
class HelperLoader:
    call: cst.Call  # the DataLoader(...) call
    where: str  # "make_loader()", "Data.train_loader()", "Data.loader"
    loop: cst.CSTNode  # a training loop that reads it
    dataset: Optional[cst.BaseExpression]
    has_sampler: bool


def helper_loaders(module: cst.Module, resolver, bound_values) -> List[HelperLoader]:
    """DataLoaders built in helpers or classes that a training loop (one calling
    backward()) iterates. `bound_values(name, at)` gives a name's values before `at`."""
    functions: Dict[str, Tuple[cst.Call, str]] = {}  # function or method name -> (call, where)
    attributes: Dict[str, Tuple[cst.Call, str]] = {}  # attribute name -> (call, where)
    for fn in resolver.nodes(cst.FunctionDef):
        cls = resolver.enclosing_class(fn)
        owner = f"{cls.name.value}." if cls is not None and resolver.enclosing_function(fn) is None else ""
        for ret in resolver.descendants(fn, cst.Return):
            if resolver.enclosing_function(ret) is not fn or ret.value is None:
                continue
            call = _loader_call(resolver, ret.value, ret, bound_values)
            if call is not None:
                functions.setdefault(fn.name.value, (call, f"{owner}{fn.name.value}()"))
        if owner:
            for assign in resolver.descendants(fn, cst.Assign):
                if resolver.is_call_to(assign.value, DATALOADERS):
                    for t in assign.targets:
                        target = t.target
                        if (isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name)
                                and target.value.value == "self"):
                            attributes.setdefault(target.attr.value, (assign.value, f"{owner}{target.attr.value}"))
    if not functions and not attributes:
        return []
    out: List[HelperLoader] = []
    seen = set()
    for loop in _reading_loops(module, resolver):
        found = _resolve(resolver, loop.iter, loop, functions, attributes, bound_values, depth=3)
        if found is not None and id(found[0]) not in seen:
            seen.add(id(found[0]))
            call, where = found
            out.append(HelperLoader(call, where, loop, _dataset(call), _has_sampler(call)))
    return out


def _reading_loops(module, resolver) -> Iterator[cst.For]:
    """The training `for` loops and the `for` loops around them (micro-batches split off
    an outer loop's batch)."""
    for site in train_loops(module, resolver):
        if isinstance(site.node, cst.For):
            yield site.node
        for outer in resolver.ancestors(site.node):
            if isinstance(outer, cst.FunctionDef):
                break
            if isinstance(outer, cst.For):
                yield outer


def _resolve(resolver, expr, at, functions, attributes, bound_values, depth) -> Optional[Tuple[cst.Call, str]]:
    if depth == 0 or expr is None:
        return None
    while isinstance(expr, cst.Call) and expr.args and _func_name(expr.func) in _WRAPPERS:
        expr = expr.args[0].value
    if isinstance(expr, cst.Call):
        name = _func_name(expr.func)
        if resolver.is_call_to(expr, DATALOADERS):
            return None  # built right here: data.py's finding
        return functions.get(name) if name is not None else None
    if isinstance(expr, cst.Attribute):
        return attributes.get(expr.attr.value)
    if isinstance(expr, cst.Name):
        values = bound_values(expr.value, at)
        if values:
            return _resolve(resolver, values[-1], at, functions, attributes, bound_values, depth - 1)
        fn = resolver.enclosing_function(at)
        if fn is not None and expr.value in parameter_names(fn):
            # a parameter: what the callers of this function pass for it
            for call in resolver.nodes(cst.Call):
                if isinstance(call.func, cst.Name) and call.func.value == fn.name.value:
                    for param, arg in bind_args(fn, call):
                        if param == expr.value:
                            found = _resolve(resolver, arg, call, functions, attributes, bound_values, depth - 1)
                            if found is not None:
                                return found
    return None


def _loader_call(resolver, expr, at, bound_values) -> Optional[cst.Call]:
    if resolver.is_call_to(expr, DATALOADERS):
        return expr
    if isinstance(expr, cst.Name):
        values = bound_values(expr.value, at)
        if values and resolver.is_call_to(values[-1], DATALOADERS):
            return values[-1]
    return None


def _func_name(func) -> Optional[str]:
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return None


def _dataset(call: cst.Call) -> Optional[cst.BaseExpression]:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == "dataset":
            return a.value
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    return positional[0] if positional else None


def _has_sampler(call: cst.Call) -> bool:
    """A sampler is given, or may be (`**kwargs` we cannot see into)."""
    return any(
        (a.keyword is not None and a.keyword.value in ("sampler", "batch_sampler")) or a.star == "**"
        for a in call.args
    )
