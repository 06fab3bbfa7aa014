"""FSD103 optimizer-before-shard."""
from __future__ import annotations

from . import Invalid, Rule, Valid

_HEAD = "import torch\nfrom torch.distributed.fsdp import fully_shard\nmodel = Net()\n"

_FACTORY = "def make_optimizer(model, lr):\n    return torch.optim.SGD(model.parameters(), lr=lr)\n"


class OptimizerBeforeShard(Rule):
    """Checks for an optimizer built from a module's parameters before `fully_shard` of it.

    ## What it does
    Flags the construction of a `torch.optim` optimizer from `model.parameters()` (or
    parameter groups built from it) when `fully_shard(model)` (or of one of its blocks)
    comes later in the same function. A call of a function of the script that returns
    the one optimizer it builds (`optimizer = make_optimizer(model, lr)`) is a
    construction too, of the models passed to it, and so is any call handed a module's
    parameters whose result is stepped (`config.instantiate(cfg.optimizer, model.parameters())`).
    So is an optimizer built after the shard from parameters taken before it (`params =
    list(model.parameters())`, then `fully_shard(model)`, then `SGD(params)`): the list holds
    the tensors of that moment.

    ## Why is this bad?
    `fully_shard` replaces every parameter with a new DTensor parameter. An optimizer
    built earlier still holds the old tensors: it steps tensors the model no longer
    uses, so the model silently never trains (or the step fails on a device mismatch).

    ## Example
    ```python
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    fully_shard(model)
    ```

    ## Use instead
    ```python
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ```

    ## Fix safety
    No automatic fix: moving the construction can move code that reads its result.
    `fsdp2-retrofit rewrite` builds the optimizer after sharding.
    """

    CODE = "FSD103"
    NAME = "optimizer-before-shard"
    MESSAGE = ("optimizer `{name}` is built from `{root}`'s parameters {taken}before `fully_shard` (line {line}): it keeps "
               "the unsharded tensors")
    VALID = (
        Valid(_HEAD + "fully_shard(model)\noptimizer = torch.optim.AdamW(model.parameters())\n"),
        Valid("import torch\nmodel = Net()\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"),
        Valid(_FACTORY + _HEAD + "fully_shard(model)\noptimizer = make_optimizer(model, 0.1)\n"),
        # a training function that hands back the sharded module it trained: the same module again
        Valid("def train_model(model, opt):\n    opt.step()\n    return model\n\n\n" + _HEAD
              + "fully_shard(model)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              + "model = train_model(model, optimizer)\n"),
        # the optimizer of a deep copy (a reference model of a test): other tensors than those sharded
        Valid("import copy\n" + _HEAD + "ref = copy.deepcopy(model)\nref_opt = torch.optim.Adam(ref.parameters())\n"
              + "fully_shard(model)\noptimizer = torch.optim.Adam(model.parameters())\n"),
        # a call handed the parameters whose result is never stepped: no optimizer
        Valid(_HEAD + "sizes = summarize(model.parameters())\nfully_shard(model)\n"
              "optimizer = torch.optim.AdamW(model.parameters())\n"),
        # the list taken after the shard; names (not tensors) collected before it
        Valid(_HEAD + "fully_shard(model)\nparams = list(model.parameters())\n"
              "optimizer = torch.optim.SGD(params, lr=0.1)\n"),
        Valid(_HEAD + "decay = {n for n, p in model.named_parameters() if p.ndim > 1}\nfully_shard(model)\n"
              "groups = [{'params': [p for n, p in model.named_parameters() if n in decay]}]\n"
              "optimizer = torch.optim.AdamW(groups)\n"),
    )
    INVALID = (
        Invalid(_HEAD + "optimizer = torch.optim.AdamW(model.parameters())\nfully_shard(model)\n", line=4),
        Invalid(
            _HEAD + "groups = [{'params': [p for p in model.parameters() if p.ndim > 1]}]\n"
            "opt = torch.optim.AdamW(groups, lr=1e-3)\nfor layer in model.layers:\n    fully_shard(layer)\n"
            "fully_shard(model)\n",
            line=5,
        ),
        Invalid(_FACTORY + _HEAD + "optimizer = make_optimizer(model, 0.1)\nfully_shard(model)\n", line=6),
        # an optimizer a factory the analysis does not see into builds (torchtune's config.instantiate):
        # handed the parameters, and stepped
        Invalid(_HEAD + "optimizer = config.instantiate(cfg.optimizer, model.parameters())\nfully_shard(model)\n"
                "optimizer.step()\n", line=4),
        # the parameters taken into a list before the shard, the optimizer built from the list after it
        Invalid(_HEAD + "params = list(model.parameters())\nfully_shard(model)\n"
                "optimizer = torch.optim.SGD(params, lr=0.1)\n", line=6),
        Invalid(_HEAD + "decay = [p for n, p in model.named_parameters() if p.ndim > 1]\n"
                "for block in model.blocks:\n    fully_shard(block)\nfully_shard(model)\n"
                "optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1}])\n", line=8),
        Invalid(  # the optimizer class picked by name (what rewrite's optimizer stage treats as one too)
            _HEAD + "optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.1)\n"
            "fully_shard(model)\n",
            line=4,
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        for opt in shards.optimizers:
            later = [
                s for s in shards.sites
                if s.scope is opt.scope and s.root in opt.models and s.order > opt.order and not s.legacy
            ]
            # a module sharded whole before the optimizer is what the optimizer holds: a later site of the same
            # root is that module again (`model = train_model(model, ...)` handing it back), not a new shard
            before = [s for s in shards.sites if s.scope is opt.scope and s.root in opt.models and s.whole
                      and s.order < opt.order and not s.legacy]
            if later and not before:
                first = min(later, key=lambda s: s.order)
                yield opt.call, {"name": opt.name, "root": first.root, "taken": "",
                                 "line": str(ctx.resolver.line(first.call))}, None
                continue
            # the parameters taken into a list before fully_shard, the optimizer built from it after
            for root, (taken, value) in sorted(opt.taken.items(), key=lambda kv: kv[0]):
                between = [s for s in shards.sites if s.scope is opt.scope and s.root == root and not s.legacy
                           and taken < s.order < opt.order]
                earlier = [s for s in shards.sites if s.scope is opt.scope and s.root == root and s.whole
                           and s.order < taken and not s.legacy]
                if between and not earlier:
                    first = min(between, key=lambda s: s.order)
                    line = ctx.resolver.line(first.call)
                    yield opt.call, {"name": opt.name, "root": root, "line": str(line),
                                     "taken": f"taken at line {ctx.resolver.line(value)}, "}, None
                    break
