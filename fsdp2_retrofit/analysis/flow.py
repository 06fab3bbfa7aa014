"""Value flow in one script: which values an expression can hold, whatever the names.

`ValueFlow(resolver, callee).values(expr)` is the set of *origins* the expression may
evaluate to: the expressions that make a value (a call the analysis does not see
into, a literal, a parameter no call binds), reached by following

- names to every binding of the name in its scope (plain and annotated assignments,
  tuple unpacking, `with ... as`), through `global`, closures and module globals;
- parameters to the arguments every call of the function passes (positional and
  keyword), when the calls are known (`callee`: the script's own functions);
- calls of the script's own functions to what their `return` statements give back,
  a tuple element to the element at the same place;
- `x.to(...)`, `.cuda()`, `.train()` ... (methods that return the module itself), an
  `a if c else b` and an `a or b` to each side;
- `self.attr` to every `self.attr = value` of the class's methods (but for
  `self.attr = self.attr.to(device)`, which holds what the others hold), and `obj.attr` the
  same way when `obj` holds an instance of a class of the script (`Data(ds).loader`);
- `obj.method(...)` and `self.method(...)` to what that method of the script's class returns.

It is flow-insensitive: a name bound twice may hold either value ("can hold", an
over-approximation). Questions about one kind of site ("does this loop read that
DataLoader?") compare origins, never spellings, so a script whose locals are renamed
gets the same answers (tests/test_alpha_rename.py).

libcst's ScopeProvider would give the bindings too; it was measured at 4.0x the cost
of parsing the fixtures' inputs (9.8 s against 2.5 s for 84 files, 6032 lines), where
this index reads the resolver's, built anyway (0.39 s for the same files): see DESIGN.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import SELF_RETURNING_METHODS, Resolver, bind_args, module_itself

Origin = object  # a CSTNode, or (node, position) for the element of a value not seen into
# functions that hand back the module they are given, its BatchNorm layers replaced: torch's and apex's
_CONVERTERS = frozenset({"convert_sync_batchnorm", "convert_syncbn_model"})
_MAX_DEPTH = 40


class ValueFlow:
    """Origins of expressions of one module (see the module's docstring)."""

    def __init__(self, resolver: Resolver, callee: Callable[[cst.Call], Optional[cst.FunctionDef]],
                 calls_of: Callable[[cst.FunctionDef], List[cst.Call]]):
        self.r = resolver
        self._callee = callee
        self._calls_of = calls_of
        self._memo: Dict[int, FrozenSet] = {}
        self._bindings: Optional[Dict[Tuple[int, str], list]] = None
        self._declared_global: Dict[int, set] = {}
        self._attr_stores: Optional[Dict[Tuple[int, str], list]] = None
        self._classes: Optional[Dict[str, Optional[cst.ClassDef]]] = None
        self._bound: Dict[int, List[Tuple[cst.Call, int]]] = {}
        self._by_spelling: Optional[Dict[str, List[cst.Call]]] = None
        self._stop: FrozenSet[int] = frozenset()

    # -- the index -----------------------------------------------------------

    def _index(self) -> None:
        """(id(scope) or 0 for the module, name) -> [(kind, target element, value, position)]."""
        r = self.r
        bindings: Dict[Tuple[int, str], list] = {}
        for fn in r.nodes(cst.FunctionDef):
            params = fn.params
            for p in [*params.posonly_params, *params.params, *params.kwonly_params]:
                bindings.setdefault((id(fn), p.name.value), []).append(("param", p, fn, None))
        for stmt in r.nodes(cst.Global):
            fn = r.enclosing_function(stmt)
            if fn is not None:
                self._declared_global.setdefault(id(fn), set()).update(n.name.value for n in stmt.names)
        for kind in (cst.Assign, cst.AnnAssign):
            for node in r.nodes(kind):
                if node.value is None or r.enclosing_class(node) is not None and r.enclosing_function(node) is None:
                    continue
                targets = [t.target for t in node.targets] if kind is cst.Assign else [node.target]
                for target in targets:
                    for name, path in _names_at(target, ()):
                        scope = self._scope_for(node, name)
                        bindings.setdefault((scope, name), []).append(("assign", node, node.value, path))
        # bindings the flow does not see into: each read of the name may hold the binding itself
        opaque = [(f.target, f) for f in r.nodes(cst.For)] + [(c.target, c) for c in r.nodes(cst.CompFor)]
        opaque += [(a.target, a) for a in r.nodes(cst.AugAssign)]
        opaque += [(h.name.name, h) for h in r.nodes(cst.ExceptHandler) if h.name is not None]
        opaque += [(d.name, d) for kind in (cst.FunctionDef, cst.ClassDef) for d in r.nodes(kind)
                   if r.enclosing_class(d) is None or r.enclosing_function(d) is not None]
        for target, node in opaque:
            for name, _ in _names_at(target, ()):
                where = self.r.parent(node) if type(node) in (cst.FunctionDef, cst.ClassDef) else node
                bindings.setdefault((self._scope_for(where, name), name), []).append(("opaque", node, None, ()))
        for node in r.nodes(cst.NamedExpr):
            if type(node.target) is cst.Name:
                name = node.target.value
                bindings.setdefault((self._scope_for(node, name), name), []).append(("assign", node, node.value, ()))
        for item in r.nodes(cst.WithItem):
            if item.asname is not None and isinstance(item.asname.name, cst.Name):
                name = item.asname.name.value
                bindings.setdefault((self._scope_for(item, name), name), []).append(("with", item, item.item, ()))
        self._bindings = bindings

    def _scope_for(self, node: cst.CSTNode, name: str) -> int:
        fn = self.r.enclosing_function(node)
        if fn is None or name in self._declared_global.get(id(fn), ()):
            return 0
        return id(fn)

    def _lookup(self, name: cst.Name) -> list:
        """The bindings a read of `name` sees: its function's, else an enclosing one's, else the module's."""
        if self._bindings is None:
            self._index()
        fn = self.r.enclosing_function(name)
        while fn is not None:
            if name.value in self._declared_global.get(id(fn), ()):
                break
            found = self._bindings.get((id(fn), name.value))
            if found is not None:
                return found
            fn = self.r.enclosing_function(fn)
        return self._bindings.get((0, name.value), [])

    # -- queries -------------------------------------------------------------

    def values(self, expr: cst.BaseExpression) -> FrozenSet:
        """The origins `expr` can hold (itself when nothing is known of it)."""
        return self._values(expr, 0)

    def stopping_at(self, calls) -> "ValueFlow":
        """A flow of the same module that does not look into what the given calls return: each is an origin
        itself (which call of a loader helper a name holds, rather than the DataLoader inside the helper)."""
        other = copy.copy(self)  # the index is the module's: shared
        other._memo, other._stop = {}, frozenset(id(c) for c in calls)
        return other

    def parameter_values(self, fn: cst.FunctionDef, name: str) -> FrozenSet:
        """The origins parameter `name` of `fn` can hold (the parameter itself when a call does
        not pass it or no call is known)."""
        if self._bindings is None:
            self._index()
        found = [b for b in self._bindings.get((id(fn), name), []) if b[0] == "param"]
        return frozenset(v for b in found for v in self._binding_values(b, 0))

    def _values(self, expr, depth: int) -> FrozenSet:
        key = id(expr)
        found = self._memo.get(key)
        if found is not None:
            return found
        if depth > _MAX_DEPTH:
            return frozenset([expr])
        self._memo[key] = frozenset([expr])  # a cycle sees the expression itself
        out = frozenset(self._compute(expr, depth + 1))
        self._memo[key] = out
        return out

    def _compute(self, expr, depth: int) -> Iterator:
        kind = type(expr)
        if kind is cst.Name:
            bindings = self._lookup(expr)
            own = next((b for b in bindings if b[0] == "assign" and self._inside(expr, b[2])), None)
            if own is not None:
                # `x = x.to(device)`: the `x` read on the right holds what the bindings before this one made
                # it, not this binding's result nor a later one's (a chain of rebindings is no cycle)
                bindings = [b for b in bindings if b[0] != "assign" or self.r.order(b[1]) < self.r.order(own[1])]
            if not bindings:
                yield expr
            for binding in bindings:
                yield from self._binding_values(binding, depth)
        elif kind is cst.Call:
            yield from self._call_values(expr, depth)
        elif kind is cst.IfExp:
            yield from self._values(expr.body, depth)
            yield from self._values(expr.orelse, depth)
        elif kind is cst.BooleanOperation and type(expr.operator) is cst.Or:
            yield from self._values(expr.left, depth)
            yield from self._values(expr.right, depth)
        elif kind is cst.Subscript:
            yield from self._subscript_values(expr, depth)
        elif kind is cst.Attribute:
            stores = [v for cls in self._classes_held(expr.value, depth) for v in self._stores(cls, expr.attr.value)]
            if not stores:
                yield expr
            for value, path in stores:
                yield from self._element(value, path, depth)
        else:
            yield expr

    def _inside(self, node, outer) -> bool:
        first, last = self.r.span(outer)
        return first <= self.r.order(node) <= last

    def _subscript_values(self, expr: cst.Subscript, depth: int) -> Iterator:
        """`loaders[phase]`, `loaders["train"]`, `pair[0]` of a container the script builds in place: a dict
        or list comprehension's element (`{x: DataLoader(...) for x in splits}`), or the entries of a dict,
        list or tuple display (the one a constant key or index names, else every one). Anything else (a
        container read from elsewhere, a slice, a container changed after it is built) is the expression."""
        key = _constant_key(expr)
        for origin in self._values(expr.value, depth):
            entries = None if _changed_after(self.r, origin) else _entries(origin, key)
            if entries is None:
                yield expr
                return
            for entry in entries:
                yield from self._values(entry, depth)

    def entries(self, expr: cst.Subscript) -> Optional[list]:
        """The element expressions of the container displays `expr` reads (`parts[0]` of `parts = [model]`:
        `model`, as written there), or None where one container is none the flow looks into."""
        key = _constant_key(expr)
        out = []
        for origin in self._values(expr.value, 0):
            found = None if _changed_after(self.r, origin) else _entries(origin, key)
            if found is None:
                return None
            out += found
        return out or None

    def attribute_entries(self, expr: cst.Subscript) -> List[list]:
        """For `self.X[key]` read in a method of a class of the script: the entries `key` reads in each
        container display a method of the class stores as the whole of `self.X` (`self.model_parts =
        [model]` in `__init__`: [[model]], the names as written there), one list per such store. Stores
        that are no display (`(self.schedule, self.model_parts) = build(...)`) are left out: the caller
        decides what one store's entries mean. [] when `expr` is no such read, or when the class changes
        `self.X` in place (`self.X[i] = ...`, `self.X.append(...)`, `del self.X[i]`)."""
        holder = expr.value
        if type(holder) is not cst.Attribute or type(holder.value) is not cst.Name or holder.value.value != "self":
            return []
        key = _constant_key(expr)
        attr = holder.attr.value
        out = []
        for cls in self._classes_held(holder.value, 0):
            if _attribute_changed(self.r, cls, attr):
                return []
            for value, path in self._stores(cls, attr):
                found = _entries(value, key) if not path else None
                if found:
                    out.append(found)
        return out

    def _binding_values(self, binding, depth: int) -> Iterator:
        kind, node, value, path = binding
        if kind == "opaque":
            yield node
            return
        if kind == "param":
            fn = value
            calls = self.bound_calls(fn)
            args = [arg for call, skip in calls for param, arg in bind_args(fn, call, skip) if param == node.name.value]
            if not calls or len(args) < len(calls):  # a call that does not pass it: its default, or unknown
                yield node
            for arg in args:
                yield from self._values(arg, depth)
            return
        yield from self._element(value, path, depth)

    def _element(self, value, path: tuple, depth: int) -> Iterator:
        """The origins of element `path` (positions in nested tuples) of `value`."""
        if not path:
            yield from self._values(value, depth)
            return
        if type(value) in (cst.Tuple, cst.List) and all(type(e) is cst.Element for e in value.elements):
            if path[0] < len(value.elements):
                yield from self._element(value.elements[path[0]].value, path[1:], depth)
                return
        for origin in self._values(value, depth):
            if type(origin) in (cst.Tuple, cst.List) and origin is not value:
                yield from self._element(origin, path, depth)
            else:
                yield (origin, path)

    def _call_values(self, call: cst.Call, depth: int) -> Iterator:
        if id(call) in self._stop:
            yield call
            return
        func = call.func
        if type(func) is cst.Attribute and func.attr.value in SELF_RETURNING_METHODS:
            yield from self._values(func.value, depth)
            return
        if type(func) is cst.Attribute and func.attr.value in _CONVERTERS and call.args:
            # `nn.SyncBatchNorm.convert_sync_batchnorm(model)` hands back the module it converts in place
            yield from self._values(call.args[0].value, depth)
            return
        if type(func) is cst.Attribute:
            methods = [m for cls in self._classes_held(func.value, depth) for m in self._methods(cls, func.attr.value)]
            functions = methods or [None]
        else:
            functions = [self._callee(call)]
        for fn in functions:
            if fn is None:
                yield call
                continue
            returns = [r for r in self.r.descendants(fn, cst.Return) if self.r.enclosing_function(r) is fn]
            if not returns or any(r.value is None for r in returns):
                yield call
            for ret in returns:
                if ret.value is not None:
                    yield from self._values(ret.value, depth)

    def methods_called(self, call: cst.Call) -> List[cst.FunctionDef]:
        """The methods of the script's classes `obj.method(...)` / `self.method(...)` can run
        (where `obj` holds an instance of a class of the script)."""
        func = call.func
        if type(func) is not cst.Attribute:
            return []
        return [m for cls in self._classes_held(func.value, 0) for m in self._methods(cls, func.attr.value)]

    def bound_calls(self, fn: cst.FunctionDef) -> List[Tuple[cst.Call, int]]:
        """(call, parameters it does not pass) for the known calls of `fn`: by name for a function;
        for a method of a top-level class of the script, `Cls(...)` for `__init__` and
        `obj.method(...)` / `self.method(...)` where `obj` holds an instance of the class (the
        method's `self` is not passed), and `Cls.method(obj, ...)` (it is)."""
        known = self._bound.get(id(fn))
        if known is not None:
            return known
        self._bound[id(fn)] = []  # a cycle (a method's call inside its own arguments) sees none
        cls = self.r.enclosing_class(fn)
        if cls is None or self.r.enclosing_function(fn) is not None or self._class_named(cls.name.value) is not cls:
            found = [(c, 0) for c in self._calls_of(fn)]
        elif fn.name.value == "__init__":
            found = [(c, 1) for c in self.calls_spelled(cls.name.value) if type(c.func) is cst.Name]
        else:  # `self.method(...)`, `obj.method(...)`; `Cls.method(obj, ...)` passes `self` itself
            found = [(c, 0 if type(c.func.value) is cst.Name and c.func.value.value == cls.name.value else 1)
                     for c in self.calls_spelled(fn.name.value) if type(c.func) is cst.Attribute
                     and (cls in self._classes_held(c.func.value, 0)
                          or type(c.func.value) is cst.Name and c.func.value.value == cls.name.value)]
        self._bound[id(fn)] = found
        return found

    def calls_spelled(self, name: str) -> List[cst.Call]:
        """The calls `name(...)` and `<expr>.name(...)` of the module (indexed once)."""
        if self._by_spelling is None:
            self._by_spelling = {}
            for call in self.r.nodes(cst.Call):
                func = call.func
                key = func.value if type(func) is cst.Name else func.attr.value if type(func) is cst.Attribute else None
                if key is not None:
                    self._by_spelling.setdefault(key, []).append(call)
        return self._by_spelling.get(name, [])

    def _classes_held(self, expr, depth: int) -> List[cst.ClassDef]:
        """The classes of the script whose instance `expr` can hold: the class around a method
        for `self`, the class a call of the script's class makes (`Data(ds)`, or a name bound to it)."""
        if type(expr) is cst.Name and expr.value == "self":
            cls = self.r.enclosing_class(expr)
            return [cls] if cls is not None and self.r.enclosing_function(expr) is not None else []
        out = []
        for origin in self._values(expr, depth):
            if type(origin) is cst.Call and type(origin.func) is cst.Name:
                cls = self._class_named(origin.func.value)
                if cls is not None and cls not in out:
                    out.append(cls)
        return out

    def _class_named(self, name: str) -> Optional[cst.ClassDef]:
        """The script's one top-level class of that name."""
        if self._classes is None:
            self._classes = {}
            for cls in self.r.module.body:
                if type(cls) is cst.ClassDef:
                    self._classes[cls.name.value] = cls if cls.name.value not in self._classes else None
        return self._classes.get(name)

    def _methods(self, cls: cst.ClassDef, name: str) -> List[cst.FunctionDef]:
        return [m for m in cls.body.body if type(m) is cst.FunctionDef and m.name.value == name]

    def _stores(self, cls: cst.ClassDef, attr: str) -> list:
        """(value, position path) of each `self.<attr> = value` in the methods of `cls`, also as an element
        of a tuple target (`self.train_loader, self.val_loader = build(...)`: path (0,) of the value)."""
        if self._attr_stores is None:
            stores: Dict[Tuple[int, str], list] = {}
            for node in self.r.nodes(cst.Assign):
                owner = self.r.enclosing_class(node)
                if owner is None:
                    continue
                for t in node.targets:
                    for target, path in _attributes_at(t.target, ()):
                        if keeps_attribute(node.value, "self", target.attr.value) and not path:
                            continue  # `self.model = self.model.to(device)`: what the other stores hold
                        stores.setdefault((id(owner), target.attr.value), []).append((node.value, path))
            self._attr_stores = stores
        return self._attr_stores.get((id(cls), attr), [])


def keeps_attribute(value, owner: str, attr: str) -> bool:
    """`value` is `<owner>.<attr>`, or it through methods that return the object itself:
    `self.model = self.model.to(device)` keeps what the attribute holds."""
    value = module_itself(value)
    return (type(value) is cst.Attribute and value.attr.value == attr and type(value.value) is cst.Name
            and value.value.value == owner)


def _names_at(target, path: tuple) -> Iterator[Tuple[str, tuple]]:
    """(name, position path) for each plain name a target binds: `a` -> ('a', ()),
    `a, (b, c)` -> ('a', (0,)), ('b', (1, 0)), ('c', (1, 1)); starred elements end the
    positions that can be told."""
    kind = type(target)
    if kind is cst.Name:
        yield target.value, path
    elif kind in (cst.Tuple, cst.List):
        for i, el in enumerate(target.elements):
            if type(el) is not cst.Element:
                return
            yield from _names_at(el.value, path + (i,))


def _constant_key(expr: cst.Subscript):
    """The constant a one-element subscript reads (`d["train"]` -> "train", `t[0]` -> 0), `...` for any other
    single index (`d[phase]`), None for a slice or several indices."""
    if len(expr.slice) != 1 or type(expr.slice[0].slice) is not cst.Index:
        return None
    index = expr.slice[0].slice.value
    if type(index) is cst.SimpleString:
        return index.evaluated_value
    if type(index) is cst.Integer:
        return int(index.value)
    return ...


def _entries(container, key) -> Optional[list]:
    """The element expressions `container[key]` can be (see ValueFlow._subscript_values), or None where the
    container is none the flow looks into."""
    kind = type(container)
    if key is None:
        return None
    if kind is cst.DictComp:
        return [container.value]
    if kind is cst.ListComp and (key is ... or type(key) is int):
        return [container.elt]
    if kind is cst.Dict:
        if not all(type(e) is cst.DictElement for e in container.elements):
            return None
        keyed = [e.value for e in container.elements
                 if type(e.key) is cst.SimpleString and e.key.evaluated_value == key]
        return keyed if key is not ... and keyed else [e.value for e in container.elements]
    if kind in (cst.List, cst.Tuple) and all(type(e) is cst.Element for e in container.elements):
        if type(key) is int and -len(container.elements) <= key < len(container.elements):
            return [container.elements[key].value]
        return [e.value for e in container.elements] if key is ... else None
    return None


def _changed_after(r: Resolver, container) -> bool:
    """A container display the script changes in place after building it (`d["x"] = ...`, `d.update(...)`,
    `lst.append(...)` on the name it is bound to): what it holds is not only what the display wrote."""
    if type(container) not in (cst.Dict, cst.DictComp, cst.List, cst.ListComp, cst.Tuple):
        return False
    stmt = r.statement_of(container)
    small = stmt.body[0] if type(stmt) is cst.SimpleStatementLine and len(stmt.body) == 1 else None
    if type(small) is not cst.Assign or small.value is not container:
        return True  # not simply bound to a name: not followed
    names = {t.target.value for t in small.targets if type(t.target) is cst.Name}
    if not names:
        return True
    # by name anywhere in the module (another function's `loaders["val"] = ...` too): a name bound twice
    # only costs precision
    for node in r.nodes(cst.Subscript):
        parent = r.parent(node)
        if (type(node.value) is cst.Name and node.value.value in names
                and type(parent) in (cst.AssignTarget, cst.AugAssign) and getattr(parent, "target", None) is node):
            return True
    for call in r.nodes(cst.Call):
        func = call.func
        if (type(func) is cst.Attribute and type(func.value) is cst.Name and func.value.value in names
                and func.attr.value in _MUTATORS):
            return True
    return False


_MUTATORS = frozenset({"update", "setdefault", "append", "extend", "insert", "__setitem__"})


def _attribute_changed(r: Resolver, cls: cst.ClassDef, attr: str) -> bool:
    """A method of `cls` changes the container `self.<attr>` holds in place: `self.<attr>[k] = v` (also
    augmented, or deleted) or `self.<attr>.append(...)` and the other mutators."""

    def held(node) -> bool:
        return (type(node) is cst.Attribute and node.attr.value == attr and type(node.value) is cst.Name
                and node.value.value == "self" and r.enclosing_class(node) is cls)

    for node in r.nodes(cst.Subscript):
        parent = r.parent(node)
        if held(node.value) and (type(parent) in (cst.AssignTarget, cst.AugAssign) and parent.target is node
                                 or type(parent) is cst.Del):
            return True
    return any(type(call.func) is cst.Attribute and call.func.attr.value in _MUTATORS and held(call.func.value)
               for call in r.nodes(cst.Call))


def _attributes_at(target, path: tuple) -> Iterator[Tuple[cst.Attribute, tuple]]:
    """(`self.<attr>` target, position path) for each attribute of `self` a target binds, as _names_at."""
    kind = type(target)
    if kind is cst.Attribute and type(target.value) is cst.Name and target.value.value == "self":
        yield target, path
    elif kind in (cst.Tuple, cst.List):
        for i, el in enumerate(target.elements):
            if type(el) is not cst.Element:
                return
            yield from _attributes_at(el.value, path + (i,))


def innermost_call(expr) -> Optional[cst.Call]:
    """`Net(...)` for `Net(...)`, `Net(...).to(d)`, `Net(...).cuda().float()`,
    `Net().cuda() if use_cuda else Net()`."""
    if type(expr) is cst.IfExp:  # exact types: an ABC isinstance costs a Python call
        return innermost_call(expr.body) or innermost_call(expr.orelse)
    while type(expr) is cst.Call:
        func = expr.func
        if isinstance(func, cst.Attribute) and func.attr.value in SELF_RETURNING_METHODS and isinstance(func.value, cst.Call):
            expr = func.value
            continue
        return expr
    return None
