"""FSD110 rank-gated-collective."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis.model_classes import runs_self
from fsdp2_retrofit.syntax.rank import TEXT_TRIGGERS as RANK_TEXT, rank_zero_side
from fsdp2_retrofit.syntax.torch_api import CLIP_GRAD_NORM, COLLECTIVES, DCP_CALLS, STATE_DICT_GETTERS, STATE_DICT_SETTERS
from fsdp2_retrofit.syntax.names import bind_args
from fsdp2_retrofit.syntax.torch_api import DESTROY_PROCESS_GROUP as DESTROY
from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nimport torch.distributed as dist\nimport torch.distributed.checkpoint as dcp\n"
    "from torch.distributed.fsdp import fully_shard\nfrom torch.distributed.checkpoint.state_dict import "
    "StateDictOptions, get_model_state_dict\nmodel = Net()\nfully_shard(model)\nrank = dist.get_rank()\n"
)

_GPT = (
    "import torch.nn as nn\nclass GPT(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.head = nn.Linear(4, 4)\n    def forward(self, x):\n        return self.head(x)\n"
    "    def generate(self, x, n):\n        for _ in range(n):\n            x = self(x)\n        return x\n"
    "    def describe(self):\n        return 'gpt'\n"
)


class RankGatedCollective(Rule):
    """Checks for a collective inside a branch that only rank 0 runs.

    ## What it does
    Flags, inside `if rank == 0:` (or `if master_process:`, `if dist.get_rank() == 0:`,
    the `else` of `if rank != 0:`, ...): `dcp.save` / `dcp.load` / `dcp.async_save`,
    `get_*_state_dict` with `full_state_dict=True`, `set_*_state_dict`, `.full_tensor()`,
    `clip_grad_norm_` of sharded parameters, `torch.distributed` collectives,
    `destroy_process_group`, `loss.backward()` (its reduce-scatter is a collective),
    calls (forwards) of a sharded module, calls of a function of the script (or a
    method of the class around the call) that is handed a sharded module and calls it
    (`evaluate(model, x)`) or runs one of these itself, outside a rank-0 branch of its
    own (`self.save_checkpoint(epoch)`), and the `step()` of an
    optimizer over sharded parameters (not a collective, but each rank updates only
    its own shards: the others keep theirs, and the ranks train different models).

    A branch is not flagged when the other side of its `if` (the `else` of a rank-0
    `if`, or the body of `if rank != 0:`) runs the same collective: a broadcast sent
    from rank 0 and received by the others (`broadcast(t, src=0)` on both sides,
    `scatter` with and without its list) is every rank joining. Nor is a barrier of a
    rank-0 `if` paired with the same barrier in an `if rank != 0:` of the same block
    (rank 0 downloads a dataset first, the others wait): each rank reaches one of them.

    ## Why is this bad?
    Each of these is a collective: every rank must join. Inside a rank-0 branch the
    other ranks never arrive, and rank 0 waits forever (a hang, or a timeout after
    30 minutes on NCCL). Rank-0 gating is for printing, logging and plain-file writes.

    ## Example
    ```python
    if rank == 0:
        dcp.save(get_model_state_dict(model), checkpoint_id="ckpt")
    ```

    ## Use instead
    ```python
    dcp.save(get_model_state_dict(model), checkpoint_id="ckpt")  # every rank
    if rank == 0:
        print("saved")
    ```

    ## Fix safety
    No automatic fix: which statements of the branch are plain-file writes and which
    feed the collective needs a person (`fsdp2-retrofit rewrite` splits its own).
    """

    CODE = "FSD110"
    NAME = "rank-gated-collective"
    MESSAGE = "{what} inside a rank-0 branch (line {line}): {why}"
    TRIGGERS = RANK_TEXT
    VALID = (
        Valid(_HEAD + "dcp.save(get_model_state_dict(model), checkpoint_id='ckpt')\nif rank == 0:\n"
              "    print('saved')\n"),
        Valid(_HEAD + "opts = StateDictOptions(full_state_dict=True, cpu_offload=True)\n"
              "state = get_model_state_dict(model, options=opts)\nif rank == 0:\n    torch.save(state, 'model.pt')\n"),
        Valid("import torch.distributed as dist\nif dist.get_rank() == 0:\n    dist.barrier()\n"),  # not sharded
        Valid(  # `self.gpu_id` is bound to a rank and to something else: no rank by its value
            "import os\n" + _HEAD + "class Trainer:\n    def __init__(self):\n"
            "        self.gpu_id = int(os.environ['LOCAL_RANK'])\n    def pin(self):\n        self.gpu_id = 0\n"
            "    def save(self):\n        if self.gpu_id == 0:\n            dcp.save({'m': 1}, checkpoint_id='ckpt')\n",
        ),
        Valid(  # rank 0 sends, the others receive: every rank joins the broadcast
            _HEAD + "if rank == 0:\n    objs = [load_config()]\n    dist.broadcast_object_list(objs, src=0)\n"
            "else:\n    objs = [None]\n    dist.broadcast_object_list(objs, src=0)\n"
        ),
        Valid(_HEAD + "if rank != 0:\n    dist.scatter(t, src=0)\nelse:\n    dist.scatter(t, chunks, src=0)\n"),
        Valid(  # rank 0 downloads first, the others wait: each rank reaches one barrier
            _HEAD + "if rank != 0:\n    dist.barrier()\nds = load(download=True)\nif rank == 0:\n    dist.barrier()\n"
        ),
        Valid(  # a method of the model's class that runs no forward
            _HEAD.replace("model = Net()", _GPT + "model = GPT()") + "if rank == 0:\n    print(model.describe())\n"
        ),
        Valid(  # a helper that runs no collective (a plain-file write)
            _HEAD + "def log(msg, path):\n    torch.save({'msg': msg}, path)\nif rank == 0:\n    log('x', 'log.pt')\n"
        ),
    )
    INVALID = (
        Invalid(_HEAD + "if rank == 0:\n    dcp.save(get_model_state_dict(model), checkpoint_id='ckpt')\n", line=10),
        Invalid(_HEAD + "if rank != 0:\n    dist.all_reduce(t)\nif rank == 0:\n    dist.barrier()\n", line=12),
        Invalid(_HEAD + "if dist.get_rank() == 0:\n    full = get_model_state_dict(model, "
                "options=StateDictOptions(full_state_dict=True))\n    torch.save(full, 'model.pt')\n", line=10),
        Invalid(_HEAD + "if master_process and step % 100 == 0:\n    val_loss = model(x_val).mean()\n", line=10),
        Invalid(_HEAD + "if rank != 0:\n    pass\nelse:\n    dist.all_reduce(t)\n", line=12),
        Invalid(_HEAD + "if not dist.get_rank():\n    y = model(x)\n", line=10),
        Invalid(_HEAD + "m = model.to('cpu')\nif rank == 0:\n    print(m(x))\n", line=11),  # the module itself
        Invalid(  # a method of the model's class that runs its forward, called through an alias
            _HEAD.replace("model = Net()", _GPT + "model = GPT()") + "m = model.cuda()\nif rank == 0:\n"
            "    print(m.generate(x, 5))\n",
            line=24,
        ),
        Invalid(  # a forward through a helper function of the script
            _HEAD + "def evaluate(net, x):\n    return net(x).mean().item()\nif rank == 0:\n"
            "    print(evaluate(model, x_val))\n", line=12,
        ),
        Invalid(_HEAD + "if rank == 0:\n    dist.destroy_process_group()\n", line=10),
        Invalid(  # a DCP save inside a method of the class, called on rank 0 only
            _HEAD + "class Trainer:\n    def save(self, path):\n        dcp.save({'m': 1}, checkpoint_id=path)\n"
            "    def fit(self):\n        if self.rank == 0:\n            self.save('ckpt')\n", line=14,
        ),
        Invalid(  # the rank read by its value: `self.gpu_id` holds LOCAL_RANK (a tutorial's Trainer)
            "import os\n" + _HEAD + "class Trainer:\n    def __init__(self):\n"
            "        self.gpu_id = int(os.environ['LOCAL_RANK'])\n    def save(self):\n        if self.gpu_id == 0:\n"
            "            dcp.save({'m': 1}, checkpoint_id='ckpt')\n", line=15,
        ),
        Invalid(_HEAD + "loss = model(x).sum()\nif rank == 0:\n    loss.backward()\n", line=11),
        Invalid(_HEAD + "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nif rank == 0:\n    opt.step()\n", line=11),
        Invalid(  # the else side runs a different collective: the broadcast still hangs
            _HEAD + "if rank == 0:\n    dist.broadcast(t, src=0)\nelse:\n    dist.barrier()\n", line=10,
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        if not shards.sites:
            return
        for call in ctx.nodes(cst.Call):
            branch = shards.rank_zero_branch(call)
            if branch is None:
                continue
            what = self._collective(ctx, call)
            if what and not self._matched(ctx, call, branch):
                why = ("the other ranks never update their shards: the ranks train different models"
                       if what.startswith("optimizer step") else "the other ranks never join the collective")
                yield call, {"what": what, "line": str(ctx.resolver.line(branch)), "why": why}, None

    def _matched(self, ctx, call: cst.Call, branch: cst.If) -> bool:
        """The other side of `branch` runs the same collective (outside nested functions)."""
        key = self._key(ctx, call)
        inside_body = any(a is branch.body for a in ctx.resolver.ancestors(call))
        other = branch.orelse if inside_body else branch.body
        if key is not None and other is None and self._paired(ctx, call, branch, key):
            return True
        if key is None or other is None:
            return False
        for candidate in ctx.resolver.descendants(other, cst.Call):
            fn = ctx.resolver.enclosing_function(candidate)
            if fn is not ctx.resolver.enclosing_function(call):
                continue
            if self._collective(ctx, candidate) and self._key(ctx, candidate) == key:
                return True
        return False

    def _paired(self, ctx, call: cst.Call, branch: cst.If, key) -> bool:
        """`if rank != 0: dist.barrier()` ... `if rank == 0: dist.barrier()` in one block (rank 0
        goes first, a download): another `if` of the block, without an else, runs its body on
        every rank but 0 and the same collective there, so each rank joins it once."""
        block = ctx.resolver.block_of(branch)
        for sibling in getattr(block, "body", ()):
            if sibling is branch or not isinstance(sibling, cst.If) or sibling.orelse is not None:
                continue
            if rank_zero_side(sibling.test) != "else":
                continue
            for candidate in ctx.resolver.descendants(sibling.body, cst.Call):
                if ctx.resolver.enclosing_function(candidate) is ctx.resolver.enclosing_function(call) and \
                        self._collective(ctx, candidate) and self._key(ctx, candidate) == key:
                    return True
        return False

    def _key(self, ctx, call: cst.Call):
        """What makes two collective calls the same collective."""
        names = ctx.resolver.qnames(call) & (DCP_CALLS | COLLECTIVES | STATE_DICT_SETTERS | STATE_DICT_GETTERS)
        if names:
            return tuple(sorted(names))
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "full_tensor":
            return ("full_tensor", _code(func.value))
        return ("call", _code(func))

    def _collective(self, ctx, call: cst.Call, depth: int = 2):
        names = ctx.resolver.qnames(call)
        func = call.func
        if names & DCP_CALLS:
            return f"`{_code(func)}`"
        if names & COLLECTIVES:
            return f"`{_code(func)}`"
        if names & STATE_DICT_SETTERS:
            return f"`{_code(func)}`"
        if names & STATE_DICT_GETTERS and ctx.shards.full_state_options(call):
            return f"full-state `{_code(func)}`"
        if names & CLIP_GRAD_NORM and call.args and ctx.shards.sharded_module(call.args[0].value, call):
            return f"`{_code(func)}` of sharded parameters (its norm is all-reduced)"
        if isinstance(func, cst.Attribute) and func.attr.value == "full_tensor":
            return "`.full_tensor()`"
        if isinstance(func, cst.Attribute) and func.attr.value == "backward" and not call.args:
            return f"`{_code(func)}()` (its gradient reduce-scatter is a collective)"
        if isinstance(func, cst.Attribute) and func.attr.value == "step" and isinstance(func.value, cst.Name):
            opt = ctx.shards.optimizer(func.value.value, call)
            if opt is not None:
                return f"optimizer step `{_code(func)}()` of sharded parameters"
        if names & DESTROY:  # destroying an NCCL communicator is collective: every rank takes part
            return f"`{_code(func)}`"
        root = ctx.shards.sharded_module(func, call, unit=True)
        if root is not None and not (isinstance(func, cst.Attribute) and func.attr.value not in ("forward",)):
            return f"a forward of sharded `{root}`"
        return self._method_forward(ctx, call) or self._helper(ctx, call, depth)

    def _method_forward(self, ctx, call: cst.Call):
        """`m.generate(...)`: a method of the sharded module's own class that runs its
        forward (calls `self(...)` or its submodules), on any name that holds the module."""
        func = call.func
        found = ctx.shards.fsdp2_root(func.value, call) if isinstance(func, cst.Attribute) else None
        if found is None:
            return None
        for site in ctx.shards.sites_for(*found):
            origin = next((s for s in ctx.shards.sites if s.call is site.call and s.whole and "." not in s.root), None)
            info = ctx.root_class(origin) if origin is not None else None
            method = info.methods.get(func.attr.value) if info is not None else None
            if method is not None and runs_self(method, info):
                return f"`{_code(func)}()`, a method running the forward of sharded `{found[0]}`,"
        return None

    def _helper(self, ctx, call: cst.Call, depth: int):
        """`evaluate(model, ...)`, `self.save_checkpoint(epoch)`: a function of this file (or a
        method of the class around the call) handed a sharded module that it calls (its
        forward), or that runs a collective itself, outside a rank-0 branch of its own."""
        found = _helper_function(ctx, call)
        if found is None or depth == 0:
            return None
        fn, skip = found
        for param, arg in bind_args(fn, call, skip):
            root = ctx.shards.sharded_module(arg, call, unit=True)
            if root is None:
                continue
            for inner in ctx.resolver.descendants(fn.body, cst.Call):
                target = inner.func
                if isinstance(target, cst.Attribute) and target.attr.value == "forward":
                    target = target.value
                if isinstance(target, cst.Name) and target.value == param:
                    return f"a forward of sharded `{root}` in `{fn.name.value}()` (line {ctx.resolver.line(inner)})"
        for inner in ctx.resolver.descendants(fn.body, cst.Call):
            if ctx.resolver.enclosing_function(inner) is not fn or ctx.shards.rank_zero_branch(inner) is not None:
                continue
            what = self._collective(ctx, inner, depth - 1)
            if what:
                return f"{what} in `{fn.name.value}()` (line {ctx.resolver.line(inner)})"
        return None


def _helper_function(ctx, call: cst.Call):
    """(the function of this file a call runs, the parameters it does not pass): a
    top-level function by name, or a method of the class around the call on `self`."""
    func = call.func
    if isinstance(func, cst.Name):
        found = [f for f in ctx.module.body if isinstance(f, cst.FunctionDef) and f.name.value == func.value]
        return (found[0], 0) if len(found) == 1 else None
    if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
        cls = ctx.resolver.enclosing_class(call)
        found = [m for m in (cls.body.body if cls is not None else ())
                 if isinstance(m, cst.FunctionDef) and m.name.value == func.attr.value]
        return (found[0], 1) if len(found) == 1 else None
    return None


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
