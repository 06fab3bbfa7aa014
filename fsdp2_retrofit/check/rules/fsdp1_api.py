"""FSD111 fsdp1-api."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.syntax.torch_api import FSDP1_CLASSES, SHARDED_GRAD_SCALER as SCALER
from . import Invalid, Rule, Valid


class Fsdp1Api(Rule):
    """Checks for the FSDP1 API: `FullyShardedDataParallel`, its `state_dict_type`, `ShardedGradScaler`.

    ## What it does
    Flags constructing `FullyShardedDataParallel` (FSDP1), calling its class methods
    (`FSDP.state_dict_type(...)`, `FSDP.summon_full_params(...)`,
    `FSDP.optim_state_dict(...)`, ...) and constructing `ShardedGradScaler`.

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
    )

    def check(self, ctx):
        r = ctx.resolver
        for call in ctx.nodes(cst.Call):
            names = r.qnames(call)
            if names & FSDP1_CLASSES:
                yield call, {"what": "FullyShardedDataParallel(...)", "instead": "`fully_shard` of the blocks, then the root"}, None
            elif names & SCALER:
                yield call, {"what": "ShardedGradScaler(...)", "instead": "`torch.amp.GradScaler`"}, None
            elif any(n.rsplit(".", 1)[0] in FSDP1_CLASSES for n in names):
                method = sorted(names)[0].rsplit(".", 1)[-1]
                instead = (
                    "`get_model_state_dict`/`get_optimizer_state_dict` with `StateDictOptions`"
                    if "state_dict" in method or "optim" in method
                    else "`torch.nn.utils.clip_grad_norm_`" if method == "clip_grad_norm_"
                    else "`unshard()`/`reshard()` or `full_tensor()` on the parameters" if method == "summon_full_params"
                    else "the `fully_shard` API"
                )
                yield call, {"what": f"FullyShardedDataParallel.{method}(...)", "instead": instead}, None
