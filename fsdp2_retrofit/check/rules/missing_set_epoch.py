"""FSD121 missing-set-epoch."""
from __future__ import annotations

from typing import Optional

import libcst as cst

from fsdp2_retrofit.analysis.closures import closure_reads
from fsdp2_retrofit.syntax.names import names_in
from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nfrom torch.distributed.fsdp import fully_shard\nfrom torch.utils.data import DataLoader\n"
    "from torch.utils.data.distributed import DistributedSampler\nmodel = Net()\nfully_shard(model)\n"
)
_EPOCHS = "for epoch in range(3):\n{set_epoch}    for x, y in loader:\n        model(x).sum().backward()\n"
_CYCLE = (
    "def cycle(dl):\n{count}    while True:\n{set_epoch}        for b in dl:\n            yield b\n"
    "loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds))\nbatches = cycle(loader)\n"
    "for step in range(100):\n    model(next(batches)).sum().backward()\n"
)


_TRAINER = (
    "class Trainer:\n    def __init__(self, data):\n        self.data = data\n    def one_epoch(self, n):\n"
    "{set_epoch}        for x, y in self.data:\n            model(x).sum().backward()\n"
    "    def fit(self):\n        for n in range(3):\n            self.one_epoch(n)\n"
    "def make_loader(ds):\n    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds))\n    return loader\n"
    "Trainer(make_loader(ds)).fit()\n"
)


_HANDED = (  # set_epoch on a parameter: the sampler a caller hands it, followed by value
    "def reshuffle(order, n):\n    order.set_epoch(n)\n"
    "sampler = DistributedSampler(ds, shuffle=True)\nloader = DataLoader(ds, batch_size=8, sampler=sampler)\n"
    "for epoch in range(3):\n    reshuffle({handed}, epoch)\n    for x, y in loader:\n        model(x).sum().backward()\n"
)


def _epochs(set_epoch: str = "") -> str:
    return _EPOCHS.format(set_epoch=set_epoch)


class MissingSetEpoch(Rule):
    """Checks for a shuffling DistributedSampler read for several epochs without `set_epoch`.

    ## What it does
    In a script that shards a model, flags the `DistributedSampler` of a training
    DataLoader when it shuffles (`shuffle` is not `False`), a loop over the loader
    sits inside another loop (the epochs), or in a nested function the function
    around it calls inside a loop, or a function the loader is handed to repeats
    passes over it (`def cycle(dl): while True: for b in dl: yield b`), or a
    method reads it through an attribute once per epoch (`self.train_data` of a
    trainer, followed by value, its pass repeated by a loop), and nothing
    calls `set_epoch` on the sampler (`sampler.set_epoch(epoch)`,
    `loader.sampler.set_epoch(epoch)`, `dl.sampler.set_epoch(epoch)` in that function, or
    `order.set_epoch(epoch)` in a function handed the sampler as `order`).

    ## Why is this bad?
    A DistributedSampler shuffles with the seed `seed + epoch`, and its epoch only
    changes through `set_epoch`. Without it every epoch reads the same permutation:
    the same batches in the same order, epoch after epoch, unlike the fresh shuffle
    of a single-process `shuffle=True` loader. Training runs, and generalises worse,
    silently.

    ## Example
    ```python
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        for x, y in loader:
            ...
    ```

    ## Use instead
    ```python
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...
    ```

    ## Fix safety
    No automatic fix: which loop counts the epochs needs a person when there are
    several.
    """

    CODE = "FSD121"
    NAME = "missing-set-epoch"
    MESSAGE = (
        "DistributedSampler of `{loader}` shuffles but nothing calls `set_epoch` on it, and the loop at line {loop} "
        "reads it every epoch: each epoch repeats the same order"
    )
    TRIGGERS = ("DistributedSampler",)
    VALID = (
        Valid(_HEAD + "sampler = DistributedSampler(ds, shuffle=True)\n"
              "loader = DataLoader(ds, batch_size=8, sampler=sampler)\n" + _epochs("    sampler.set_epoch(epoch)\n")),
        Valid(_HEAD + "sampler = DistributedSampler(ds, shuffle=True)\n"
              "loader = DataLoader(ds, batch_size=8, sampler=sampler)\n"
              + _epochs("    loader.sampler.set_epoch(epoch)\n")),
        Valid(_HEAD + "sampler = DistributedSampler(ds, shuffle=False)\n"
              "loader = DataLoader(ds, batch_size=8, sampler=sampler)\n" + _epochs()),
        Valid(_HEAD + "sampler = DistributedSampler(ds)\nloader = DataLoader(ds, batch_size=8, sampler=sampler)\n"
              "for x, y in loader:\n    model(x).sum().backward()\n"),  # one pass
        Valid(_HEAD + _CYCLE.format(count="    epoch = 0\n",
                                    set_epoch="        dl.sampler.set_epoch(epoch)\n        epoch += 1\n")),
        Valid(_HEAD + _TRAINER.format(set_epoch="        self.data.sampler.set_epoch(n)\n")),
        Valid(_HEAD + _HANDED.format(handed="sampler")),  # was flagged: `order` is not spelled `sampler`
    )
    INVALID = (
        Invalid(_HEAD + "sampler = DistributedSampler(ds, shuffle=True)\n"
                "loader = DataLoader(ds, batch_size=8, sampler=sampler)\n" + _epochs(), line=7),
        Invalid(_HEAD + "loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds))\n"
                "step = 0\nwhile step < 100:\n    for x, y in loader:\n        model(x).sum().backward()\n"
                "        step += 1\n", line=7),
        Invalid(  # the pass is a function nested in main(), called once per epoch
            "import torch\nfrom torch.distributed.fsdp import fully_shard\nfrom torch.utils.data import DataLoader\n"
            "from torch.utils.data.distributed import DistributedSampler\ndef main():\n    model = Net()\n"
            "    fully_shard(model)\n    sampler = DistributedSampler(ds, shuffle=True)\n"
            "    loader = DataLoader(ds, batch_size=8, sampler=sampler)\n    def train_epoch():\n"
            "        for x, y in loader:\n            model(x).sum().backward()\n"
            "    for epoch in range(3):\n        train_epoch()\n", line=8),
        Invalid(_HEAD + _CYCLE.format(count="", set_epoch=""), line=11),  # a generator repeats the passes
        Invalid(_HEAD + _TRAINER.format(set_epoch=""), line=17),  # a trainer's method, once per epoch
        Invalid(_HEAD + _HANDED.format(handed="other_sampler"), line=9),  # another sampler's epoch is set
    )

    def check(self, ctx):
        if not ctx.shards.uses_fully_shard:
            return
        r = ctx.resolver
        receivers, loaders_set, samplers_set = set(), set(), set()
        for call in ctx.nodes(cst.Call):
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value == "set_epoch":
                receivers.add(_code(func.value))
                # `<s>.set_epoch(...)`: the samplers `s` can hold (a parameter a caller hands one),
                # followed by value
                samplers_set.update(id(v) for v in ctx.analysis.flow.values(func.value))
                if isinstance(func.value, cst.Attribute) and func.value.attr.value == "sampler":
                    # `<x>.sampler.set_epoch(...)`: the loaders `x` can hold, followed by value
                    loaders_set.update(id(v) for v in ctx.analysis.flow.values(func.value.value))
        fors = ctx.nodes(cst.For)
        for loader in ctx.training_loaders():
            sampler = loader.sampler
            if not loader.trains or sampler is None or sampler.kind != "distributed" or sampler.call is None:
                continue
            if _shuffle_off(sampler.call):
                continue
            names = {_code(sampler.expr), f"{loader.name}.sampler"}
            if loader.cycled is not None:  # (while, for, parameter) of a generator repeating the passes
                names.add(f"{loader.cycled[2]}.sampler")
            if loader.epoch_passed is not None:  # (loop, reader, epoch) of a repeated pass through another name
                names.add(f"{_code(loader.epoch_passed[1])}.sampler")
            if names & receivers or id(loader.call) in loaders_set or id(sampler.call) in samplers_set:
                continue
            loop = self._epoch_loop(r, fors, loader.name)
            if loop is None and loader.cycled is not None:
                loop = loader.cycled[1]
            if loop is None and loader.epoch_passed is not None:
                loop = loader.epoch_passed[0]
            if loop is not None:
                yield sampler.call, {"loader": loader.name, "loop": str(r.line(loop))}, None

    def _epoch_loop(self, r, fors, name: str) -> Optional[cst.CSTNode]:
        """A loop over the loader that sits inside another loop of the same function,
        or in a nested function, reading the loader through its closure, that the
        function around it calls inside a loop."""
        for loop in fors:
            if name not in names_in(loop.iter):
                continue
            if _in_loop(r, loop):
                return loop
            fn = r.enclosing_function(loop)
            outer = r.enclosing_function(fn) if fn is not None else None
            if outer is None or name not in closure_reads(fn):
                continue
            for call in r.descendants(outer, cst.Call):
                if isinstance(call.func, cst.Name) and call.func.value == fn.name.value and \
                        r.enclosing_function(call) is outer and _in_loop(r, call):
                    return loop
        return None


def _in_loop(r, node) -> bool:
    """`node` sits in a loop of its own function."""
    for anc in r.ancestors(node):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return False
        if isinstance(anc, (cst.For, cst.While)):
            return True
    return False


def _shuffle_off(call: cst.Call) -> bool:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "shuffle":
            return isinstance(arg.value, cst.Name) and arg.value.value == "False"
    return False


def _code(node) -> str:
    from fsdp2_retrofit.syntax.names import code

    return code(node)
