"""Reading the value an FSDP1 wrap's argument holds, by value (parsed, never run): a name
through its one assignment, an element of a tuple a helper returns (`mp, wrap =
get_policies(cfg)`), a call of a function of the project through its return
(analysis/module_values), a field of a config dataclass through its default
(analysis/config_fields). The settings reader of analysis/fsdp1 (_Finder) is one of these."""
from __future__ import annotations

from typing import Dict, List, Set

import libcst as cst

from .module_values import ModuleValues
from fsdp2_retrofit.syntax.names import assigned_names, bind_args, code, walk


class ValueReader:
    """Follows a wrap's (or a state_dict_type block's) arguments to the values they hold; what it
    read is in `read_values`, why a value was lost in `_lost` (and where, `lost_at`)."""

    def __init__(self, facts):
        self.facts = facts
        self.r = facts.resolver
        self._origin: Dict[int, object] = {}  # id of a node read from a sibling module -> its module's namer
        self._lost: Dict[int, str] = {}  # id of an argument -> why its value could not be followed
        self.values = ModuleValues(facts.classes)
        self.read_values: List[cst.CSTNode] = []  # values read into a wrap's settings (they stay where they are)
        self.lost_at: Dict[int, cst.CSTNode] = {}  # id of an argument -> the node that made its value unknown

    def _resolve(self, expr, wrap):
        """The value `expr` holds, as far as it can be read (else `expr`). A name of the script
        is seen through its one assignment (that statement is consumed by `wrap` (a wrap or
        block) when the name is read nowhere else). A name imported from a project module
        (`from policies import bfSixteen`) is read there, through re-exports
        (`policies/__init__.py`: `from .mixed_precision import *`), and a call of a function of
        the project (`get_wrapper()`) is what its return gives back (analysis/module_values);
        those modules are read (parsed, never imported) and left as they are. Where a value is
        lost, why is kept for the refusal (self._lost)."""
        value = expr
        for _ in range(8):  # a name of a name, a function returning another one's call, a config's field
            if isinstance(value, cst.Name):
                read = self._read_name(value, wrap)
            elif isinstance(value, cst.Attribute):
                read = self._field(value, wrap)
            elif isinstance(value, cst.Call):
                read = self._returned(value)
            else:
                break
            if value is not expr and id(value) in self._lost and id(expr) not in self._lost:
                self._lost[id(expr)] = self._lost[id(value)]
            if read is None or read is value:
                break
            self.read_values.append(read)
            value = read
        return value

    def _returned(self, call: cst.Call):
        """What a call of a function of the project gives back (None when not known)."""
        bound = self._bound(call.func)
        if bound is None:
            bound = self._local_function(call.func)
        if bound is None:
            return None
        if bound.function is None:
            self._lost[id(call)] = bound.why or f"`{code(call.func)}` is not a function of the project"
            return None
        found = self.values.returned(bound)
        if found.value is None:
            self._lost[id(call)] = found.why
            return None
        return self._adopt(found)

    def _local_function(self, func):
        """A top-level function of the module itself (of the linked program: a project module's)."""
        from .module_values import Bound

        entry = self.facts.classes.top_level.get("")
        if not isinstance(func, cst.Name) or entry is None or self._origin.get(id(func)) not in (None, entry[1]):
            return None
        for stmt in self.r.module.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == func.value:
                return Bound(function=stmt, namer=entry[1])
        return None

    def _field(self, expr: cst.Attribute, wrap):
        """`cfg.sharding_strategy` of a dataclass instance: the field's default, when nothing in the
        program gives it another value (analysis/config_fields); else why not, at its line."""
        from .config_fields import config_class, field_default

        if self._origin.get(id(expr)) is not None or not isinstance(expr.value, cst.Name):
            return None
        built = self._resolve(expr.value, wrap)
        if not isinstance(built, cst.Call) or not isinstance(built.func, (cst.Name, cst.Attribute)):
            if id(expr.value) in self._lost:  # `cfg` of `cfg.sharding_strategy` could not be read
                self._lost.setdefault(id(expr), self._lost[id(expr.value)])
            return None
        namer = self._origin.get(id(built))
        cls = config_class(namer.resolver, code(built.func)) if namer is not None else None
        if cls is None and namer is None and isinstance(built.func, cst.Name):
            cls = config_class(self.r, built.func.value)
        if cls is None:  # `from configs import TrainConfig`: the class of a project module
            bound = self._bound(built.func)
            namer = bound.namer if bound is not None and bound.function is None and bound.value is None else None
            cls = config_class(namer.resolver, code(built.func).rsplit(".", 1)[-1]) if namer is not None else None
        if cls is None:
            return None
        resolvers = [self.r] + [n.resolver for _, n in self.facts.classes.top_level.values() if n.resolver is not self.r]
        found = field_default(resolvers, cls, built, expr.attr.value)
        if found.value is None:
            self._lost[id(expr)] = found.why
            if found.where is not None and any(found.where is n for n in self.r.nodes(type(found.where))):
                self.lost_at[id(expr)] = found.where  # refused where the field is given another value
            elif found.where is not None:  # in another module of the project: named in the reason
                for namespace, (_, other) in self.facts.classes.top_level.items():
                    if any(found.where is n for n in other.resolver.nodes(type(found.where))):
                        self._lost[id(expr)] += (f" ({self.facts.classes.shown_file(namespace)}:"
                                                 f"{other.resolver.line(found.where)})")
            return None
        self.read_values.append(found.statement)
        if namer is not None:
            self._origin.update((id(n), namer) for n in walk(found.value))
        return found.value

    def _bound(self, expr):
        """What a name (or `module.name`) read in the script or in a project module is bound to
        in a project module, or None when it is not one of theirs."""
        namer = self._origin.get(id(expr))
        resolver = namer.resolver if namer is not None else self.r
        for qname in sorted(resolver.qnames(expr)):
            if namer is not None and "." not in qname and namer.namespace:
                qname = f"{namer.namespace}.{qname}"  # a name the project module binds itself
            bound = self.values.bound(qname)
            if bound is not None:
                return bound
        return None

    def _adopt(self, bound):
        """`bound.value`, its nodes read in the module they come from."""
        for node in walk(bound.value):
            self._origin[id(node)] = bound.namer
        return bound.value

    def _read_name(self, expr: cst.Name, wrap):
        namer = self._origin.get(id(expr))
        bound = self._bound(expr)
        if bound is not None and bound.value is not None:
            return self._adopt(bound)
        if bound is not None:
            self._lost[id(expr)] = bound.why or f"`{expr.value}` names a function, not a value"
            return expr
        if namer is not None:
            local = self.values.local_value(expr, namer)  # a local name of a project module's function
            if local is not None:
                self._origin.update((id(node), namer) for node in walk(local))
                return local
            values = sorted((v for v in self.values.local_values(expr, namer) if isinstance(v, cst.BaseExpression)),
                            key=code)  # in a stable order: the flow gives a set
            if len(values) > 1:
                shown = ", ".join(f"`{code(v)}`" for v in values[:3])
                self._lost.setdefault(id(expr), f"`{expr.value}` is given {len(values)} values where it is read "
                                                f"({shown}): the rewrite reads a name given one value")
            return expr
        stmts = [
            s for s in self.r.nodes(cst.SimpleStatementLine)
            if expr.value in assigned_names(s)
        ]
        if not stmts:
            return self._handed(expr)
        if len(stmts) != 1 or len(stmts[0].body) != 1 or not isinstance(stmts[0].body[0], cst.Assign):
            return expr
        assign = stmts[0].body[0]
        if len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Tuple):
            return self._unpacked(expr, stmts[0], assign, wrap)
        if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
            self._lost[id(expr)] = (f"`{expr.value}` is assigned by `{code(stmts[0]).strip()}` (line "
                                    f"{self.r.line(stmts[0])}), a form the rewrite does not follow")
            return expr
        reads = [n for n in self.r.nodes(cst.Name) if n.value == expr.value and not self._spelled_in_a_path(n)]
        if len(reads) == 2 and stmts[0] not in wrap.consumed:  # the assignment's target and this argument
            wrap.consumed.append(stmts[0])
        return assign.value

    def _spelled_in_a_path(self, name: cst.Name) -> bool:
        """`wrap` of `torch.distributed.fsdp.wrap` (an import's module path) or of `x.wrap` (an
        attribute's name): not the variable `wrap`."""
        parent = self.r.parent(name)
        return isinstance(parent, cst.Attribute) and parent.attr is name

    def _handed(self, expr: cst.Name):
        """A parameter (`cfg` of `Trainer.__init__(self, net, cfg)`) is what every call of its
        function hands it, when every call hands it the same expression (`Trainer(net,
        ParallelConfig())`); else `expr`, and why in the refusal."""
        from .rank_values import called_functions

        fn = self.r.enclosing_function(expr)
        if fn is None or expr.value not in {p.name.value for p in fn.params.params + fn.params.kwonly_params}:
            return expr
        for function, calls, skip in called_functions(self.r):
            if function is not fn:
                continue
            handed = [dict(bind_args(fn, call, skip)).get(expr.value) for call in calls]
            owner = self.r.enclosing_class(fn) if skip else None
            callee = f"`{owner.name.value}(...)`" if owner is not None else f"`{fn.name.value}(...)`"
            if any(v is None for v in handed) or any(a.star for c in calls for a in c.args):
                self._lost.setdefault(id(expr), f"`{expr.value}` is a parameter that a call "
                                                f"{callee} does not hand by name or position")
                return expr
            if len({code(v) for v in handed}) > 1:
                self._lost.setdefault(id(expr), f"`{expr.value}` is a parameter handed {len(handed)} different "
                                                f"values by the calls {callee}")
                return expr
            return handed[0]
        return expr

    def _unpacked(self, expr: cst.Name, stmt, assign: cst.Assign, wrap):
        """`mp_policy, wrap_policy = get_policies(cfg, rank)`: the element of the tuple the call gives
        back (or the tuple written there) at this name's place. The statement is consumed when each
        of its names is read only by the wrap."""
        names = [e.value for e in assign.targets[0].target.elements]
        if not all(isinstance(n, cst.Name) for n in names) or any(isinstance(e, cst.StarredElement)
                                                                  for e in assign.targets[0].target.elements):
            self._lost[id(expr)] = f"`{code(assign.targets[0].target)}` (line {self.r.line(stmt)}) unpacks into a starred name"
            return expr
        index = [n.value for n in names].index(expr.value)
        value = self._resolve(assign.value, wrap)
        if isinstance(value, cst.Tuple) and len(value.elements) == len(names) and not any(
                isinstance(e, cst.StarredElement) for e in value.elements):
            reads = {n.value: 0 for n in names}
            for n in self.r.nodes(cst.Name):
                if n.value in reads:
                    reads[n.value] += 1
            used = {n.value for a in getattr(wrap, "call", cst.Call(cst.Name("_"))).args for n in walk(a.value) if isinstance(n, cst.Name)}
            if all(count == 2 and name in used for name, count in reads.items()) and stmt not in wrap.consumed:
                wrap.consumed.append(stmt)
            return value.elements[index].value
        self._lost[id(expr)] = self._lost.get(id(assign.value)) or (
            f"`{expr.value}` is unpacked from `{code(assign.value)}` (line {self.r.line(stmt)}), whose value is not "
            f"a tuple of {len(names)} the rewrite can read")
        return expr

    def _qn(self, node) -> Set[str]:
        """Qualified names of a node of the script, or of a value read from a sibling module."""
        namer = self._origin.get(id(node))
        return (namer.resolver if namer is not None else self.r).qnames(node)
