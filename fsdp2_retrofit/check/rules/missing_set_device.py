"""FSD106 missing-set-device."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.syntax.torch_api import DEVICE_SELECTORS as SET_DEVICE, INIT_PROCESS_GROUP as INIT
from . import Edit, Fix, Invalid, Rule, Valid

_HEAD = "import os\nimport torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"


class MissingSetDevice(Rule):
    """Checks for `init_process_group` with no `set_device(LOCAL_RANK)` before it.

    ## What it does
    In a script that shards with `fully_shard`, flags `dist.init_process_group(...)`
    when no `torch.cuda.set_device(...)` (or `torch.accelerator.set_device_index`)
    runs before it in the same function and the call passes no `device_id=`. A
    `set_device` of a constant (`set_device(0)`, `set_device("cuda:0")`) does not
    count: it picks the same GPU on every rank. A
    `"gloo"` backend (CPU only) is never flagged.

    ## Why is this bad?
    Without it every process on a node uses GPU 0: NCCL communicators are created on
    the wrong device, ranks hang in the first collective, or GPU 0 runs out of memory
    while the other GPUs idle.

    ## Example
    ```python
    dist.init_process_group("nccl")
    ```

    ## Use instead
    ```python
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    ```

    ## Fix safety
    The fix is unsafe: it inserts `torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`,
    which assumes a CUDA machine and a launcher that sets `LOCAL_RANK` (torchrun does).
    """

    CODE = "FSD106"
    FIX_SAFETY = "unsafe"
    NAME = "missing-set-device"
    MESSAGE = "`init_process_group` without `torch.cuda.set_device(LOCAL_RANK)` before it: every rank uses GPU 0"
    TRIGGERS = ("init_process_group",)
    VALID = (
        Valid(_HEAD + "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\ndist.init_process_group('nccl')\n"
              "fully_shard(model)\n"),
        Valid(_HEAD + "dist.init_process_group('gloo')\nfully_shard(model)\n"),
        Valid("import torch.distributed as dist\ndist.init_process_group('nccl')\n"),  # nothing is sharded
        Valid(_HEAD + "dist.init_process_group('nccl', device_id=torch.device('cuda', local_rank))\n"
              "fully_shard(model)\n"),
    )
    INVALID = (
        Invalid(
            _HEAD + "dist.init_process_group('nccl')\nfully_shard(model)\n",
            line=5,
            fixed=_HEAD + "torch.cuda.set_device(int(os.environ[\"LOCAL_RANK\"]))\n"
            "dist.init_process_group('nccl')\nfully_shard(model)\n",
        ),
        Invalid(
            _HEAD + "def main():\n    dist.init_process_group(backend='nccl')\n    torch.cuda.set_device(0)\n"
            "    fully_shard(model)\n",
            line=6,
            fixed=_HEAD + "def main():\n    torch.cuda.set_device(int(os.environ[\"LOCAL_RANK\"]))\n"
            "    dist.init_process_group(backend='nccl')\n    torch.cuda.set_device(0)\n    fully_shard(model)\n",
        ),
        Invalid(  # a constant device: every rank on GPU 0
            _HEAD + "torch.cuda.set_device(0)\ndist.init_process_group('nccl')\nfully_shard(model)\n",
            line=6,
            fixed=_HEAD + "torch.cuda.set_device(0)\ntorch.cuda.set_device(int(os.environ[\"LOCAL_RANK\"]))\n"
            "dist.init_process_group('nccl')\nfully_shard(model)\n",
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        if not shards.sites:
            return
        set_devices = [
            c for c in ctx.nodes(cst.Call) if ctx.resolver.qnames(c) & SET_DEVICE and not _constant_device(c)
        ]
        for call in ctx.nodes(cst.Call):
            if not ctx.resolver.qnames(call) & INIT:
                continue
            if _gloo_only(call) or any(a.keyword is not None and a.keyword.value == "device_id" for a in call.args):
                continue
            fn = shards.scope_of(call)
            here = shards.order(call)
            if any(
                shards.order(s) < here and (shards.scope_of(s) is fn or shards.scope_of(s) is None)
                for s in set_devices
            ):
                continue
            stmt = ctx.resolver.statement_of(call)
            fix = None
            if isinstance(stmt, cst.SimpleStatementLine):
                line = cst.parse_statement('torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n')
                fix = Fix(
                    "Insert `torch.cuda.set_device(int(os.environ[\"LOCAL_RANK\"]))` before it",
                    [Edit(stmt, [line], kind="before")],
                    safe=False,
                    imports=(("os", None, None), ("torch", None, None)),
                )
            yield call, {}, fix


def _constant_device(call: cst.Call) -> bool:
    """`set_device(0)`, `set_device("cuda:0")`: the same device on every rank."""
    if len(call.args) != 1:
        return False
    value = call.args[0].value
    return isinstance(value, cst.Integer) or (isinstance(value, cst.SimpleString) and ":" in value.value)


def _gloo_only(call: cst.Call) -> bool:
    for i, arg in enumerate(call.args):
        if (arg.keyword is None and i == 0) or (arg.keyword is not None and arg.keyword.value == "backend"):
            value = arg.value
            return isinstance(value, cst.SimpleString) and "nccl" not in value.value and "cuda" not in value.value
    return False
