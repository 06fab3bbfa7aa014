"""DataLoaders: where each is built, with which dataset, shuffle and sampler, and
whether a training loop reads it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import libcst as cst

from .loops import LoopAnalysis, LoopSite
from .returns import names_out
from .site_analysis import Block, SiteAnalysis
from fsdp2_retrofit.syntax.names import (
    Resolver, assigned_names, bind_args, calls_in, code, instance_attribute, iterated_name, last_assignment, names_in,
    walk,
)
from fsdp2_retrofit.syntax.torch_api import DATALOADERS, DISTRIBUTED_SAMPLERS, GET_RANK, PLAIN_SAMPLERS

# RandomSampler's parameters, in order
RANDOM_SAMPLER_PARAMS = ("data_source", "replacement", "num_samples", "generator")


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
    # `kw.update(shuffle=...)` (or kw["shuffle"] = ...) between the dict and the loader:
    # the name of the dict whose final "shuffle" the sampler must take
    shuffle_set_later: Optional[str] = None
    sampler: Optional["SamplerSite"] = None  # the sampler= it is given, where it has one
    returned: bool = False  # `return loader` from the function that builds it (a helper)
    # (name, block) where the one call of that helper binds the loader (`train_loader, val_loader =
    # build_loaders(...)`), or None
    received: Optional[tuple] = None
    # (while, for, parameter) where a function of the script it is handed to repeats passes over it
    # (`def cycle(dl): while True: for batch in dl: yield batch`), or None
    cycled: Optional[tuple] = None
    # (function, parameter) of the script's functions whose parameter holds this loader and
    # nothing else, at every call (`train_model(model, loader, ...)` reading it as `batches`)
    handed_to: List[tuple] = field(default_factory=list)
    # (loop, reader, epoch): a pass over it read through another name or attribute (`for x, y in
    # self.train_data:`) and the name holding that pass's epoch number (None where none is known);
    # see LoaderAnalysis._epoch_passed
    epoch_passed: Optional[tuple] = None


@dataclass
class SamplerSite:
    """The sampler a DataLoader is given: `kind` "distributed" (nothing to do), "plain"
    (a RandomSampler/SequentialSampler of one dataset, replaced by a DistributedSampler
    with `shuffle`), "replacement" (`RandomSampler(data, replacement=True[, num_samples=N])`:
    drawn per rank instead), "per_rank" (such a sampler already drawing from a generator
    seeded by the rank: nothing to do), or "other" (a batch_sampler, a subset, weighted or
    custom sampler: no safe conversion)."""

    kind: str
    expr: cst.BaseExpression  # the sampler= value
    call: Optional[cst.Call] = None  # the sampler's construction (inline, or the one its name is bound to)
    dataset: Optional[cst.BaseExpression] = None
    shuffle: str = "False"
    num_samples: Optional[cst.BaseExpression] = None  # "replacement": the samples drawn per epoch (None: len(data))


@dataclass
class UnfollowedLoader:
    """A DataLoader the analysis cannot follow to a loop: built inline in a `for`,
    stored on an attribute, or returned by a helper function."""

    node: cst.CSTNode
    how: str


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
        fed = self._loops_fed(train_loops)
        for stmt in stmts:
            if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
                continue
            assign = stmt.body[0]
            call = assign.value
            target = assign.targets[0].target
            if not self.r.is_call_to(call, DATALOADERS):
                continue
            if isinstance(target, cst.Name):
                name = target.value
            elif instance_attribute(target) and id(call) in fed and self._in_trainer_method(stmt):
                name = instance_attribute(target)  # `self.loader = DataLoader(...)` in a Solver
            else:
                continue
            args = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
            kwargs_dict, shuffle_set_later = None, None
            for a in call.args:
                if a.star == "**" and isinstance(a.value, cst.Name):
                    kwargs_dict = self._dict_bound_before(a.value.value, stmt)
                    if kwargs_dict is not None:
                        for key, value in _dict_entries(kwargs_dict):
                            args.setdefault(key, value)
                        if self._shuffle_set_after(a.value.value, kwargs_dict, stmt):
                            shuffle_set_later = a.value.value
            positional = [a.value for a in call.args if a.keyword is None and not a.star]
            dataset = loader_dataset(call, args)
            sampler = self._sampler(args, stmt)  # None for `sampler=None` or a name only ever None
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
                    has_sampler=sampler is not None,  # batch_sampler= included ("other")
                    trains=name in iterated or id(call) in fed,
                    shuffle_set_later=shuffle_set_later,
                    sampler=sampler,
                    returned=self._returned(name, stmt),
                    received=self._received(name, stmt),
                    cycled=self._cycled(name, stmt),
                    handed_to=self.handed_to(call),
                    epoch_passed=self._epoch_passed(call, fed[id(call)]) if id(call) in fed else None,
                )
            )
        return out

    def _epoch_passed(self, call: cst.Call, loop) -> Optional[tuple]:
        """(loop, reader, epoch) where the training loop `loop` is one pass over the DataLoader `call`
        (`for x, y in self.train_data:`, `reader` holding that loader and nothing else) and `epoch` the
        number of that pass: the variable of a `for <epoch> in range(...)` right around it, or a
        parameter of its function that holds, at every call, the variable of such a loop whose body
        makes the call (`self._run_epoch(epoch)` in `train()`), followed by value; `epoch` is None
        where the pass may repeat and its number is neither. None for a pass in the loader's own
        function, or one that runs once."""
        reader = loop.iter if type(loop) is cst.For else None
        fn = self.r.enclosing_function(loop)
        if (type(reader) not in (cst.Name, cst.Attribute) or self.flow.values(reader) != {call} or fn is None
                or fn is self.r.enclosing_function(call)):
            return None  # in the loader's own function its name is followed (codemods/data.py's epoch loops)
        around = self._loop_chain(loop)[0]
        if around:
            return loop, reader, around[0].target.value if self._is_epoch_loop(around[0]) else None
        bound = self.flow.bound_calls(fn)
        calls = [c for c, _ in bound]
        for param in fn.params.params:
            origins = self.flow.parameter_values(fn, param.name.value)
            epoch = next(iter(origins)) if len(origins) == 1 else None
            if calls and self._is_epoch_loop(epoch) and all(self._loop_chain(c)[0][:1] == [epoch] for c in calls):
                return loop, reader, param.name.value
        handed = self._handed_in_epoch(call, reader, fn, bound)
        if handed is not None:
            return handed
        # a pass that may repeat (its function is called in a loop) with no epoch number known
        return (loop, reader, None) if any(self._loop_chain(c)[0] for c in calls) else None

    def _handed_in_epoch(self, call: cst.Call, reader, fn: cst.FunctionDef, bound: list) -> Optional[tuple]:
        """(statement, argument, epoch) where the pass reads a parameter of `fn` and the one call of `fn`
        sits in the body of a `for <epoch> in range(...)`, handing it the loader as a name or an attribute
        that holds `call` and nothing else (`run_epoch(self.net, self.train_dl, self.opt)` in `fit()`'s
        epoch loop): set_epoch goes before that call's statement, through the argument."""
        if type(reader) is not cst.Name or len(bound) != 1:
            return None
        site, skip = bound[0]
        arg = dict(bind_args(fn, site, skip)).get(reader.value)
        around = self._loop_chain(site)[0]
        if (arg is None or type(arg) not in (cst.Name, cst.Attribute) or not around
                or not self._is_epoch_loop(around[0]) or self.flow.values(arg) != {call}):
            return None
        return self.r.statement_of(site), arg, around[0].target.value

    def _is_epoch_loop(self, node) -> bool:
        """`for <name> in range(...)`."""
        return (type(node) is cst.For and type(node.target) is cst.Name and type(node.iter) is cst.Call
                and "builtins.range" in self.r.qnames(node.iter.func))

    def handed_to(self, call: cst.Call) -> List[tuple]:
        """(function, parameter) for each parameter of a script function that holds the value of
        `call` (a DataLoader, or a call returning one) and no other value (followed by value:
        analysis/flow.py)."""
        out = []
        for site, fn in self._local_calls():
            for param, arg in bind_args(fn, site):
                if (fn, param) in out or call not in self.flow.values(arg):
                    continue
                if self.flow.parameter_values(fn, param) == {call}:
                    out.append((fn, param))
        return out

    def _loaders_feeding(self, train_loops: List[LoopSite]) -> Set[int]:
        """id() of each DataLoader call whose value reaches a training loop, followed by value
        (analysis/flow.py) through names, arguments, returns, attributes and methods: what the
        loop iterates (also through enumerate(), zip(), tqdm(), iter()), what `next()` draws from
        in it, and what an outer `for` around it iterates (micro-batches split off each batch)."""
        return set(self._loops_fed(train_loops))

    def _loops_fed(self, train_loops: List[LoopSite]) -> Dict[int, cst.CSTNode]:
        """id() of each DataLoader call whose value reaches a training loop -> the first such loop."""
        if getattr(self, "_fed", None) is not None:
            return self._fed
        found: Dict[int, cst.CSTNode] = {}
        self._fed_calls: Dict[int, cst.CSTNode] = {}  # every call whose value a loop reads -> the loop
        for loop in train_loops:
            calls: Set[int] = set()
            every: Set[int] = set()
            for expr in self._loop_reads(loop):
                self._loader_origins(expr, calls, 3, every)
            for call in calls:
                found.setdefault(call, loop.node)
            for call in every:
                self._fed_calls.setdefault(call, loop.node)
        self._fed = found
        return found

    def _loop_reads(self, loop: LoopSite) -> List[cst.BaseExpression]:
        """What a training loop reads its batches from: what it iterates, what `next()` draws from in it,
        and what an outer `for` around it iterates (micro-batches split off each batch)."""
        reads: List[cst.BaseExpression] = []
        if isinstance(loop.node, cst.For):
            reads.append(loop.node.iter)
        reads += [c.args[0].value for c in self.r.descendants(loop.node, cst.Call)
                  if type(c.func) is cst.Name and c.func.value == "next" and c.args]
        for outer in self.r.ancestors(loop.node):
            if isinstance(outer, cst.FunctionDef):
                break
            if isinstance(outer, cst.For):
                reads.append(outer.iter)
        return reads

    def helper_calls_held(self, expr, calls: List[cst.Call]) -> frozenset:
        """The values `expr` can hold, followed by value but not into the given calls of a loader helper:
        each of those it can hold is itself among them (`self.val_loader` -> the `self.make_loader(...)` that
        built it), beside whatever other origins it has."""
        key = tuple(sorted(id(c) for c in calls))
        flows = self.__dict__.setdefault("_stopping_flows", {})
        if key not in flows:
            flows[key] = self.flow.stopping_at(calls)
        return flows[key].values(expr)

    def helper_call_trains(self, call: cst.Call) -> bool:
        """The value of `call` (a function or method of the script that returns a DataLoader) feeds a training
        loop: a loop reads it as the call's value (loop_fed_by); the name the call binds is what a training
        loop iterates, in that function or one it hands it to (name_trains); or what a training loop reads
        holds this call of the helper, followed by value (helper_calls_held: `self.train_loader =
        self.make_loader(...)` read by `for x, y in self.train_loader:` in another method, or handed on)."""
        if self.loop_fed_by(call) is not None:
            return True
        stmt = self.r.statement_of(call)
        small = stmt.body[0] if type(stmt) is cst.SimpleStatementLine and len(stmt.body) == 1 else None
        if (type(small) is cst.Assign and len(small.targets) == 1 and small.value is call
                and type(small.targets[0].target) is cst.Name
                and self.name_trains(small.targets[0].target.value, self.r.enclosing_function(stmt))):
            return True
        siblings = [c for fn, _ in self.callees(call) for c in self.helper_calls(fn)] or [call]
        for loop in self.train_loops():
            for expr in self._loop_reads(loop):
                names = [expr] + [n for n in walk(expr) if type(n) in (cst.Name, cst.Attribute) and n is not expr]
                if any(call in self.helper_calls_held(n, siblings) for n in names):
                    return True
        return False

    def shared_helper_calls(self, loader: "LoaderSite") -> Optional[List[cst.Call]]:
        """The calls of the function of the script that builds and returns the training DataLoader `loader`
        where only some of them feed a training loop (the same helper builds a validation loader too): the
        DataLoader is split for those calls only. None where every call trains, or it is no such helper's."""
        fn = self.r.enclosing_function(loader.stmt)
        if fn is None or not loader.returned:
            return None
        calls = [c for c in self.helper_calls(fn) if self.r.enclosing_function(c) is not fn]
        fed = [c for c in calls if self.helper_call_trains(c)]
        return calls if fed and len(fed) < len(calls) else None

    def helper_calls(self, fn: cst.FunctionDef) -> List[cst.Call]:
        """The calls of a function of the script by its name, or of a method of one of its top-level classes
        (`self.make_loader(...)`, `solver.make_loader(...)`: flow.bound_calls); none where the method's name
        is also called or read otherwise (`Solver.make_loader(self, ...)`, `getattr`, handed on as a value):
        calls the analysis cannot see may be the ones that train."""
        cls = self.r.enclosing_class(fn)
        if cls is None:
            return self.calls_of(fn)
        if self.r.enclosing_function(fn) is not None:
            return []
        calls = [c for c, _ in self.flow.bound_calls(fn)]
        return [] if self.unseen_use(fn, calls) is not None else calls

    def unseen_use(self, fn: cst.FunctionDef, calls: Optional[List[cst.Call]] = None) -> Optional[cst.Name]:
        """The first use of the name of the script's function or method `fn` that is none of its known calls
        (`calls`: by default helper_calls') nor its def: `getattr`, handed on as a value, a method of that
        name of another class. None where every use is known."""
        if calls is None:
            calls = self.calls_of(fn) if self.r.enclosing_class(fn) is None else [c for c, _ in self.flow.bound_calls(fn)]
        known = {id(fn.name)} | {id(c.func.attr if type(c.func) is cst.Attribute else c.func) for c in calls}
        return next((n for n in self.r.nodes(cst.Name) if n.value == fn.name.value and id(n) not in known), None)

    def loader_helper_calls(self, loaders: List["LoaderSite"], entry: Optional[cst.CSTNode]) -> List[cst.Call]:
        """The calls of the functions of the script (not `entry`, not methods) that build one of `loaders`
        that trains: the data stage gives it a DistributedSampler there, which asks the process group for the
        rank when it is built, so the group must start before such a call."""
        helpers = {self.r.enclosing_function(loader.stmt) for loader in loaders if loader.trains}
        helpers = {fn for fn in helpers if fn is not None and fn is not entry and self.r.enclosing_class(fn) is None}
        return [c for fn in helpers for c in self.calls_of(fn) if self.r.enclosing_function(c) not in helpers]

    def name_handed_to(self, name: str, fn: Optional[cst.FunctionDef]) -> List[tuple]:
        """(function, parameter) for each call in `fn` that hands the name `name` to a function of the
        script as that parameter (`train_model(model, train_loader, ...)`)."""
        out = []
        for site, callee in self._local_calls():
            if self.r.enclosing_function(site) is fn:
                out.extend((callee, param) for param, arg in bind_args(callee, site)
                           if type(arg) is cst.Name and arg.value == name and (callee, param) not in out)
        return out

    def name_trains(self, name: str, fn: Optional[cst.FunctionDef], depth: int = 2) -> bool:
        """A training loop iterates the name `name` of `fn` (None: the module's top level): there, or in a
        function of the script the name is handed to as an argument, followed `depth` calls deep
        (`train_model(model, train_loader, ...)` whose loop reads its parameter)."""
        for loop in self.train_loops():
            if (type(loop.node) is cst.For and self.r.enclosing_function(loop.node) is fn
                    and name in names_in(loop.node.iter)):
                return True
        return depth > 0 and any(self.name_trains(param, callee, depth - 1)
                                 for callee, param in self.name_handed_to(name, fn))

    def loop_fed_by(self, call: cst.Call) -> Optional[cst.CSTNode]:
        """The first training loop that reads the value of `call` (any call: a function of another
        module that returns a DataLoader), followed as `fed_loaders` follows DataLoaders; None if none."""
        self._loops_fed(self.train_loops())
        return self._fed_calls.get(id(call))

    def fed_loaders(self) -> List[tuple]:
        """(DataLoader call, the training loop it reaches) for every DataLoader call whose value
        a training loop reads, wherever it is built (a helper's `return DataLoader(...)`, a
        method, `self.loader = DataLoader(...)` read as `data.loader`), in source order."""
        fed = self._loops_fed(self.train_loops())
        return [(c, fed[id(c)]) for c in self.calls if id(c) in fed]

    def _loader_origins(self, expr, found: Set[int], depth: int, every: Optional[Set[int]] = None) -> None:
        """Adds to `found` the DataLoader calls `expr` can hold, looking through the arguments
        of calls that wrap one (iter(loader), enumerate(loader), a generator of the script);
        to `every` (when given) every call it can hold."""
        names = [expr] if type(expr) in (cst.Name, cst.Attribute, cst.Call) else []
        names += [n for n in walk(expr) if type(n) is cst.Name and n is not expr]
        for name in names:
            for origin in self.flow.values(name):
                if type(origin) is not cst.Call:
                    continue
                if every is not None:
                    every.add(id(origin))
                if self.r.is_call_to(origin, DATALOADERS):
                    found.add(id(origin))
                elif depth > 0 and origin.args:
                    for arg in origin.args:
                        self._loader_origins(arg.value, found, depth - 1, every)

    def _cycled(self, name: str, stmt) -> Optional[tuple]:
        """(while, for, parameter) when the loader is handed to a function of the script whose
        `while` repeats a `for` over that parameter, and every call of that function sits in the
        loader's scope and hands it this loader there (no other loader gets its set_epoch)."""
        scope = self.r.enclosing_function(stmt)
        for call, fn in self._local_calls():
            params = _parameters_given(fn, call, name)
            if len(params) != 1 or any(self.r.enclosing_function(c) is not scope
                                       or _parameters_given(fn, c, name) != params for c in self.calls_of(fn)):
                continue
            param = next(iter(params))
            site = pass_in_while(self.r, param, fn.body)
            if site is not None:
                return (*site, param)
        return None

    def _received(self, name: str, stmt) -> Optional[tuple]:
        """(name, block) where the one call of the function that builds the loader and returns
        it binds it in its caller (`train_loader, val_loader = build_loaders(...)`), or None."""
        helper = self.r.enclosing_function(stmt)
        calls = self.calls_of(helper)
        out = names_out(self.r, calls[0], helper, {name}) if len(calls) == 1 else {}
        if len(out) != 1:
            return None
        return next(iter(out)), self.r.block_of(self.r.statement_of(calls[0]))

    def _sampler(self, args, stmt) -> Optional[SamplerSite]:
        if "batch_sampler" in args:
            return SamplerSite("other", args["batch_sampler"])
        expr = args.get("sampler")
        if expr is None or (type(expr) is cst.Name and expr.value == "None"):
            return None  # `sampler=None`: the DataLoader's default, no sampler
        if type(expr) is cst.Name and _only_none(self.flow.values(expr)):
            return None  # `train_sampler = None` ... `sampler=train_sampler`: no sampler either
        call = expr if isinstance(expr, cst.Call) else None
        if isinstance(expr, cst.Name):
            bound = self._value_bound_before(expr.value, stmt)
            if self._distributed_or_none(bound):
                return SamplerSite("distributed", expr, bound.body if isinstance(bound, cst.IfExp) else bound)
            call = bound if isinstance(bound, cst.Call) else None
        if self._distributed_or_none(expr) and isinstance(expr, cst.IfExp):
            return SamplerSite("distributed", expr, expr.body)
        if call is None:
            return SamplerSite("other", expr)
        if self.r.is_call_to(call, DISTRIBUTED_SAMPLERS):
            return SamplerSite("distributed", expr, call)
        shuffle = next((PLAIN_SAMPLERS[q] for q in self.r.qnames(call.func) if q in PLAIN_SAMPLERS), None)
        if shuffle is not None and len(call.args) == 1 and call.args[0].keyword in (None,) and not call.args[0].star:
            return SamplerSite("plain", expr, call, call.args[0].value, shuffle)
        if shuffle == "True":
            return self._with_replacement(expr, call) or SamplerSite("other", expr, call)
        return SamplerSite("other", expr, call)

    def _with_replacement(self, expr, call: cst.Call) -> Optional[SamplerSite]:
        """`RandomSampler(data, replacement=True[, num_samples=N])` (arguments by position or
        keyword): "replacement"; with a `generator=` that reads the rank (`torch.Generator()
        .manual_seed(... + dist.get_rank())`, what the rewrite writes): "per_rank"; else None."""
        args: Dict[str, cst.BaseExpression] = {}
        for i, arg in enumerate(call.args):
            if arg.star:
                return None
            key = arg.keyword.value if arg.keyword is not None else (
                RANDOM_SAMPLER_PARAMS[i] if i < len(RANDOM_SAMPLER_PARAMS) else None)
            if key not in RANDOM_SAMPLER_PARAMS:
                return None
            args[key] = arg.value
        replacement = args.get("replacement")
        if "data_source" not in args or not (isinstance(replacement, cst.Name) and replacement.value == "True"):
            return None
        generator = args.get("generator")
        if generator is None:
            return SamplerSite("replacement", expr, call, args["data_source"], "True", args.get("num_samples"))
        if any(self.r.is_call_to(node, GET_RANK) for origin in self.flow.values(generator)
               if isinstance(origin, cst.CSTNode) for node in walk(origin)):
            return SamplerSite("per_rank", expr, call, args["data_source"], "True", args.get("num_samples"))
        return None

    def _distributed_or_none(self, value) -> bool:
        """`DistributedSampler(...) if ddp else None` (either order): the script's own optional
        distributed mode, which already splits the data whenever it runs on several ranks."""
        if not isinstance(value, cst.IfExp):
            return False
        branches = [value.body, value.orelse]
        samplers = [b for b in branches if isinstance(b, cst.Call) and self.r.is_call_to(b, DISTRIBUTED_SAMPLERS)]
        nones = [b for b in branches if isinstance(b, cst.Name) and b.value == "None"]
        return len(samplers) == 1 and len(nones) == 1

    def _returned(self, name: str, stmt) -> bool:
        function = self.r.enclosing_function(stmt)
        return function is not None and any(
            r.value is not None and name in names_in(r.value) and self.r.enclosing_function(r) is function
            for r in self.r.descendants(function, cst.Return)
        )

    def _value_bound_before(self, name: str, stmt) -> Optional[cst.BaseExpression]:
        """The value `name` was last bound to by a plain assignment in the block before `stmt`."""
        block = self.r.block_of(stmt)
        earlier = last_assignment(name, stmt, block) if block is not None else None
        small = earlier.body[0] if earlier is not None else None
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
            return small.value
        return None

    def _shuffle_set_after(self, name: str, dict_node, stmt) -> bool:
        """Whether a statement between the dict's binding and `stmt` may set its "shuffle"
        (`name.update(shuffle=...)`, `name["shuffle"] = ...`, `name.setdefault("shuffle", ...)`,
        or an update whose keys cannot be read)."""
        body = list(self.r.block_of(stmt).body)
        start = next(i for i, s in enumerate(body) if any(n is dict_node for n in walk(s)))
        for between in body[start + 1 : body.index(stmt)]:
            for call in calls_in(between):
                func = call.func
                if not (isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)
                        and func.value.value == name and func.attr.value in ("update", "setdefault")):
                    continue
                keys = [a.keyword.value if a.keyword is not None else
                        (a.value.evaluated_value if isinstance(a.value, cst.SimpleString) else None)
                        for a in call.args]
                if func.attr.value == "setdefault":
                    keys = keys[:1]
                elif any(a.keyword is None for a in call.args):
                    keys = [None]  # update({...}) or update(other): read what a literal says, else assume it may
                    if len(call.args) == 1 and isinstance(call.args[0].value, (cst.Dict, cst.Call)):
                        keys = [k for k, _ in _dict_entries(call.args[0].value)] or [None]
                if "shuffle" in keys or None in keys:
                    return True
            for target in _subscript_targets(between):
                if isinstance(target.value, cst.Name) and target.value.value == name:
                    index = target.slice[0].slice if len(target.slice) == 1 else None
                    key = index.value if isinstance(index, cst.Index) else None
                    if not isinstance(key, cst.SimpleString) or key.evaluated_value == "shuffle":
                        return True
        return False

    def _unfollowed(self, loaders: List[LoaderSite]) -> List[UnfollowedLoader]:
        followed = {id(l.call) for l in loaders}
        out = []
        for call in self.r.nodes(cst.Call):
            if id(call) in followed or not self.r.is_call_to(call, DATALOADERS):
                continue
            how = "built and used in one expression"
            for anc in self.r.ancestors(call):
                if isinstance(anc, cst.For) and any(n is call for n in walk(anc.iter)):
                    how = "built inline in the `for` that reads it"
                    break
                if isinstance(anc, cst.Return):
                    how = f"returned by {self.r.enclosing_function(anc).name.value}()"
                    break
                if isinstance(anc, cst.Assign):
                    if any(isinstance(t.target, cst.Attribute) for t in anc.targets):
                        how = f"stored on `{code(anc.targets[0].target)}`"
                    break
                if isinstance(anc, cst.BaseStatement):
                    break
            out.append(UnfollowedLoader(call, how))
        for loader in loaders:
            if loader.returned and not loader.trains:
                function = self.r.enclosing_function(loader.stmt)
                out.append(UnfollowedLoader(loader.stmt, f"`{loader.name}`, returned by {function.name.value}()"))
        return out

    def _dict_bound_before(self, name: str, stmt) -> Optional[cst.CSTNode]:
        """The dict literal or `dict(...)` call `name` was last bound to in the block before `stmt`."""
        value = self._value_bound_before(name, stmt)
        if isinstance(value, cst.Dict) or (
            isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "dict"
        ):
            return value
        return None


class DataAnalysis(LoopAnalysis, LoaderAnalysis):
    """The training loops and the DataLoaders they read, on the shared analysis base: what
    `check` asks of a script (it needs no model facts: the script is often sharded already);
    the rewrite's analysis (facts.py) extends it."""

    def train_loops(self) -> List[LoopSite]:
        """The loops of the script that call backward() (found once)."""
        if getattr(self, "_train_loop_list", None) is None:
            self._train_loop_list = self._train_loops(self.r.nodes(cst.For) + self.r.nodes(cst.While))
        return self._train_loop_list

    def training_loaders(self) -> List[LoaderSite]:
        """The DataLoaders of the script, each marked whether a training loop reads it (found once)."""
        if getattr(self, "_training_loaders", None) is None:
            self._training_loaders = self._loaders(self.r.nodes(cst.SimpleStatementLine), self.train_loops())
        return self._training_loaders


def loader_dataset(call: cst.Call, keywords: Optional[dict] = None) -> Optional[cst.BaseExpression]:
    """The dataset a DataLoader call is given: `dataset=` (from `keywords` when given: the call's
    keyword arguments with the entries of a dict it unpacks) or its first positional argument."""
    if keywords is None:
        keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    return keywords.get("dataset", positional[0] if positional else None)


def training_loaders(module: cst.Module, resolver: Resolver) -> List[LoaderSite]:
    """DataAnalysis.training_loaders of a module."""
    return DataAnalysis(module, resolver).training_loaders()


def unfollowed_loaders(analysis: LoaderAnalysis, loaders: List[LoaderSite]) -> List[UnfollowedLoader]:
    """The DataLoaders no loop can be traced to (see UnfollowedLoader), asked of the script's analysis."""
    return analysis._unfollowed(loaders)


def _subscript_targets(stmt):
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.Assign):
                yield from (t.target for t in small.targets if isinstance(t.target, cst.Subscript))
    elif isinstance(stmt, cst.BaseCompoundStatement):
        for inner in walk(stmt):
            if isinstance(inner, cst.SimpleStatementLine):
                yield from _subscript_targets(inner)


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


def _parameters_given(fn: cst.FunctionDef, call: cst.Call, name: str) -> Set[str]:
    """The parameters of `fn` that `call` binds to the name `name`."""
    return {p for p, arg in bind_args(fn, call) if isinstance(arg, cst.Name) and arg.value == name}


def pass_in_while(resolver: Resolver, name: str, block) -> Optional[tuple]:
    """(the while, the for) when a `for` over `name` in `block` sits directly in a `while`'s body:
    each turn of the `while` is one more pass."""
    for node in resolver.descendants(block, cst.For):
        if iterated_name(node.iter) != name:
            continue
        body = resolver.parent(node)
        owner = resolver.parent(body) if body is not None else None
        if isinstance(body, cst.IndentedBlock) and isinstance(owner, cst.While):
            return owner, node
    return None


def _only_none(values) -> bool:
    """Every value a name can hold is the literal None."""
    return bool(values) and all(type(v) is cst.Name and v.value == "None" for v in values)
