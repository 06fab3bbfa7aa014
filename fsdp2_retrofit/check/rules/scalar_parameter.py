"""FSD126 scalar-parameter."""
from __future__ import annotations

from typing import Set

import libcst as cst

from fsdp2_retrofit.analysis.scalar_params import class_tree
from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nimport torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
    "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.fc = nn.Linear(4, 4)\n        self.scale = nn.Parameter({value})\n"
)
_SHARD = "model = Net()\nfully_shard(model)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"


def _case(value: str, tail: str = _SHARD) -> str:
    return _HEAD.format(value=value) + tail


class ScalarParameter(Rule):
    """Checks for a 0-dim parameter in a module passed to `fully_shard`.

    ## What it does
    Flags the `fully_shard` call of a model whose class (in the script or a module beside
    it), or a class it is built from, creates a 0-dim parameter in `__init__`
    (`self.logit_scale = nn.Parameter(torch.tensor(0.5))`, `nn.Parameter(torch.ones([]) * x)`,
    `register_parameter(...)`), when the script keeps no parameter out of `fully_shard`
    (no `ignored_params=`, no `register_parameter(name, None)`).

    ## Why is this bad?
    `fully_shard` splits every parameter it manages along dim 0; a 0-dim one has no dim
    0, and `fully_shard` raises ("doesn't support scalar parameters") as the script
    starts. Kept out of it, the parameter is a plain tensor that FSDP never reduces: it
    needs its own gradient all-reduce, or each rank trains its own value.

    ## Example
    ```python
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.logit_scale = nn.Parameter(torch.tensor(0.5))

    fully_shard(model)
    ```

    ## Use instead
    `fsdp2-retrofit rewrite` of the single-GPU script keeps such parameters out of
    `fully_shard`: unregistered while it runs, put back whole on every rank, each with a
    `register_post_accumulate_grad_hook` that all-reduces its gradient divided by the
    world size. From torch 2.7, `fully_shard(model, ignored_params={model.logit_scale})`
    keeps it out too (its gradient still needs the all-reduce).

    ## Fix safety
    No automatic fix: where the parameter lives and which ranks reduce it is for the
    script to say.
    """

    CODE = "FSD126"
    NAME = "scalar-parameter"
    MESSAGE = (
        "`{root}` ({cls}) has a 0-dim parameter {param}: fully_shard raises on it (it splits parameters along "
        "dim 0); keep it out of fully_shard and all-reduce its gradient"
    )
    VALID = (
        Valid(_case("torch.zeros(4)")),
        Valid(_case("torch.tensor([0.5])")),
        Valid(_case("torch.tensor(0.5)", "model = Net()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n")),
        Valid(_case("torch.tensor(0.5)", "model = Net()\nfully_shard(model, ignored_params={model.scale})\n")),
        Valid(_case("torch.tensor(0.5)", "model = Net()\nmodel.register_parameter('scale', None)\n"
                    "fully_shard(model)\n")),
    )
    INVALID = (
        Invalid(_case("torch.tensor(0.5)"), line=10),
        Invalid(_case("torch.ones([]) * 2.3"), line=10),
        Invalid(  # in a block class the model is built from, sharded inside main()
            "import torch\nimport torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
            "class Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.alpha = nn.Parameter(torch.zeros(()))\n"
            "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.blocks = nn.ModuleList([Block() for _ in range(2)])\n"
            "def main():\n    model = Net()\n    for block in model.blocks:\n        fully_shard(block)\n"
            "    fully_shard(model)\n",
            line=16,  # the first fully_shard of it: a Block's
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        if not shards.uses_fully_shard or _kept_out(ctx):
            return
        seen: Set[str] = set()
        for site in shards.sites:
            if site.legacy or not site.whole or site.root in seen:
                continue
            info = ctx.root_class(site)
            if info is None:
                continue
            classes = ctx.classes()
            found = [p for name in sorted(class_tree(classes, [info.name])) for p in classes.get(name).scalar_params]
            if found:
                seen.add(site.root)
                yield site.call, {"root": site.root, "cls": f"class `{info.name}`", "param": found[0].describe()}, None


def _kept_out(ctx) -> bool:
    """The script keeps some parameter out of fully_shard: `ignored_params=` or `register_parameter(name, None)`."""
    for call in ctx.nodes(cst.Call):
        if any(a.keyword is not None and a.keyword.value == "ignored_params" for a in call.args):
            return True
        func = call.func
        if (isinstance(func, cst.Attribute) and func.attr.value == "register_parameter" and len(call.args) == 2
                and isinstance(call.args[1].value, cst.Name) and call.args[1].value.value == "None"):
            return True
    return False
