"""FSD120 batch-size-shape."""
from __future__ import annotations


import libcst as cst

from fsdp2_retrofit.analysis.batch_size import (
    PARTIAL_LAST_BATCH,
    batch_shaped_calls,
    drops_last,
    nominal_batch_size,
    short_code,
)
from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nfrom torch.distributed.fsdp import fully_shard\nfrom torch.utils.data import DataLoader\n"
    "from torch.utils.data.distributed import DistributedSampler\nmodel = Net()\nfully_shard(model)\n"
    "sampler = DistributedSampler(ds)\n"
)


class BatchSizeShape(Rule):
    """Checks for a tensor shaped by the DataLoader's batch size inside the training loop of a sharded script.

    ## What it does
    In a script that shards a model, flags inside a loop over a training DataLoader a
    `reshape` / `view` / `expand` or a tensor factory (`torch.ones`, `torch.zeros`,
    `torch.randn`, ...) given the loader's `batch_size` expression (the same name or
    attribute, e.g. `batch_size` or `args.batch_size`) as a dimension, or a call of a
    function or method of the script handed it where that parameter shapes a tensor
    (`model.init_hidden(args.batch_size)`), when that
    loader's batches can be smaller: it reads `batch_size // world_size` per rank
    (the global batch kept), or it has no `drop_last=True`.

    ## Why is this bad?
    After the split each rank reads a shard of the dataset: its last batch is
    partial wherever the shard's length does not divide by the batch size (the
    single-process run may have had only full batches), and with the global batch
    kept every batch holds `batch_size // world_size` samples. A tensor shaped by the
    nominal batch size then no longer matches the data: a shape error
    (`mat1 and mat2 shapes cannot be multiplied`), or a reshape that silently mixes
    samples.

    ## Example
    ```python
    for images, labels in loader:
        images = images.reshape(batch_size, -1)
        real = torch.ones(batch_size, 1)
    ```

    ## Use instead
    ```python
    for images, labels in loader:
        images = images.reshape(images.size(0), -1)
        real = torch.ones(images.size(0), 1)
    ```

    ## Fix safety
    No automatic fix: which tensor of the batch gives the right size needs a person.
    """

    CODE = "FSD120"
    NAME = "batch-size-shape"
    MESSAGE = "`{call}` is shaped by `{name}`, {why}: use the batch's own size (`x.size(0)`)"
    TRIGGERS = ("batch_size",)
    VALID = (
        Valid(_HEAD + "loader = DataLoader(ds, batch_size=bs, sampler=sampler)\nfor x, y in loader:\n"
              "    x = x.reshape(x.size(0), -1)\n    model(x).sum().backward()\n"),
        Valid(_HEAD + "loader = DataLoader(ds, batch_size=bs, sampler=sampler, drop_last=True)\nfor x, y in loader:\n"
              "    x = x.reshape(bs, -1)\n    model(x).sum().backward()\n"),  # full batches of bs on every rank
        Valid("import torch\nfrom torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=bs)\n"
              "for x, y in loader:\n    x = x.reshape(bs, -1)\n    net(x).sum().backward()\n"),  # not sharded
        # a function handed the batch size that shapes nothing by it
        Valid("def note(n):\n    print(n)\n\n\n" + _HEAD + "loader = DataLoader(ds, batch_size=bs, sampler=sampler)\n"
              "for x, y in loader:\n    note(bs)\n    model(x).sum().backward()\n"),
    )
    INVALID = (
        Invalid(_HEAD + "loader = DataLoader(ds, batch_size=batch_size, sampler=sampler)\nfor x, y in loader:\n"
                "    x = x.reshape(batch_size, -1)\n    model(x).sum().backward()\n", line=10),
        Invalid(  # the global batch kept: every batch is batch_size // world_size
            _HEAD + "loader = DataLoader(ds, batch_size=args.batch_size // world_size, sampler=sampler, drop_last=True)\n"
            "for epoch in range(3):\n    for x, y in loader:\n        target = torch.ones(args.batch_size, 1)\n"
            "        (model(x) - target).sum().backward()\n",
            line=11,
        ),
        Invalid(  # a method of the script's class handed the batch size shapes a tensor by it
            "class Tagger:\n    def init_hidden(self, bsz):\n        return torch.zeros(2, bsz, 16)\n\n\n" + _HEAD
            + "loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler)\nfor x, y in loader:\n"
            "    hidden = model.init_hidden(args.batch_size)\n    model(x, hidden).sum().backward()\n",
            line=15,
        ),
    )

    def check(self, ctx):
        if not ctx.shards.uses_fully_shard:
            return
        r = ctx.resolver
        loops = [n for n in ctx.nodes(cst.For)]
        for loader in ctx.training_loaders():
            if not loader.trains:
                continue
            nominal = nominal_batch_size(loader.call)
            if nominal is None:
                continue
            name, divided = nominal
            if drops_last(loader.drop_last) and not divided:
                continue
            why = "the per-rank loader reads `batch_size // world_size`" if divided else PARTIAL_LAST_BATCH
            for call in batch_shaped_calls(r, loops, loader.name, name):
                yield call, {"call": short_code(call), "name": name, "why": why}, None

