"""Device placement: which tensors meet the model's outputs, and where each is made.

On a GPU the launch preamble picks NCCL and a CUDA mesh, and `fully_shard` moves the
model's parameters and buffers to the mesh's device (torch 2.13, torch/distributed/fsdp/_fully_shard/:
_fully_shard.py:fully_shard takes `device = _get_device_from_mesh(mesh)`, the mesh's type and the
current device, and _fsdp_init.py:_get_modules_and_states calls `_move_states_to_device`). The
root's pre-forward moves only the forward's own positional and keyword tensors there
(_fsdp_state.py:FSDPState._root_pre_forward calls torch/distributed/utils.py:_to_kwargs onto
`self._device`, for a CUDA-like device only), and nothing moves the outputs back. Whatever
else meets the outputs — targets, labels built in the loop, masks made by a factory — stays
where the script made it, on the CPU when the script names no device, and the first loss
raises "Expected all tensors to be on the same device"; `.numpy()` of an output raises
because the output is a CUDA tensor.

Two questions, asked by codemods/device_placement.py:

- `device_free(resolver)`: the script places nothing anywhere (no `.to(<device>)`, `.cuda()`,
  `device=`, `torch.device`, "cuda" string), so it ran on the CPU and nothing it makes is
  on the rank's GPU. Scripts that place their tensors are not this module's business.
- `placements(facts)`: in every function (or module level) that calls the model, the tensors
  that meet a value computed from the model's output (an argument of the same call, an operand
  of the same arithmetic or comparison) followed back to where each is made: a loop target
  (moved at the loop's head), a factory call (`torch.ones(n, 1)`, given the device), a
  binding (`y = batch["y"]`, moved where it is bound); `.numpy()` of an output (a `.cpu()`
  before it). What cannot be followed (a parameter, a helper's return) is `Unfollowed`.
- `literal_devices(facts)`: `0`, "cuda:0", `torch.device("cuda", 0)`, `.cuda(0)` used as a
  device: every rank would use GPU 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import (
    bind_args,
    child_nodes,
    code,
    import_bindings,
    instance_attribute,
    parameter_names,
    root_name,
    walk,
)

# factories that take `device=`: deterministic ones get it, random ones keep drawing from the
# CPU generator and move (`.to(device)`), so the numbers are the single-process run's
DETERMINISTIC_FACTORIES = frozenset(
    f"torch.{n}" for n in ("ones", "zeros", "full", "empty", "arange", "linspace", "eye", "tensor", "as_tensor")
)
RANDOM_FACTORIES = frozenset(
    f"torch.{n}" for n in ("randn", "rand", "randint", "randperm", "normal", "bernoulli", "multinomial")
)
FACTORIES = DETERMINISTIC_FACTORIES | RANDOM_FACTORIES
# methods whose value is a Python number or a host copy: no longer on the device
_HOST_METHODS = frozenset({"item", "tolist", "numpy", "cpu", "size", "dim", "numel"})
# calls whose arguments do not meet: printing, counting, formatting
_NOT_MEETING = frozenset({"print", "len", "str", "int", "float", "bool", "format", "isinstance", "getattr", "range",
                          "enumerate", "zip", "min", "max", "round", "repr", "type", "id", "hasattr", "setattr"})
# a binding whose value is one of these is a number, not a tensor
_NUMBER_CALLS = frozenset({"len", "int", "float", "round", "min", "max", "sum", "abs", "range", "bool"})
_SHAPE_METHODS = frozenset({"reshape", "view", "permute", "transpose", "flatten", "unflatten", "unsqueeze",
                            "squeeze", "expand", "repeat", "narrow", "split", "chunk", "argmax", "argmin", "softmax",
                            "log_softmax", "sum", "mean", "max", "min", "topk", "size", "to", "type", "std", "var",
                            "norm", "clamp", "clip", "pow", "roll", "tile", "movedim", "cumsum", "amax", "amin"})
_TENSOR_FIELDS = frozenset({"T", "mT", "data", "real", "imag"})
# options of torch.nn's loss modules that are never tensors
_MODULE_OPTIONS = frozenset({"reduction", "ignore_index", "label_smoothing", "size_average", "reduce", "margin", "p",
                             "eps", "beta", "delta", "log_input", "full", "zero_infinity", "blank", "dim", "inplace"})
_PREAMBLE = ("init_device_mesh(", "set_device(", "init_process_group(", "LOCAL_RANK")


@dataclass
class Placement:
    kind: str  # "loop" | "factory" | "binding" | "unpacked" | "numpy"
    node: cst.CSTNode  # the For, the factory call, the binding statement, the `.numpy()` call
    scope: Optional[cst.FunctionDef]  # where the device must be visible
    names: Tuple[str, ...] = ()  # loop / unpacked: the names moved
    meets: Optional[cst.CSTNode] = None  # where the value meets the outputs
    shape: str = "tensor"  # loop target: "tensor", or "dict" / "sequence" (moved element by element)


@dataclass
class Unfollowed:
    node: cst.CSTNode  # where it meets the outputs
    name: str
    why: str


@dataclass
class LiteralDevice:
    node: cst.CSTNode  # the literal (Integer, SimpleString), or the `.cuda(0)` / `torch.device("cuda", 0)` call
    kind: str  # "index" (an int that is a device), "string", "device_call", "cuda_call"


def _preamble(stmt) -> bool:
    text = code(stmt)
    return any(p in text for p in _PREAMBLE)


def _statements(resolver, origins=None):
    """The script's statements, but for the launch preamble and the lines earlier stages wrote
    with the mesh's device (the broadcast of rank 0's weights, a parameter moved where fully_shard
    does not): a statement naming `torch.cuda.is_available()` with no line of the user's file.
    Only the statements holding a name or a string that spells one of those are rendered to be
    read (rendering every statement of the script cost a 5000-line script 1.2 s)."""
    spelled = _spelling_statements(resolver)
    out = []
    for s in resolver.nodes(cst.SimpleStatementLine):
        if id(s) in spelled:
            text = code(s)
            if any(p in text for p in _PREAMBLE) or (
                    origins is not None and "torch.cuda.is_available()" in text and origins.line(s) == 0):
                continue
        out.append(s)
    return out


_SPELLINGS = ("init_device_mesh", "set_device", "init_process_group", "LOCAL_RANK", "is_available")


def _spelling_statements(resolver) -> set:
    """ids of the simple statements holding a name or a string literal that contains one of
    _SPELLINGS: the only ones whose text can hold a preamble call or `torch.cuda.is_available()`."""
    found = set()
    nodes = [n for n in resolver.nodes(cst.Name) if any(w in n.value for w in _SPELLINGS)]
    for kind in (cst.SimpleString, cst.FormattedStringText):
        nodes += [n for n in resolver.nodes(kind) if any(w in n.value for w in _SPELLINGS)]
    for node in nodes:
        for anc in resolver.ancestors(node):
            if type(anc) is cst.SimpleStatementLine:
                found.add(id(anc))
                break
    return found


def _is_dtype(resolver, expr) -> bool:
    return any(q.startswith("torch.") and q.split(".")[-1] in _DTYPES for q in resolver.qnames(expr))


_DTYPES = frozenset({"float", "float32", "float64", "float16", "half", "double", "bfloat16", "long", "int",
                     "int64", "int32", "int8", "uint8", "bool", "complex64"})


def device_free(resolver, origins=None) -> bool:
    """The script places nothing: it trained on the CPU (see the module's docstring)."""
    for stmt in _statements(resolver, origins):
        for node in walk(stmt):
            kind = type(node)
            if kind is cst.Call and type(node.func) is cst.Attribute:
                attr = node.func.attr.value
                if attr in ("cuda", "to_empty"):
                    return False
                if attr == "to" and not all(
                    (a.keyword is not None and a.keyword.value in ("dtype", "non_blocking", "copy"))
                    or _is_dtype(resolver, a.value) for a in node.args
                ):
                    return False
            elif kind is cst.Arg and node.keyword is not None and node.keyword.value in ("device", "map_location"):
                return False
            elif kind is cst.SimpleString and "cuda" in node.value:
                return False
            elif kind is cst.Name and node.value in ("device", "cuda"):
                return False
    return True


class _Scope:
    """One function (or the module level) that calls the model: what its values are."""

    def __init__(self, facts, scope, calls, wrappers=()):
        self.facts, self.r, self.scope = facts, facts.resolver, scope
        self.model_calls = {id(c) for c in calls}
        self.wrapper_calls = {id(c) for c in wrappers}  # their outputs are on the device, their inputs are not
        self.stmts = [s for s in self.r.nodes(cst.SimpleStatementLine) if self.r.enclosing_function(s) is scope]
        self.bindings: Dict[str, List[Tuple[cst.CSTNode, cst.CSTNode]]] = {}  # name -> [(stmt, small)]
        for stmt in self.stmts:
            for small in stmt.body:
                for target in _targets(small):
                    for el in _flat(target):
                        if type(el) is cst.Name:
                            self.bindings.setdefault(el.value, []).append((stmt, small))
        self.outputs: Set[str] = set()
        changed = True
        while changed:  # names bound from the model's output, through any arithmetic of it
            changed = False
            for name, binds in self.bindings.items():
                if name not in self.outputs and any(
                    small.value is not None and self.on_device(small.value) for _, small in binds
                    if type(small) in (cst.Assign, cst.AnnAssign, cst.AugAssign)
                ):
                    self.outputs.add(name)
                    changed = True

    def on_device(self, expr) -> bool:
        """`expr` computes from the model's output (and is not a host copy of it)."""
        stack = [expr]
        while stack:
            node = stack.pop()
            kind = type(node)
            if kind is cst.Call:
                if id(node) in self.model_calls or id(node) in self.wrapper_calls:
                    return True
                if type(node.func) is cst.Attribute and node.func.attr.value in _HOST_METHODS:
                    continue
            if kind is cst.Name and node.value in self.outputs:
                return True
            if kind is cst.Attribute:
                stack.append(node.value)
                continue
            if kind is cst.Arg:
                stack.append(node.value)
                continue
            stack.extend(child_nodes(node))
        return False


def _targets(small):
    kind = type(small)
    if kind is cst.Assign:
        return [t.target for t in small.targets]
    if kind in (cst.AnnAssign, cst.AugAssign):
        return [small.target]
    return []


def _flat(target):
    if type(target) in (cst.Tuple, cst.List):
        for el in target.elements:
            yield from _flat(el.value)
    else:
        yield target


def model_calls(facts) -> Dict[Optional[cst.FunctionDef], List[cst.Call]]:
    """The calls of a model (`model(x)`, `model.forward(x)`, `self.model(x)`), per function."""
    r = facts.resolver
    out: Dict[Optional[cst.FunctionDef], List[cst.Call]] = {}
    for call in r.nodes(cst.Call):
        func = call.func
        if type(func) is cst.Attribute and func.attr.value == "forward":
            func = func.value
        spelled = func.value if type(func) is cst.Name else instance_attribute(func)
        fn = r.enclosing_function(call)
        if spelled is not None and spelled in facts.model_names.get(fn, set()):
            out.setdefault(fn, []).append(call)
    return out


def wrapper_calls(facts) -> Dict[Optional[cst.FunctionDef], List[cst.Call]]:
    """Calls of an instance of a class of the script or a sibling module built around a model
    (`objective = Reconstruction(network)`, then `objective(images, targets)`), per function: the
    instance is not sharded, so fully_shard's pre-forward moves none of its inputs, and inside its
    forward they meet the model's output."""
    r = facts.resolver
    out: Dict[Optional[cst.FunctionDef], List[cst.Call]] = {}
    for call in r.nodes(cst.Call):
        func = call.func
        if type(func) not in (cst.Name, cst.Attribute) or facts.model_held(func) is not None:
            continue
        if facts.instance_class(func) is None:
            continue
        built = [o for o in facts.analysis.flow.values(func) if type(o) is cst.Call]
        if any(type(a.value) in (cst.Name, cst.Attribute) and facts.model_held(a.value) is not None
               for b in built for a in b.args):
            out.setdefault(r.enclosing_function(call), []).append(call)
    return out


def _operands(node) -> List[cst.CSTNode]:
    kind = type(node)
    if kind is cst.BinaryOperation:
        return [node.left, node.right]
    if kind is cst.Comparison:
        return [node.left] + [c.comparator for c in node.comparisons]
    if kind is cst.Call:
        func = node.func
        if type(func) is cst.Name and func.value in _NOT_MEETING:
            return []
        ops = [a.value for a in node.args if a.keyword is None or a.keyword.value not in ("dim", "reduction")]
        if type(func) is cst.Attribute:
            if func.attr.value in _SHAPE_METHODS:
                return []
            if not (type(func.value) is cst.Name and func.value.value == "self"):  # `self.criterion(out, y)`
                ops.append(func.value)  # `out.eq(y)`, `y.eq(out)`
        return ops
    return []


def _read_names(expr) -> List[cst.Name]:
    """The names `expr` reads as values (not attribute names, keywords, called functions,
    nor what a host method or a factory call reads)."""
    found, stack = [], [expr]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is cst.Name:
            if node.value not in ("True", "False", "None"):
                found.append(node)
        elif kind is cst.Attribute:
            if node.attr.value in _TENSOR_FIELDS:
                stack.append(node.value)  # `y.T`, `y.data`: the tensor's own; `args.alpha`, `self.scale`: not
        elif kind is cst.Call:
            func = node.func
            if type(func) is cst.Attribute:
                if func.attr.value in _HOST_METHODS or func.attr.value in ("size", "shape"):
                    continue
                stack.append(func.value)
            stack.extend(a.value for a in node.args)
        elif kind is cst.Arg:
            stack.append(node.value)
        elif kind in (cst.Lambda, cst.FormattedString):
            continue
        else:
            stack.extend(child_nodes(node))
    return found


class _Finder:
    def __init__(self, facts):
        self.facts, self.r = facts, facts.resolver
        self.placed: List[Placement] = []
        self.unfollowed: List[Unfollowed] = []
        self._seen: Set[Tuple[int, Tuple[str, ...]]] = set()
        self._scopes: Dict[int, _Scope] = {}
        self._imports: Optional[Set[str]] = None
        self._parameters: Set[Tuple[int, str]] = set()
        self._called = model_calls(facts)
        self._wrapped = wrapper_calls(facts)

    def add(self, placement: Placement) -> None:
        key = (id(placement.node), placement.names if placement.kind in ("loop", "unpacked") else ())
        if key not in self._seen:
            self._seen.add(key)
            self.placed.append(placement)

    def factory(self, call) -> Optional[str]:
        names = self.r.qnames(call.func) | self.r.qnames(call)
        hit = names & FACTORIES
        return next(iter(hit)) if hit else None

    def run(self) -> None:
        wrapped, called = self._wrapped, self._called
        for scope in list(called) + [f for f in wrapped if f not in called]:
            s = self._scope(scope)
            nodes = self._nodes_of(scope)
            for call in wrapped.get(scope, ()):  # a wrapper's inputs meet the output inside its forward
                for op in [a.value for a in call.args]:
                    if not s.on_device(op):
                        self._follow_operand(s, op, call)
            for node in nodes:
                if id(node) in s.model_calls or id(node) in s.wrapper_calls or _is_numpy(node):
                    continue  # the forward's own inputs: fully_shard's pre-forward moves them
                ops = _operands(node)
                if len(ops) < 2 or not any(s.on_device(o) for o in ops):
                    continue
                for op in ops:
                    if s.on_device(op):
                        continue
                    self._follow_operand(s, op, node)
                if type(node) is cst.Call:
                    self._follow_callee(s, node)
            # what is now moved is on the device too: its `.numpy()` needs a `.cpu()` as the outputs' do
            s.outputs |= {n for p in self.placed if p.scope is scope for n in p.names}
            for node in nodes:
                if _is_numpy(node) and s.on_device(node.func.value):
                    self.add(Placement("numpy", node, scope, meets=node))

    def _follow_callee(self, s: _Scope, call: cst.Call) -> None:
        """`criterion(out, y)` of a module the script builds with tensors (`nn.CrossEntropyLoss(weight=
        torch.tensor([...]))`, `nn.BCEWithLogitsLoss(pos_weight=w)`, a loss class of its own): they meet
        the outputs inside its forward, so each is placed where the construction makes it, as an operand
        is. The module is a name bound in the function before the call, or `self.<attr>` stored in a
        method of the class around it."""
        func = call.func
        made = None  # (scope, statement, the constructor call)
        if type(func) is cst.Name:
            binds = [(st, sm) for st, sm in s.bindings.get(func.value, []) if self.r.order(st) < self.r.order(call)]
            if binds and type(binds[-1][1]) in (cst.Assign, cst.AnnAssign):
                made = (s, binds[-1][0], binds[-1][1].value)
        elif instance_attribute(func) is not None and type(func.value) is cst.Name and func.value.value == "self":
            cls = self.r.enclosing_class(call)
            stores = [a for a in self.r.nodes(cst.Assign) if self.r.enclosing_class(a) is cls and len(a.targets) == 1
                      and type(a.targets[0].target) is cst.Attribute and code(a.targets[0].target) == code(func)]
            if len(stores) == 1 and self.r.enclosing_function(stores[0]) is not None:
                store = stores[0]
                made = (self._scope(self.r.enclosing_function(store)), self.r.statement_of(store), store.value)
        if made is None or type(made[2]) is not cst.Call or not self._module_class(made[2]):
            return
        scope, stmt, build = made
        for arg in build.args:
            if arg.keyword is None or arg.keyword.value not in _MODULE_OPTIONS:
                self._follow_name_in(scope, arg.value, stmt, call, set())

    def _module_class(self, build: cst.Call) -> bool:
        """`build` makes a torch.nn module (`nn.CrossEntropyLoss(...)`) or one of a class of the script."""
        if type(build.func) is cst.Name and build.func.value in {c.name.value for c in self.r.nodes(cst.ClassDef)}:
            return True
        return any(q.startswith("torch.nn.") and q.rsplit(".", 1)[-1][:1].isupper() for q in self.r.qnames(build.func))

    def _nodes_of(self, scope):
        if scope is None:
            return [n for kind in (cst.Call, cst.BinaryOperation, cst.Comparison) for n in self.r.nodes(kind)
                    if self.r.enclosing_function(n) is None]
        return [n for n in walk(scope.body) if type(n) in (cst.Call, cst.BinaryOperation, cst.Comparison)
                and self.r.enclosing_function(n) is scope]

    def _follow_operand(self, s: _Scope, op, meets) -> None:
        for node in walk(op):
            if type(node) is cst.Call and self.factory(node) and not _has_device(node):
                self.add(Placement("factory", node, s.scope, meets=meets))
        for name in _read_names(op):
            if self.r.qnames(name) & {"torch", "math", "numpy", "np"} or name.value in ("True", "False", "None"):
                continue
            self._follow_name(s, name.value, name, meets, set())

    def _follow_name(self, s: _Scope, name: str, use, meets, seen: Set[str]) -> bool:
        """Place where `name` (read at `use`) is made; False where that is not known."""
        if name in seen or name in s.outputs:
            return True
        seen = seen | {name}
        if type(use) is cst.Name and self._comprehension_target(use, name):
            self.add(Placement("use", use, s.scope, names=(name,), meets=meets))
            return True  # `sum((model(x).argmax(1) == y).sum() for x, y in loader)`: moved where it is read
        loop = self._loop_target(use, name)
        if loop is not None:
            self.add(Placement("loop", loop, s.scope, names=(name,), meets=meets, shape=self._shape(loop, name)))
            return True
        before = [(st, sm) for st, sm in s.bindings.get(name, []) if self.r.order(st) < self.r.order(use)]
        if not before:
            if s.scope is not None and name in _params(s.scope):
                return self._follow_parameter(s, name, meets, seen)
            if self._imported(name) or name in self._classes():
                return True  # an imported name or a class: not a tensor of the script
            if s.scope is not None:
                module = self._scope(None)
                if name in module.bindings:  # a global of the module: where the module binds it
                    return self._follow_name(module, name, walk(self.facts.module.body[-1])[-1], meets, seen - {name}) \
                        if _is_number_binding(module.bindings[name]) is False else True
            self.unfollowed.append(Unfollowed(meets, name, f"`{name}` is bound outside the function that computes "
                                              "the outputs (a global, a closure): the rewrite does not follow it there"))
            return False
        stmt, small = before[-1]
        if type(small) is cst.AugAssign:
            return self._follow_name_in(s, small.value, stmt, meets, seen)
        if type(small) not in (cst.Assign, cst.AnnAssign) or small.value is None:
            return True
        value = small.value
        targets = _targets(small)
        if _is_number(value, self.r):
            return True
        if type(value) is cst.Call and self.factory(value):
            if not _has_device(value):
                self.add(Placement("factory", value, s.scope, names=(name,), meets=meets))
            return True
        if len(targets) == 1 and type(targets[0]) in (cst.Tuple, cst.List):
            # `x, y = batch`: the pieces are moved after the unpacking
            source = root_name(value) if type(value) is not cst.Tuple else None
            if source is not None and (self._loop_target(stmt, source) is not None or source in s.bindings):
                self.add(Placement("unpacked", stmt, s.scope, names=(name,), meets=meets))
                return True
            if type(value) is cst.Tuple and len(value.elements) == len(targets[0].elements):
                for el, part in zip(targets[0].elements, value.elements):
                    if type(el.value) is cst.Name and el.value.value == name:
                        part = part.value
                        if type(part) is cst.Call and self.factory(part):
                            if not _has_device(part):
                                self.add(Placement("factory", part, s.scope, names=(name,), meets=meets))
                            return True
                        return self._follow_name_in(s, part, stmt, meets, seen)
        elif len(targets) == 1 and type(targets[0]) is cst.Name:
            root = root_name(value)
            if root is not None and type(value) in (cst.Subscript, cst.Attribute, cst.Call, cst.Name):
                outside = root not in s.bindings and self._loop_target(stmt, root) is None and not (
                    s.scope is not None and root in _params(s.scope))
                if outside and self._imported(root):
                    if type(value) is cst.Call and self.factory(value) is None and any(
                            q.startswith("torch.") for q in self.r.qnames(value.func)):
                        return self._follow_name_in(s, value, stmt, meets, seen)  # `torch.cat([a, b])`
                    return True  # `argparse.ArgumentParser()`, `np.mean(...)`: not a tensor the script moves
                if type(value) is cst.Call and type(value.func) is not cst.Attribute:
                    self.unfollowed.append(Unfollowed(meets, name, f"`{name}` is made by `{code(value.func)}(...)`, "
                                                      "whose value the rewrite does not follow"))
                    return False
                loop = self._loop_target(stmt, root)
                if loop is not None and self._shape(loop, root) != "tensor":
                    self.add(Placement("binding", stmt, s.scope, names=(name,), meets=meets))
                    return True  # `y = batch["y"]`: moved where it is taken from the batch
                if root in s.bindings or loop is not None:
                    return self._follow_name(s, root, stmt, meets, seen)
                self.add(Placement("binding", stmt, s.scope, names=(name,), meets=meets))
                return True  # `y = labels[idx]` of a tensor made elsewhere: moved where it is taken
            return self._follow_name_in(s, value, stmt, meets, seen)
        self.unfollowed.append(Unfollowed(meets, name, f"`{name}` is bound by `{code(stmt).strip()}`, a shape "
                                          "the rewrite does not follow"))
        return False

    def _classes(self) -> Set[str]:
        return {c.name.value for c in self.r.nodes(cst.ClassDef)} | {f.name.value for f in self.r.nodes(cst.FunctionDef)}

    def _imported(self, name: str) -> bool:
        if self._imports is None:
            self._imports = {b for imp in self.r.nodes(cst.Import) + self.r.nodes(cst.ImportFrom)
                             for b in _imported_names(imp)}
        return name in self._imports

    def _follow_parameter(self, s: _Scope, name: str, meets, seen) -> bool:
        """A parameter: followed into every call of the function (plain calls by its name),
        where the argument is placed in the caller; unfollowed where the function has none."""
        fn = s.scope
        if (id(fn), name) in self._parameters:
            return True  # a recursion: followed already
        self._parameters.add((id(fn), name))
        calls = [c for c in self.r.nodes(cst.Call) if type(c.func) is cst.Name and c.func.value == fn.name.value]
        why = f"`{name}` is a parameter of `{fn.name.value}()`"
        if not calls or self.r.enclosing_class(fn) is not None:
            self.unfollowed.append(Unfollowed(meets, name, why + ", whose callers the rewrite does not follow"))
            return False
        ok = True
        for call in calls:
            arg = next((a for p, a in bind_args(fn, call) if p == name), None)
            caller = self.r.enclosing_function(call)
            if arg is None or caller is fn:
                self.unfollowed.append(Unfollowed(meets, name, why + f", not handed at `{code(call)[:60]}`"))
                ok = False
                continue
            outer = self._scope(caller)
            ok = self._follow_name_in(outer, arg, self.r.statement_of(call), meets, set()) and ok  # names of another scope
        return ok

    def _scope(self, fn) -> _Scope:
        known = self._scopes.get(id(fn))
        if known is None:
            known = self._scopes[id(fn)] = _Scope(self.facts, fn, self._called.get(fn, []), self._wrapped.get(fn, []))
        return known

    def _follow_name_in(self, s, expr, stmt, meets, seen) -> bool:
        for node in walk(expr):
            if type(node) is cst.Call and self.factory(node) and not _has_device(node):
                self.add(Placement("factory", node, s.scope, meets=meets))
        ok = True
        for n in _read_names(expr):
            if self.r.qnames(n) & {"torch", "math", "numpy", "np"}:
                continue
            ok = self._follow_name(s, n.value, stmt, meets, seen) and ok
        return ok

    def _loop_target(self, use, name) -> Optional[cst.For]:
        """The `for` whose body holds `use` and whose target binds `name` (an element the
        iterated value yields, not enumerate's count nor a range's number)."""
        child = use
        for anc in self.r.ancestors(use):
            if isinstance(anc, cst.FunctionDef):
                return None
            inside, child = child is anc.body if type(anc) is cst.For else False, anc
            if inside:
                it = anc.iter
                target = anc.target
                if type(it) is cst.Call and type(it.func) is cst.Name and it.func.value == "range":
                    continue
                if type(it) is cst.Call and type(it.func) is cst.Name and it.func.value == "enumerate" \
                        and type(target) is cst.Tuple and target.elements:
                    first = target.elements[0].value
                    if type(first) is cst.Name and first.value == name:
                        return None
                if any(type(el) is cst.Name and el.value == name for el in _flat(target)):
                    return anc
        return None

    def _comprehension_target(self, use, name) -> bool:
        for anc in self.r.ancestors(use):
            if isinstance(anc, (cst.FunctionDef, cst.BaseStatement)):
                return False
            if type(anc) in (cst.GeneratorExp, cst.ListComp, cst.SetComp, cst.DictComp):
                comp = anc.for_in
                while comp is not None:
                    if any(type(el) is cst.Name and el.value == name for el in _flat(comp.target)):
                        return True
                    comp = comp.inner_for_in
        return False

    def _shape(self, loop: cst.For, name: str) -> str:
        """A loop target read as `batch["x"]` is a dict, as `batch[0]` a sequence; else a tensor."""
        for node in walk(loop.body):
            if type(node) is cst.Subscript and type(node.value) is cst.Name and node.value.value == name:
                index = node.slice[0].slice if node.slice and type(node.slice[0].slice) is cst.Index else None
                if index is not None and type(index.value) is cst.SimpleString:
                    return "dict"
                if index is not None and type(index.value) is cst.Integer:
                    return "sequence"
        return "tensor"


def _imported_names(imp):
    return [b[0] if isinstance(b, tuple) else b for b in import_bindings(imp)]


def _is_number_binding(binds) -> bool:
    small = binds[-1][1]
    return type(small) in (cst.Assign, cst.AnnAssign) and small.value is not None and _is_number(small.value, None)


def _is_numpy(node) -> bool:
    return type(node) is cst.Call and type(node.func) is cst.Attribute and node.func.attr.value == "numpy"


def _params(fn: cst.FunctionDef) -> Set[str]:
    return parameter_names(fn)


def _has_device(call: cst.Call) -> bool:
    return any(a.keyword is not None and a.keyword.value == "device" for a in call.args)


def _is_number(value, r) -> bool:
    kind = type(value)
    if kind in (cst.Integer, cst.Float, cst.SimpleString, cst.FormattedString, cst.Dict, cst.Lambda):
        return True
    if kind is cst.Call:
        func = value.func
        if type(func) is cst.Name and func.value in _NUMBER_CALLS:
            return True
        if type(func) is cst.Attribute and func.attr.value in _HOST_METHODS:
            return True
    if kind is cst.Attribute and value.attr.value in ("shape",):
        return True
    if kind is cst.Subscript and type(value.value) is cst.Attribute and value.value.attr.value == "shape":
        return True
    if kind is cst.UnaryOperation:
        return _is_number(value.expression, r)
    return False


def placements(facts) -> Tuple[List[Placement], List[Unfollowed]]:
    """What must go to the rank's device in a script that names none (see the docstring)."""
    finder = _Finder(facts)
    finder.run()
    return finder.placed, finder.unfollowed


# -- literal device 0 ----------------------------------------------------------------


def _zero(node) -> bool:
    return type(node) is cst.Integer and node.value == "0"


def _device_arg(call: cst.Call):
    """The device argument of a placement call, or None."""
    func = call.func
    if type(func) is cst.Attribute and func.attr.value in ("to", "cuda") and call.args:
        first = call.args[0]
        if first.keyword is None or first.keyword.value == "device":
            return first.value
    for a in call.args:
        if a.keyword is not None and a.keyword.value in ("device", "map_location"):
            return a.value
    return None


def _branches(expr):
    if type(expr) is cst.IfExp:
        return [*_branches(expr.body), *_branches(expr.orelse)]
    return [expr]


def literal_devices(facts) -> List[LiteralDevice]:
    """Every way the script names GPU 0 as its device (see the module's docstring)."""
    r = facts.resolver
    stmts = _statements(r)
    found: List[LiteralDevice] = []
    device_names: Set[str] = set()  # names given as a device
    for stmt in stmts:
        for node in walk(stmt):
            if type(node) is cst.Call:
                arg = _device_arg(node)
                if arg is not None and type(arg) is cst.Name:
                    device_names.add(arg.value)
                if r.qnames(node.func) & {"torch.device"} and node.args and type(node.args[0].value) is cst.Name:
                    device_names.add(node.args[0].value)
    for stmt in stmts:
        for node in walk(stmt):
            kind = type(node)
            if kind is cst.SimpleString and node.evaluated_value == "cuda:0":
                found.append(LiteralDevice(node, "string"))
            elif kind is cst.Call:
                func = node.func
                if r.qnames(func) & {"torch.device"} and len(node.args) == 2 and _zero(node.args[1].value):
                    found.append(LiteralDevice(node, "device_call"))
                elif type(func) is cst.Attribute and func.attr.value == "cuda" and node.args \
                        and _zero(node.args[0].value):
                    found.append(LiteralDevice(node, "cuda_call"))
                else:
                    arg = _device_arg(node)
                    for branch in _branches(arg) if arg is not None else []:
                        if _zero(branch):
                            found.append(LiteralDevice(branch, "index"))
            elif kind is cst.Assign and len(node.targets) == 1 and type(node.targets[0].target) is cst.Name \
                    and node.targets[0].target.value in device_names:
                for branch in _branches(node.value):
                    if _zero(branch):
                        found.append(LiteralDevice(branch, "index"))
    return found


def is_placed(p: Placement, resolver) -> bool:
    """`p` is done already in the tree it was found in (the rewrite's output: nothing left)."""
    def moved(expr) -> bool:
        return type(expr) is cst.Call and type(expr.func) is cst.Attribute and expr.func.attr.value == "to"

    if p.kind == "loop":
        first = p.node.body.body[0] if isinstance(p.node.body, cst.IndentedBlock) else None
        small = first.body[0] if type(first) is cst.SimpleStatementLine else None
        if type(small) is not cst.Assign:
            return False
        target, value = small.targets[0].target, small.value
        pairs = zip(_flat(target), value.elements) if type(target) is cst.Tuple and type(value) is cst.Tuple else \
            [(target, cst.Element(value))]
        return any(type(t) is cst.Name and t.value == p.names[0] and (moved(v.value) or type(v.value) in (
            cst.DictComp, cst.ListComp)) for t, v in pairs)
    if p.kind == "factory":
        parent = resolver.parent(p.node)
        return _has_device(p.node) or (type(parent) is cst.Attribute and parent.attr.value == "to")
    if p.kind == "binding":
        return moved(p.node.body[0].value)
    if p.kind == "use":
        parent = resolver.parent(p.node)
        return type(parent) is cst.Attribute and parent.attr.value == "to"
    if p.kind == "numpy":
        receiver = p.node.func.value
        return type(receiver) is cst.Call and type(receiver.func) is cst.Attribute and receiver.func.attr.value == "cpu"
    return False


def unplaced(facts) -> List[Placement]:
    """The placements a tree still needs (none, in a rewrite's output)."""
    return [p for p in placements(facts)[0] if not is_placed(p, facts.resolver)]
