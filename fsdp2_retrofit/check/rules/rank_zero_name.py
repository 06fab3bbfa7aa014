"""FSD116 rank-zero-name."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis.rank_bindings import rank_zero_only_bindings, rank_zero_reads
from fsdp2_retrofit.syntax.names import code, names_read
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
    `x = None`), directly or through values every rank computes from it (`path =
    f"{x}/model.pt"`, an argument of a function of the script). Nested functions
    reading such a name from the function around them are checked too.

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
        "`{func}` runs on every rank but reads {how}: the other ranks fail with NameError while rank 0 waits"
    )
    TRIGGERS = RANK_TEXT
    VALID = (
        Valid(_HEAD + "objs = [None]\nif rank == 0:\n    objs = [cfg]\ndist.broadcast_object_list(objs, src=0)\n"),
        Valid(_HEAD + "if rank == 0:\n    objs = [cfg]\nelse:\n    objs = [None]\n"
              "dist.broadcast_object_list(objs, src=0)\n"),
        Valid(_HEAD + "if rank == 0:\n    path = 'model.pt'\n    torch.save(state, path)\n"),  # used inside the gate
        Valid(_HEAD + "run_dir = None\nif rank == 0:\n    run_dir = make_dir()\npath = f'{run_dir}/m'\n"
              "dcp.save(state, checkpoint_id=path)\n"),  # bound on every rank first: the value exists everywhere
        Valid("import torch\nimport torch.distributed as dist\nif dist.get_rank() == 0:\n    t = x\n"
              "dist.broadcast(t, src=0)\n"),  # not sharded
    )
    INVALID = (
        Invalid(_HEAD + "if rank == 0:\n    objs = [cfg]\ndist.broadcast_object_list(objs, src=0)\n", line=10),
        Invalid(_HEAD + "if rank == 0:\n    ckpt_dir = make_dir()\ndcp.save(state, checkpoint_id=ckpt_dir)\n", line=10),
        Invalid(_HEAD + "if rank == 0:\n    out_dir = make_dir()\npath = f'{out_dir}/model'\np2 = path\n"
                "dcp.save(state, checkpoint_id=p2)\n", line=12),  # through values computed from it
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
        r = ctx.resolver
        gated = rank_zero_only_bindings(r, shards.rank_zero_branch)
        if not gated:
            return

        def only_on_rank_zero(scope, name, at):
            found = gated.get(scope, {}).get(name)
            return found if found is not None and r.order(found[0]) < r.order(at) else None

        def everywhere(stmt) -> bool:
            return shards.rank_zero_branch(stmt) is None

        for call in ctx.nodes(cst.Call):
            if not r.qnames(call) & _EVERY_RANK or shards.rank_zero_branch(call) is not None or not call.args:
                continue
            names = set().union(*(names_read(a.value) for a in call.args))
            reads = rank_zero_reads(r, call, names, only_on_rank_zero, everywhere)
            if reads:
                yield call, {"how": reads[0].describe(r.line), "func": code(call.func)}, None
