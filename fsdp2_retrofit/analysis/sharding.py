"""ShardFacts: what an FSDP2 script shards, where, and which values hold sharded state.

The lint rules of `check` ask these facts their questions ("is this name a sharded
module here?", "does this value hold DTensor state?", "is this call inside a
rank-0 branch?"). A name counts as sharded only after the `fully_shard` call that
shards it (in the function that shards it), everywhere in functions that receive it
as an argument, and in every method of a class that shards `self.<attr>`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import libcst as cst

from .closures import closure_reads
from .optimizer_factories import parameter_handing_calls, returned_optimizer, stepped
from fsdp2_retrofit.syntax.names import Resolver, attr_path, bind_args, code, module_itself, names_in, parameter_names
from fsdp2_retrofit.syntax.rank import rank_zero_side
from fsdp2_retrofit.syntax.torch_api import (
    DDP as DDP_CLASSES,
    FSDP1_CLASSES,
    FSDP_MODULE,
    FULLY_SHARD,
    GET_MODEL_STATE_DICT,
    GET_OPTIMIZER_STATE_DICT,
    GET_STATE_DICT,
    STATE_DICT_GETTERS,
    is_optimizer_call,
)

FSDP1 = FSDP1_CLASSES
# what each state-dict getter returns, for messages
_GETTER_KINDS = {
    **dict.fromkeys(GET_MODEL_STATE_DICT, "model"),
    **dict.fromkeys(GET_OPTIMIZER_STATE_DICT, "optimizer"),
    **dict.fromkeys(GET_STATE_DICT, "model and optimizer"),
}
# methods that give parts of a module (iterating them yields submodules or entries)
_PART_METHODS = {
    "children", "modules", "named_children", "named_modules", "values", "items", "parameters", "named_parameters",
}
_COPIES = frozenset({"copy.deepcopy", "copy.copy"})
_ITERATION_WRAPPERS = {"enumerate", "reversed", "list", "tuple", "iter", "zip", "sorted"}

Scope = Optional[cst.CSTNode]  # FunctionDef, ClassDef (for self.attr), or None for the module


@dataclass
class ShardSite:
    """One `fully_shard(target)` (or FSDP1 wrapper) call."""

    call: cst.Call = field(repr=False)
    root: str  # "model", or "self.model" inside a class
    whole: bool  # the target is the root itself, not one of its parts
    scope: Scope
    order: int  # source order (Resolver.order)
    legacy: bool = False  # FullyShardedDataParallel (FSDP1)
    # the call is fully_shard/FSDP itself (not a helper that shards, nor an argument received)
    direct: bool = False
    # the expression whose module value the call shards (its argument, or the call itself
    # when the name bound to its result is the root); None for a site a function receives
    target: Optional[cst.BaseExpression] = field(default=None, repr=False)


class Handed(NamedTuple):
    """A sharded module a call hands to a class or function of another project module
    (`Trainer(model, ...)` with `from trainer import Trainer`): what `check` tells that
    module's analysis when it checks both in one run (check/checker.py). A NamedTuple, not a
    dataclass: check imports this module on every run, and a frozen dataclass costs ~4 M
    instructions to create (benchmarks/RESULTS.md)."""

    file: str  # the module's file, resolved
    name: str  # the class or function there
    key: Union[int, str]  # the argument: its position among the positional ones, or its keyword
    where: str  # "train.py:17", the call
    whole: bool
    legacy: bool


@dataclass
class OptimizerBuild:
    name: str
    call: cst.Call = field(repr=False)
    models: Set[str]  # roots whose parameters reach it
    scope: Scope
    order: int
    # root -> where its parameters were taken, when before the call (`params = list(model.parameters())`
    # earlier, then `SGD(params)`): the tensors are those the module held there
    taken: Dict[str, Tuple[int, cst.CSTNode]] = field(default_factory=dict)  # root -> (order, the value)


@dataclass
class ShardFacts:
    resolver: Resolver
    sites: List[ShardSite]
    optimizers: List[OptimizerBuild]
    # name -> [(order, (root, whole))] per function, in source order: what each binding aliases
    _aliases: Dict[Scope, Dict[str, List[Tuple[int, Tuple[str, bool]]]]] = field(default_factory=dict)
    _received: Dict[Scope, Dict[str, ShardSite]] = field(default_factory=dict)
    _bindings: Dict[Scope, Dict[str, List[tuple]]] = field(default_factory=dict)
    _closure_reads: Dict[Scope, Set[str]] = field(default_factory=dict)
    # the analysis's value flow (analysis/flow.py): a module reached by no name of its own
    # (`trainer.model`, a method's return) is matched to a site by value
    flow: object = field(default=None, repr=False)
    _by_value: Dict[Tuple[str, int], List[ShardSite]] = field(default_factory=dict)
    _site_origins: Dict[int, frozenset] = field(default_factory=dict)
    # sharded modules this file hands to classes and functions of other project modules
    handed_out: List[Handed] = field(default_factory=list)
    # names holding a rank by their value (`self.gpu_id = int(os.environ["LOCAL_RANK"])`), made on demand

    # -- positions ----------------------------------------------------------

    def order(self, node: cst.CSTNode) -> int:
        return self.resolver.order(node)

    def scope_of(self, node: cst.CSTNode) -> Scope:
        return self.resolver.enclosing_function(node)

    # -- modules ------------------------------------------------------------

    def part(self, expr: cst.BaseExpression, at: cst.CSTNode) -> Optional[Tuple[str, bool]]:
        """(root, whole) for an expression naming a module or a part of one; loop
        variables and aliases over a module's parts resolve to that module."""
        found = part_root(expr)
        if found is None:
            return None
        root, whole = found
        alias = self.alias(root, at)
        if alias is not None:
            return alias[0], alias[1] and whole
        if root == "self":
            return None
        return root, whole

    def alias(self, name: str, at: cst.CSTNode) -> Optional[Tuple[str, bool]]:
        """(root, whole) of the module (or part) `name` aliases at `at`: its binding last
        before `at` in its function (`for m in a.layers: ...`, then `for m in b.layers: ...`:
        `a`, then `b`); a read before any binding (a loop read again) takes the last one."""
        bindings = self._aliases.get(self.scope_of(at), {}).get(name)
        if not bindings:
            return None
        here = self.order(at)
        before = [b for b in bindings if b[0] < here]
        return (before or bindings)[-1][1]

    def sites_for(self, root: str, at: cst.CSTNode) -> List[ShardSite]:
        """The shard sites of `root` that are in effect at `at`."""
        fn = self.scope_of(at)
        here = self.order(at)
        out = []
        for site in self.sites:
            if site.root != root:
                continue
            if root.startswith("self."):
                cls = self.resolver.enclosing_class(at)
                if cls is not None and cls is self.resolver.enclosing_class(site.call):
                    if site.scope is not fn or site.order < here:
                        out.append(site)
            elif site.scope is fn:
                if site.order < here:
                    out.append(site)
            elif site.scope is None and fn is not None and not self._binds(fn, root):
                out.append(site)  # a module-level model used inside a function
        received = self._received.get(fn, {}).get(root)
        if received is not None:
            out.append(received)
        if not out and self._closes_over(fn, root):
            out = self.sites_for(root, fn)  # sharded around the nested def, before it
        return out or self._by_value.get((root, id(at)), [])

    def _closes_over(self, fn: Scope, root: str) -> bool:
        """Whether nested function `fn` reads `root` from the function around it."""
        if fn is None or root.startswith("self.") or self.scope_of(fn) is None:
            return False
        if fn not in self._closure_reads:
            self._closure_reads[fn] = closure_reads(fn)
        return root.split(".", 1)[0] in self._closure_reads[fn] and not self._binds(fn, root)

    def sharded_module(self, expr: cst.BaseExpression, at: cst.CSTNode, unit: bool = False) -> Optional[str]:
        """The root name when `expr` is (part of) a sharded module at `at`.

        unit=True asks whether `expr` itself runs FSDP2's hooks when called: the
        root when the root was sharded, a part when any part was (only blocks
        sharded: the root's own forward is an ordinary one)."""
        found = self.part(expr, at)
        sites = self.sites_for(found[0], at) if found is not None else []
        if not sites:
            found, sites = self._attribute_alias(expr, at)
        if not sites:
            found, sites = self._value_sites(expr, at)
            if not sites:
                return None
        root, whole = found
        if unit and whole and not any(s.whole for s in sites):
            return None
        return root

    def _value_sites(self, expr: cst.BaseExpression, at: cst.CSTNode) -> Tuple[Optional[Tuple[str, bool]], list]:
        """((root, whole), sites) when every module `expr` can hold (its parts stripped) is, by
        value, one a site shards (the flow's origins) and the site is in effect at `at` (_in_effect).
        Remembered for sites_for(root, at)."""
        if self.flow is None:
            return None, []
        sites, whole = [], True
        if type(expr) is cst.Subscript:  # `parts[0]`, `models["lm"]` of a list or dict the script builds
            sites = (self._holding(self.flow.values(expr), at) or self._entry_sites(expr)
                     or self._held_entry_sites(expr))
        base, whole = _base(expr) if not sites else (None, True)
        while not sites:
            if base is None or (type(base) is cst.Name and base.value == "self"):
                return None, []
            origins = self.flow.values(base)
            sites = self._holding(origins, at) or self._entries_returned(origins, base)
            if sites:
                break
            if type(base) is not cst.Attribute:
                return None, []
            base, whole = _base(base.value)[0], False  # `trainer.model.blocks`: a part of `trainer.model`
        root = sites[-1].root
        self._by_value[(root, id(at))] = [s for s in sites if s.root == root]
        return (root, whole), self._by_value[(root, id(at))]

    def _attribute_alias(self, expr: cst.BaseExpression, at: cst.CSTNode):
        """((root, whole), sites) where `expr`'s base is a local name bound only to an attribute of
        `self` before `at` (`net = self._model`; `net.forward(x)`): that attribute, as sites_for reads it
        (sharded anywhere in the class); else (None, [])."""
        base, whole = _base(expr)
        if type(base) is not cst.Name or base.value == "self":
            return None, []
        values = self.bound_values(base.value, at)
        roots = {part_root(v) for v in values}
        if len(roots) != 1:
            return None, []
        root = roots.pop()
        if root is None or not root[1] or not root[0].startswith("self."):
            return None, []
        sites = self.sites_for(root[0], at)
        return ((root[0], whole), sites) if sites else (None, [])

    def _entry_sites(self, expr: cst.Subscript) -> List[ShardSite]:
        """The sites of what every entry `expr` can read held where the container was written (`parts =
        [model]` after `model = shard(model)`: the name as it is there, where the flow, which reads every
        binding of `model`, cannot tell); [] unless every entry is sharded there."""
        return self._sharded_entries(self.flow.entries(expr))

    def _held_entry_sites(self, expr: cst.Subscript) -> List[ShardSite]:
        """`self.model_parts[0]` in a method of a class one of whose methods stores `self.model_parts =
        [model]` with `model` sharded there: the sites of those entries. An attribute holds what any
        store of its class put there, as sites_for reads a sharded `self.model` in every method; a
        store the flow does not see into (a pipeline branch's `(..., self.model_parts, ...) =
        build(...)`) does not hide the one it does."""
        for entries in self.flow.attribute_entries(expr):
            sites = self._sharded_entries(entries)
            if sites:
                return sites
        return []

    def _entries_returned(self, origins, base) -> List[ShardSite]:
        """`self._first_part().forward(x)` where the method returns `self.model_parts[0]` (a container's
        entry, which the flow leaves as the expression): the sites of what every such entry holds; []
        unless every origin is one (base a call: a value handed back, not a name bound here)."""
        if type(base) is not cst.Call or not origins:
            return []
        out: List[ShardSite] = []
        for origin in origins:
            if type(origin) is not cst.Subscript:
                return []
            sites = self._entry_sites(origin) or self._held_entry_sites(origin)
            if not sites:
                return []
            out += sites
        return out

    def _sharded_entries(self, entries: Optional[list]) -> List[ShardSite]:
        """The sites of each entry held where it is written; [] unless every entry is sharded there."""
        if not entries or len(entries) > 8:
            return []
        out: List[ShardSite] = []
        for entry in entries:
            found = self.part(entry, entry) if type(entry) in (cst.Name, cst.Attribute) else None
            sites = self.sites_for(found[0], entry) if found is not None and found[1] else []
            if not sites:
                return []
            out += sites
        return out

    def _holding(self, origins, at: cst.CSTNode) -> List[ShardSite]:
        """The sites in effect at `at` that shard what a value with these origins holds, where every
        value it can hold is sharded there (a lint does not guess); else []."""
        sites = [s for s in self.sites if s.target is not None and origins & self._origins_of(s)
                 and self._in_effect(s, at, 3)]
        if sites and origins <= frozenset().union(*map(self._origins_of, sites)):
            return sites
        return []

    def _in_effect(self, site: ShardSite, at: cst.CSTNode, depth: int) -> bool:
        """The site has run when `at` runs: before it in the same function; at module level,
        for a function; in `__init__`, for the class's other methods (they run on a made
        instance); before a call of the function around `at` (its known calls, the flow's)."""
        fn = self.scope_of(at)
        if site.scope is fn:
            return site.order < self.order(at)
        if site.scope is None:
            return True
        if fn is None:
            return False
        if isinstance(site.scope, cst.FunctionDef) and site.scope.name.value == "__init__":
            # a module sharded in `__init__`: in effect in the class's other methods (they run on a made instance)
            cls = self.resolver.enclosing_class(site.scope)
            if cls is not None and self.resolver.enclosing_class(fn) is cls:
                return True
        if depth == 0:
            return False
        return any(self._in_effect(site, call, depth - 1) for call, _ in self.flow.bound_calls(fn))

    def _origins_of(self, site: ShardSite) -> frozenset:
        """The origins of the module a site shards (its target with the parts stripped), and the
        call itself (fully_shard returns the module it shards)."""
        known = self._site_origins.get(id(site))
        if known is None:
            base, _ = _base(site.target)
            known = self.flow.values(base) if base is not None else frozenset()
            known = self._site_origins[id(site)] = known | {site.call}
        return known

    @property
    def uses_fully_shard(self) -> bool:
        """Whether the script shards anything with FSDP2's fully_shard (FSDP1 wraps aside)."""
        return any(not s.legacy for s in self.sites)

    def fsdp2_root(self, expr: cst.BaseExpression, at: cst.CSTNode) -> Optional[Tuple[str, cst.CSTNode]]:
        """(root, where its sharding is in effect) when `expr` is a whole module sharded
        with fully_shard at `at`. A closure variable of a nested function counts when
        the function around it sharded the module before defining the nested one; the
        place returned is then that nested def (ask optimizer() there)."""
        found = self.part(expr, at)
        if found is None or not found[1]:
            return None
        root, anchor = found[0], at
        while True:
            if self.is_fsdp2(root, anchor):
                return root, anchor
            fn = self.scope_of(anchor)
            if fn is None or self._binds(fn, root) or root.startswith("self.") or root in parameter_names(fn):
                return None
            anchor = fn

    def is_fsdp2(self, root: str, at: cst.CSTNode) -> bool:
        return any(not s.legacy for s in self.sites_for(root, at)) and not self._not_fsdp2_here(root, at)

    def _not_fsdp2_here(self, root: str, at: cst.CSTNode) -> bool:
        """`at` runs only where the module is not FSDP2's: in the branch of `if isinstance(m, DDP)`,
        or in the other branch of `if isinstance(m, FSDPModule)` (fully_shard makes the module an
        FSDPModule, never a DDP). OLMo-core's `elif isinstance(self.model, DDP): ... no_sync()`."""
        child = at
        for anc in self.resolver.ancestors(at):
            if type(anc) in (cst.FunctionDef, cst.ClassDef, cst.Lambda):
                return False
            if type(anc) is cst.If and (child is anc.body or child is anc.orelse):
                checked = self._isinstance_of(anc.test, root)
                if checked and (checked & DDP_CLASSES if child is anc.body else checked & FSDP_MODULE):
                    return True
            child = anc
        return False

    def _isinstance_of(self, test: cst.BaseExpression, root: str) -> Set[str]:
        """The qualified names of the classes `isinstance(<root>, C)` (or a tuple of classes) tests."""
        if not (type(test) is cst.Call and len(test.args) == 2 and self.resolver.qnames(test) == {"builtins.isinstance"}):
            return set()
        found = part_root(test.args[0].value)
        if found is None or found != (root, True):
            return set()
        return self.resolver.qnames(test.args[1].value)  # a tuple of classes: none (not known to exclude)

    def optimizer(self, name: str, at: cst.CSTNode) -> Optional[OptimizerBuild]:
        """The optimizer bound to `name` at `at` when it trains a sharded module."""
        fn = self.scope_of(at)
        cls = self.resolver.enclosing_class(at) if name.startswith("self.") else None
        for opt in self.optimizers:
            if opt.name != name:
                continue
            if cls is not None:  # `self.optimizer`, stored in a method of the class: read in all of them
                if opt.scope is None or self.resolver.enclosing_class(opt.call) is not cls:
                    continue
            elif not (opt.scope is fn or (opt.scope is None and not self._binds(fn, name))):
                continue
            if any(self.sites_for((self.alias(root, at) or (root,))[0], at) for root in opt.models):
                return opt
        if self._closes_over(fn, name):
            return self.optimizer(name, fn)  # the optimizer of the function around a nested one
        return None

    # -- state --------------------------------------------------------------

    def sharded_state(self, expr: cst.BaseExpression, at: cst.CSTNode, depth: int = 4) -> Optional[str]:
        """What sharded state `expr` holds at `at` ("the state dict of `model`"), or None."""
        if depth == 0 or expr is None:
            return None
        if isinstance(expr, cst.Call):
            func = expr.func
            if isinstance(func, cst.Attribute) and func.attr.value == "state_dict" and not expr.args:
                owner = func.value
                root = self.sharded_module(owner, at)
                if root is not None and self.is_fsdp2(root, at):
                    return f"the state dict of sharded `{code(owner)}`"
                held = part_root(owner)
                if held is not None and held[1] and self.optimizer(held[0], at) is not None:
                    return f"the state of optimizer `{held[0]}` over sharded parameters"
                return None
            getter = self.resolver.qnames(expr) & STATE_DICT_GETTERS
            if getter and expr.args and not self.full_state_options(expr):
                first = expr.args[0].value
                if self.sharded_module(first, at) is not None:
                    return f"the sharded {_GETTER_KINDS[getter.pop()]} state from `{code(expr.func)}`"
                return None
            if isinstance(func, cst.Name) and func.value == "dict":
                return self._first_state([a.value for a in expr.args], at, depth)
            return None
        if isinstance(expr, (cst.Dict,)):
            return self._first_state([e.value for e in expr.elements if isinstance(e, cst.DictElement)], at, depth)
        if isinstance(expr, (cst.List, cst.Tuple, cst.Set)):
            return self._first_state([e.value for e in expr.elements], at, depth)
        if isinstance(expr, cst.Subscript):
            return self.sharded_state(expr.value, at, depth - 1)
        if isinstance(expr, cst.Name):
            root = self.sharded_module(expr, at)
            if root is not None and self.is_fsdp2(root, at):
                return f"sharded module `{expr.value}` itself"
            return self._first_state(self.bound_values(expr.value, at), at, depth - 1)
        return None

    def _first_state(self, exprs, at, depth) -> Optional[str]:
        for e in exprs:
            found = self.sharded_state(e, at, depth)
            if found:
                return found
        return None

    def full_state_options(self, call: cst.Call) -> bool:
        """The call passes options=StateDictOptions(full_state_dict=True, ...) (or a name bound to it)."""
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == "options":
                value = arg.value
                if isinstance(value, cst.Name):
                    bound = self._bindings.get(self.scope_of(call), {}).get(value.value, [])
                    if not bound:
                        bound = self._bindings.get(None, {}).get(value.value, [])
                    if not bound:
                        return True  # defined somewhere we cannot see: do not guess "sharded"
                    value = bound[-1][1]  # (order, value, whole)
                if isinstance(value, cst.Call):
                    for a in value.args:
                        if a.keyword is not None and a.keyword.value == "full_state_dict":
                            return not (isinstance(a.value, cst.Name) and a.value.value == "False")
                return False
        return False

    def bound_values(self, name: str, at: cst.CSTNode) -> List[cst.BaseExpression]:
        """Values assigned to `name` before `at` in its function: the last plain
        assignment, and what went into it after that (`name[k] = v`, `name.update(...)`)."""
        here = self.order(at)
        earlier = [b for b in self._bindings.get(self.scope_of(at), {}).get(name, []) if b[0] < here]
        starts = [i for i, b in enumerate(earlier) if b[2]]
        return [b[1] for b in earlier[starts[-1] if starts else 0:]]

    def _binds(self, fn: Scope, name: str) -> bool:
        return name in self._bindings.get(fn, {}) or name in self._aliases.get(fn, {})

    # -- rank-0 branches ----------------------------------------------------

    def rank_zero_branch(self, node: cst.CSTNode) -> Optional[cst.If]:
        """The `if` whose branch around `node` runs on rank 0 only, if any."""
        child = node
        for anc in self.resolver.ancestors(node):
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return None
            if isinstance(anc, cst.If):
                from .rank_values import aliases_of

                side = rank_zero_side(anc.test, aliases_of(self.resolver).at(anc))
                if side == "body" and child is anc.body:
                    return anc
                if side == "else" and child is anc.orelse:
                    return anc
            child = anc
        return None


def _base(expr: cst.BaseExpression) -> Tuple[Optional[cst.BaseExpression], bool]:
    """The expression holding the module `expr` is (part of), and whether it is that module
    itself: `model` for `model.blocks[0]` (False), `trainer.model` for `trainer.model` (True:
    an attribute is asked of the flow as it is)."""
    whole = True
    while True:
        kind = type(expr)
        if kind is cst.Subscript:
            whole, expr = False, expr.value
        elif kind is cst.Call and type(expr.func) is cst.Attribute and expr.func.attr.value in _PART_METHODS:
            whole, expr = False, expr.func.value
        elif kind in (cst.Name, cst.Attribute, cst.Call):
            return expr, whole
        else:
            return None, whole


def part_root(expr: cst.BaseExpression) -> Optional[Tuple[str, bool]]:
    """("model", True) for `model`; ("model", False) for `model.blocks[0]`,
    `model.layers.children()`; ("self.net", ...) for `self.net...`; None otherwise."""
    whole = True
    path: List[str] = []
    while True:
        if isinstance(expr, cst.Name):
            if expr.value == "self":
                if not path:
                    return ("self", whole)
                return ("self." + path[-1], whole and len(path) == 1)
            return (expr.value, whole)
        if isinstance(expr, cst.Attribute):
            path.append(expr.attr.value)
            if len(path) > 1 or not isinstance(expr.value, cst.Name) or expr.value.value != "self":
                whole = False
            expr = expr.value
        elif isinstance(expr, cst.Subscript):
            whole = False
            expr = expr.value
        elif isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _PART_METHODS:
            whole = False
            expr = expr.func.value
        else:
            return None


def shard_facts(analysis) -> ShardFacts:
    """The sharding facts of a script's analysis (site_analysis.SiteAnalysis: its module,
    resolver and functions); with its path, calls of the functions it imports from project
    modules that shard (analysis.project_sharders) count too, and so do the modules other
    files hand its classes and functions (`analysis.received`, Handed records)."""
    imported = {}
    if analysis.path and analysis.path != "-":
        from .project_sharders import imported_sharders

        imported = imported_sharders(analysis.module, analysis.r, analysis.path)
    return _Collector(analysis, imported, getattr(analysis, "received", ())).run()


class _Collector:
    def __init__(self, analysis, imported: Optional[Dict[str, "Sharder"]] = None, received: Sequence[Handed] = ()):
        self.analysis = analysis
        self.module = analysis.module
        self.r = analysis.r
        self.imported = imported or {}
        self.received = received
        self.facts = ShardFacts(self.r, [], [])
        self.facts.flow = analysis.flow
        self._fields: Dict[int, object] = {}  # a call of a record's field -> what it does (_field_call)
        self._param_calls: Optional[Set[int]] = None  # optimizer_factories.parameter_handing_calls
        # calls of record fields are followed for the file checked, not for the project modules
        # whose sharders project_sharders tabulates (their tables stay what their imports make them)
        self.follow_fields = True

    def run(self) -> ShardFacts:
        f = self.facts
        _index_bindings(f, self.r)
        _index_aliases(f, self.r)
        self.self_shards: Dict[cst.FunctionDef, Tuple[bool, bool]] = {}  # methods sharding `self` (or its parts)
        for call in self.r.nodes(cst.Call):
            qn = self.r.qnames(call)
            if call.args and (qn & FULLY_SHARD or qn & FSDP1):
                self._add_site(call, legacy=not (qn & FULLY_SHARD))
                self._shards_self(call, legacy=not (qn & FULLY_SHARD))
        for call in self.r.nodes(cst.Call):
            opt = self._optimizer(call)
            if opt is not None:
                f.optimizers.append(opt)
        _receive_handed(f, self.module, self.analysis.path, self.received)
        self._propagate()
        _hand_out(f, self.r, self.imported, self.analysis.path)
        return f

    def _shards_self(self, call: cst.Call, legacy: bool) -> None:
        """`fully_shard(self, ...)` (or of `self.blocks[i]`) in a method of a top-level class: the
        method shards the object it is called on (OLMo-core's `model.apply_fsdp(mesh)`)."""
        found = part_root(module_itself(call.args[0].value))
        fn = self.r.enclosing_function(call)
        if found is None or not (found[0] == "self" or found[0].startswith("self.")) or fn is None:
            return
        cls = self.r.enclosing_class(fn)
        if cls is None or self.r.enclosing_class(call) is not cls or cls not in self.module.body:
            return
        whole = found[0] == "self" and found[1]
        was = self.self_shards.get(fn, (False, True))
        self.self_shards[fn] = (was[0] or whole, was[1] and legacy)

    def shard_methods(self) -> Dict[str, Dict[str, Tuple[bool, bool]]]:
        """class name -> {method: (whole, legacy)} for the top-level classes of this module whose
        methods shard `self` (see _shards_self), their own or inherited from a class of the module
        (a method a class overrides is its own: only a sharding override counts)."""
        classes = {c.name.value: c for c in self.module.body if isinstance(c, cst.ClassDef)}

        def methods(name: str, seen: frozenset) -> Dict[str, Tuple[bool, bool]]:
            cls = classes.get(name)
            if cls is None or name in seen:
                return {}
            out: Dict[str, Tuple[bool, bool]] = {}
            for base in reversed(cls.bases):
                if isinstance(base.value, cst.Name) and base.keyword is None:
                    out.update(methods(base.value.value, seen | {name}))
            for m in cls.body.body:
                if isinstance(m, cst.FunctionDef):
                    out.pop(m.name.value, None)
                    if m in self.self_shards:
                        out[m.name.value] = self.self_shards[m]
            return out

        found = {name: methods(name, frozenset()) for name in classes}
        return {name: m for name, m in found.items() if m}

    def _method_call(self, call: cst.Call) -> bool:
        """`m.apply_fsdp(...)` where `m` is declared an instance of a class of the project (an
        annotation: a parameter's, or the element type of the annotated sequence a loop runs
        over) whose method of that name shards `self`: the module `m` holds is sharded there.
        A loop over `parts: List[C] = [model] if ... else model` shards `model` (an element
        of the literal) or its parts."""
        func = call.func
        if type(func) is not cst.Attribute or type(func.value) is not cst.Name or func.value.value == "self":
            return False
        declared = self._declared(func.value)
        if declared is None:
            return False
        cls, receivers = declared
        if cls in self.own_classes:
            methods = self.own_methods.get(cls)
        else:
            methods = self.imported.shard_methods(cls) if hasattr(self.imported, "shard_methods") else None
        found = (methods or {}).get(func.attr.value)
        if found is None:
            return False
        changed = False
        for expr, whole in receivers:
            changed |= self._add_call_site(call, expr, found[0] and whole, found[1])
        return changed

    def _imported_self_sharded(self, call: cst.Call) -> bool:
        """`net = Net(mesh)` of a class of an imported project module whose `__init__` shards
        `self` whole: the name bound to the instance holds a sharded module."""
        path = attr_path(call.func)
        if not path or ".".join(path) in self.own_classes or not hasattr(self.imported, "shard_methods"):
            return False
        found = (self.imported.shard_methods(".".join(path)) or {}).get("__init__")
        if found is None or not found[0]:
            return False
        return self._bind_returns(call, {None: True}, {None: found[1]})

    def _declared(self, name: cst.Name) -> Optional[Tuple[str, List[Tuple[cst.BaseExpression, bool]]]]:
        """(the class `name` holds, [(expression holding it, whether the expression is that object
        itself)]): every value it can hold made by one call `C(...)` (the flow's origins), or, for
        a name with one binding, an annotated parameter, or the target of loops over a name with
        one annotated binding `List[C]`/`Sequence[C]`. A call of something else than a class
        finds no class (the caller looks the name up among the project's classes)."""
        flow = self.analysis.flow
        built = {attr_path(o.func) if type(o) is cst.Call else None for o in flow.values(name)}
        if len(built) == 1 and None not in built:  # every value it can hold is made by one call: `C(...)`
            return ".".join(built.pop()), [(name, True)]
        bindings = flow._lookup(name)
        if len(bindings) == 1 and bindings[0][0] == "param":
            node = bindings[0][1]
            cls = _class_of(node.annotation.annotation) if node.annotation is not None else None
            return (cls, [(name, True)]) if cls is not None else None
        # every binding a loop over the same sequence (`for m in parts:` written several times)
        loops = [_sequence_looped(b[1], name.value) for b in bindings if b[0] == "opaque" and type(b[1]) is cst.For]
        if not loops or len(loops) != len(bindings) or None in loops:
            return None
        seq = flow._lookup(loops[0])
        if any(flow._lookup(n) != seq for n in loops[1:]):
            return None
        if len(seq) != 1 or seq[0][0] != "assign" or type(seq[0][1]) is not cst.AnnAssign or seq[0][3]:
            return None
        cls = _element_class(seq[0][1].annotation.annotation)
        if cls is None:
            return None
        receivers: List[Tuple[cst.BaseExpression, bool]] = []
        for value in _branches(seq[0][2]):
            if type(value) in (cst.List, cst.Tuple):
                receivers += [(e.value, True) for e in value.elements if type(e) is cst.Element]
            else:
                receivers.append((value, False))  # a sequence of modules: its elements are its parts
        return cls, receivers

    def _add_site(self, call: cst.Call, legacy: bool) -> None:
        f = self.facts
        scope = f.scope_of(call)
        found = f.part(call.args[0].value, call)
        if found is not None:
            f.sites.append(ShardSite(call, found[0], found[1], scope, f.order(call), legacy, True, call.args[0].value))
        # `model = fully_shard(model)`, `model = FSDP(Net())`: the name bound to the result
        parent = self.r.parent(call)
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
            bound = part_root(parent.targets[0].target)
            if bound is not None and bound[1] and (found is None or bound[0] != found[0]):
                f.sites.append(ShardSite(call, bound[0], True, scope, f.order(call), legacy, found is None, call))


    def _optimizer(self, call: cst.Call) -> Optional[OptimizerBuild]:
        """An optimizer built by `call`: a torch optimizer, or a call of a function of the
        script that returns the one it builds (`opt = make_optimizer(model, lr)`: the
        models are then read from the call's arguments)."""
        known = is_optimizer_call(self.r, call) or self._optimizer_factory_call(call)
        if self._param_calls is None:
            self._param_calls = parameter_handing_calls(self.r)
        if not known and id(call) not in self._param_calls:
            return None
        parent = self.r.parent(call)
        if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1):
            return None
        target = part_root(parent.targets[0].target)
        if target is None or not call.args:
            return None
        f = self.facts
        arg = call.args[0].value
        if not known:
            if not target[1]:
                return None  # `opts[k] = build(...)`: no name holds it
            # a call the analysis does not see into, handed a module's parameters, whose result is stepped
            # (`opt = config.instantiate(cfg.optimizer, model.parameters())`, then `opt.step()`): an optimizer
            # built by the project's or a library's factory
            arg = next(a.value for a in call.args if _parameters_taken(a.value))
            if not stepped(self.r, parent.targets[0].target, f.scope_of):
                return None
        models: Set[str] = names_in(arg) | _attribute_roots(arg)
        taken: Dict[str, Tuple[int, cst.CSTNode]] = {}
        for name in names_in(arg):  # parameter groups built earlier: `groups = [{"params": ...}]`
            for value in f.bound_values(name, call):
                if isinstance(value, cst.Call) and self.r.qnames(value) & _COPIES:
                    continue  # `ref = copy.deepcopy(model)`: another module, with tensors of its own
                roots = names_in(value) | _attribute_roots(value)
                models |= roots
                for root in roots & _parameters_taken(value):
                    if root not in taken or f.order(value) < taken[root][0]:
                        taken[root] = (f.order(value), value)
        return OptimizerBuild(target[0], call, models, f.scope_of(call), f.order(call), taken)

    def _optimizer_factory_call(self, call: cst.Call) -> bool:
        """`make_optimizer(model, ...)`: a call of a function of the script (the analysis's
        callee: a def nested around the call, else a top-level one) that returns the one
        torch optimizer it builds."""
        if not call.args:
            return False
        fn = self.analysis._callee(call)
        return fn is not None and returned_optimizer(fn, lambda c: is_optimizer_call(self.r, c)) is not None

    def _propagate(self) -> None:
        """Functions receiving a sharded module as an argument, classes storing one on
        self, and names bound to functions' sharded return values: for the script's
        functions, its classes' methods (`self.setup(...)`) and the functions of project
        modules it imports (`imported`, a Sharder each); attributes a method binds to a
        sharded module (`self.fsdp_model = self.model`, see _stored_sharded)."""
        classes = {s.name.value: s for s in self.module.body if isinstance(s, cst.ClassDef)}
        stores = self._attribute_stores()
        self.own_classes = set(classes)
        self.own_methods = self.shard_methods() if self.self_shards else {}
        self._may_shard_methods = bool(self.own_methods) or hasattr(self.imported, "shard_methods")
        for _ in range(3):
            changed = False
            for call in self.r.nodes(cst.Call):
                func = call.func
                callee = self._callee(call)
                if callee is None and isinstance(func, cst.Name) and func.value in classes:
                    changed |= self._constructed(call, classes[func.value])
                    continue
                if callee is not None:
                    changed |= self._called(call, *callee)
                    continue
                sharder = self._imported_sharder(call)
                if sharder is not None:
                    changed |= self._called_sharder(call, sharder)
                elif type(func) is cst.Attribute and self._field_call(call):
                    changed = True
                elif type(func) is cst.Attribute and self._may_shard_methods:
                    changed |= self._method_call(call) or self._imported_self_sharded(call)
                elif type(func) is cst.Name and self._may_shard_methods:
                    changed |= self._imported_self_sharded(call)
            for assign in stores:
                changed |= self._stored_sharded(assign)
            if not changed:
                break

    def _attribute_stores(self) -> List[cst.Assign]:
        """`self.<attr> = <module>` in a method, the value a name or an attribute (a module held
        elsewhere that the attribute now names too)."""
        out = []
        for assign in self.r.nodes(cst.Assign):
            if len(assign.targets) != 1 or self.r.enclosing_class(assign) is None:
                continue
            found = part_root(assign.targets[0].target)
            if found is None or not found[1] or not found[0].startswith("self."):
                continue
            if type(module_itself(assign.value)) in (cst.Name, cst.Attribute):
                out.append(assign)
        return out

    def _stored_sharded(self, assign: cst.Assign) -> bool:
        """`self.fsdp_model = self.model` after `self.model` was sharded (whole): the attribute
        holds that sharded module from there on, in every method of the class (a site at the
        assignment; FSDP1's or FSDP2's as the module's sites are)."""
        f = self.facts
        value = module_itself(assign.value)
        found = f.part(value, assign)
        if found is None or not found[1]:
            return False
        root = part_root(assign.targets[0].target)[0]
        sites = [s for s in f.sites_for(found[0], assign) if s.call is not assign]
        if not sites or root == found[0]:
            return False
        whole, legacy = any(s.whole for s in sites), all(s.legacy for s in sites)
        known = next((s for s in f.sites if s.call is assign and s.root == root), None)
        if known is not None:  # sites found later (a later round) may change what it holds
            changed = (known.whole, known.legacy) != (whole, legacy)
            known.whole, known.legacy = whole, legacy
            return changed
        f.sites.append(ShardSite(assign, root, whole, f.scope_of(assign), f.order(assign), legacy, target=value))
        return True

    def _callee(self, call: cst.Call) -> Optional[Tuple[cst.FunctionDef, int]]:
        """(the function a call runs, how many of its parameters the call does not pass):
        a function of the script by name (the analysis's callee), or a method of the class
        around the call called on `self`."""
        func = call.func
        if isinstance(func, cst.Name):
            found = self.analysis._callee(call)
            return (found, 0) if found is not None else None
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
            cls = self.r.enclosing_class(call)
            if cls is None:
                return None
            method = next((m for m in cls.body.body
                           if isinstance(m, cst.FunctionDef) and m.name.value == func.attr.value), None)
            return (method, 1) if method is not None else None
        return None

    def _imported_sharder(self, call: cst.Call) -> Optional["Sharder"]:
        """The Sharder of a project function of another module a call runs: only for a call
        that is a statement of its own, or whose value is bound or returned (a module is
        parsed when a call asks for one of its functions)."""
        if not self.imported or not isinstance(self.r.parent(call), (cst.Expr, cst.Assign, cst.Return)):
            return None
        path = attr_path(call.func)
        return self.imported.get(".".join(path)) if path is not None else None

    def _field_call(self, call: cst.Call) -> bool:
        """`model = spec.parallelize_fn(model, mesh)`: a call of a callable field of a project record
        class whose stored values shard (analysis.record_fields): its first argument, and the name
        bound to its result, are sharded from there on. Asked once a call."""
        if id(call) not in self._fields:
            self._fields[id(call)] = None
            parent = self.r.parent(call)
            if (self.follow_fields and self.imported and call.args and not call.args[0].star
                    and call.args[0].keyword is None and isinstance(parent, (cst.Expr, cst.Assign, cst.Return))
                    # a module it can shard (`spec.fn(model, ...)`), or a result bound (`m = spec.fn(build(), ...)`)
                    and (type(call.args[0].value) in (cst.Name, cst.Attribute, cst.Subscript) or type(parent) is cst.Assign)):
                from .record_fields import field_sharder

                owner = call.func.value
                declared = self._declared(owner) if type(owner) is cst.Name else None
                self._fields[id(call)] = field_sharder(self.analysis.path, call, self.r,
                                                       declared[0] if declared else None, self.imported)
        known = self._fields[id(call)]
        if known is None:
            return False
        changed = False
        if known.arg is not None:
            changed |= self._add_call_site(call, call.args[0].value, *known.arg)
        if known.returns is not None:
            changed |= self._bind_returns(call, {None: known.returns})
        return changed

    def _called(self, call: cst.Call, callee: cst.FunctionDef, skip: int) -> bool:
        f = self.facts
        changed = False
        for param, arg in bind_args(callee, call, skip):
            changed |= self._sharded_by_callee(callee, param, arg, call)
            root = f.sharded_module(arg, call)
            if root is not None:
                changed |= _receive(f, callee, param, _received_site(f, root, call))
        legacy: Dict[Optional[int], bool] = {}
        return self._bind_returns(call, self._sharded_returns(callee, legacy), legacy) or changed

    def _constructed(self, call: cst.Call, cls: cst.ClassDef) -> bool:
        """`Trainer(model)` of a class of the script whose __init__ stores the sharded
        module as `self.<attr>`: every method of the class reads it sharded."""
        f = self.facts
        init = next((m for m in cls.body.body if isinstance(m, cst.FunctionDef) and m.name.value == "__init__"), None)
        if init is None:
            return False
        changed = False
        shards_self = self.self_shards.get(init)
        if shards_self is not None and shards_self[0]:  # `fully_shard(self, ...)` in __init__: made sharded
            changed |= self._bind_returns(call, {None: True}, {None: shards_self[1]})
        for param, arg in bind_args(init, call, skip=1):
            root = f.sharded_module(arg, call)
            if root is None:
                continue
            site = _received_site(f, root, call)
            for name in ["self." + a for a in _stored_as(init, param)]:
                for method in cls.body.body:
                    if isinstance(method, cst.FunctionDef):
                        changed |= _receive(f, method, name, site)
        return changed

    def _called_sharder(self, call: cst.Call, sharder: "Sharder") -> bool:
        """A call of a project function of another module that shards its parameter
        (`shard_model(model, mesh)`) or returns a sharded module (`model = shard_model(...)`)."""
        changed = False
        for param, arg in bind_args(sharder.fn, call):
            if param in sharder.shards:
                whole, legacy = sharder.shards[param]
                changed |= self._add_call_site(call, arg, whole, legacy)
        return self._bind_returns(call, sharder.returns) or changed

    def _add_call_site(self, call: cst.Call, arg, whole: bool, legacy: bool) -> bool:
        """The module `arg` (a name, an alias of one, `self.model`, or a part of one) is
        sharded by `call` from there on."""
        f = self.facts
        target = f.part(arg, call)
        if target is None or target[0] == "self":
            return False
        if any(s.call is call and s.root == target[0] for s in f.sites):
            return False
        f.sites.append(ShardSite(call, target[0], whole and target[1], f.scope_of(call), f.order(call), legacy,
                                 target=arg))
        return True

    def _bind_returns(self, call: cst.Call, returns: Dict[Optional[int], bool],
                      legacy: Optional[Dict[Optional[int], bool]] = None) -> bool:
        """`model = setup(model)`, `model, opt = build(cfg)`, `self.model = shard(...)`:
        the names bound to what a function returns sharded (`legacy`: the positions the
        function wraps with FSDP1 only)."""
        f = self.facts
        parent = self.r.parent(call)
        if not returns or not (isinstance(parent, cst.Assign) and len(parent.targets) == 1):
            return False
        changed = False
        for position, whole in returns.items():
            name = _target_at(parent.targets[0].target, position)
            if name is None or any(s.call is call and s.root == name for s in f.sites):
                continue
            f.sites.append(ShardSite(call, name, whole, f.scope_of(call), f.order(call),
                                     bool(legacy and legacy.get(position)), target=call))
            changed = True
        return changed

    def _resharding(self, site: ShardSite) -> bool:
        """The site runs only for a module FSDP2 already shards: inside the body of an `if`
        whose test is `isinstance(<its root>, FSDPModule)` (directly, or a name bound to it:
        `is_fsdp = isinstance(model, FSDPModule)`), as a helper that swaps a submodule of a
        sharded model shards the new one. It shards no plain module handed to the function."""
        if not isinstance(site.call, cst.Call):
            return False
        child = site.call
        for above in self.r.ancestors(site.call):
            if isinstance(above, (cst.FunctionDef, cst.ClassDef)):
                return False
            if isinstance(above, cst.If) and child is above.body and self._tests_fsdp2(above.test, site):
                return True
            child = above
        return False

    def _tests_fsdp2(self, test, site: ShardSite) -> bool:
        tests = [test]
        if isinstance(test, cst.Name):
            tests = self.facts.bound_values(test.value, test)
        for t in tests:
            if (isinstance(t, cst.Call) and isinstance(t.func, cst.Name) and t.func.value == "isinstance"
                    and len(t.args) == 2 and isinstance(t.args[0].value, cst.Name)
                    and t.args[0].value.value == site.root.split(".", 1)[0]
                    and any(q.rsplit(".", 1)[-1] == "FSDPModule" for q in self.r.qnames(t.args[1].value))):
                return True
        return False

    def _sharded_by_callee(self, callee: cst.FunctionDef, param: str, arg, call: cst.Call) -> bool:
        """`apply_fsdp(model, mesh)`: a function that shards its parameter shards the
        caller's module from that call on."""
        inside = [s for s in self.facts.sites if s.scope is callee and s.root == param and not self._resharding(s)]
        if not inside:
            return False
        return self._add_call_site(call, arg, any(s.whole for s in inside), all(s.legacy for s in inside))

    def _sharded_returns(self, fn: cst.FunctionDef,
                         legacy: Optional[Dict[Optional[int], bool]] = None) -> Dict[Optional[int], bool]:
        """Positions of the returned values that are sharded modules (None for the whole
        return value, i for the i-th element of a returned tuple), each with whether the
        module itself is a unit (not only its blocks). `legacy`, when given, is filled with
        whether every site of each position is an FSDP1 wrap."""
        f = self.facts
        out: Dict[Optional[int], bool] = {}

        def add(position, value, ret) -> None:
            root = f.sharded_module(value, ret)
            if root is not None:
                found = f.part(value, ret) or _base(value)
                sites = f.sites_for(root, ret)
                whole = found[1] and any(s.whole for s in sites)
                out[position] = out.get(position, False) or whole
                if legacy is not None:
                    legacy[position] = legacy.get(position, True) and bool(sites) and all(s.legacy for s in sites)

        for ret in self.r.nodes(cst.Return):
            if self.r.enclosing_function(ret) is not fn or ret.value is None:
                continue
            if isinstance(ret.value, cst.Tuple):
                for i, element in enumerate(ret.value.elements):
                    add(i, element.value, ret)
            else:
                add(None, ret.value, ret)
        return out

    def sharders(self) -> Dict[str, "Sharder"]:
        """The top-level functions of this module that shard a parameter or return a
        sharded module, by name (what another module importing them learns)."""
        out: Dict[str, Sharder] = {}
        for fn in self.module.body:
            if not isinstance(fn, cst.FunctionDef):
                continue
            params = parameter_names(fn)
            shards: Dict[str, Tuple[bool, bool]] = {}
            for s in self.facts.sites:
                if s.scope is fn and s.root in params and not self._resharding(s):
                    whole, legacy = shards.get(s.root, (False, True))
                    shards[s.root] = (whole or s.whole, legacy and s.legacy)
            returns = self._sharded_returns(fn)
            if shards or returns:
                out[fn.name.value] = Sharder(fn, shards, returns)
        return out


@dataclass
class Sharder:
    """What a project function does to the modules it is handed: `shards` maps a
    parameter it shards (itself or its parts, directly or through another function) to
    (the parameter itself is a unit, the sharding is FSDP1's); `returns` the positions
    of its sharded return values (see _Collector._sharded_returns)."""

    fn: cst.FunctionDef = field(repr=False)
    shards: Dict[str, Tuple[bool, bool]]
    returns: Dict[Optional[int], bool]


def _index_bindings(f: ShardFacts, r: Resolver) -> None:
    """name -> [(order, value)] per function, for `name = value` and `name[k] = value`."""
    for assign in r.nodes(cst.Assign):
        fn = f.scope_of(assign)
        for t in assign.targets:
            target = t.target
            whole = not isinstance(target, cst.Subscript)
            if isinstance(target, cst.Subscript):
                target = target.value
            if isinstance(target, cst.Name):
                f._bindings.setdefault(fn, {}).setdefault(target.value, []).append(
                    (f.order(assign), assign.value, whole)
                )
    for call in r.nodes(cst.Call):  # ckpt.update({...}) / ckpt.update(model=...)
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "update" and isinstance(func.value, cst.Name):
            fn = f.scope_of(call)
            for arg in call.args:
                f._bindings.setdefault(fn, {}).setdefault(func.value.value, []).append(
                    (f.order(call), arg.value, False)
                )


def _index_aliases(f: ShardFacts, r: Resolver) -> None:
    """Loop variables and names bound to parts of a module (`for block in model.layers`,
    `layer = model.layers[0]`) map to that module, and names bound to the module
    itself (`m = model`, `m = model.to(device)`) to the module."""
    for loop in r.nodes(cst.For) + r.nodes(cst.CompFor):
        iterated = loop.iter
        while isinstance(iterated, cst.Call) and isinstance(iterated.func, cst.Name) and (
            iterated.func.value in _ITERATION_WRAPPERS and iterated.args
        ):
            iterated = iterated.args[0].value
        found = part_root(iterated)
        if found is None:
            continue
        fn = f.scope_of(loop)
        anchor = loop
        while isinstance(anchor, cst.CompFor):  # a comprehension binds before its element is read
            anchor = r.parent(anchor)
        for name in _target_names(loop.target):
            f._aliases.setdefault(fn, {}).setdefault(name, []).append((f.order(anchor), (found[0], False)))
    for assign in r.nodes(cst.Assign):
        value = assign.value
        if isinstance(module_itself(value), cst.Name):
            value = module_itself(value)  # `m = model.to(device)`: the module itself
        if isinstance(value, cst.Name) and len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name):
            if value.value != "self" and assign.targets[0].target.value != value.value:
                f._aliases.setdefault(f.scope_of(assign), {}).setdefault(assign.targets[0].target.value, []).append(
                    (f.order(assign), (value.value, True)))
            continue
        if isinstance(value, (cst.Subscript, cst.Attribute)) or (
            isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute)
            and value.func.attr.value in _PART_METHODS
        ):
            found = part_root(value)
            if found is not None and not found[1] and len(assign.targets) == 1:
                target = assign.targets[0].target
                if isinstance(target, cst.Name) and found[0] != "self":
                    f._aliases.setdefault(f.scope_of(assign), {}).setdefault(target.value, []).append(
                        (f.order(assign), (found[0], False)))
    for names in f._aliases.values():
        for bindings in names.values():
            bindings.sort(key=lambda b: b[0])


def _receive_handed(f: ShardFacts, module: cst.Module, path: Optional[str],
                    received: Sequence[Handed]) -> None:
    """Modules other files hand this one's classes and functions, sharded: a class's
    constructor parameter and the `self.<attr>` it is stored as (in every method), or a
    function's parameter. The site a rule names is the class or function itself."""
    here = os.path.realpath(path) if received and path else None
    defs = {s.name.value: s for s in module.body if isinstance(s, (cst.ClassDef, cst.FunctionDef))}
    for handed in received:
        node = defs.get(handed.name)
        if node is None or os.path.realpath(handed.file) != here:
            continue
        fn = node if isinstance(node, cst.FunctionDef) else next(
            (m for m in node.body.body if isinstance(m, cst.FunctionDef) and m.name.value == "__init__"), None)
        if fn is None:
            continue
        positional = [p.name.value for p in (*fn.params.posonly_params, *fn.params.params)]
        positional = positional[1 if fn is not node else 0:]  # a constructor's `self` is not passed
        if isinstance(handed.key, int):
            param = positional[handed.key] if handed.key < len(positional) else None
        else:
            param = handed.key if handed.key in parameter_names(fn) else None
        if param is None:
            continue
        site = ShardSite(node, param, handed.whole, None, -1, handed.legacy)
        _receive(f, fn, param, site)
        if fn is not node:
            for name in ["self." + a for a in _stored_as(fn, param)]:
                for method in node.body.body:
                    if isinstance(method, cst.FunctionDef):
                        _receive(f, method, name, site)


def _hand_out(f: ShardFacts, r: Resolver, imported, source: Optional[str]) -> None:
    """Each call of a class or function of another project module (reached through an
    import, not a star) handed a sharded module: a Handed record for that module (`source`:
    this file's path, as the record's place names it)."""
    if not imported or not hasattr(imported, "where"):
        return
    for call in r.nodes(cst.Call):
        path = attr_path(call.func)
        found = imported.where(".".join(path)) if path is not None else None
        if found is None:
            continue
        position = 0
        for arg in call.args:
            if arg.star:
                break
            key: Union[int, str] = arg.keyword.value if arg.keyword is not None else position
            position += arg.keyword is None
            root = f.sharded_module(arg.value, call)
            if root is None:
                continue
            sites = f.sites_for(root, call)
            f.handed_out.append(Handed(str(found[0]), found[1], key, f"{source}:{r.line(call)}",
                                       any(s.whole for s in sites), all(s.legacy for s in sites)))


def _received_site(f: ShardFacts, root: str, call: cst.Call) -> ShardSite:
    """The site a function receiving sharded `root` at `call` sees."""
    found = f.sites_for(root, call)
    return ShardSite(found[0].call, root, any(s.whole for s in found), None, -1, all(s.legacy for s in found))


def _target_at(target, position: Optional[int]) -> Optional[str]:
    """The name (or `self.<attr>`) an assignment target binds at a returned position."""
    if position is not None:
        if not (isinstance(target, (cst.Tuple, cst.List)) and position < len(target.elements)):
            return None
        target = target.elements[position].value
    if isinstance(target, cst.Name):
        return target.value
    found = part_root(target) if isinstance(target, cst.Attribute) else None
    return found[0] if found is not None and found[1] and found[0] != "self" else None


def _receive(f: ShardFacts, scope, name: str, site: ShardSite) -> bool:
    known = f._received.setdefault(scope, {})
    if name in known:
        return False
    known[name] = ShardSite(site.call, name, site.whole, scope, -1, site.legacy)
    return True


def _stored_as(init: cst.FunctionDef, param: str) -> Iterator[str]:
    """Attributes `self.<attr> = param` in a constructor."""
    for stmt in init.body.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Assign) and isinstance(small.value, cst.Name) and small.value.value == param:
                    for t in small.targets:
                        target = t.target
                        if (isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name)
                                and target.value.value == "self"):
                            yield target.attr.value


_SEQUENCES = {"List", "list", "Sequence", "Iterable", "Tuple", "tuple", "MutableSequence"}


def _class_of(annotation: cst.BaseExpression) -> Optional[str]:
    """`C`, `pkg.C`, `Optional[C]`: the class name an annotation spells; None otherwise."""
    if type(annotation) is cst.Subscript and type(annotation.value) is cst.Name and annotation.value.value == "Optional":
        if len(annotation.slice) == 1 and type(annotation.slice[0].slice) is cst.Index:
            annotation = annotation.slice[0].slice.value
    path = attr_path(annotation)
    return ".".join(path) if path is not None else None


def _element_class(annotation: cst.BaseExpression) -> Optional[str]:
    """`C` for `List[C]`, `list[C]`, `Sequence[C]`, `Tuple[C, ...]` (typing's or the builtins')."""
    if type(annotation) is not cst.Subscript:
        return None
    head = attr_path(annotation.value)
    if head is None or head[-1] not in _SEQUENCES or head[0] not in ("typing", "collections", head[-1]):
        return None
    items = annotation.slice
    if head[-1] in ("Tuple", "tuple"):
        if not (len(items) == 2 and type(items[1].slice) is cst.Index and type(items[1].slice.value) is cst.Ellipsis):
            return None
    elif len(items) != 1:
        return None
    if type(items[0].slice) is not cst.Index:
        return None
    return _class_of(items[0].slice.value)


def _sequence_looped(loop: cst.For, name: str) -> Optional[cst.Name]:
    """`parts` for `for name in parts:` and `for i, name in enumerate(parts):`."""
    target, seq = loop.target, loop.iter
    if type(target) is cst.Tuple and len(target.elements) == 2 and type(seq) is cst.Call and (
            type(seq.func) is cst.Name and seq.func.value == "enumerate" and len(seq.args) == 1):
        target, seq = target.elements[1].value, seq.args[0].value
    return seq if type(target) is cst.Name and target.value == name and type(seq) is cst.Name else None


def _branches(value: cst.BaseExpression) -> List[cst.BaseExpression]:
    """Both sides of `a if c else b` (nested), else the value itself."""
    if type(value) is cst.IfExp:
        return _branches(value.body) + _branches(value.orelse)
    return [value]


def _target_names(target) -> List[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)) and target.elements:
        return _target_names(target.elements[-1].value)  # `for i, block in enumerate(...)`
    return []


def _parameters_taken(expr) -> Set[str]:
    """The modules whose parameters `expr` reads as tensors (`model.parameters()`, `m.named_parameters()`,
    a comprehension or `list(...)` over them): `model` for `list(model.parameters())`."""
    out: Set[str] = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if (type(node) is cst.Call and type(node.func) is cst.Attribute
                and node.func.attr.value in ("parameters", "named_parameters")):
            found = part_root(node.func.value)
            if found is not None:
                out.add(found[0])
        stack.extend(node.children)
    return out


def _attribute_roots(expr) -> Set[str]:
    """Roots of `x.parameters()`-like reads inside an optimizer's argument."""
    out: Set[str] = set()

    class _V(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> None:
            found = part_root(node)
            if found is not None and found[0] != "self":
                out.add(found[0])

    expr.visit(_V())
    return out
