"""FSD116 rank-zero-name."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis.rank_bindings import rank_zero_only_bindings
from fsdp2_retrofit.syntax.names import names_in, parameter_names
from fsdp2_retrofit.syntax.rank import TEXT_TRIGGERS as RANK_TEXT
from fsdp2_retrofit.syntax.torch_api import COLLECTIVES, DCP_CALLS, STATE_DICT_SETTERS, TORCH_SAVE
from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nimport torch.distributed as dist\nimport torch.distributed.checkpoint as dcp\n"
    "from torch.distributed.fsdp import fully_shard\nmodel = Net()\nfully_shard(model)\nrank = dist.get_rank()\n"
)
_EVERY_RANK = COLLECTIVES | DCP_CALLS | STATE_DICT_SETTERS | TORCH_SAVE


class RankZeroName(Rule):
    """Checks for a name bound only on rank 0 used by a collective or a save every rank runs.

    ## What it does
    Flags a collective (`torch.distributed` collectives, `dcp.save` / `dcp.load`,
    `set_*_state_dict`) or a `torch.save` outside any rank-0 branch whose arguments
    read a name that the function binds only inside rank-0 branches (`if rank == 0:
    x = ...`, with no binding of `x` on the other ranks: no `else`, no earlier
    `x = None`). Nested functions reading such a name from the function around
    them are checked too.

    ## Why is this bad?
    On every rank but 0 the name was never bound: those ranks fail with `NameError`
    (or `UnboundLocalError`) at the call, while rank 0 enters the collective and waits
    for ranks that are gone (a hang until the timeout).

    ## Example
    ```python
    if rank == 0:
        objs = [load_config()]
    dist.broadcast_object_list(objs, src=0)
    ```

    ## Use instead
    ```python
    objs = [load_config() if rank == 0 else None]
    dist.broadcast_object_list(objs, src=0)
    ```

    ## Fix safety
    No automatic fix: what the other ranks should hold (a placeholder, the received
    value) is the user's choice.
    """

    CODE = "FSD116"
    NAME = "rank-zero-name"
    MESSAGE = (
        "`{name}` is bound only on rank 0 (line {line}) but `{func}` runs on every rank: the other ranks "
        "fail with NameError while rank 0 waits"
    )
    TRIGGERS = RANK_TEXT
    VALID = (
        Valid(_HEAD + "objs = [None]\nif rank == 0:\n    objs = [cfg]\ndist.broadcast_object_list(objs, src=0)\n"),
        Valid(_HEAD + "if rank == 0:\n    objs = [cfg]\nelse:\n    objs = [None]\n"
              "dist.broadcast_object_list(objs, src=0)\n"),
        Valid(_HEAD + "if rank == 0:\n    path = 'model.pt'\n    torch.save(state, path)\n"),  # used inside the gate
        Valid("import torch\nimport torch.distributed as dist\nif dist.get_rank() == 0:\n    t = x\n"
              "dist.broadcast(t, src=0)\n"),  # not sharded
    )
    INVALID = (
        Invalid(_HEAD + "if rank == 0:\n    objs = [cfg]\ndist.broadcast_object_list(objs, src=0)\n", line=10),
        Invalid(_HEAD + "if rank == 0:\n    ckpt_dir = make_dir()\ndcp.save(state, checkpoint_id=ckpt_dir)\n", line=10),
        Invalid(  # a nested function reading the name from the function around it
            "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\ndef main(model):\n"
            "    fully_shard(model)\n    if dist.get_rank() == 0:\n        stats = compute()\n"
            "    def sync():\n        dist.all_reduce(stats)\n    sync()\n",
            line=8,
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        if not shards.uses_fully_shard:
            return
        gated = rank_zero_only_bindings(ctx.resolver, shards.rank_zero_branch)
        if not gated:
            return
        for call in ctx.nodes(cst.Call):
            if not ctx.resolver.qnames(call) & _EVERY_RANK or shards.rank_zero_branch(call) is not None:
                continue
            for name in sorted(set().union(*(names_in(a.value) for a in call.args)) if call.args else ()):
                found = self._gated(ctx, gated, name, call)
                if found is not None:
                    yield call, {"name": name, "line": str(ctx.resolver.line(found)), "func": _code(call.func)}, None
                    break

    def _gated(self, ctx, gated, name, at):
        """The rank-0-only binding of `name` that `at` reads, climbing out of nested
        functions that do not bind it themselves."""
        anchor = at
        while True:
            scope = ctx.resolver.enclosing_function(anchor)
            found = gated.get(scope, {}).get(name)
            if found is not None:
                binding, _ = found
                return binding if ctx.resolver.order(binding) < ctx.resolver.order(at) else None
            if scope is None or name in parameter_names(scope) or _binds(ctx, scope, name):
                return None
            anchor = scope


def _binds(ctx, scope, name) -> bool:
    """`scope` binds `name` itself (anywhere: then it is its own local)."""
    from fsdp2_retrofit.analysis.rank_bindings import binding_targets

    cache = ctx.__dict__.setdefault("_fsd116_binds", {})
    if not cache:
        for node, bound in binding_targets(ctx.resolver):
            cache.setdefault(ctx.resolver.enclosing_function(node), set()).add(bound)
    return name in cache.get(scope, set())


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
