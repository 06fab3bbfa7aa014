"""A forward of the sharded model whose control flow each process draws for itself.

`for _ in range(random.randint(0, 3)): h = self.middle(h)` in the model's forward: every
process draws its own depth from its own random stream (Python's `random` is seeded from
the operating system when the script does not seed it). After the retrofit the ranks run
different numbers of layers, so the all-gathers and reduce-scatters fully_shard issues per
layer no longer pair up between the ranks: a size mismatch error (gloo) or a hang (NCCL).

Found: a loop (`for` over, `while` test) or an `if` / conditional expression test in the
`forward` of a model an optimizer trains (its class and the classes of the submodules it
holds, in this file) that reads a random draw: a call of `random.*`, `numpy.random.*` or
torch's random functions, directly or through a name the forward binds from one. Not
found when that generator is seeded in the script, each time with a value every rank
shares (`random.seed(0)`, `np.random.seed(args.seed)`): every rank then draws the same
numbers in the same order. torch's default generator starts from the same fixed seed in
every process, so an unseeded torch draw is alike on every rank; it is found only where the
script seeds it with a value that is not (`torch.manual_seed(rank)`). A seed call with no
argument, or one that reads a rank or the clock, is not the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Set

import libcst as cst

from .rank_uniform import RankUniform
from fsdp2_retrofit.syntax.names import bind_args, walk

# generator -> (qualified-name prefixes of its draws, its seeding calls)
_GENERATORS = {
    "random": (("random.",), {"random.seed"}),
    "numpy": (("numpy.random.",), {"numpy.random.seed"}),
    "torch": (
        ("torch.rand", "torch.randint", "torch.randn", "torch.randperm", "torch.bernoulli", "torch.multinomial",
         "torch.normal", "torch.poisson"),
        {"torch.manual_seed", "torch.random.manual_seed"},
    ),
}
_NOT_DRAWS = {"random.seed", "random.getstate", "random.setstate", "numpy.random.seed", "numpy.random.get_state",
              "numpy.random.set_state", "numpy.random.default_rng", "numpy.random.RandomState"}


@dataclass(frozen=True)
class RandomForward:
    test: cst.CSTNode  # the loop or `if` whose control flow reads the draw
    draw: cst.Call  # the random call
    class_name: str
    generator: str  # "random", "numpy", "torch"


def random_forward_flow(facts) -> Optional[RandomForward]:
    """The first control flow of a trained model's forward decided by an unseeded random draw."""
    r = facts.resolver
    own = {id(node): node for node in r.nodes(cst.ClassDef)}
    seeded = _seeded(facts)
    for name in _model_classes(facts):
        info = facts.classes.get(name)
        if info is None or id(info.node) not in own:
            continue
        forward = next(
            (s for s in info.node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "forward"), None
        )
        if forward is None:
            continue
        found = _in_forward(forward, r, seeded)
        if found is not None:
            test, draw, generator = found
            return RandomForward(test, draw, name, generator)
    return None


def _model_classes(facts) -> List[str]:
    """The global names of the trained models' classes and of the submodules they hold."""
    out: List[str] = []
    todo = [name for m in facts.models if m.class_name for name in [m.class_name]]
    while todo:
        name = todo.pop(0)
        info = facts.classes.get(name)
        if name in out or info is None:
            continue
        out.append(name)
        todo.extend(info.submodules.values())
    return out


def _generator(call: cst.Call, r) -> Optional[str]:
    """"random", "numpy" or "torch" when `call` draws from that generator."""
    for q in r.qnames(call) - _NOT_DRAWS:
        for generator, (draws, _) in _GENERATORS.items():
            # `random.randint`, `numpy.random.rand`; `torch.rand` and `torch.rand_like`
            if any(q.startswith(d) if d.endswith(".") else q in (d, d + "_like") for d in draws):
                return generator
    return None


def _seeded(facts) -> Set[str]:
    """The generators every rank draws alike: seeded in the script, each time with a value every
    rank shares. torch's, also when the script never seeds it: it starts from a fixed seed in
    every process (Python's `random` and numpy's start from the operating system's entropy)."""
    r = facts.resolver
    uniform = RankUniform(r, facts=facts)
    alike, apart = {"torch"}, set()
    for call in r.nodes(cst.Call):
        for generator, (_, seeds) in _GENERATORS.items():
            if not r.qnames(call) & seeds:
                continue
            if call.args and all(uniform.condition(a.value, call) for a in call.args):
                alike.add(generator)
            else:
                apart.add(generator)
    return alike - apart


def _in_forward(forward: cst.FunctionDef, r, seeded: Set[str]):
    """(test, draw, generator) of the first control flow of `forward` that reads an unseeded draw."""
    drawn: Dict[str, tuple] = {}  # name bound in the forward -> (draw, generator)

    def draw_in(expr):
        for node in walk(expr):
            if type(node) is cst.Call:
                generator = _generator(node, r)
                if generator is not None and generator not in seeded:
                    return node, generator
            elif type(node) is cst.Name and node.value in drawn:
                return drawn[node.value]
        return None

    for node in walk(forward.body):
        if type(node) is cst.Assign:
            found = draw_in(node.value)
            if found is not None:
                for target in node.targets:
                    for name in walk(target.target):
                        if type(name) is cst.Name:
                            drawn[name.value] = found
        tested = None
        if type(node) is cst.For:
            tested = node.iter
        elif type(node) in (cst.While, cst.If, cst.IfExp):
            tested = node.test
        if tested is not None:
            found = draw_in(tested)
            if found is not None:
                return (node, *found)
    return None


@dataclass(frozen=True)
class RandomArgument:
    """`if np.random.random() < 0.1: labels = None` before `model(x, t, labels)`, where the
    forward branches on that parameter (`if y is not None: t += self.label_emb(y)`): each rank
    draws for itself whether its forward runs the layer."""

    test: cst.CSTNode  # the `if` whose test reads the draw
    draw: cst.Call
    name: str  # the name the branch binds and the model call hands the forward
    call: cst.Call  # the model call
    class_name: str
    param: str  # the forward's parameter it becomes
    branch: cst.CSTNode  # the forward's control flow that reads the parameter (a node of its class's file)
    generator: str


def random_forward_argument(facts) -> Optional[RandomArgument]:
    """The first call of a trained model whose argument a branch on an unseeded random draw
    binds, where the model's forward decides its control flow from that parameter."""
    r = facts.resolver
    seeded = _seeded(facts)
    for model in facts.models:
        info = facts.classes.get(model.class_name) if model.class_name else None
        forward = info.methods.get("forward") if info is not None else None
        if forward is None:
            continue
        params = [p.name.value for p in forward.params.params][1:]
        branched = _branched_params(forward, set(params))
        if not branched:
            continue
        for function, names in model.names.items():
            scope = function.body if function is not None else r.module
            for call in walk(scope):
                if type(call) is not cst.Call or type(call.func) is not cst.Name or call.func.value not in names:
                    continue
                if r.enclosing_function(call) is not function:
                    continue
                for param, value in bind_args(forward, call, skip=1):
                    if type(value) is not cst.Name or param not in branched:
                        continue
                    found = _drawn_branch_binding(scope, value.value, function, r, seeded)
                    if found is not None:
                        test, draw, generator = found
                        return RandomArgument(test, draw, value.value, call, model.class_name, param,
                                              branched[param], generator)
    return None


def _branched_params(forward: cst.FunctionDef, params: Set[str]) -> Dict[str, cst.CSTNode]:
    """The forward's parameters an `if`, `while` or conditional expression tests (`if y is not None`)."""
    out: Dict[str, cst.CSTNode] = {}
    for node in walk(forward.body):
        if type(node) in (cst.If, cst.While, cst.IfExp):
            for name in walk(node.test):
                if type(name) is cst.Name and name.value in params and name.value not in out:
                    out[name.value] = node
    return out


def _drawn_branch_binding(scope, name: str, function, r, seeded: Set[str]):
    """(test, draw, generator) of an `if` in `scope` whose test reads an unseeded draw and whose
    branches bind `name`."""
    for node in walk(scope):
        if type(node) is not cst.If or r.enclosing_function(node) is not function:
            continue
        draw = next((c for c in walk(node.test) if type(c) is cst.Call and _generator(c, r) is not None
                     and _generator(c, r) not in seeded), None)
        if draw is None:
            continue
        bound = [t for s in walk(node.body) if type(s) is cst.Assign for t in s.targets
                 if type(t.target) is cst.Name and t.target.value == name]
        if bound:
            return node, draw, _generator(draw, r)
    return None
