"""DataLoaders: where each is built, with which dataset, shuffle and sampler, and
whether a training loop reads it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Set

import libcst as cst

from .loops import LoopSite, train_loops
from .site_analysis import Block, SiteAnalysis
from fsdp2_retrofit.syntax.names import Resolver, assigned_names, bind_args, names_in
from fsdp2_retrofit.syntax.torch_api import DATALOADERS


@dataclass
class LoaderSite:
    name: str
    stmt: cst.SimpleStatementLine
    call: cst.Call
    block: Block
    dataset: Optional[cst.BaseExpression]
    shuffle: Optional[cst.BaseExpression]
    drop_last: Optional[cst.BaseExpression]
    kwargs_dict: Optional[cst.CSTNode]  # the dict(...) / {...} node the loader unpacks
    has_sampler: bool
    trains: bool = False


class LoaderAnalysis(SiteAnalysis):
    """Finds the DataLoaders and what reads them."""

    def _loaders(self, stmts, train_loops: List[LoopSite]) -> List[LoaderSite]:
        out = []
        iterated = {l.loader for l in train_loops if l.loader}
        for loop in train_loops:
            if isinstance(loop.node, cst.For):
                iterated |= names_in(loop.node.iter)
            iterated |= _next_call_names(loop.node, self.r)
            # micro-batches split off each batch of an outer loop: that loop reads the data
            for outer in self.r.ancestors(loop.node):
                if isinstance(outer, cst.FunctionDef):
                    break
                if isinstance(outer, cst.For):
                    iterated |= names_in(outer.iter)
        # `it = iter(loader)` (or a generator over it) read inside a training loop
        for stmt in stmts:
            if assigned_names(stmt) & iterated and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
                iterated |= names_in(stmt.body[0].value)
        passed = self._names_passed_to_loop_functions(train_loops)
        for stmt in stmts:
            if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            assign = stmt.body[0]
            call = assign.value
            if not self.r.is_call_to(call, DATALOADERS) or not isinstance(assign.targets[0].target, cst.Name):
                continue
            name = assign.targets[0].target.value
            args = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
            kwargs_dict = None
            for a in call.args:
                if a.star == "**" and isinstance(a.value, cst.Name):
                    kwargs_dict = self._dict_bound_before(a.value.value, stmt)
                    if kwargs_dict is not None:
                        for key, value in _dict_entries(kwargs_dict):
                            args.setdefault(key, value)
            positional = [a.value for a in call.args if a.keyword is None and not a.star]
            dataset = args.get("dataset", positional[0] if positional else None)
            out.append(
                LoaderSite(
                    name=name,
                    stmt=stmt,
                    call=call,
                    block=self.r.block_of(stmt),
                    dataset=dataset,
                    shuffle=args.get("shuffle", positional[2] if len(positional) > 2 else None),
                    drop_last=args.get("drop_last"),
                    kwargs_dict=kwargs_dict,
                    has_sampler="sampler" in args or "batch_sampler" in args,
                    trains=name in iterated or name in passed,
                )
            )
        return out

    def _names_passed_to_loop_functions(self, train_loops) -> Set[str]:
        """Loader names handed to a function whose loop trains (train_one_epoch(model, loader))."""
        out: Set[str] = set()
        for loop in train_loops:
            if loop.function is None or not loop.loader:
                continue
            for call in self.calls:
                if isinstance(call.func, cst.Name) and call.func.value == loop.function.name.value:
                    for param, arg in bind_args(loop.function, call):
                        if param == loop.loader and isinstance(arg, cst.Name):
                            out.add(arg.value)
        return out

    def _dict_bound_before(self, name: str, stmt) -> Optional[cst.CSTNode]:
        block = self.r.block_of(stmt)
        if block is None:
            return None
        body = list(block.body)
        for earlier in reversed(body[: body.index(stmt)]):
            if name in assigned_names(earlier):
                value = earlier.body[0].value if isinstance(earlier.body[0], cst.Assign) else None
                if isinstance(value, cst.Dict) or (
                    isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "dict"
                ):
                    return value
                return None
        return None


def training_loaders(module: cst.Module, resolver: Resolver) -> List[LoaderSite]:
    """The DataLoaders of a script, each marked whether a training loop reads it;
    needs no model facts (the lint asks this of scripts that are already sharded)."""
    loops = train_loops(module, resolver)
    return LoaderAnalysis(module, resolver)._loaders(resolver.nodes(cst.SimpleStatementLine), loops)


def _next_call_names(loop, resolver: Resolver) -> Set[str]:
    """Names handed to `next(...)` inside a loop: iterators it draws batches from."""
    found: Set[str] = set()
    for node in resolver.descendants(loop, cst.Call):
        if isinstance(node.func, cst.Name) and node.func.value == "next" and node.args:
            found.update(names_in(node.args[0].value))
    return found


def _dict_entries(node):
    if isinstance(node, cst.Dict):
        for el in node.elements:
            if isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString):
                yield el.key.evaluated_value, el.value
    elif isinstance(node, cst.Call):
        for a in node.args:
            if a.keyword is not None:
                yield a.keyword.value, a.value
