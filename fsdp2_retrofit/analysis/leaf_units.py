"""Leaf units: large modules of a model outside its repeated blocks (an embedding, the head,
a final norm with the head) that become FSDP units of their own, as torchtitan lays out a
transformer (embeddings, then each block, then `[final norm, head]`, then the root).

Why: the root unit stays gathered through forward and backward. With a large vocabulary the
embedding and the head hold a large share of the parameters; left in the root they are whole
on every rank for the whole step. As units of their own they are gathered only while they run
(the embedding) or from the end of forward into backward (the head, which runs last): the
peak drops by about their size times (N-1)/N, for two or four more all-gathers a step.

The rule, decided from the class definitions (parsed, never imported):

- a candidate is a `torch.nn` leaf with parameters (Embedding, Linear, LayerNorm, RMSNorm)
  assigned to `self.<attr>` in the root class's `__init__`, outside the repeated blocks;
- its parameter count comes from its constructor's arguments, where they are literals or
  values that can be read: the root's `__init__` parameters bound to the build call's
  arguments (literals, names bound once to literals) or their defaults, local names of
  `__init__`, fields of a config dataclass of the script (defaults and the call's keywords),
  of a dict literal (`cfg["vocab"]`) or a `SimpleNamespace(...)`, and the defaults of an
  argparse namespace (`args.vocab_size` of `args = parser.parse_args()`, analysis/cli_defaults.py:
  the report names them, as the command line may change them);
- it becomes a unit when it holds at least as many parameters as one repeated block (then
  taking it out of the root lowers the peak by at least what a block's gathering costs);
- where its size or the block's is not read (a vocabulary built from the data, `len(tokenizer)`,
  a layer the counter does not know), the unit is decided when the script runs: the generated
  code compares the two counts before fully_shard (`runtime`), unless what is read settles it
  already (it holds fewer than the parts of a block whose sizes are read);
- a norm called right before such a head in `forward` shares its unit (`[norm, head]`);
- it stays in the root when it shares a parameter with another module (tied weights: both
  must live in one unit, and a unit gathered from the embedding to the head would be gathered
  the whole step, as the root is), when a method other than `__init__` or the script reads
  one of its attributes (`self.head.weight`: outside its own forward its parameters are
  shards); where the blocks themselves are not found (built under an `if`, appended later),
  the layout is today's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import libcst as cst

from fsdp2_retrofit.syntax.names import TORCH_MODULE_BASES, attr_path, bind_args, child_nodes, walk
from fsdp2_retrofit.syntax.torch_api import (
    BARE_CONTAINERS, NN_NO_PARAMETERS, NN_NORMS, NN_PARAMETER, NN_SIZED_LEAVES, SEQUENTIAL, TENSOR_FACTORIES,
)

from .cli_defaults import Defaults, namespace_defaults
from .model_classes import ClassInfo, ClassRegistry, _Namer, _repeated_elements

Path_ = Tuple[str, ...]

_MAX_DEPTH = 6
_RNN_CELLS = {"torch.nn.RNNCell": 1, "torch.nn.GRUCell": 3, "torch.nn.LSTMCell": 4}  # gates
_NAMESPACES = frozenset({"types.SimpleNamespace", "builtins.dict"})


@dataclass
class LeafUnit:
    """One unit of leaves of the root: `paths` from the root (one, or the norm and the head)."""

    paths: List[Path_]
    params: Optional[int]  # None: a size is not read (`runtime`)
    what: str  # `tok_emb` (nn.Embedding): 3,200,000 parameters
    last: bool = False  # it runs last in forward, after the blocks: backward starts with it
    # a size (its own or a block's) is only known when the script runs: the generated code makes it a
    # unit where it holds at least as many parameters as one block
    runtime: bool = False


@dataclass
class LeafLayout:
    units: List[LeafUnit] = field(default_factory=list)
    block_params: Optional[int] = None  # None: read when the script runs
    containers: List[Path_] = field(default_factory=list)  # the blocks' containers (the run-time comparison's)
    # large leaves (or leaves of a size not read: True) left in the root, and why
    kept: List[Tuple[Path_, str, bool]] = field(default_factory=list)
    sources: Dict[str, object] = field(default_factory=dict)  # argparse defaults the sizes were read from


def leaf_layout(registry: ClassRegistry, cls: Optional[str], call: Optional[cst.Call], flow,
                script: cst.Module, model_name: str, lists: bool) -> Optional[LeafLayout]:
    """The leaf units of a model of class `cls` built by `call` in the script (None: today's
    layout). `flow`: the script's ValueFlow (the build call's arguments are followed to the
    one value they hold); `lists`: fully_shard takes a list of modules (torch >= 2.5)."""
    info = registry.get(cls)
    init = info.methods.get("__init__") if info is not None else None
    if init is None or call is None or info.namer is None:
        return None
    if any(b not in TORCH_MODULE_BASES for b in info.bases):
        return None  # a base class's __init__ would build modules too
    env: Dict[str, object] = {}
    counter = _Counter(registry)
    top = registry.top_level.get("")
    if top is None:
        return None
    script_env = _ScriptEnv(flow, counter, top[1])
    for param, arg in bind_args(init, call, skip=1):
        env[param] = counter.value(arg, script_env, top[1])
    for p in [*init.params.params[1:], *init.params.kwonly_params]:
        if p.name.value not in env and p.default is not None:
            env[p.name.value] = counter.value(p.default, env, info.namer)
    leaves: Dict[Path_, Tuple[str, Optional[int]]] = {}
    blocks: List[Optional[int]] = []
    floors: List[int] = []  # at least what each container's block holds
    for stmt in init.body.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue  # modules built under an if/for are not candidates (their blocks may be)
        for small in stmt.body:
            if not isinstance(small, cst.Assign) or len(small.targets) != 1:
                continue
            target = small.targets[0].target
            path = attr_path(target)
            if type(target) is cst.Name and len(path) == 1:
                env[path[0]] = counter.value(small.value, env, info.namer)
                continue
            if not path or path[0] != "self" or len(path) != 2 or not isinstance(small.value, cst.Call):
                continue
            callee = info.namer.of(small.value)
            if callee in NN_SIZED_LEAVES:
                leaves[path[1:]] = (callee, counter.count(small.value, env, info.namer, 0))
            elif callee in BARE_CONTAINERS | SEQUENTIAL:
                elements = _repeated_elements(small.value)
                if elements:
                    blocks.append(counter.count(elements[0], env, info.namer, 0))
                    floors.append(counter.lower_bound(elements[0], env, info.namer))
    for container in info.containers:
        if len(container.path) != 1:
            return None  # blocks inside a ModuleDict or another module: not read here
    if not blocks or len(blocks) != len(info.containers):
        return None
    counted = [b for b in blocks if b is not None]
    layout = LeafLayout(block_params=max(counted) if len(counted) == len(blocks) else None,
                        containers=[c.path for c in info.containers])
    tied = _tied(info, script, model_name)
    forward = _call_order(info)
    large = {p: _large(callee, n, layout.block_params, max(floors)) for p, (callee, n) in leaves.items()}
    for path in [p for p, is_large in large.items() if is_large is not False]:
        callee, n = leaves[path]
        runtime = large[path] is None
        reason = tied.get(path[0])
        if reason is None and path[0] not in forward:
            reason = f"`forward` does not call `self.{path[0]}(...)`"
        if reason is not None:
            layout.kept.append((path, reason, runtime))
            continue
        paths, total = [path], n
        at = forward.index(path[0])
        before = forward[at - 1] if at > 0 else None
        if lists and callee not in NN_NORMS and before is not None and (before,) in leaves and (
            leaves[(before,)][0] in NN_NORMS and before not in tied and large[(before,)] is False
        ):
            norm = leaves[(before,)][1]
            paths, total = [(before,), path], n + norm if n is not None and norm is not None else None
        names = " + ".join(f"`{'.'.join(p)}` ({leaves[p][0].rsplit('.', 1)[-1]})" for p in paths)
        size = f"{total:,} parameters" if total is not None else "its size is known at run time"
        layout.units.append(LeafUnit(paths, total, f"{names}: {size}", runtime=runtime))
    runs = [forward.index(u.paths[-1][0]) for u in layout.units]
    blocks_at = [forward.index(c.path[0]) for c in info.containers if c.path[0] in forward]
    if layout.units and blocks_at and max(runs) == len(forward) - 1 and max(runs) > max(blocks_at):
        layout.units[runs.index(max(runs))].last = True
    layout.sources = dict(counter.sources)
    return layout


def _large(callee: str, n: Optional[int], block: Optional[int], floor: int) -> Optional[bool]:
    """Whether a leaf holds at least one block's parameters: None where a size is not read (the
    generated code compares the counts when it runs), False where it holds fewer than the
    `floor` a block holds at least (the parts of a block whose sizes are read). A norm holds
    one or two vectors of the model's width, fewer than a block with one layer of that width:
    one of a size not read is no unit of its own (it joins the head it runs before)."""
    if n is not None and block is not None:
        return n >= block
    if n is not None and n < floor or callee in NN_NORMS:
        return False
    return None


def _tied(info: ClassInfo, script: cst.Module, model_name: str) -> Dict[str, str]:
    """attr -> why a leaf of the root must stay in the root: it shares a parameter (a tie of
    `__init__`), or a method other than `__init__`, or the script, reads its attributes."""
    out: Dict[str, str] = {}
    for a, b in info.ties:
        out.setdefault(a[0], f"`{'.'.join(a)}` is `{'.'.join(b)}` (tied weights stay in one unit: the root)")
        out.setdefault(b[0], f"`{'.'.join(a)}` is `{'.'.join(b)}` (tied weights stay in one unit: the root)")
    for name, method in info.methods.items():
        for node in walk(method):
            if type(node) is not cst.Attribute:
                continue
            path = attr_path(node)
            if not path or path[0] != "self" or len(path) < 3:
                continue
            if name == "__init__" and not _is_assign_target(method, node):
                continue  # `nn.init.normal_(self.tok_emb.weight)`: runs before fully_shard
            out.setdefault(path[1], f"`{name}` reads `{'.'.join(path)}` (a unit's parameters are shards outside "
                                    "its forward)")
    for node in walk(script):
        if type(node) is cst.Attribute:
            path = attr_path(node)
            if path and len(path) >= 3 and path[0] == model_name:
                out.setdefault(path[1], f"the script reads `{'.'.join(path)}`")
    return out


def _is_assign_target(method, node) -> bool:
    return any(type(s) is cst.Assign and any(t.target is node for t in s.targets) for s in walk(method))


def _call_order(info: ClassInfo) -> List[str]:
    """The attrs of `forward`'s `self.<attr>(...)` calls and of the containers it runs (`for
    block in self.blocks:`), in the order they run (an argument's call before the call around
    it), each once."""
    forward = info.methods.get("forward")
    out: List[str] = []
    if forward is None:
        return out
    containers = {c.path[0] for c in info.containers}

    def add(expr) -> None:
        path = attr_path(expr)
        if path and len(path) == 2 and path[0] == "self" and path[1] not in out:
            out.append(path[1])

    # libcst's visiting order (child_nodes), without a visitor (which rebuilds every node it passes): a
    # loop's container when the loop is entered, a call when it is left
    stack: list = [(forward, False)]
    while stack:
        node, left = stack.pop()
        kind = type(node)
        if left:
            add(node.func)
            continue
        if kind is cst.For:
            for n in walk(node.iter):
                if type(n) is cst.Attribute and (attr_path(n) or ("",))[-1] in containers:
                    add(n)
        elif kind is cst.Call:
            stack.append((node, True))
        stack.extend((child, False) for child in reversed(child_nodes(node)))
    return out


class _ScriptEnv(dict):
    """Names of the script, read through its value flow: a name holding one value (a literal,
    `4 * DIM`, `GPTConfig(...)`) has that value's; any other, none."""

    def __init__(self, flow, counter: "_Counter", namer: _Namer):
        super().__init__()
        self.flow, self.counter, self.namer, self.depth = flow, counter, namer, 0
        self._namespaces: Dict[int, Optional[Defaults]] = {}

    def namespace(self, call: cst.Call) -> Optional[Defaults]:
        """The defaults of the argparse namespace `call` returns (analysis/cli_defaults.py), or None."""
        if id(call) not in self._namespaces:
            self._namespaces[id(call)] = namespace_defaults(
                self.flow, call, lambda expr: self.counter.value(expr, self, self.namer))
        return self._namespaces[id(call)]

    def lookup(self, name: cst.Name):
        origins = self.flow.values(name)
        if len(origins) != 1 or self.depth > 8:
            return None
        origin = next(iter(origins))
        if origin is name or not isinstance(origin, cst.BaseExpression):
            return None
        self.depth += 1
        try:
            return self.counter.value(origin, self, self.namer)
        finally:
            self.depth -= 1


class _Counter:
    """Parameter counts of module constructor calls, from literal and readable sizes."""

    def __init__(self, registry: ClassRegistry):
        self.registry = registry
        self._depth = 0
        self.lower = False  # count a part whose size is not read as none (a lower bound)
        # the argparse defaults the counts read, option -> value: the command line may give others
        self.sources: Dict[str, object] = {}

    def value(self, expr, env: Dict[str, object], namer: _Namer):
        """An int (or a config's dict of fields) `expr` holds, or None."""
        t = type(expr)
        if t is cst.Integer:
            return expr.evaluated_value
        if t is cst.Name:
            if expr.value in ("True", "False"):
                return expr.value == "True"
            if isinstance(env, _ScriptEnv):
                return env.lookup(expr)
            if expr.value in env:
                return env[expr.value]
            return self._module_constant(expr.value, namer)
        if t is cst.Attribute:
            path = attr_path(expr)
            if path and len(path) == 2:
                holder = env.lookup(expr.value) if isinstance(env, _ScriptEnv) else env.get(path[0])
                if isinstance(holder, dict):
                    return self._field(holder, path[1])
                return env.get(".".join(path))
            return None
        if t is cst.Subscript and len(expr.slice) == 1 and type(expr.slice[0].slice) is cst.Index:
            key = expr.slice[0].slice.value  # `cfg["vocab"]` of a dict literal
            holder = self.value(expr.value, env, namer) if type(expr.value) is cst.Name else None
            return self._field(holder, key.evaluated_value) if isinstance(holder, dict) and type(
                key) is cst.SimpleString else None
        if t is cst.Dict:
            out = {}
            for element in expr.elements:
                if type(element) is not cst.DictElement or type(element.key) is not cst.SimpleString:
                    return None
                out[element.key.evaluated_value] = self.value(element.value, env, namer)
            return out
        if t is cst.UnaryOperation and type(expr.operator) is cst.Minus:
            inner = self.value(expr.expression, env, namer)
            return -inner if isinstance(inner, int) else None
        if t is cst.BinaryOperation:
            left, right = self.value(expr.left, env, namer), self.value(expr.right, env, namer)
            if not isinstance(left, int) or not isinstance(right, int) or isinstance(left, bool) or isinstance(right, bool):
                return None
            op = type(expr.operator)
            if op is cst.Add:
                return left + right
            if op is cst.Subtract:
                return left - right
            if op is cst.Multiply:
                return left * right
            if op is cst.FloorDivide and right:
                return left // right
            if op is cst.Divide and right and left % right == 0:
                return left // right
            return None
        if t is cst.Call and namer.of(expr) == "builtins.int" and len(expr.args) == 1:
            return self.value(expr.args[0].value, env, namer)
        if t is cst.Call and namer.of(expr) in _NAMESPACES:  # `SimpleNamespace(vocab=512)`, `dict(vocab=512)`
            if any(a.keyword is None for a in expr.args):
                return None
            return {a.keyword.value: self.value(a.value, env, namer) for a in expr.args}
        if t is cst.Call and isinstance(env, _ScriptEnv):
            defaults = env.namespace(expr)  # `parser.parse_args()`: the options' defaults
            if defaults is not None:
                return defaults
        if t is cst.Call:
            return self.config(expr, env, namer)
        return None

    def _field(self, holder: dict, name: str):
        """A field of a config's or namespace's values; an argparse default read is noted in `sources`."""
        found = holder.get(name)
        if isinstance(holder, Defaults) and found is not None:
            self.sources.setdefault(holder.options.get(name, name), found)
        return found

    def _module_constant(self, name: str, namer: _Namer):
        """`VOCAB` bound once at the top level of the class's module (`VOCAB = 512`)."""
        found = self.registry.top_level.get(namer.namespace)
        bound = found[0].get(name, ()) if found is not None else ()
        if len(bound) != 1 or self._depth > 8:
            return None
        self._depth += 1
        try:
            return self.value(bound[0].value, {}, namer)
        finally:
            self._depth -= 1

    def config(self, expr, env, namer: _Namer) -> Optional[dict]:
        """`GPTConfig(n_embd=64)` of a dataclass of the script: its fields' values."""
        if not isinstance(expr, cst.Call):
            return None
        info = self.registry.get(namer.of(expr))
        if info is None or info.is_module:
            return None
        fields: Dict[str, object] = {}
        order: List[str] = []
        for stmt in info.node.body.body:
            for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
                if type(small) is cst.AnnAssign and type(small.target) is cst.Name:
                    order.append(small.target.value)
                    fields[small.target.value] = self.value(small.value, {}, info.namer) if small.value else None
        if "__init__" in info.methods:
            return None
        positional = [a for a in expr.args if a.keyword is None and not a.star]
        for name, arg in zip(order, positional):
            fields[name] = self.value(arg.value, env, namer)
        for a in expr.args:
            if a.keyword is not None:
                fields[a.keyword.value] = self.value(a.value, env, namer)
        return fields

    def count(self, call: cst.Call, env: Dict[str, object], namer: _Namer, depth: int) -> Optional[int]:
        """Parameters a constructor call builds, or None where a size cannot be read (with `lower`
        set: at least how many, a part not read counting none)."""
        found = self._count(call, env, namer, depth)
        return 0 if found is None and self.lower else found

    def lower_bound(self, call: cst.Call, env: Dict[str, object], namer: _Namer) -> int:
        """The parameters a constructor call builds at least: those of the parts whose sizes are read."""
        self.lower = True
        try:
            return self.count(call, env, namer, 0)
        finally:
            self.lower = False

    def _count(self, call: cst.Call, env: Dict[str, object], namer: _Namer, depth: int) -> Optional[int]:
        if depth > _MAX_DEPTH or not isinstance(call, cst.Call):
            return None
        callee = namer.of(call)
        args = [self.value(a.value, env, namer) for a in call.args if a.keyword is None and not a.star]
        kwargs = {a.keyword.value: self.value(a.value, env, namer) for a in call.args if a.keyword is not None}
        if any(a.star for a in call.args) and callee not in SEQUENTIAL:
            return None

        def arg(i, name, default=None):
            return args[i] if len(args) > i else kwargs.get(name, default)

        if callee in NN_NO_PARAMETERS:
            return 0
        if callee == "torch.nn.Embedding":
            n, d = arg(0, "num_embeddings"), arg(1, "embedding_dim")
            return n * d if _ints(n, d) else None
        if callee == "torch.nn.Linear":
            i, o, bias = arg(0, "in_features"), arg(1, "out_features"), arg(2, "bias", True)
            return i * o + (o if bias else 0) if _ints(i, o) and isinstance(bias, bool) else None
        if callee == "torch.nn.LayerNorm":
            s, affine, bias = arg(0, "normalized_shape"), arg(2, "elementwise_affine", True), arg(3, "bias", True)
            if not _ints(s) or not isinstance(affine, bool) or not isinstance(bias, bool):
                return None
            return (s + (s if bias else 0)) if affine else 0
        if callee == "torch.nn.RMSNorm":
            s, affine = arg(0, "normalized_shape"), arg(2, "elementwise_affine", True)
            return (s if affine else 0) if _ints(s) and isinstance(affine, bool) else None
        if callee == "torch.nn.MultiheadAttention":
            d, bias = arg(0, "embed_dim"), arg(3, "bias", True)
            if len(args) > 4 or {"add_bias_kv", "kdim", "vdim"} & set(kwargs) or not _ints(d) or not isinstance(bias, bool):
                return None
            return 4 * d * d + (4 * d if bias else 0)  # in_proj (3d x d), out_proj (d x d), their biases
        if callee in _RNN_CELLS:
            i, h, bias = arg(0, "input_size"), arg(1, "hidden_size"), arg(2, "bias", True)
            if not _ints(i, h) or not isinstance(bias, bool):
                return None
            return _RNN_CELLS[callee] * (h * (i + h) + (2 * h if bias else 0))
        if callee in BARE_CONTAINERS | SEQUENTIAL:
            elements = _repeated_elements(call)
            if elements is None:
                return None
            if len(call.args) == 1 and isinstance(call.args[0].value, (cst.ListComp, cst.GeneratorExp)):
                times = _range_length(call.args[0].value, env, self, namer)
                one = self.count(elements[0], env, namer, depth + 1) if elements else 0
                return times * one if times is not None and one is not None else None
            counts = [self.count(e, env, namer, depth + 1) for e in elements]
            return sum(counts) if all(c is not None for c in counts) else None
        info = self.registry.get(callee)
        if info is None or not info.is_module or info.namer is None:
            return None
        return self._count_class(info, call, env, namer, depth)

    def _count_class(self, info: ClassInfo, call: cst.Call, env, namer: _Namer, depth: int) -> Optional[int]:
        init = info.methods.get("__init__")
        if init is None or any(b not in TORCH_MODULE_BASES for b in info.bases):
            return None
        inner: Dict[str, object] = {}
        for param, arg in bind_args(init, call, skip=1):
            inner[param] = self.value(arg, env, namer)
        for p in [*init.params.params[1:], *init.params.kwonly_params]:
            if p.name.value not in inner and p.default is not None:
                inner[p.name.value] = self.value(p.default, inner, info.namer)
        total = 0
        for stmt in init.body.body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                if not self.lower and any(type(n) is cst.Assign and any(
                        (attr_path(t.target) or ("",))[0] == "self" for t in n.targets) for n in walk(stmt)):
                    return None  # modules built under an if/for
                continue
            for small in stmt.body:
                if type(small) is cst.Assign and len(small.targets) == 1:
                    path = attr_path(small.targets[0].target)
                    if path and len(path) == 1:
                        inner[path[0]] = self.value(small.value, inner, info.namer)
                        continue
                    if not path or path[0] != "self":
                        continue
                    if len(path) != 2:
                        return None  # a tie or a parameter set on a submodule
                    if type(small.value) is not cst.Call:
                        inner[".".join(path)] = self.value(small.value, inner, info.namer)
                        continue
                    callee = info.namer.of(small.value)
                    if callee in NN_PARAMETER:
                        n = self._tensor_size(small.value, inner, info.namer)
                    elif callee and (callee.startswith("torch.nn.") or self.registry.is_module_class(callee)):
                        n = self.count(small.value, inner, info.namer, depth + 1)
                    else:
                        inner[".".join(path)] = self.value(small.value, inner, info.namer)
                        continue
                    if n is None and not self.lower:
                        return None
                    total += n or 0
                elif type(small) is cst.Expr and type(small.value) is cst.Call:
                    func = small.value.func
                    if type(func) is cst.Attribute and func.attr.value in ("register_parameter", "add_module"):
                        return None
        return total

    def _tensor_size(self, call: cst.Call, env, namer: _Namer) -> Optional[int]:
        """`nn.Parameter(torch.zeros(a, b))` / `torch.randn(a, b)` / `torch.ones(a)`: a*b."""
        if not call.args or type(call.args[0].value) is not cst.Call:
            return None
        inner = call.args[0].value
        if namer.of(inner) not in TENSOR_FACTORIES:
            return None
        dims = [self.value(a.value, env, namer) for a in inner.args if a.keyword is None]
        if not dims or not _ints(*dims):
            return None
        total = 1
        for d in dims:
            total *= d
        return total


def _range_length(comp, env, counter: _Counter, namer: _Namer) -> Optional[int]:
    """n for `[... for _ in range(n)]`."""
    loop = comp.for_in
    if loop.inner_for_in is not None or loop.ifs:
        return None
    it = loop.iter
    if type(it) is not cst.Call or namer.of(it) != "builtins.range" or len(it.args) != 1:
        return None
    n = counter.value(it.args[0].value, env, namer)
    return n if _ints(n) else None


def _ints(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def model_leaf_layout(facts, model, lists: bool) -> Optional[LeafLayout]:
    """The leaf units of a trained model of the script (analysis/models.ModelSite), or None:
    built by a call of its class read here (not a library's, not chosen at run time)."""
    if model.library is not None or model.runtime_blocks or model.alternatives or not model.containers:
        return None
    if model.tied_containers or model.copy_of is not None:
        return None
    call = _build_call(facts, model)
    if call is None:
        return None
    return leaf_layout(facts.classes, model.class_name, call, facts.analysis.flow, facts.resolver.module,
                       model.name, lists)


def model_parameter_count(facts, model) -> Optional[int]:
    """The parameters a trained model's build makes, read from its classes and the sizes the script
    gives (literals, defaults, values the flow reads one value for), or None where one is not read."""
    top = facts.classes.top_level.get("")
    call = _build_call(facts, model) if model.library is None and not model.alternatives else None
    if call is None or top is None:
        return None
    counter = _Counter(facts.classes)
    return counter.count(call, _ScriptEnv(facts.analysis.flow, counter, top[1]), top[1], 0)


def _build_call(facts, model) -> Optional[cst.Call]:
    """The call of the model's class in `name = ...` that builds it (`Net(...)` of `Net(...).to(device)`)."""
    small = model.stmt.body[0] if len(model.stmt.body) == 1 else None
    if type(small) is not cst.Assign:
        return None
    from .flow import innermost_call

    call = innermost_call(small.value)
    top = facts.classes.top_level.get("", (None, None))[1]
    if call is None or model.class_name not in facts.resolver.qnames(call) and (
            top is None or top.of(call) != model.class_name):
        return None
    return call
