"""FSD108 missing-sampler."""
from __future__ import annotations

from fsdp2_retrofit.syntax.torch_api import ITERABLE_DATASETS as ITERABLE
from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nfrom torch.distributed.fsdp import fully_shard\nfrom torch.utils.data import DataLoader\n"
    "model = Net()\nfully_shard(model)\n"
)
_LOOP = "for x, y in loader:\n    loss = model(x).sum()\n    loss.backward()\n"


class MissingSampler(Rule):
    """Checks for a training DataLoader without a sampler in a sharded script.

    ## What it does
    In a script that shards a model, flags a `DataLoader` that a training loop (one
    that calls `backward()`) reads and that gets no `sampler=` or `batch_sampler=`:
    bound to a name the loop iterates (or passes to the function whose loop trains),
    or built in a helper (`return DataLoader(...)` read as `for b in make_loader(ds):`
    or through a name bound to it), a method (`data.train_loader()`) or a constructor
    (`self.loader = DataLoader(...)` read as `data.loader`).

    ## Why is this bad?
    Every rank then iterates the whole dataset in the same order: all ranks train on
    the same batches, so N GPUs do the work of one, and with `shuffle=True` each rank
    shuffles on its own. The run looks healthy and learns as if the batch were N times
    smaller than the compute spent.

    ## Example
    ```python
    loader = DataLoader(dataset, batch_size=32, shuffle=True)
    ```

    ## Use instead
    ```python
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    ...
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
    ```

    ## Fix safety
    No automatic fix here; `fsdp2-retrofit rewrite` adds the sampler, its `set_epoch`
    call and moves `shuffle` onto it.
    """

    CODE = "FSD108"
    NAME = "missing-sampler"
    MESSAGE = "DataLoader {name} has no DistributedSampler: every rank trains on the same batches"
    TRIGGERS = ("DataLoader",)
    VALID = (
        Valid(_HEAD + "loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds))\n" + _LOOP),
        Valid("import torch\nfrom torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=8)\n"
              + _LOOP.replace("model(x)", "net(x)")),
        Valid(_HEAD + "val_loader = DataLoader(ds, batch_size=8)\nfor x, y in val_loader:\n    model(x)\n"),
        Valid(_HEAD + "class Stream(torch.utils.data.IterableDataset):\n    pass\n"
              "loader = DataLoader(Stream(), batch_size=8)\n" + _LOOP),
        Valid(_HEAD + "def make_loader(ds):\n    return DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds))\n"
              "for x, y in make_loader(ds):\n    model(x).sum().backward()\n"),
        Valid(_HEAD + "def make_loader(ds):\n    return DataLoader(ds, batch_size=8)\n"
              "for x, y in make_loader(ds):\n    model(x)\n"),  # evaluation: no backward
    )
    INVALID = (
        Invalid(_HEAD + "loader = DataLoader(ds, batch_size=8, shuffle=True)\n" + _LOOP, line=6),
        Invalid(  # built in a helper, read through a name
            _HEAD + "def make_loader(ds):\n    return DataLoader(ds, batch_size=8, shuffle=True)\n"
            "loader = make_loader(ds)\n" + _LOOP, line=7,
        ),
        Invalid(  # an attribute of a data class, read by a training function
            _HEAD + "class Data:\n    def __init__(self, ds):\n        self.train = DataLoader(ds, batch_size=8)\n"
            "def fit(model, batches):\n    for x, y in enumerate(batches):\n        model(x).sum().backward()\n"
            "fit(model, Data(ds).train)\n", line=8,
        ),
        Invalid(  # a method of a data class, its instance bound to a name first
            _HEAD + "class Data:\n    def batches(self, ds):\n        return DataLoader(ds, batch_size=8)\n"
            "data = Data()\nfor x, y in data.batches(ds):\n    model(x).sum().backward()\n", line=8,
        ),
    )

    def check(self, ctx):
        if not ctx.shards.uses_fully_shard:
            return
        for loader in ctx.training_loaders():
            if loader.trains and not loader.has_sampler and not _iterable_dataset(ctx, loader.call, loader.dataset):
                yield loader.call, {"name": f"`{loader.name}`"}, None
        from fsdp2_retrofit.analysis.data import loader_dataset

        named = {id(loader.call) for loader in ctx.training_loaders() if loader.trains}
        for call, loop in ctx.analysis.fed_loaders():
            if id(call) not in named and not _has_sampler(call) and not _iterable_dataset(ctx, call, loader_dataset(call)):
                where = f"built in `{_where(ctx, call)}`, read by the training loop at line {ctx.resolver.line(loop)},"
                yield call, {"name": where}, None


def _where(ctx, call) -> str:
    """`Data.loader` for `self.loader = DataLoader(...)`, `make_loader()` or `Data.loader()` for
    one built in a function or method, `line N` at module level."""
    import libcst as cst

    r = ctx.resolver
    fn = r.enclosing_function(call)
    if fn is None:
        return f"line {r.line(call)}"
    cls = r.enclosing_class(fn)
    owner = f"{cls.name.value}." if cls is not None and r.enclosing_function(fn) is None else ""
    parent = r.parent(call)
    if type(parent) is cst.Assign and owner:
        for t in parent.targets:
            if type(t.target) is cst.Attribute and type(t.target.value) is cst.Name and t.target.value.value == "self":
                return owner + t.target.attr.value
    return f"{owner}{fn.name.value}()"


def _has_sampler(call) -> bool:
    """A sampler is given, or may be (`**kwargs` not seen into)."""
    return any(
        (a.keyword is not None and a.keyword.value in ("sampler", "batch_sampler")) or a.star == "**"
        for a in call.args
    )


def _iterable_dataset(ctx, call, dataset) -> bool:
    """The loader `call` reads an IterableDataset of the script (`dataset`): it takes no sampler
    (each such dataset splits its stream itself)."""
    import libcst as cst

    expr = dataset
    if isinstance(expr, cst.Name):
        bound = ctx.shards.bound_values(expr.value, call)
        expr = bound[-1] if bound else expr
    if not isinstance(expr, cst.Call) or not isinstance(expr.func, cst.Name):
        return False
    for cls in ctx.nodes(cst.ClassDef):
        if cls.name.value == expr.func.value:
            return any(ctx.resolver.qnames(base.value) & ITERABLE for base in cls.bases)
    return False
