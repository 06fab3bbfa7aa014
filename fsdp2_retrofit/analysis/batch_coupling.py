"""Objectives that couple the samples of a batch: their value changes when the batch is split.

FSDP2 averages the ranks' gradients, which equals the gradient of the global batch only for a loss
that is a mean (or a scaled sum) of per-sample terms. Where a sample's term reads the other samples
of its batch, each rank computes it over its own part of the batch, and the average of those is
another objective than the single process's:

* a batch-by-batch matrix of two batch tensors: `z @ z.T`, `torch.mm(a, b.t())`,
  `torch.matmul(e, e.transpose(1, 0))`, `torch.cdist(a, b)`, `torch.einsum("nc,mc->nm", a, b)`,
  `F.cosine_similarity(a.unsqueeze(1), b.unsqueeze(0), dim=-1)`: InfoNCE's negatives, EBGAN's
  pull-away term (each rank's logits see B/world_size negatives, not B);
* a statistic over the batch dimension combined with a batch tensor: `fake - real.mean(0, keepdim=True)`
  (a relativistic average GAN), `x + 0.5 * x.std() * noise` (DRAGAN's perturbation): the mean or the
  spread of each rank's part, not of the global batch;
* a class-weighted mean (`nn.CrossEntropyLoss(weight=w)`, `F.nll_loss(..., weight=w)`, reduction "mean"):
  it divides by the total weight of the batch's targets, each rank by its own part's (kind "normalizer").

Batch tensors are followed by value (analysis/flow.py) to the forward of a model or to the variables of
a training loop; a loss object of a class of the script or of a sibling module (`criterion(features,
labels)`, its class read from the registry) is read inside its `forward`, with the parameters the call
hands batch tensors, and flagged at the call; only operations the analysis knows to keep one row per sample are followed through
(elementwise functions, reshapes, `.detach()`, `.data`, a loss with `reduction="none"`...). Found,
never fixed: the expert's fix (an all-gather of the embeddings with the gradient kept, or the
statistic all-reduced) changes the model code, so the rewrite reports the line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import bind_args, code, keyword_arg
from fsdp2_retrofit.syntax.torch_api import (
    BATCH_STATISTICS as _STATISTIC_FUNCTIONS, CDIST, COSINE_SIMILARITY, EINSUM, MATMULS as _MATMULS,
    ROW_FUNCTIONS as _ROW_FUNCTIONS, UNIFORM_DRAWS, WEIGHTED_MEAN_LOSSES as _WEIGHTED_MEAN_LOSSES,
)

_DEPTH = 10
# methods of a tensor that keep one row per sample (the result is batch-shaped where the receiver is)
_ROW_METHODS = frozenset({
    "detach", "clone", "contiguous", "float", "double", "half", "bfloat16", "to", "type", "cuda", "cpu",
    "view", "reshape", "flatten", "squeeze", "unsqueeze", "expand", "expand_as", "view_as", "reshape_as",
    "abs", "exp", "log", "sqrt", "rsqrt", "pow", "sigmoid", "tanh", "relu", "neg", "clamp", "clip",
    "softmax", "log_softmax", "mul", "div", "add", "sub", "requires_grad_", "masked_fill", "normalize",
})
_STATISTICS = frozenset({"mean", "std", "var", "sum", "logsumexp"})


@dataclass
class Coupling:
    node: cst.CSTNode  # the expression that couples the samples
    what: str  # what it computes, for the report
    kind: str = "coupling"  # "coupling": a term reads other samples; "normalizer": a mean over a batch-dependent total


def batch_couplings(facts) -> List[Coupling]:
    """Every expression of the script that couples the samples of a batch tensor (see the module's doc)."""
    found = _Finder(facts)
    out: Dict[int, Coupling] = {}
    r = facts.resolver
    for node in r.nodes(cst.BinaryOperation):
        hit = found.product(node) or found.statistic_operand(node)
        if hit is not None:
            out.setdefault(id(hit.node), hit)
    for call in r.nodes(cst.Call):
        hit = found.matrix_call(call) or found.inside_criterion(call) or found.weighted_mean(call)
        if hit is not None:
            out.setdefault(id(hit.node), hit)
    return sorted(out.values(), key=lambda c: r.line(c.node))


def batch_tensors(facts):
    """A test of whether an expression of the script holds a tensor with one row per sample of
    a training batch (a loop's batch, a model's output, a row-wise function of either)."""
    return _Finder(facts).batch


class _Finder:
    def __init__(self, facts) -> None:
        self.facts = facts
        self.r = facts.resolver
        self.flow = facts.analysis.flow
        self.loops = {id(loop.node) for loop in facts.loops}
        self._memo: Dict[int, bool] = {}

    # -- batch tensors -----------------------------------------------------------------------------

    def batch(self, expr, depth: int = 0) -> bool:
        """`expr` holds a tensor with one row per sample of a training batch (a model's output, a
        training loop's batch, or a row-wise function of one)."""
        if depth > _DEPTH or expr is None:
            return False
        key = id(expr)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = False  # a cycle holds nothing more
        self._memo[key] = result = self._batch(expr, depth)
        return result

    def _batch(self, expr, depth: int) -> bool:
        t = type(expr)
        if t is cst.Name:
            return any(self._origin(o, expr, depth) for o in self.flow.values(expr))
        if t is cst.Attribute:
            if expr.attr.value in ("data", "T", "mT"):
                return self.batch(expr.value, depth + 1)
            return self._names_model(expr) is None and any(self._origin(o, expr, depth) for o in self.flow.values(expr))
        if t is cst.Subscript:
            return self.batch(expr.value, depth + 1)
        if t is cst.UnaryOperation:
            return self.batch(expr.expression, depth + 1)
        if t is cst.BinaryOperation and not isinstance(expr.operator, cst.MatrixMultiply):
            return self.batch(expr.left, depth + 1) or self.batch(expr.right, depth + 1)
        if t is cst.Call:
            return self._batch_call(expr, depth)
        return False

    def _origin(self, origin, at, depth: int) -> bool:
        node = origin[0] if isinstance(origin, tuple) else origin
        if node is at:
            return False
        if isinstance(node, cst.For):
            return id(node) in self.loops
        return isinstance(node, cst.BaseExpression) and self.batch(node, depth + 1)

    def _batch_call(self, call: cst.Call, depth: int) -> bool:
        if self._names_model(call.func) is not None:
            return True
        names = self.r.qnames(call.func)
        first = next((a.value for a in call.args if a.keyword is None and not a.star), None)
        if names & _ROW_FUNCTIONS:
            return self.batch(first, depth + 1)
        if names & UNIFORM_DRAWS and first is not None:
            return self._size_of_batch(first, depth)
        if any(n.endswith("Variable") for n in names):
            return self.batch(first, depth + 1)
        if isinstance(call.func, cst.Attribute) and not names & _STATISTIC_FUNCTIONS:
            method = call.func.attr.value
            if method in _ROW_METHODS:
                return self.batch(call.func.value, depth + 1)
            if method in _STATISTICS and not self._over_batch(call, 0):
                return self.batch(call.func.value, depth + 1)  # a statistic over another dimension
        if names & _STATISTIC_FUNCTIONS and not self._over_batch(call, 1):
            return self.batch(first, depth + 1)
        return False

    def _size_of_batch(self, expr, depth: int) -> bool:
        """`x.size()` / `x.shape` of a batch tensor: a draw of its shape."""
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "size":
            return not expr.args and self.batch(expr.func.value, depth + 1)
        return isinstance(expr, cst.Attribute) and expr.attr.value == "shape" and self.batch(expr.value, depth + 1)

    def _names_model(self, expr):
        return self.facts.model_held(expr)

    # -- a criterion object whose class is read, not followed by the flow ------------------------------

    def inside_criterion(self, call: cst.Call) -> Optional[Coupling]:
        """`criterion(features, labels)` of an instance of a class of the script or a sibling module
        (`criterion = SupConLoss(...)`) handed batch tensors: a coupling in its forward, named at the call."""
        info = self._criterion_class(call)
        method = info.methods.get("forward") if info is not None else None
        if method is None:
            return None
        held = {param for param, arg in bind_args(method, call, skip=1) if self.batch(arg)}
        if not held:
            return None
        inside = _Inside(self, info, method, held)
        hits = inside.scan()
        if not hits:
            return None
        where = (f"{self.facts.classes.shown_file(info.namespace)}:" if info.namespace else "line ") + str(
            inside.r.line(hits[0].node))
        name = info.name.rsplit(".", 1)[-1]
        return Coupling(call, f"`{code(call)}` runs {name}.forward, where ({where}) {hits[0].what}")

    def _criterion_class(self, call: cst.Call):
        """The class of the criterion object a call runs: one held by a name or by `self.<attr>`
        (`criterion(...)`, `self.loss_fn(...)`). A method of another value (`x.relu()`,
        `out.mean()`) is not followed: asking the flow what `x` holds at each of a long
        forward's calls cost a 5000-line script 1.8 s, quadratic in its rebindings of `x`."""
        func = call.func
        if not (type(func) is cst.Name or type(func) is cst.Attribute and type(func.value) is cst.Name
                and func.value.value == "self"):
            return None
        if self._names_model(func):
            return None
        return self.facts.instance_class(func)

    # -- a mean over the batch's own total weight -------------------------------------------------------

    def weighted_mean(self, call: cst.Call) -> Optional[Coupling]:
        """`nn.CrossEntropyLoss(weight=w)`, `F.nll_loss(..., weight=w)` with the mean reduction: the mean
        divides by the sum of the weights of the batch's targets, so each rank divides by its own part's
        total and the average of the ranks' losses is not the global batch's weighted mean."""
        if not (self.r.qnames(call.func) & _WEIGHTED_MEAN_LOSSES):
            return None
        weight = keyword_arg(call, "weight")
        if weight is None or type(weight) is cst.Name and weight.value == "None":
            return None
        reduction = keyword_arg(call, "reduction")
        if reduction is not None and not (type(reduction) is cst.SimpleString and
                                          reduction.evaluated_value == "mean"):
            return None  # "sum" (the loss_scale stage's), "none", or not known
        return Coupling(call, f"`{code(call.func)}(..., weight={code(weight)})` averages over the total class weight "
                              "of the batch's targets", kind="normalizer")

    # -- statistics over the batch ----------------------------------------------------------------------

    def _over_batch(self, call: cst.Call, skip: int) -> bool:
        """A mean/std/var/sum call that reduces the batch dimension: no `dim`, or dim 0 (also in a tuple)."""
        dims = [a.value for a in call.args if a.keyword is None and not a.star][skip:skip + 1]
        dims += [a.value for a in call.args if a.keyword is not None and a.keyword.value in ("dim", "axis")]
        if not dims:
            return True
        dim = dims[0]
        values = [e.value for e in dim.elements] if isinstance(dim, (cst.Tuple, cst.List)) else [dim]
        return any(isinstance(v, cst.Integer) and v.value == "0" for v in values)

    def _batch_statistic(self, expr) -> Optional[cst.Call]:
        """`expr` is (a constant multiple of) a statistic over the batch dimension of a batch tensor."""
        while isinstance(expr, cst.BinaryOperation) and _constant(expr.left) != _constant(expr.right):
            expr = expr.right if _constant(expr.left) else expr.left
        if not isinstance(expr, cst.Call):
            return None
        names = self.r.qnames(expr.func)
        if names & _STATISTIC_FUNCTIONS:
            first = next((a.value for a in expr.args if a.keyword is None and not a.star), None)
            return expr if self._over_batch(expr, 1) and self.batch(first) else None
        if isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _STATISTICS:
            return expr if self._over_batch(expr, 0) and self.batch(expr.func.value) else None
        return None

    def statistic_operand(self, node: cst.BinaryOperation) -> Optional[Coupling]:
        """`a - b.mean(0)`: a batch statistic combined, row by row, with a batch tensor."""
        if not isinstance(node.operator, (cst.Add, cst.Subtract, cst.Multiply, cst.Divide)):
            return None
        for stat_side, other in ((node.right, node.left), (node.left, node.right)):
            stat = self._batch_statistic(stat_side)
            if stat is not None and self._batch_statistic(other) is None and self.batch(other):
                return Coupling(node, f"`{code(node)}` combines each sample with `{code(stat)}`, a statistic over "
                                      "the batch")
        return None

    # -- batch-by-batch matrices ------------------------------------------------------------------------

    def product(self, node: cst.BinaryOperation) -> Optional[Coupling]:
        if not isinstance(node.operator, cst.MatrixMultiply):
            return None
        return self._pair(node, node.left, node.right)

    def matrix_call(self, call: cst.Call) -> Optional[Coupling]:
        names = self.r.qnames(call.func)
        args = [a.value for a in call.args if a.keyword is None and not a.star]
        if names & _MATMULS and len(args) == 2:
            return self._pair(call, args[0], args[1])
        if names & CDIST and len(args) >= 2 and self.batch(args[0]) and self.batch(args[1]):
            return Coupling(call, f"`{code(call)}` is a batch-by-batch distance matrix")
        if names & COSINE_SIMILARITY and len(args) >= 2:
            dims = {_unsqueezed(args[0]), _unsqueezed(args[1])}
            if dims == {"0", "1"} and self.batch(args[0]) and self.batch(args[1]):
                return Coupling(call, f"`{code(call)}` compares every sample with every other")
        if names & EINSUM and args and isinstance(args[0], cst.SimpleString):
            operands = args[1:] if len(args) > 2 else (
                [e.value for e in args[1].elements] if len(args) == 2 and isinstance(args[1], (cst.List, cst.Tuple))
                else [])
            if _einsum_pairs_rows(args[0].evaluated_value) and len(operands) == 2 and all(map(self.batch, operands)):
                return Coupling(call, f"`{code(call)}` pairs every sample with every other")
        return None

    def _pair(self, node, left, right) -> Optional[Coupling]:
        """`a @ b.T`: rows of one batch tensor times the transposed rows of another."""
        for plain, turned in ((left, right), (right, left)):
            inner = _transposed(turned)
            if inner is not None and self.batch(inner) and self.batch(plain):
                return Coupling(node, f"`{code(node)}` is a batch-by-batch matrix (every sample against every other)")
        return None


class _Inside(_Finder):
    """The same questions inside one method of a class (its own module's names): a name holds a batch
    tensor where a parameter handed one, or a value assigned to it in the method, does."""

    def __init__(self, outer: _Finder, info, method: cst.FunctionDef, held) -> None:
        self.facts, self.loops, self._memo = outer.facts, set(), {}
        self.r = info.namer.resolver
        self.method, self.held = method, held
        self.assigned: Dict[str, list] = {}
        for node in self.r.descendants(method, cst.Assign):
            for target in node.targets:
                if isinstance(target.target, cst.Name):
                    self.assigned.setdefault(target.target.value, []).append(node.value)

    def scan(self) -> List[Coupling]:
        hits = [self.product(n) or self.statistic_operand(n) for n in self.r.descendants(self.method, cst.BinaryOperation)]
        hits += [self.matrix_call(c) for c in self.r.descendants(self.method, cst.Call)]
        return sorted((h for h in hits if h is not None), key=lambda h: self.r.line(h.node))

    def _batch(self, expr, depth: int) -> bool:
        if type(expr) is cst.Name:
            return expr.value in self.held or any(self.batch(v, depth + 1) for v in self.assigned.get(expr.value, ()))
        if type(expr) is cst.Attribute and expr.attr.value not in ("data", "T", "mT"):
            return False  # `self.temperature`: an attribute of the criterion, not a batch
        return super()._batch(expr, depth)

    def _names_model(self, expr):
        return None  # the criterion's own code calls no model of the script

    def inside_criterion(self, call: cst.Call) -> Optional[Coupling]:
        return None


def _constant(expr) -> bool:
    return isinstance(expr, (cst.Integer, cst.Float)) or (
        isinstance(expr, cst.UnaryOperation) and isinstance(expr.expression, (cst.Integer, cst.Float)))


def _transposed(expr) -> Optional[cst.BaseExpression]:
    """x for `x.T`, `x.t()`, `x.transpose(0, 1)` / `(1, 0)` / `(-1, -2)`, `x.permute(1, 0)`."""
    if isinstance(expr, cst.Attribute) and expr.attr.value in ("T", "mT"):
        return expr.value
    if not isinstance(expr, cst.Call) or not isinstance(expr.func, cst.Attribute):
        return None
    method, args = expr.func.attr.value, [code(a.value) for a in expr.args]
    if method == "t" and not args:
        return expr.func.value
    if method == "transpose" and sorted(args) in (["0", "1"], ["-1", "-2"]) or method == "permute" and args == ["1", "0"]:
        return expr.func.value
    return None


def _unsqueezed(expr) -> Optional[str]:
    if (isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "unsqueeze"
            and len(expr.args) == 1):
        return code(expr.args[0].value)
    return None


def _einsum_pairs_rows(equation: str) -> bool:
    """`"nc,mc->nm"`: the two operands' first indices differ and both stay in the output."""
    if "->" not in equation or equation.count(",") != 1:
        return False
    inputs, output = equation.replace(" ", "").split("->")
    a, b = inputs.split(",")
    return bool(a and b) and a[0] != b[0] and a[0] in output and b[0] in output
