"""Where a DataLoader's batch size is set when it comes through a `**` dict, for --keep-global-batch.

`DataLoader(data, **train_kwargs)`: the value of `train_kwargs` is followed back through
assignments and aliases, a parameter (to every call of its function) and a helper's
`return`, to the dict it was built as (`{...}` or `dict(...)`). Each place that gives that
dict its "batch_size" is a place to divide: the entry itself, a later `kw["batch_size"] = n`,
`kw.update(batch_size=n)`, or an update with another dict that sets it (followed the same
way). Where the value is lost on the way, `lost` says where and why.

What is set through a later alias (`other = kw`) or in a function of the script the dict is
handed to (`add_defaults(kw)`) counts too; a function of another module is assumed to leave
the dict as it is.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import libcst as cst

from .batch_size import name_home, name_reads
from .returns import own_returns
from .site_analysis import SiteAnalysis
from dataclasses import dataclass
from fsdp2_retrofit.syntax.names import bind_args, code, names_in, parameter_names

KEY = "batch_size"
_MAX_STEPS = 12  # values followed further than this are reported as lost
_REMOVERS = ("pop", "popitem", "clear")


@dataclass
class BatchSizeSet:
    """One place a dict's "batch_size" is given: `value`, in statement `stmt`."""

    value: cst.BaseExpression
    stmt: cst.CSTNode


@dataclass
class KwargsBatchSize:
    """The places that set the batch size a DataLoader unpacks from its `**` dicts (none:
    the dicts never set it), or `lost`: (node, why) where the value could not be followed."""

    sets: List[BatchSizeSet]
    lost: Optional[Tuple[cst.CSTNode, str]] = None


class _Lost(Exception):
    def __init__(self, node: cst.CSTNode, why: str):
        super().__init__(why)
        self.node, self.why = node, why


class KwargsAnalysis(SiteAnalysis):
    """Follows the `**` argument of a call back to the dicts it holds."""

    def batch_size_through(self, call: cst.Call) -> Optional[KwargsBatchSize]:
        """None when `call` unpacks no `**` dict; see KwargsBatchSize."""
        unpacked = [a.value for a in call.args if a.star == "**"]
        if not unpacked:
            return None
        at = self.r.statement_of(call)
        try:
            sets = [s for value in unpacked for s in self._sets_in(value, at, 0)]
        except _Lost as lost:
            return KwargsBatchSize([], (lost.node, lost.why))
        unique = {id(s.value): s for s in sets}
        return KwargsBatchSize(list(unique.values()))

    def _sets_in(self, expr: cst.BaseExpression, at: cst.CSTNode, steps: int) -> List[BatchSizeSet]:
        """Where the dict `expr` (read in statement `at`) is given its batch size."""
        if steps > _MAX_STEPS:
            raise _Lost(expr, f"`{code(expr)}` is followed through more than {_MAX_STEPS} steps")
        if isinstance(expr, cst.Dict):
            return self._literal_sets(expr, at, steps)
        if isinstance(expr, cst.Call) and self.r.is_call_to(expr, {"builtins.dict"}):
            return self._call_sets(expr, at, steps)
        if isinstance(expr, cst.Name):
            return self._name_sets(expr, at, steps)
        helper = self._callee(expr) if isinstance(expr, cst.Call) else None
        if helper is not None:
            returns = own_returns(self.r, helper)
            if not returns or any(r.value is None for r in returns):
                raise _Lost(expr, f"{helper.name.value}() does not return a dict on every path")
            return [s for r in returns for s in self._sets_in(r.value, self.r.statement_of(r), steps + 1)]
        raise _Lost(expr, f"`{code(expr)}` is not a dict the rewrite can follow to where it is built")

    def _literal_sets(self, node: cst.Dict, at, steps: int) -> List[BatchSizeSet]:
        out = []
        for el in node.elements:
            if isinstance(el, cst.StarredDictElement):
                out += self._sets_in(el.value, at, steps + 1)
            elif not isinstance(el.key, cst.SimpleString):
                raise _Lost(el.key, f"the key `{code(el.key)}` is not a string the rewrite can read")
            elif el.key.evaluated_value == KEY:
                out.append(BatchSizeSet(el.value, self.r.statement_of(node)))
        return out

    def _call_sets(self, call: cst.Call, at, steps: int) -> List[BatchSizeSet]:
        """`dict(batch_size=n, ...)`, `dict(other, ...)`, `kw.update(...)`: the keywords,
        and the dicts it copies entries from."""
        out = []
        for a in call.args:
            if a.keyword is None:
                out += self._sets_in(a.value, at, steps + 1)
            elif a.keyword.value == KEY:
                out.append(BatchSizeSet(a.value, self.r.statement_of(call)))
        return out

    def _name_sets(self, name: cst.Name, at, steps: int) -> List[BatchSizeSet]:
        """The dict a name holds where `at` reads it: from its one binding, or, for a
        parameter, from what every call of its function passes; then what the function
        that holds it sets in it before `at`."""
        scope = self.r.enclosing_function(at)
        home, bindings = name_home(self.r, name.value, scope)
        start = None
        if len(bindings) > 1:
            lines = ", ".join(str(self.r.line(b)) for b in bindings)
            raise _Lost(bindings[1], f"`{name.value}` is bound {len(bindings)} times (lines {lines})")
        if bindings and home is not None and name.value in parameter_names(home):
            raise _Lost(bindings[0], f"`{name.value}` is a parameter of {home.name.value}() and is also bound here: "
                                     "which dict reaches the DataLoader depends on the run")
        if bindings:
            value = _assigned_value(self.r, bindings[0])
            if value is None:
                raise _Lost(bindings[0], f"`{name.value}` is bound here in a way the rewrite does not follow")
            start = self.r.statement_of(bindings[0])
            # an alias holds the same dict: what is set in it up to `at` counts; a copy or a new dict is made here
            out = self._sets_in(value, at if isinstance(value, cst.Name) and home is scope else start, steps + 1)
        elif home is not None and name.value in parameter_names(home):
            calls = self.calls_of(home)
            if not calls:
                raise _Lost(name, f"`{name.value}` is a parameter of {home.name.value}(), which the script never calls")
            out = []
            for call in calls:
                given = dict(bind_args(home, call))
                if name.value not in given:
                    raise _Lost(call, f"this call of {home.name.value}() passes no plain `{name.value}` argument")
                out += self._sets_in(given[name.value], self.r.statement_of(call), steps + 1)
        else:
            raise _Lost(name, f"`{name.value}` is not bound in this script")
        return out + self._later_sets(name.value, home, start, at if home is scope else None, steps)

    def _later_sets(self, name: str, home, start, end, steps: int) -> List[BatchSizeSet]:
        """What statements of `home` between `start` (its binding; None: the function's
        start) and `end` (None: anywhere), and the functions inside it that see its `name`,
        set in the dict `name` holds there."""
        low = self.r.order(start) if start is not None else -1
        high = self.r.order(end) if end is not None else float("inf")
        out = []
        for node in name_reads(self.r, name, home):
            # a function nested in `home` (any function, for a global) may run at any time: all of its uses count
            if self.r.enclosing_function(node) is home and not low < self.r.order(node) < high:
                continue
            out += self._set_by(node, name, steps) + self._handed_on(node, home, end, steps)
        return out

    def _handed_on(self, node: cst.Name, home, end, steps: int) -> List[BatchSizeSet]:
        """What is set in the dict through another name it is handed to: a later alias in
        the same function (`other = name`), or a parameter of a function of the script it is
        passed to (`add_defaults(name)`)."""
        if steps > _MAX_STEPS:
            raise _Lost(node, f"`{node.value}` is followed through more than {_MAX_STEPS} steps")
        parent = self.r.parent(node)
        if isinstance(parent, cst.Assign) and parent.value is node:
            stmt = self.r.statement_of(node)
            targets = [t.target for t in parent.targets]
            if not all(isinstance(t, cst.Name) for t in targets):
                raise _Lost(parent, f"`{node.value}` is stored where the rewrite cannot follow it")
            return [s for t in targets for s in self._later_sets(t.value, home, stmt, end, steps + 1)]
        call = self.r.parent(parent) if isinstance(parent, cst.Arg) and parent.value is node else None
        callee = self._callee(call) if isinstance(call, cst.Call) and not parent.star else None
        if callee is None:
            return []
        params = [p for p, arg in bind_args(callee, call) if arg is node]
        return [s for p in params for s in self._later_sets(p, callee, None, None, steps + 1)]

    def _set_by(self, node: cst.Name, name: str, steps: int) -> List[BatchSizeSet]:
        """What this use of the dict's name sets in it: `name[k] = v`, `name[k] += v`,
        `del name[k]`, `name.update(...)`, `name.setdefault(k, v)`, `name.pop(k)` (`name |= ...`
        binds the name a second time: name_home counts it)."""
        parent = self.r.parent(node)
        stmt = self.r.statement_of(node)
        if isinstance(parent, cst.Subscript) and parent.value is node:
            key = _key(parent)
            holder = self.r.parent(parent)
            if isinstance(holder, cst.AssignTarget) and holder.target is parent:
                assign = self.r.parent(holder)
                if key is None:
                    raise _Lost(parent, f"`{code(parent)}` stores under a key the rewrite cannot read")
                return [self._set(assign.value, stmt, name)] if key == KEY else []
            changes = isinstance(holder, cst.AugAssign) and holder.target is parent
            deletes = any(isinstance(a, cst.Del) for a in self.r.ancestors(parent) if a is not stmt)
            if (changes or deletes) and key in (None, KEY):
                raise _Lost(parent, f"`{code(self.r.parent(parent) if changes else parent)}` changes the batch "
                                    "size in a way the rewrite cannot divide")
            return []
        method = self.r.parent(parent) if isinstance(parent, cst.Attribute) and parent.value is node else None
        if not (isinstance(method, cst.Call) and method.func is parent):
            return []
        verb = parent.attr.value
        if verb == "update":
            return [self._set(s.value, s.stmt, name) for s in self._call_sets(method, stmt, steps + 1)]
        first = method.args[0].value if method.args else None
        key = first.evaluated_value if isinstance(first, cst.SimpleString) else None
        if verb == "setdefault" and key == KEY and len(method.args) > 1:
            return [self._set(method.args[1].value, stmt, name)]
        if (verb == "setdefault" and key in (None, KEY)) or (verb in _REMOVERS and key in (None, KEY)):
            raise _Lost(method, f"`{code(method)}` changes the batch size in a way the rewrite cannot divide")
        return []

    def _set(self, value: cst.BaseExpression, stmt, name: str) -> BatchSizeSet:
        if name in names_in(value):
            raise _Lost(value, f"`{code(value)}` is computed from the dict `{name}` itself: divided again it "
                               "would be divided twice")
        return BatchSizeSet(value, stmt)


def _assigned_value(resolver, target: cst.Name) -> Optional[cst.BaseExpression]:
    """The value of `target = value` or `target: T = value` (one target), else None."""
    holder = resolver.parent(target)
    if isinstance(holder, cst.AssignTarget):
        assign = resolver.parent(holder)
        return assign.value if len(assign.targets) == 1 else None
    if isinstance(holder, cst.AnnAssign) and holder.target is target:
        return holder.value
    return None


def _key(subscript: cst.Subscript) -> Optional[str]:
    """The string literal a subscript indexes with, or None."""
    if len(subscript.slice) != 1 or not isinstance(subscript.slice[0].slice, cst.Index):
        return None
    value = subscript.slice[0].slice.value
    return value.evaluated_value if isinstance(value, cst.SimpleString) else None


def batch_size_through(module: cst.Module, resolver, call: cst.Call) -> Optional[KwargsBatchSize]:
    """Where the batch size `call` unpacks from its `**` dicts is set (KwargsBatchSize);
    None when it unpacks none."""
    return KwargsAnalysis(module, resolver).batch_size_through(call)
