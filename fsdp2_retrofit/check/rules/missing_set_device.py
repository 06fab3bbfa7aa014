"""FSD106 missing-set-device."""
from __future__ import annotations

import re

import libcst as cst

from fsdp2_retrofit.syntax.torch_api import DEVICE_SELECTORS as SET_DEVICE, INIT_PROCESS_GROUP as INIT
from fsdp2_retrofit.syntax.names import walk
from . import Edit, Fix, Invalid, Rule, Valid

_HEAD = "import os\nimport torch\nimport torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"


class MissingSetDevice(Rule):
    """Checks for `init_process_group` with no `set_device(LOCAL_RANK)` before it.

    ## What it does
    In a script that shards with `fully_shard`, flags `dist.init_process_group(...)`
    when no `torch.cuda.set_device(...)` (or `torch.accelerator.set_device_index`)
    runs in the same function (before it or after it: NCCL creates its communicator at
    the first collective) and the call passes no `device_id=`. A `set_device` of a
    constant (`set_device(0)`, `set_device("cuda:0")`) does not count: it picks the
    same GPU on every rank. Any device module counts (`torch.npu.set_device(r)`,
    `get_torch_device().set_device(r)`). Not flagged either, since the device may be set
    where the lint cannot see it: `init_process_group(**kwargs)` (a launcher wrapper),
    or a call before it of a function of the file that calls `set_device`, or of a
    function or class of a project module (`utils.get_device(...)`, a base class's
    `Worker.__init__(self)`) whose module or a project module it imports (three deep)
    calls `.set_device(`. A `"gloo"` backend (CPU only) is never flagged.

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
        Valid(_HEAD + "def main():\n    dist.init_process_group('nccl')\n"
              "    torch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n    fully_shard(model)\n"),
        Valid(_HEAD + "def init_distributed(**kwargs):\n    dist.init_process_group(**kwargs)\n"
              "fully_shard(model)\n"),
        Valid(_HEAD + "def main(rank):\n    get_torch_device().set_device(rank)\n"
              "    dist.init_process_group('nccl')\n    fully_shard(model)\n"),
        Valid(_HEAD + "def setup(rank):\n    torch.cuda.set_device(rank)\n"
              "def main(rank):\n    setup(rank)\n    dist.init_process_group('nccl')\n    fully_shard(model)\n"),
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
        set_devices = [c for c in ctx.nodes(cst.Call) if _sets_device(ctx, c)]
        for call in ctx.nodes(cst.Call):
            if not ctx.resolver.qnames(call) & INIT:
                continue
            if _gloo_only(call) or any(a.keyword is not None and a.keyword.value == "device_id" for a in call.args):
                continue
            if any(a.star == "**" for a in call.args):
                continue  # `init_process_group(**kwargs)`: a launcher wrapper; device_id may be among them
            fn = shards.scope_of(call)
            # anywhere in the function: NCCL creates its communicator at the first collective,
            # so `set_device` right after `init_process_group` picks the device as well
            if any(shards.scope_of(s) is fn or shards.scope_of(s) is None for s in set_devices):
                continue
            if _helper_sets_device(ctx, fn, call):
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


_SETS_DEVICE_TEXT = re.compile(rb"\.set_device(?:_index)?\(")


def _sets_device(ctx, call: cst.Call) -> bool:
    """`torch.cuda.set_device(x)`, or `.set_device(x)` of any device module
    (`get_torch_device().set_device(rank)`, `torch.npu.set_device(...)`), not of a constant."""
    if _constant_device(call):
        return False
    if ctx.resolver.qnames(call) & SET_DEVICE:
        return True
    return isinstance(call.func, cst.Attribute) and call.func.attr.value in ("set_device", "set_device_index")


def _helper_sets_device(ctx, fn, init: cst.Call) -> bool:
    """A call before `init` in its function that may select the device out of this lint's
    sight: a function of this file that calls `set_device`, or a function or class of a
    project module (a base class's `__init__`, `utils.get_device(...)`) whose module, or a
    project module it imports (three deep), calls `.set_device(`. A lint does not guess."""
    shards = ctx.shards
    here = shards.order(init)
    local = {s.name.value: s for s in ctx.module.body if isinstance(s, cst.FunctionDef)}
    for call in ctx.nodes(cst.Call):
        if shards.scope_of(call) is not fn or shards.order(call) >= here:
            continue
        if isinstance(call.func, cst.Name) and call.func.value in local:
            body = local[call.func.value]
            if any(isinstance(n, cst.Call) and _sets_device(ctx, n) for n in walk(body)):
                return True
            continue
        for q in ctx.resolver.qnames(call):
            if "." in q and not q.startswith(("torch.", "builtins.", "os.", "sys.")) and _project_sets_device(ctx.path, q):
                return True
    return False


def _project_sets_device(path, qname: str) -> bool:
    from fsdp2_retrofit.analysis.project_imports import imported_files, locate, read

    if not path or path == "-":
        return False
    parts = qname.split(".")
    found = None
    for end in range(len(parts) - 1, 0, -1):
        found = locate(path, 0, ".".join(parts[:end]))
        if found is not None:
            break
    if found is None:
        return False
    todo, seen = [(found, 0)], set()
    while todo:
        file, depth = todo.pop()
        if str(file) in seen:
            continue
        seen.add(str(file))
        data = read(file)
        if data is None:
            continue
        if _SETS_DEVICE_TEXT.search(data):
            return True
        if depth < 3:
            todo.extend((f, depth + 1) for f in imported_files(file, data))
    return False


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
