"""How the loss that reaches `backward()` is reduced over the batch: summed or averaged.

FSDP2 (like DDP) averages the gradients over the ranks. A loss averaged over each
rank's part of the batch then has the gradient of the loss averaged over the whole
global batch: what the single-process run computes. A loss summed over each rank's
part gives 1/world_size of the gradient of the sum over the global batch, so its
backward must be scaled by the world size (where each rank's loss covers its own part of
the batch: analysis/data_split.py); when summed and averaged terms are added
in one loss, no one factor makes both right.

The loss is read from the script's text, never run: each additive term of the
expression `backward()` is called on is followed through the names it reads (their
latest assignment before it in the same function, else at module level), the
criterion objects they call (`nn.MSELoss(reduction="sum")`), and the script's own
functions that return a loss (`def loss_function(...): return bce + kld`). A term is

* ``sum``: a loss function or criterion with `reduction="sum"` / `size_average=False`,
  or `torch.sum(x)` / `x.sum()` over the whole of a tensor computed with torch (not the
  value of a model, a criterion or a function the analysis cannot read: a loss already?);
* ``mean``: a loss function or criterion with the default or `reduction="mean"`
  (`"batchmean"`), or `torch.mean(x)` / `x.mean()`;
* ``constant``: a number (also a name bound to one); it adds nothing to the gradient;
* ``batched``: a sum over the batch divided by a power of the rank's batch size other than
  one (`per_sample.sum() / b ** 2` where `b = x.size(0)`): each rank divides by its own batch
  size, so the gradient comes out world_size ** (1 - power) times the single-process one;
* ``unknown``: anything else (a model's own loss that cannot be read, a method, a division
  by a name that is not a batch tensor's size, a sum over the model's weights, a sum of a
  list of losses).

With the script's facts (`loss_reductions(resolver, facts)`), two more things are read: the
size of a training batch tensor (`x.size(0)`, `x.shape[0]`, `len(x)`, a name bound to one,
`B, C, H, W = x.shape`) as a divisor or factor, which moves a term by powers of the batch size
(a sum divided by it is a mean); and the call of an instance of a class of the script or a
sibling module (`trainer = DiffusionTrainer(net)`; `trainer(x)`), whose `forward`'s returns are
read as a function's are: a forward returning `F.mse_loss(..., reduction="none")` gives one
loss per sample, and `trainer(x).sum()` is a sum over the batch.

A constant factor (`-0.5 * torch.sum(...)`, `beta * kld`, a division by a number, also
as a tensor method: `torch.sum(...).mul_(-0.5)`, `.div(2)`, `.neg()`) keeps a term's kind; a product with the world size (`loss * world_size`, what the rewrite
writes) is unknown: it is scaled already. The whole loss is ``sum`` when every term that is not a constant is a
sum, ``mean`` when every one is a mean, ``mixed`` when both occur, else ``unknown``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Set

import libcst as cst

from fsdp2_retrofit.syntax.names import Resolver, code, names_read, parameter_names
from fsdp2_retrofit.syntax.rank import is_world_size_value
from fsdp2_retrofit.syntax.torch_api import LOSS_CLASSES, LOSS_FUNCTIONS, MEANS, STACKS, SUMS

SUM, MEAN, CONSTANT, UNKNOWN = "sum", "mean", "constant", "unknown"
BATCHED = "batched"  # a sum over the batch divided by the batch size to a power other than 0 and 1
NONE = "none"  # `reduction="none"`: one value per sample, reduced later (or an error at backward)
MIXED = "mixed"

_WEIGHT_READS = (".parameters(", ".named_parameters(", ".weight", ".bias")
_MAX_DEPTH = 12
# a tensor's methods that multiply (divide) it by their one argument, or negate it
_MULTIPLIES = frozenset({"mul", "mul_", "multiply", "multiply_"})
_DIVIDES = frozenset({"div", "div_", "divide", "divide_", "true_divide", "true_divide_"})
_NEGATES = frozenset({"neg", "neg_", "negative", "negative_"})


@dataclass
class Term:
    """One additive term of a loss: its kind and the node that decided it."""

    kind: str
    node: cst.CSTNode
    power: int = 0  # of a BATCHED term: the power of the rank's batch size it is divided by
    # an UNKNOWN `<call>.sum()` over what a call the analysis cannot read returns: one loss per
    # sample (a sum over the batch) or a loss already?
    unread_sum: bool = False


@dataclass
class LossReduction:
    """The loss one `backward()` call differentiates."""

    backward: cst.Call  # the `<loss>.backward(...)` call
    loss: cst.BaseExpression  # the expression differentiated (inside `scaler.scale(...)` too)
    terms: List[Term] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return combine(self.terms)

    @property
    def power(self) -> Optional[int]:
        """The power of the rank's batch size the loss's sum over the batch is divided by (0: a
        sum, 1: a mean), where every term is reduced alike; else None."""
        if self.kind not in (SUM, MEAN, BATCHED):
            return None
        return next(batch_power(t) for t in self.terms if t.kind != CONSTANT)

    def of_kind(self, kind: str) -> List[Term]:
        return [t for t in self.terms if t.kind == kind]


def batch_power(term: Term) -> Optional[int]:
    """The power of the batch size a term's sum over the batch is divided by, or None."""
    return {SUM: 0, MEAN: 1, BATCHED: term.power}.get(term.kind)


def _with_power(node: cst.CSTNode, power: int) -> Term:
    return Term(SUM if power == 0 else MEAN if power == 1 else BATCHED, node, power)


def combine(terms: List[Term]) -> str:
    kinds = {t.kind for t in terms if t.kind != CONSTANT}
    powers = {batch_power(t) for t in terms if t.kind != CONSTANT} - {None}
    if len(powers) > 1:
        return MIXED
    if len(kinds) == 1 and kinds <= {SUM, MEAN, BATCHED}:
        return next(iter(kinds))
    return UNKNOWN


def loss_reductions(resolver: Resolver, facts=None) -> List[LossReduction]:
    """Every `<loss>.backward()` (and `scaler.scale(<loss>).backward()`) of the
    script, with the terms of its loss; with the script's `facts` (of `resolver`), batch sizes
    and the forwards of its classes' instances are read too."""
    out = []
    for call in resolver.nodes(cst.Call):
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "backward"):
            continue
        loss = _differentiated(func.value)
        out.append(LossReduction(call, loss, _Reader(resolver, facts).terms(loss, 0)))
    return out


def _differentiated(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`loss` in `scaler.scale(loss)` (a GradScaler's scaled loss); `expr` otherwise."""
    if (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Attribute)
        and expr.func.attr.value == "scale"
        and len(expr.args) == 1
        and expr.args[0].keyword is None
        and not expr.args[0].star
    ):
        return expr.args[0].value
    return expr


class _Reader:
    def __init__(self, resolver: Resolver, facts=None) -> None:
        self.r = resolver
        self.facts = facts
        self.batch = None
        if facts is not None:
            from fsdp2_retrofit.analysis.batch_coupling import batch_tensors

            self.batch = batch_tensors(facts)
        self.top_functions = {
            s.name.value: s for s in resolver.module.body if isinstance(s, cst.FunctionDef)
        }
        self.seen: Set[int] = set()  # bindings being followed (no cycles)

    def terms(self, expr: cst.BaseExpression, depth: int) -> List[Term]:
        if depth > _MAX_DEPTH:
            return [Term(UNKNOWN, expr)]
        if isinstance(expr, (cst.Integer, cst.Float)):
            return [Term(CONSTANT, expr)]
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, (cst.Minus, cst.Plus)):
            return self.terms(expr.expression, depth + 1)
        if isinstance(expr, cst.BinaryOperation):
            return self._binary(expr, depth)
        if isinstance(expr, cst.Name):
            return self._name(expr, depth)
        if isinstance(expr, cst.Call):
            return self._call(expr, depth)
        return [Term(UNKNOWN, expr)]

    # -- operators ---------------------------------------------------------------

    def _binary(self, expr: cst.BinaryOperation, depth: int) -> List[Term]:
        op = expr.operator
        if isinstance(op, (cst.Add, cst.Subtract)):
            return self.terms(expr.left, depth + 1) + self.terms(expr.right, depth + 1)
        if isinstance(op, cst.Multiply) and (self._world_size(expr.left) or self._world_size(expr.right)):
            return [Term(UNKNOWN, expr)]  # scaled by the world size already (a rewritten or a DDP script)
        if isinstance(op, cst.Divide):
            power = self._batch_size_power(expr.right, 0)
            if power:
                return self._shift(self.terms(expr.left, depth + 1), power, expr)
        if isinstance(op, cst.Multiply):
            for size, other in ((expr.right, expr.left), (expr.left, expr.right)):
                power = self._batch_size_power(size, 0)
                if power:
                    return self._shift(self.terms(other, depth + 1), -power, expr)
        left, right = self.terms(expr.left, depth + 1), self.terms(expr.right, depth + 1)
        if isinstance(op, cst.Multiply):
            if _constant(left) or self._scalar_factor(expr.left, left):
                return right
            if _constant(right) or self._scalar_factor(expr.right, right):
                return left
        if isinstance(op, cst.Divide) and _constant(right):
            return left
        # a division by a name (the batch size?), a product of two tensors: not known
        return [Term(UNKNOWN, expr)]

    def _world_size(self, expr: cst.BaseExpression) -> bool:
        """`dist.get_world_size()`, `int(os.environ["WORLD_SIZE"])`, `world_size`, `args.world_size`."""
        if is_world_size_value(expr, self.r):
            return True
        return isinstance(expr, (cst.Name, cst.Attribute)) and code(expr).rsplit(".", 1)[-1].lower() == "world_size"

    def _shift(self, terms: List[Term], power: int, node: cst.CSTNode) -> List[Term]:
        """`terms` divided by the batch size to `power` (multiplied, for a negative power)."""
        if any(batch_power(t) is None and t.kind != CONSTANT for t in terms):
            return [Term(UNKNOWN, node)]
        return [t if t.kind == CONSTANT else _with_power(t.node, batch_power(t) + power) for t in terms]

    def _batch_size_power(self, expr: cst.BaseExpression, depth: int) -> Optional[int]:
        """How many factors of the rank's batch size `expr` is (`x.size(0)`: 1, `b ** 2`: 2,
        `B * B`: 2), where `x` holds a training batch tensor; None when it is not such a size."""
        if self.batch is None or depth > 6:
            return None
        t = type(expr)
        if t is cst.BinaryOperation:
            op = type(expr.operator)
            if op is cst.Power:
                base, exponent = self._batch_size_power(expr.left, depth + 1), _integral(expr.right)
                return base * exponent if base and exponent and exponent > 0 else None
            if op is cst.Multiply:
                left = self._batch_size_power(expr.left, depth + 1)
                right = self._batch_size_power(expr.right, depth + 1)
                return left + right if left and right else None
            return None
        if t is cst.Call:
            func, args = expr.func, [a for a in expr.args if not a.star]
            if type(func) is cst.Name and func.value in ("float", "int") and len(args) == 1:
                return self._batch_size_power(args[0].value, depth + 1)
            if type(func) is cst.Name and func.value == "len" and len(args) == 1:
                return 1 if self.batch(args[0].value) else None
            if type(func) is cst.Attribute and func.attr.value == "size" and len(args) == 1 and (
                    args[0].keyword is None or args[0].keyword.value == "dim") and _integral(args[0].value) == 0:
                return 1 if self.batch(func.value) else None
            return None
        if t is cst.Subscript:
            return 1 if self._first_of_shape(expr.value, expr.slice) else None
        if t is cst.Name:
            origins = self.facts.analysis.flow.values(expr)
            found = {self._origin_power(o, expr, depth) for o in origins}
            return found.pop() if len(found) == 1 else None
        return None

    def _origin_power(self, origin, at, depth: int) -> Optional[int]:
        if isinstance(origin, tuple):
            node, path = origin
            return 1 if path == (0,) and self._shape_of_batch(node) else None
        if origin is at or not isinstance(origin, cst.BaseExpression):
            return None
        return self._batch_size_power(origin, depth + 1)

    def _first_of_shape(self, value: cst.BaseExpression, index) -> bool:
        """`x.shape[0]`, `x.size()[0]` of a batch tensor `x`."""
        if len(index) != 1 or not isinstance(index[0].slice, cst.Index) or _integral(index[0].slice.value) != 0:
            return False
        return self._shape_of_batch(value)

    def _shape_of_batch(self, node) -> bool:
        """`x.shape` / `x.size()` of a batch tensor `x`."""
        if type(node) is cst.Attribute and node.attr.value == "shape":
            return self.batch(node.value)
        if type(node) is cst.Call and type(node.func) is cst.Attribute and node.func.attr.value == "size":
            return not node.args and self.batch(node.func.value)
        return False

    def _scalar_factor(self, expr: cst.BaseExpression, terms: List[Term]) -> bool:
        """A name or attribute that is no loss (`beta`, `args.kl_weight`): a weight."""
        return isinstance(expr, (cst.Name, cst.Attribute)) and all(t.kind == UNKNOWN for t in terms)

    # -- names -------------------------------------------------------------------

    def _name(self, name: cst.Name, depth: int) -> List[Term]:
        binding = self._binding(name.value, name)
        if binding is None or id(binding) in self.seen:
            return [Term(UNKNOWN, name)]
        self.seen.add(id(binding))
        try:
            if isinstance(binding, cst.AugAssign):
                before = self._name_before(name.value, binding, depth)
                value = self.terms(binding.value, depth + 1)
                if isinstance(binding.operator, (cst.AddAssign, cst.SubtractAssign)):
                    return before + value
                if isinstance(binding.operator, cst.MultiplyAssign) and _constant(value):
                    return before
                if isinstance(binding.operator, cst.DivideAssign) and _constant(value):
                    return before
                return [Term(UNKNOWN, binding)]
            if binding.value is None:
                return [Term(UNKNOWN, name)]
            return self.terms(binding.value, depth + 1)
        finally:
            self.seen.discard(id(binding))

    def _name_before(self, name: str, at: cst.CSTNode, depth: int) -> List[Term]:
        binding = self._binding(name, at)
        if binding is None or isinstance(binding, cst.AugAssign) or binding.value is None:
            return [Term(UNKNOWN, at)]
        return self.terms(binding.value, depth + 1)

    def _binding(self, name: str, at: cst.CSTNode):
        """The latest `name = ...` / `name += ...` that ends before `at`, in the function
        of `at` (or, when the function neither binds it nor takes it, at module level)."""
        function = self.r.enclosing_function(at)
        here = self.r.order(at)
        found = self._latest(name, function, here)
        if found is None and function is not None and name not in parameter_names(function):
            found = self._latest(name, None, None)
        return found

    def _latest(self, name: str, function, before: Optional[int]):
        best, best_order = None, -1
        for kind in (cst.Assign, cst.AugAssign, cst.AnnAssign):
            for node in self.r.nodes(kind):
                if self.r.enclosing_function(node) is not function:
                    continue
                if before is not None and self.r.span(node)[1] >= before:
                    continue
                if kind is cst.Assign:
                    targets = [t.target for t in node.targets]
                    if not any(isinstance(t, cst.Name) and t.value == name for t in targets):
                        continue
                elif not (isinstance(node.target, cst.Name) and node.target.value == name):
                    continue
                order = self.r.order(node)
                if order > best_order:
                    best, best_order = node, order
        return best

    # -- calls -------------------------------------------------------------------

    def _call(self, call: cst.Call, depth: int) -> List[Term]:
        qnames = self.r.qnames(call)
        func = call.func
        if qnames & LOSS_FUNCTIONS:
            return [Term(_reduction(call), call)]
        if qnames & (SUMS | MEANS):
            positional = [a for a in call.args if a.keyword is None]
            if len(positional) != 1 or any(a.keyword is not None and a.keyword.value == "dim" for a in call.args):
                return [Term(NONE, call)]  # along a dimension: not a scalar
            kind = SUM if qnames & SUMS else MEAN
            return self._reduced(call, positional[0].value, kind, depth)
        if isinstance(func, cst.Attribute) and func.attr.value in ("sum", "mean"):
            if call.args and any(a.keyword is None or a.keyword.value == "dim" for a in call.args):
                return [Term(NONE, call)]
            return self._reduced(call, func.value, SUM if func.attr.value == "sum" else MEAN, depth)
        if isinstance(func, cst.Attribute) and func.attr.value in _MULTIPLIES | _DIVIDES | _NEGATES:
            scaled = self._scaled(call, func, depth)
            if scaled is not None:
                return scaled
        if isinstance(func, cst.Name):
            built = self._criterion(func, depth)
            if built is not None:
                return [Term(built, call)]
            if func.value in self.top_functions:
                return self._returned(self.top_functions[func.value], call, depth)
        forward = self._instance_forward(func)
        if forward is not None:
            method, resolver = forward
            return _Reader(resolver)._returned(method, call, depth + 1)
        return [Term(UNKNOWN, call)]

    def _instance_forward(self, func: cst.BaseExpression):
        """(forward, its module's resolver) of the class whose instance `func` holds, if read."""
        if self.facts is None:
            return None
        info = self.facts.instance_class(func)
        method = info.methods.get("forward") if info is not None else None
        return (method, info.namer.resolver) if method is not None else None

    def _scaled(self, call: cst.Call, func: cst.Attribute, depth: int) -> Optional[List[Term]]:
        """`x.mul_(-0.5)`, `x.div(2)`, `x.neg()`: a constant factor keeps the terms of `x`, as
        `-0.5 * x` does (a weight by name only for a product, as in _binary); else None."""
        if func.attr.value in _NEGATES:
            return self.terms(func.value, depth + 1) if not call.args else None
        if len(call.args) != 1 or call.args[0].keyword is not None or call.args[0].star:
            return None
        operand = call.args[0].value
        power = self._batch_size_power(operand, 0)
        if power:
            return self._shift(self.terms(func.value, depth + 1), power if func.attr.value in _DIVIDES else -power, call)
        factor = self.terms(operand, depth + 1)
        if _constant(factor) or (func.attr.value in _MULTIPLIES and self._scalar_factor(operand, factor)):
            return self.terms(func.value, depth + 1)
        return None

    def _reduced(self, call: cst.Call, operand: cst.BaseExpression, kind: str, depth: int) -> List[Term]:
        """`operand.sum()` / `torch.mean(operand)`: the reduction of `operand` over the batch,
        unless `operand` is already a reduced loss (then it keeps its kind)."""
        inner = self.terms(operand, depth + 1)
        if inner and all(t.kind in (SUM, MEAN, CONSTANT) for t in inner) and any(t.kind != CONSTANT for t in inner):
            return inner
        if kind == SUM and len(inner) == 1 and inner[0].kind == UNKNOWN and self._opaque_call(inner[0].node):
            # `criterion(out, y).sum()`: what it returns may be a mean already (a mean of one stays a mean)
            return [Term(UNKNOWN, call, unread_sum=True)]
        if self.r.qnames(operand) & STACKS or isinstance(operand, (cst.List, cst.Tuple)):
            return [Term(UNKNOWN, call)]  # a sum of losses held in a list: what each is, is not read
        if self._reads_weights(operand, operand, 0):
            return [Term(UNKNOWN, call)]  # over the model's weights (a regularizer), not over the batch
        return [Term(kind, call)]

    def _reads_weights(self, expr: cst.CSTNode, at: cst.CSTNode, depth: int) -> bool:
        """`expr` reads the model's weights: `.parameters(`, `.weight`, ... in its text or in the
        value of a name it reads (`w = model.fc.weight`; `(w @ w.T).sum()`)."""
        if any(read in code(expr) for read in _WEIGHT_READS):
            return True
        if depth > 3:
            return False
        for name in names_read(expr):
            binding = self._binding(name, at)
            value = getattr(binding, "value", None)
            if isinstance(binding, cst.Assign) and value is not None and self._reads_weights(value, binding, depth + 1):
                return True
        return False

    def _opaque_call(self, node: cst.CSTNode) -> bool:
        """A call of something that is not torch's nor a tensor's method: a model, a criterion
        object or function the analysis cannot read, a method of `self`."""
        if not isinstance(node, cst.Call) or any(q.startswith("torch.") for q in self.r.qnames(node)):
            return False
        func = node.func
        if isinstance(func, cst.Name):
            return True
        return isinstance(func, cst.Attribute) and code(func).split(".")[0] == "self"

    def _criterion(self, func: cst.Name, depth: int) -> Optional[str]:
        """The reduction of a criterion object: `criterion = nn.MSELoss(reduction="sum")`."""
        binding = self._binding(func.value, func)
        if not isinstance(binding, cst.Assign) or not isinstance(binding.value, cst.Call):
            return None
        if self.r.qnames(binding.value) & LOSS_CLASSES:
            return _reduction(binding.value)
        return None

    def _returned(self, function: cst.FunctionDef, call: cst.Call, depth: int) -> List[Term]:
        """The terms of what a function of the script returns (every return alike)."""
        if id(function) in self.seen:
            return [Term(UNKNOWN, call)]
        self.seen.add(id(function))
        try:
            returns = [
                r for r in self.r.descendants(function, cst.Return) if self.r.enclosing_function(r) is function
            ]
            if not returns or any(r.value is None for r in returns):
                return [Term(UNKNOWN, call)]
            found = [self.terms(r.value, depth + 1) for r in returns]
            kinds = {NONE if f and all(t.kind == NONE for t in f) else combine(f) for f in found}
            if len(kinds) != 1 or kinds == {UNKNOWN}:
                return [Term(UNKNOWN, call)]
            return [t for f in found for t in f]
        finally:
            self.seen.discard(id(function))


def _integral(expr) -> Optional[int]:
    """The value of an integer literal (`2`, or a float that is one: `2.`), else None."""
    if type(expr) is cst.Integer:
        return expr.evaluated_value
    if type(expr) is cst.Float and float(expr.evaluated_value).is_integer():
        return int(expr.evaluated_value)
    return None


def _constant(terms: List[Term]) -> bool:
    return bool(terms) and all(t.kind == CONSTANT for t in terms)


def _reduction(call: cst.Call) -> str:
    """The reduction a loss function call or criterion constructor asks for, by keyword
    (`reduction=`, the old `size_average=`/`reduce=`); the default is the mean."""
    kwargs = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    if "reduction" in kwargs:
        value = kwargs["reduction"]
        if not isinstance(value, cst.SimpleString):
            return UNKNOWN
        return {"sum": SUM, "mean": MEAN, "batchmean": MEAN, "none": NONE}.get(value.evaluated_value, UNKNOWN)
    reduce = kwargs.get("reduce")
    if reduce is not None:
        if not isinstance(reduce, cst.Name) or reduce.value not in ("True", "False"):
            return UNKNOWN
        if reduce.value == "False":
            return NONE
    size_average = kwargs.get("size_average")
    if size_average is not None:
        if isinstance(size_average, cst.Name) and size_average.value == "False":
            return SUM
        if isinstance(size_average, cst.Name) and size_average.value in ("True", "None"):
            return MEAN
        return UNKNOWN
    return MEAN
