"""FSD124 sampler-misuse."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.syntax.torch_api import DATALOADERS, DISTRIBUTED_SAMPLERS
from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nfrom torch.distributed.fsdp import fully_shard\nfrom torch.utils.data import DataLoader\n"
    "from torch.utils.data.distributed import DistributedSampler\nmodel = Net()\nfully_shard(model)\n"
)


class SamplerMisuse(Rule):
    """Checks for a DataLoader or DistributedSampler set up so that the data is not split between ranks.

    ## What it does
    In a script that shards a model, flags:
    - `DataLoader(..., sampler=..., shuffle=True)`: both a sampler and `shuffle=True`;
    - `DistributedSampler(..., num_replicas=1)` or `rank=` a number written in the
      call (`rank=0`): the same partition on every rank.

    ## Why is this bad?
    The DataLoader raises `ValueError: sampler option is mutually exclusive with
    shuffle` when it is built with both (the shuffling belongs to the sampler:
    `DistributedSampler(ds, shuffle=True)`). A DistributedSampler told it is one
    replica, or rank 0, hands every rank the same samples: the ranks train on the
    same batches, silently.

    ## Example
    ```python
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, shuffle=True)
    ```

    ## Use instead
    ```python
    sampler = DistributedSampler(dataset, shuffle=True)  # world size and rank from the process group
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    ```

    ## Fix safety
    No automatic fix: where the shuffle should go, and which rank a sampler serves,
    is the script's choice.
    """

    CODE = "FSD124"
    NAME = "sampler-misuse"
    MESSAGE = "{what}: {why}"
    TRIGGERS = ("sampler", "Sampler")
    VALID = (
        Valid(_HEAD + "sampler = DistributedSampler(ds, shuffle=True)\n"
              "loader = DataLoader(ds, batch_size=8, sampler=sampler, shuffle=False)\n"),
        Valid(_HEAD + "sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank)\n"),
        Valid("from torch.utils.data.distributed import DistributedSampler\n"
              "sampler = DistributedSampler(ds, num_replicas=1, rank=0)\n"),  # nothing sharded
    )
    INVALID = (
        Invalid(_HEAD + "sampler = DistributedSampler(ds)\nloader = DataLoader(ds, batch_size=8, sampler=sampler, "
                "shuffle=True)\n", line=8),
        Invalid(_HEAD + "sampler = DistributedSampler(ds, shuffle=True, num_replicas=1, rank=0)\n", line=7),
    )

    def check(self, ctx):
        if not ctx.shards.uses_fully_shard:
            return
        for call in ctx.nodes(cst.Call):
            names = ctx.resolver.qnames(call)
            kw = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
            if names & DATALOADERS:
                if ("sampler" in kw or "batch_sampler" in kw) and _is(kw.get("shuffle"), "True"):
                    yield call, {"what": "DataLoader with both a sampler and `shuffle=True`",
                                 "why": "ValueError when it is built (give the sampler shuffle=True instead)"}, None
            elif names & DISTRIBUTED_SAMPLERS:
                fixed = [k for k in ("num_replicas", "rank") if isinstance(kw.get(k), cst.Integer)]
                if _is(kw.get("num_replicas"), "1") or "rank" in fixed:
                    yield call, {"what": f"DistributedSampler with a constant {' and '.join(fixed)}",
                                 "why": "every rank reads the same partition of the data (leave them to the "
                                 "process group)"}, None


def _is(expr, value: str) -> bool:
    return isinstance(expr, (cst.Name, cst.Integer)) and expr.value == value
