"""FSD111 fsdp1-api."""
from __future__ import annotations

import os
from pathlib import PurePath
from typing import Optional

import libcst as cst

from fsdp2_retrofit.syntax.names import walk
from fsdp2_retrofit.syntax.torch_api import FSDP1_CLASSES, SHARDED_GRAD_SCALER as SCALER
from . import Invalid, Rule, Valid


class Fsdp1Api(Rule):
    """Checks for the FSDP1 API: `FullyShardedDataParallel`, its `state_dict_type`, `ShardedGradScaler`.

    ## What it does
    Flags constructing `FullyShardedDataParallel` (FSDP1), calling its class methods
    (`FSDP.state_dict_type(...)`, `FSDP.summon_full_params(...)`,
    `FSDP.optim_state_dict(...)`, ...) and constructing `ShardedGradScaler`.

    Only where FSDP1 is the only path: a module that also shards with `fully_shard`
    (itself or through a project function) or names FSDP2's API (`FSDPModule`,
    `MixedPrecisionPolicy`, also re-exported by a project module) supports both on
    purpose, and there only FSDP1 calls handed a module this file shards with
    `fully_shard` are flagged (`FSDP.state_dict_type(model, ...)` after
    `fully_shard(model)`: a half-done migration), FSDP1 calls that run together with a
    `fully_shard` call (one function, neither under an `if` or `try`: FSDP1 is then no
    alternative, it is used beside FSDP2), and `ShardedGradScaler` where the
    file shards with `fully_shard` and wraps nothing with FSDP1. An FSDP1 call inside the body of an
    `if` whose test asks whether the module is an FSDP1 one (`isinstance(m, FSDP)`, or
    a function of the script or the project that does: `fsdp_version(m) == 1`) is
    never flagged. Nor is a file whose subject FSDP1 is (a test module, a copy of torch's own
    `torch/distributed` code): FSD401, off by default, notes those. (The rule stays on by default rather than opt-in: an FSDP1-only or
    half-migrated script is what `rewrite` migrates, and code that keeps FSDP1 beside
    FSDP2 on purpose is left alone by the conditions above.)

    ## Why is this bad?
    FSDP1 flattens parameters into one FlatParameter per unit, which breaks per-parameter
    optimizers, freezing and state-dict handling; PyTorch develops FSDP2 (`fully_shard`,
    DTensor per parameter) instead. FSDP1 has no CPU/gloo path either, so its scripts
    cannot be tested without GPUs.

    ## Example
    ```python
    model = FSDP(model, auto_wrap_policy=policy, use_orig_params=True)
    ```

    ## Use instead
    ```python
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    ```

    ## Fix safety
    No automatic fix here; `fsdp2-retrofit rewrite` migrates FSDP1 scripts.
    """

    CODE = "FSD111"
    NAME = "fsdp1-api"
    MESSAGE = "`{what}` is FSDP1 API; FSDP2 uses {instead}"
    TRIGGERS = ("FullyShardedDataParallel", "ShardedGradScaler")
    NEEDS_SHARDING = False
    VALID = (
        Valid("from torch.distributed.fsdp import fully_shard\nfully_shard(model)\n"),
        Valid("from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"),  # unused import
        Valid("scaler = torch.amp.GradScaler('cuda')\n"),
        Valid(  # FSDP1 beside FSDP2: the compatibility path is not flagged
            "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard\n"
            "if args.fsdp_version == 1:\n    model = FSDP(model)\nelse:\n    fully_shard(model)\n"
        ),
        Valid(  # FSDP1's own branch, found by a test of the module's class
            "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
            "def full_params(module):\n    if isinstance(module, FSDP):\n"
            "        with FSDP.summon_full_params(module):\n            return module.state_dict()\n"
            "    return module.state_dict()\n"
        ),
    )
    INVALID = (
        Invalid("from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\nmodel = FSDP(model)\n", line=2),
        Invalid(
            "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType\n"
            "with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):\n    sd = model.state_dict()\n",
            line=2,
        ),
        Invalid("from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
                "scaler = ShardedGradScaler()\n", line=2),
        Invalid(  # FSDP1's API on a module fully_shard shards: a half-done migration
            "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, fully_shard\n"
            "fully_shard(model)\n"
            "with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):\n    sd = model.state_dict()\n",
            line=3,
        ),
    )

    def check(self, ctx):
        if fsdp1_by_design(ctx.path) is not None:
            return  # FSDP1 is the file's subject: FSD401's note (off by default), not an error
        r = ctx.resolver
        fsdp2 = _fsdp2_path(ctx)
        for call, found in fsdp1_calls(ctx):
            if _fsdp1_branch(ctx, call):
                continue  # `if isinstance(m, FSDP): FSDP.summon_full_params(m)`: FSDP1's own path
            if fsdp2 and r.qnames(call) & SCALER and _fully_shard_only(ctx):
                pass  # the scaler of a script that shards with fully_shard alone
            elif fsdp2 and not _on_fully_sharded(ctx, call) and not _beside_fully_shard(ctx, call):
                continue  # FSDP1 beside FSDP2 (a compatibility path), not on a module fully_shard shards
            yield call, found, None


_TEST_DIRS = frozenset({"test", "tests", "testing"})


def fsdp1_by_design(path: Optional[str]) -> Optional[str]:
    """Why FSDP1 is the deliberate subject of the file at `path`, or None: a test module (pytest's
    discovery: `test_*.py`, `*_test.py`, `conftest.py`, or under a `tests/` folder: a test of an
    FSDP1 path keeps FSDP1 on purpose), or a copy of torch's own code (`.../torch/distributed/...`
    vendored into a project: torch's FSDP1 state-dict helpers are FSDP1 by definition)."""
    if not path or path == "-":
        return None
    parts = PurePath(os.path.normpath(path)).parts
    name = parts[-1] if parts else ""
    if name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py" \
            or any(p in _TEST_DIRS for p in parts[:-1]):
        return "a test module"
    if any(a == "torch" and b == "distributed" for a, b in zip(parts, parts[1:])):
        return "a copy of torch's own torch.distributed code"
    return None


def fsdp1_calls(ctx):
    """(call, message fields) of every call of FSDP1's API in the module: constructing
    FullyShardedDataParallel or ShardedGradScaler, a class method of FSDP1's class."""
    r = ctx.resolver
    for call in ctx.nodes(cst.Call):
            names = r.qnames(call)
            if names & FSDP1_CLASSES:
                found = {"what": "FullyShardedDataParallel(...)", "instead": "`fully_shard` of the blocks, then the root"}
            elif names & SCALER:
                found = {"what": "ShardedGradScaler(...)", "instead": "`torch.amp.GradScaler`"}
            elif any(n.rsplit(".", 1)[0] in FSDP1_CLASSES for n in names):
                method = sorted(names)[0].rsplit(".", 1)[-1]
                instead = (
                    "`get_model_state_dict`/`get_optimizer_state_dict` with `StateDictOptions`"
                    if "state_dict" in method or "optim" in method
                    else "`torch.nn.utils.clip_grad_norm_`" if method == "clip_grad_norm_"
                    else "`unshard()`/`reshard()` or `full_tensor()` on the parameters" if method == "summon_full_params"
                    else "the `fully_shard` API"
                )
                found = {"what": f"FullyShardedDataParallel.{method}(...)", "instead": instead}
            else:
                continue
            yield call, found


# FSDP2's own names: a module that uses one has an FSDP2 path beside any FSDP1 one
_FSDP2_NAMES = frozenset({
    "fully_shard", "FSDPModule", "register_fsdp_forward_method", "MixedPrecisionPolicy", "CPUOffloadPolicy",
    "OffloadPolicy", "UnshardHandle",
})


def _fsdp2_path(ctx) -> bool:
    """The module shards with `fully_shard` (itself or through a project function that does) or
    names FSDP2's API (`isinstance(m, FSDPModule)`, `MixedPrecisionPolicy`), imported from torch
    or from a project module that re-exports it (`from utils.fsdp import FSDPModule`)."""
    if ctx.shards.uses_fully_shard:
        return True
    for node in ctx.nodes(cst.Name) + ctx.nodes(cst.Attribute):
        if any("." in q and q.rsplit(".", 1)[-1] in _FSDP2_NAMES for q in ctx.resolver.qnames(node)):
            return True
    return False


def _fully_shard_only(ctx) -> bool:
    """The module itself calls fully_shard (or a project function that does) and wraps nothing
    with FSDP1: no FSDP1 path its ShardedGradScaler could be for."""
    sites = [s for s in ctx.shards.sites if isinstance(s.call, cst.Call)]
    return any(not s.legacy for s in sites) and not any(s.legacy for s in sites)


def _beside_fully_shard(ctx, call: cst.Call) -> bool:
    """The FSDP1 call and a `fully_shard` call run together, not as alternatives: both in one
    function (or both at module level), neither under an `if`, a conditional expression or a
    `try` there (`teacher = FSDP(teacher)` beside `fully_shard(model)`)."""
    fn = ctx.shards.scope_of(call)
    if _conditional(ctx, call):
        return False
    return any(
        not s.legacy and isinstance(s.call, cst.Call) and ctx.shards.scope_of(s.call) is fn
        and not _conditional(ctx, s.call)
        for s in ctx.shards.sites
    )


def _conditional(ctx, node) -> bool:
    for above in ctx.resolver.ancestors(node):
        if isinstance(above, (cst.FunctionDef, cst.ClassDef, cst.Module)):
            return False
        if isinstance(above, (cst.If, cst.IfExp, cst.Try, cst.Match)):
            return True
    return False


def _on_fully_sharded(ctx, call: cst.Call) -> bool:
    """The FSDP1 call is handed a module that `fully_shard` shards at that point: FSDP1's API on
    an FSDP2 module (`FSDP.state_dict_type(model, ...)` after `fully_shard(model)`)."""
    shards = ctx.shards
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value not in ("module", "model"):
            continue
        root = shards.sharded_module(arg.value, call)
        # sharded by a call this module makes (not handed in by another module's call: a helper
        # taking a module of either kind is the compatibility code this rule leaves alone)
        if root is not None and any(not s.legacy and isinstance(s.call, cst.Call) for s in shards.sites_for(root, call)):
            return True
        if arg.keyword is None:
            break  # the module is the first positional argument
    return False


def _fsdp1_branch(ctx, call: cst.Call) -> bool:
    """The call runs only where a test found an FSDP1 module: inside the body of an `if` (or
    the true side of `a if test else b`) whose test is `isinstance(x, FullyShardedDataParallel)`."""
    r = ctx.resolver
    child = call
    for node in r.ancestors(call):
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return False
        if isinstance(node, cst.If) and child is node.body and _tests_fsdp1(ctx, node.test):
            return True
        if isinstance(node, cst.IfExp) and child is node.body and _tests_fsdp1(ctx, node.test):
            return True
        child = node
    return False


def _tests_fsdp1(ctx, test) -> bool:
    """The test asks whether a module is an FSDP1 one: `isinstance(x, FSDP)`, or a call of a
    function of the script or of a project module whose body asks it (`fsdp_version(m) == 1`)."""
    if _asks_isinstance_fsdp1(ctx.resolver, test):
        return True
    for node in walk(test):
        if isinstance(node, cst.Call):
            for fn, resolver in _functions(ctx, node):
                if _asks_isinstance_fsdp1(resolver, fn):
                    return True
    return False


def _asks_isinstance_fsdp1(resolver, tree) -> bool:
    for node in walk(tree):
        if (isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "isinstance"
                and len(node.args) == 2):
            classes = node.args[1].value
            parts = [e.value for e in classes.elements] if isinstance(classes, cst.Tuple) else [classes]
            if any(resolver.qnames(p) & FSDP1_CLASSES for p in parts):
                return True
    return False


def _functions(ctx, call: cst.Call):
    """(def, the resolver of its file) of the function a call names: a top-level def of the
    script, or of a project module (read through its imports, never imported)."""
    if isinstance(call.func, cst.Name):
        for stmt in ctx.module.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == call.func.value:
                yield stmt, ctx.resolver
                return
    names = ctx.resolver.qnames(call)
    if not any("." in q and not q.startswith(("torch.", "builtins.")) for q in names):
        return
    from fsdp2_retrofit.analysis.module_values import ModuleValues

    values = ModuleValues(ctx.classes())
    for q in sorted(names):
        bound = values.bound(q)
        if bound is not None and bound.function is not None and bound.namer is not None:
            yield bound.function, bound.namer.resolver
