"""FSD401 fsdp1-by-design."""
from __future__ import annotations

from . import Invalid, Rule, Valid
from .fsdp1_api import fsdp1_by_design, fsdp1_calls

_FSDP1 = "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"


class Fsdp1ByDesign(Rule):
    """Notes FSDP1's API where FSDP1 is the file's subject: its tests, a copy of torch's own code.

    ## What it does
    Off by default (select it with `--select FSD401` or `--extend-select FSD4`). Flags what
    FSD111 flags — constructing `FullyShardedDataParallel`, its class methods,
    `ShardedGradScaler` — in the files FSD111 leaves alone because FSDP1 is what they are
    about: a test module (`test_*.py`, `*_test.py`, `conftest.py`, a file under `tests/`)
    and a copy of torch's own `torch/distributed/...` code vendored into the project.

    ## Why is this bad?
    It is not, as such: a test of an FSDP1 code path must build FSDP1, and a vendored copy of
    torch's state-dict helpers is FSDP1's own code. The note lists what a migration to FSDP2
    will have to touch (or delete) there, without failing a pre-commit run on it.

    ## Example
    ```python
    # tests/test_fsdp1_checkpoint.py
    model = FSDP(model, use_orig_params=True)
    ```

    ## Use instead
    ```python
    # once the FSDP1 path is retired, test the FSDP2 one
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    ```

    ## Fix safety
    No automatic fix: `fsdp2-retrofit rewrite` migrates FSDP1 scripts.
    """

    CODE = "FSD401"
    NAME = "fsdp1-by-design"
    MESSAGE = "`{what}` is FSDP1 API in {why}; FSDP2 uses {instead} (a note: FSDP1 is this file's subject)"
    TRIGGERS = ("FullyShardedDataParallel", "ShardedGradScaler")
    NEEDS_SHARDING = False
    DEFAULT = False
    VALID = (
        Valid(_FSDP1 + "model = FSDP(model)\n"),  # a script: FSD111's error, not this note
        Valid("from torch.distributed.fsdp import fully_shard\nfully_shard(model)\n", path="tests/test_fsdp2.py"),
    )
    INVALID = (
        Invalid(_FSDP1 + "model = FSDP(model)\n", line=2, path="tests/test_fsdp1_path.py"),
        Invalid(_FSDP1 + "with FSDP.summon_full_params(model):\n    pass\n", line=2,
                path="third_party/torch/distributed/checkpoint/state_dict.py"),
    )

    def check(self, ctx):
        why = fsdp1_by_design(ctx.path)
        if why is None:
            return
        for call, found in fsdp1_calls(ctx):
            yield call, {**found, "why": why}, None
