"""How a script launches: its process group, the names it keeps for the mesh and the
rank, and the DDP/DataParallel/FSDP1 wrappers it already uses."""
from __future__ import annotations

from typing import List, Optional

import libcst as cst

from .returns import names_out, returns_any
from .site_analysis import SiteAnalysis
from fsdp2_retrofit.syntax.names import Resolver, instance_attribute, is_main_guard
from fsdp2_retrofit.syntax.rank import is_rank_value
from fsdp2_retrofit.syntax.torch_api import DATA_PARALLEL, DDP, FSDP1_CLASSES, INIT_DEVICE_MESH, INIT_PROCESS_GROUP


DISTRIBUTED_WRAPPERS = {
    **dict.fromkeys(DDP, "DistributedDataParallel"),
    **dict.fromkeys(DATA_PARALLEL, "DataParallel"),
    **dict.fromkeys(FSDP1_CLASSES, "FullyShardedDataParallel (FSDP1)"),
}


class LaunchAnalysis(SiteAnalysis):
    """Finds what the script does to launch itself."""

    def _entry(self, model):
        """Where the launch goes: (block, scope, call, unfollowed). The block and scope that
        build `model`; or, when the function building it returns it (`model, opt = build(cfg)`),
        those of the one assignment that receives it, followed up to a function that keeps it
        (call: that assignment's call of the helper that returns the model). unfollowed: the
        helper, when it returns the model and that is not received by one such assignment (the
        rest None). A returned model nothing receives (`main()` as a statement, or no call by
        name) stays where it is built."""
        block, scope, call, names = model.block, model.scope, None, {model.name}
        caller = self._own_method_call(scope) if isinstance(scope, cst.FunctionDef) and "." in model.name else None
        if caller is not None:  # `self.build_model()` in the Solver's __init__ builds `self.net`: the launch goes there
            return self.r.block_of(self.r.statement_of(caller)), self.r.enclosing_function(caller), caller, None
        while isinstance(scope, cst.FunctionDef) and returns_any(self.r, scope, names):
            calls = self.calls_of(scope)
            if not calls or (len(calls) == 1 and type(self.r.parent(calls[0])) is cst.Expr):
                break  # nothing here receives the model: `main()` discarding it, or `fire.Fire(main)`
            out = names_out(self.r, calls[0], scope, names) if len(calls) == 1 else {}
            if not out or self.r.enclosing_function(calls[0]) is scope:
                return None, None, None, scope
            call = calls[0]
            block = self.r.block_of(self.r.statement_of(call))
            scope = self.r.enclosing_function(call) or self.module
            names = set(out)
        return block, scope, call, None

    def _own_method_call(self, fn: cst.FunctionDef) -> Optional[cst.Call]:
        """The one call of the method `fn` by another method of its class on its own instance, as a
        statement (`self.build_model()` in __init__), or None."""
        cls = self.r.enclosing_class(fn)
        if cls is None:
            return None
        found = []
        for method in cls.body.body:
            if not isinstance(method, cst.FunctionDef) or method is fn or not method.params.params:
                continue
            me = method.params.params[0].name.value
            found += [c for c in self.r.descendants(method, cst.Call) if instance_attribute(c.func) == f"{me}.{fn.name.value}"]
        if len(found) != 1 or type(self.r.parent(found[0])) is not cst.Expr:
            return None
        return found[0]

    def _launch_names(self, stmts, entry_scope, mesh_scope=None):
        """The mesh and the rank names of the entry scope (the script's own, e.g.
        `rank = int(os.environ["RANK"])`, or the launch stage's); the mesh is looked for in
        `mesh_scope` when given (a helper that builds and shards the model, see _entry)."""
        mesh = rank = None
        mesh_scope = entry_scope if mesh_scope is None else mesh_scope
        entry_fn = entry_scope if isinstance(entry_scope, cst.FunctionDef) else None
        mesh_fn = mesh_scope if isinstance(mesh_scope, cst.FunctionDef) else None
        for stmt in stmts:
            if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            assign = stmt.body[0]
            value, target = assign.value, assign.targets[0].target
            if isinstance(target, cst.Name) and self.r.is_call_to(value, INIT_DEVICE_MESH) and (
                mesh_scope is None or self.r.enclosing_function(stmt) is mesh_fn
            ):
                mesh = mesh or target.value
            if entry_scope is not None and self.r.enclosing_function(stmt) is not entry_fn:
                continue
            pairs = []
            if isinstance(target, cst.Tuple) and isinstance(value, cst.Tuple):
                pairs = list(zip(target.elements, value.elements))
                pairs = [(t.value, v.value) for t, v in pairs]
            else:
                pairs = [(target, value)]
            if not self._on_every_path(stmt):
                continue  # `if ddp: ddp_rank = int(os.environ["RANK"])`: unbound in the other mode
            for t, v in pairs:
                if isinstance(t, cst.Name) and is_rank_value(v, self.r):
                    rank = rank or t.value
        return mesh, rank

    def _on_every_path(self, stmt) -> bool:
        """`stmt` sits directly in a function's body, the module's or the main guard's (not in a
        branch or a loop): what it binds is bound wherever the code after it runs."""
        block = self.r.block_of(stmt)
        owner = self.r.parent(block) if block is not None and not isinstance(block, cst.Module) else None
        return isinstance(block, cst.Module) or isinstance(owner, cst.FunctionDef) or is_main_guard(owner)

    def _distributed_init(self, calls) -> Optional[cst.Call]:
        """The script's own `init_process_group(...)` call, if any."""
        return next(
            (c for c in calls if self.r.is_call_to(c, INIT_PROCESS_GROUP)), None
        )

    def _wrappers(self, calls) -> List[tuple]:
        """(line, name) of each DDP/DataParallel/FSDP1 use."""
        return [
            (self.r.line(c), DISTRIBUTED_WRAPPERS[q])
            for c in calls
            for q in self.r.qnames(c)
            if q in DISTRIBUTED_WRAPPERS
        ]


def launch_names(module: cst.Module, resolver: Resolver, entry_scope=None):
    """(mesh name, rank name) the entry scope (None: module level) binds."""
    return LaunchAnalysis(module, resolver)._launch_names(resolver.nodes(cst.SimpleStatementLine), entry_scope)


def distributed_init(module: cst.Module, resolver: Resolver) -> Optional[cst.Call]:
    """The script's own `init_process_group(...)` call, if any."""
    return LaunchAnalysis(module, resolver)._distributed_init(resolver.nodes(cst.Call))


def distributed_wrappers(module: cst.Module, resolver: Resolver) -> List[tuple]:
    """(line, name) of each DDP/DataParallel/FSDP1 use."""
    return LaunchAnalysis(module, resolver)._wrappers(resolver.nodes(cst.Call))
