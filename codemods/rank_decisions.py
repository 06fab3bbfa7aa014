"""rank_decisions: a condition that decides whether a collective runs must come out the same on
every rank. `if acc > best: save(...)` where `acc` is a figure of one rank's own part of the data
(its loss, a sum the rewrite does not combine over the ranks), an early-stopping `break` on a
rank's own loss: some ranks enter the DCP save, the forward or the next training step, the others
do not, and the run hangs. Refused at the condition's line (FSR640); a figure the rewrite combines
over the ranks (codemods/loop_sums.py) is the same on every rank and passes."""
from __future__ import annotations

from typing import Optional

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts, code
from fsdp2_retrofit.analysis.rank_uniform import RankLocal, RankUniform
from fsdp2_retrofit.analysis.random_forward import random_forward_argument, random_forward_flow
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.names import instance_attribute, walk
from fsdp2_retrofit.syntax.rank import is_rank_name, rank_zero_side
from fsdp2_retrofit.syntax.torch_api import TORCH_SAVE


_GENERATOR_NAMES = {"random": "Python's `random`", "numpy": "numpy's random generator",
                    "torch": "torch's default generator"}
_SEEDS = {"random": "`random.seed(0)`", "numpy": "`np.random.seed(0)`", "torch": "`torch.manual_seed(0)`"}


class CheckRankDecisionsCommand(RetrofitStage):
    DESCRIPTION = "Refuse a collective whose condition each rank decides from its own part of the data."
    CODE = "rank_decisions"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        drawn = random_forward_flow(facts)
        if drawn is not None:
            r, head = facts.resolver, _short(drawn.test).rstrip(":")
            self.refuse(
                "FSR641", drawn.test,
                f"the forward of {drawn.class_name} decides `{head}` from `{_short(drawn.draw)}` "
                f"(line {r.line(drawn.draw)}), a draw of {_GENERATOR_NAMES[drawn.generator]}, which the script does "
                "not seed with a value every rank shares",
                "after the retrofit each rank draws its own number and runs its own layers: the all-gathers and "
                "reduce-scatters of the sharded layers no longer pair up between the ranks (a size mismatch "
                "error on gloo, a hang on NCCL)",
                f"seed it the same on every rank before training ({_SEEDS[drawn.generator]}), or draw the number "
                "on rank 0 and broadcast it (dist.broadcast_object_list) before the forward",
            )
        handed = random_forward_argument(facts)
        if handed is not None:
            r, head = facts.resolver, _short(handed.test).rstrip(":")
            owner = facts.classes.get(handed.class_name)
            line = owner.namer.resolver.line(handed.branch) if owner is not None and owner.namer is not None else 0
            where = (f"{facts.classes.shown_file(owner.namespace)}:{line}" if owner is not None and owner.namespace
                     else f"line {line}")
            self.refuse(
                "FSR641", handed.test,
                f"`{head}` decides `{handed.name}` from `{_short(handed.draw)}`, a draw of "
                f"{_GENERATOR_NAMES[handed.generator]}, which the script does not seed with a value every rank shares; "
                f"`{_short(handed.call)}` (line {r.line(handed.call)}) hands it to the forward of "
                f"{handed.class_name.rsplit('.', 1)[-1]} as `{handed.param}`, which decides "
                f"`{_short(handed.branch).rstrip(':')}` ({where})",
                "after the retrofit each rank draws its own number and runs its own layers: the all-gathers and "
                "reduce-scatters of the sharded layers no longer pair up between the ranks (a size mismatch "
                "error on gloo, a hang on NCCL)",
                f"seed it the same on every rank before training ({_SEEDS[handed.generator]}), or draw the number "
                "on rank 0 and broadcast it (dist.broadcast_object_list) before the forward",
            )
        if facts.distributed_init is None:
            return
        r = facts.resolver
        uniform = RankUniform(r, {l.name for l in facts.loaders}, facts=facts)
        local = RankLocal(uniform, facts)
        refused = set()
        for site, what in _collectives(facts):
            stop = _loop_of(site, r) if type(site) is cst.Break else r.enclosing_function(site)
            child = site
            for parent in r.ancestors(site):
                if parent is stop or isinstance(parent, cst.FunctionDef):
                    break
                if type(parent) in (cst.If, cst.While) and child is not parent.test and id(parent) not in refused:
                    read = None if uniform.condition(parent.test, parent) else _local_read(parent.test, parent, local)
                    if read is not None:
                        name, source = read
                        refused.add(id(parent))
                        self.refuse(
                            "FSR640", parent,
                            f"`{_head(parent)}` decides whether {what} (line {r.line(site)}) runs, and `{name}` is "
                            f"each rank's own value (from its part of the data: `{_short(source)}`, line "
                            f"{r.line(source)})",
                            "after the retrofit each rank reads its own part of the split DataLoader and decides "
                            "for itself: the ranks that take the branch wait in the collective for the others, "
                            "which never come (a hang)",
                            "decide from a value every rank shares: average it over the ranks first "
                            "(dist.all_reduce, then divide by the world size), or broadcast rank 0's decision",
                        )
                child = parent
        self._rank_split_forwards(facts)

    def _rank_split_forwards(self, facts: ScriptFacts) -> None:
        """FSR646: a forward of the sharded model that each rank runs a number of times read from its
        rank (`if i % world_size != rank: continue`, `for i in range(rank, n, world_size)`)."""
        r = facts.resolver
        refused = set()
        for site, what in _collectives(facts):
            if type(site) is not cst.Call or "forward" not in what and "handed" not in what:
                continue
            found = rank_split_of(site, facts)
            if found is None or id(found) in refused:
                continue
            refused.add(id(found))
            self.refuse(
                "FSR646", found,
                f"`{_short(found).rstrip(':')}` decides from the rank how many times {what} (line {r.line(site)}) "
                "runs: each rank runs it for its own share, and where the world size does not divide the work "
                "the ranks run it a different number of times",
                "FSDP2 all-gathers the parameters in every forward, a collective each rank must join: the rank "
                "with one forward more waits in its all-gather for the others, which never come (a hang)",
                "give every rank the same number of forwards: pad each rank's share to ceil(n / world_size) items "
                "(repeat an item and drop its result), or let every rank run all of them",
            )


def rank_split_of(site: cst.CSTNode, facts: ScriptFacts) -> Optional[cst.CSTNode]:
    """The statement around `site` (in its function) that runs it a number of times each rank reads
    from its rank: an `if`/`while` whose test reads the rank (not a rank-0 test: rank_zero's), a
    `for` over an iterable that reads it (`range(rank, n, world_size)`), or an earlier
    `if <reads the rank>: continue` (or `break`, `return`) of a loop around it; None otherwise."""
    r = facts.resolver
    child = site
    for parent in r.ancestors(site):
        if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            break
        if type(parent) in (cst.If, cst.While) and child is not parent.test and _reads_rank(parent.test, facts) \
                and rank_zero_side(parent.test) is None:
            return parent
        if type(parent) is cst.For and child is parent.body and _reads_rank(parent.iter, facts) \
                and not _whole_rounds(parent.iter):
            return parent
        if type(parent) is cst.IndentedBlock and type(r.parent(parent)) in (cst.For, cst.While):
            here = next((i for i, stmt in enumerate(parent.body) if stmt is child), len(parent.body))
            for stmt in parent.body[:here]:
                if type(stmt) is cst.If and _reads_rank(stmt.test, facts) and any(
                        type(n) in (cst.Continue, cst.Break, cst.Return) for n in walk(stmt)):
                    return stmt
        child = parent
    return None


def _whole_rounds(iterable: cst.BaseExpression) -> bool:
    """`range(rank, n // world_size * world_size, world_size)`: every rank gets n // world_size items
    (the shape the data stage writes for hand-sliced batches)."""
    if type(iterable) is not cst.Call or type(iterable.func) is not cst.Name or iterable.func.value != "range" \
            or len(iterable.args) != 3:
        return False
    stop, step = iterable.args[1].value, code(iterable.args[2].value)
    return (type(stop) is cst.BinaryOperation and type(stop.operator) is cst.Multiply and code(stop.right) == step
            and type(stop.left) is cst.BinaryOperation and type(stop.left.operator) is cst.FloorDivide
            and code(stop.left.right) == step)


def _reads_rank(expr: cst.BaseExpression, facts: ScriptFacts) -> bool:
    """`expr` reads the rank: a name spelled as one (`rank`, `local_rank`, `dist.get_rank()`), or
    one whose value is (`int(os.environ.get("RANK", 0))`), followed by value."""
    for node in walk(expr):
        if type(node) in (cst.Name, cst.Attribute, cst.Call) and is_rank_name(node):
            return True
        if type(node) is cst.Name and any(isinstance(v, cst.BaseExpression) and is_rank_name(v)
                                          for v in facts.analysis.flow.values(node)):
            return True
    return False


def _collectives(facts: ScriptFacts):
    """(node, what) for the statements that are collectives after the retrofit: a save of model or
    optimizer state (a DCP save), a forward of a sharded model, a `break` out of a loop that runs
    the model (the ranks that stay run its next all-gather alone)."""
    r = facts.resolver
    for call in r.nodes(cst.Call):
        scope = r.enclosing_function(call)
        held = set(facts.model_names.get(scope, set())) | set(facts.optimizer_names.get(scope, {}))
        if r.is_call_to(call, TORCH_SAVE) and call.args and any(
                type(n) is cst.Name and n.value in held for n in walk(call.args[0].value)):
            yield call, "a checkpoint save (a DCP save after the retrofit, which every rank joins)"
        elif _forward(call, facts.model_names.get(scope, set())):
            handed = type(call.func) is cst.Name and call.func.value not in facts.model_names.get(scope, set())
            yield call, (f"a call handed the sharded model (`{_short(call)}`: its forward or state, collectives)"
                         if handed else f"a forward of the sharded model (`{_short(call)}`)")
    for brk in r.nodes(cst.Break):
        loop = _loop_of(brk, r)
        if loop is not None and any(_forward(c, facts.model_names.get(r.enclosing_function(c), set()))
                                    for c in r.descendants(loop, cst.Call)):
            yield brk, f"the `break` out of the loop at line {r.line(loop)} (the model's collectives)"


def _local_read(test, at, local: RankLocal):
    """(the name, where its rank's own value comes from) of the first name of `test` that holds one."""
    for node in walk(test):
        if type(node) is cst.Name:
            source = local.source(node, at)
            if source is not None:
                return node.value, source
    return None


def _forward(call: cst.Call, models) -> bool:
    """`model(x)`, `self.model(x)` in a trainer's method, `evaluate(model, ...)`: runs the sharded model
    (its all-gathers)."""
    if type(call.func) is cst.Name and call.func.value in models:
        return True
    if instance_attribute(call.func) in models:
        return True
    return type(call.func) is cst.Name and any(type(a.value) is cst.Name and a.value.value in models
                                               for a in call.args)


def _loop_of(node, r) -> Optional[cst.CSTNode]:
    for a in r.ancestors(node):
        if type(a) in (cst.For, cst.While):
            return a
        if isinstance(a, cst.FunctionDef):
            return None
    return None


def _head(stmt) -> str:
    return f"{'if' if type(stmt) is cst.If else 'while'} {code(stmt.test)}"


def _short(node) -> str:
    if type(node) is cst.For:
        return f"for {code(node.target)} in {code(node.iter)}"
    text = code(node).strip().splitlines()[0]
    return text if len(text) <= 80 else text[:77] + "..."
