"""FSR9.. data: training data the rewrite cannot split between the ranks (FSR901, FSR902, FSR903, FSR904, FSR905)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import DATA_IMPORTS, EPOCH, MODEL, OPT

_DATA = DATA_IMPORTS + MODEL + OPT  # lines 1-4
_LOADERS = """\
from torch.utils.data import DataLoader
def make_loader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)
"""
_HELPER_LOADER = """\
import torch
from torch.utils.data import TensorDataset
from {module} import make_loader
""" + MODEL + OPT + """\
loader = make_loader(TensorDataset(torch.randn(32, 8), torch.randn(32, 2)), 8)
""" + EPOCH


class DataSamplerNotDistributable(Blocker):
    """A training DataLoader is given a batch_sampler, or a sampler other than
    RandomSampler/SequentialSampler.

    ## Why
    Such a sampler draws indices of the whole dataset on every rank: each rank would train on the
    same batches, and no DistributedSampler reproduces a subset, weighted or custom order.

    ## What to do
    Split the indices by rank yourself (indices[rank::world_size]), or use shuffle=True /
    RandomSampler.
    """

    CODE = "FSR901"
    NAME = "data-sampler-not-distributable"
    INVALID = (Invalid(
        _DATA + "loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 2)), batch_sampler=my_batches)\n"
        + EPOCH,
        line=5,
    ),)
    VALID = (
        # a sampler name that only ever holds None is the DataLoader's default: no sampler
        Valid(_DATA + "picker = None\nloader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 2)), "
              "batch_size=8, sampler=picker, shuffle=True)\n" + EPOCH),
    )


class DataLoaderNotFollowed(Blocker):
    """No training loop reads a named DataLoader, and one is built where it cannot be followed (inline
    in a `for`, on an attribute, returned by a helper).

    ## Why
    The rewrite gives the training DataLoader a DistributedSampler; left as is, every rank would
    train on the same batches.

    ## What to do
    Bind the training DataLoader to a name in the function that trains, then loop over that name.
    """

    CODE = "FSR902"
    NAME = "data-loader-not-followed"
    INVALID = (Invalid(
        _DATA + """\
for x, y in DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 2)), batch_size=8):
    (model(x) - y).pow(2).mean().backward()
    opt.step()
""",
        line=5,
    ),)


class DataBatchSizeReadElsewhere(Blocker):
    """--keep-global-batch: the training DataLoader's batch size is a name (or attribute) the script
    also reads to size batch tensors, and it cannot be rebound once to the per-rank size (bound
    several times or in another scope, read for something else too, or the loader is built in a
    loop).

    ## Why
    Divided in the DataLoader only, the other reads keep the global size and disagree with the
    per-rank batch: a shape error, or a silent broadcast.

    ## What to do
    Bind the per-rank size to a name of its own, read by the DataLoader and the batch tensors, or
    run without --keep-global-batch.
    """

    CODE = "FSR903"
    NAME = "data-batch-size-read-elsewhere"
    INVALID = (Invalid(
        """\
import torch
from torch.utils.data import DataLoader
batch_size = 8
def main(data):
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=batch_size)
    for x in loader:
        model(x.view(batch_size, -1)).sum().backward()
        opt.step()
""",
        line=3,
        options={'keep_global_batch': True},
    ),)


class DataLoaderOutsideProject(Blocker):
    """The training DataLoader is built in a module outside the project (an installed package, or a
    folder above the project's root).

    ## Why
    The DataLoader needs a DistributedSampler where it is built, and the rewrite edits only the
    script and the project's own modules.

    ## What to do
    Build the DataLoader in the script or a module of the project, or give it its DistributedSampler
    there by hand.
    """

    CODE = "FSR904"
    NAME = "data-loader-outside-project"
    # The script is a module of a package (its folder holds __init__.py) with no project marker
    # above it: the project is the script's folder, and `fsr904_shared` is found beside the
    # package (where `python -m` imports it from), one folder up: outside the project.
    # The script is a module of a package (its folder holds __init__.py) with no project marker
    # above it: the project is the script's folder, and `fsr904_shared` is found beside the
    # package (where `python -m` imports it from), one folder up: outside the project.
    INVALID = (Invalid(
        _HELPER_LOADER.format(module="fsr904_shared.loaders"),
        line=3,
        files={"__init__.py": "", "../fsr904_shared/loaders.py": _LOADERS},
        path="../fsr904_shared/loaders.py",
    ),)
    # the helper module inside the project (beside the script): its DataLoader gets the sampler there
    VALID = (Valid(_HELPER_LOADER.format(module="loaders"), files={"loaders.py": _LOADERS}),)
    # the helper module inside the project (beside the script): its DataLoader gets the sampler there


class DataGlobalBatchOfOne(Blocker):
    """--keep-global-batch with a training batch size of 1.

    ## Why
    The option keeps the global batch as written and divides it between the ranks: one sample has no
    part for a second rank.

    ## What to do
    Run without --keep-global-batch (each rank reads one sample a step; the global batch is
    world_size samples).
    """

    CODE = "FSR905"
    NAME = "data-global-batch-of-one"
    INVALID = (Invalid(
        _DATA + "loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 2)), batch_size=1)\n" + EPOCH,
        line=5,
        options={'keep_global_batch': True},
    ),)
