"""FSD118 batchnorm-per-rank."""
from __future__ import annotations

from typing import Set

from fsdp2_retrofit.analysis.batchnorm import class_batchnorm

from . import Invalid, Rule, Valid

_HEAD = (
    "import torch\nimport torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
    "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.conv = nn.Conv2d(3, 8, 3)\n        self.bn = nn.{norm}(8)\n"
)
_SYNC = ("convert_sync_batchnorm", "SyncBatchNorm")


def _case(norm: str, tail: str) -> str:
    return _HEAD.format(norm=norm) + tail


_TRAIN = "model = Net()\nfully_shard(model)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"


class BatchNormPerRank(Rule):
    """Checks for BatchNorm layers in a sharded model that is trained.

    ## What it does
    Flags the `fully_shard` call of a model whose class (in the script or a module
    beside it) builds `nn.BatchNorm1d/2d/3d` or a library model with BatchNorm layers
    (`self.backbone = torchvision.models.resnet18()`), when an optimizer trains the
    model and the script never converts it with `nn.SyncBatchNorm.convert_sync_batchnorm`.

    ## Why is this bad?
    `fully_shard` shards parameters, not batches: in training mode each rank's
    BatchNorm normalises with the mean and variance of its own per-rank batch, and
    keeps its own running statistics (buffers are not synchronised). The loss, the
    gradients and the running averages differ from a single process on the global
    batch, and the ranks' running statistics drift apart, silently; smaller per-rank
    batches make the statistics noisier.

    ## Example
    ```python
    model = ConvNet()  # has nn.BatchNorm2d
    fully_shard(model)
    ```

    ## Use instead
    ```python
    model = nn.SyncBatchNorm.convert_sync_batchnorm(ConvNet())
    fully_shard(model)
    ```
    or a normalisation without batch statistics (GroupNorm, LayerNorm).

    ## Fix safety
    No automatic fix: SyncBatchNorm adds a collective to every forward (each rank
    must run the same number of forwards) and needs a GPU backend.
    """

    CODE = "FSD118"
    NAME = "batchnorm-per-rank"
    MESSAGE = (
        "sharded `{root}` ({cls}) has BatchNorm layers and is trained: each rank normalises with its own batch "
        "statistics; convert with nn.SyncBatchNorm.convert_sync_batchnorm before fully_shard"
    )
    VALID = (
        Valid(_case("GroupNorm", _TRAIN.replace("Net()", "Net()"))),
        Valid(_case("BatchNorm2d", "model = nn.SyncBatchNorm.convert_sync_batchnorm(Net())\nfully_shard(model)\n"
                    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n")),
        Valid(_case("BatchNorm2d", "teacher = Net()\nfully_shard(teacher)\nteacher.eval()\n")),  # not trained
        Valid(_case("SyncBatchNorm", _TRAIN)),
        Valid(_case("BatchNorm2d", "model = Net()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n")),
        Valid(  # a library model whose norm_layer is not BatchNorm
            "import torch\nimport torch.nn as nn\nimport torchvision\nfrom torch.distributed.fsdp import fully_shard\n"
            "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.backbone = torchvision.models.resnet18(norm_layer=lambda c: nn.GroupNorm(2, c))\n" + _TRAIN
        ),
    )
    INVALID = (
        Invalid(_case("BatchNorm2d", _TRAIN), line=10),
        Invalid(  # built with .to(device), blocks sharded first, inside main()
            _case("BatchNorm1d", "def main():\n    model = Net().to('cpu')\n    fully_shard(model.conv)\n"
                  "    fully_shard(model)\n    opt = torch.optim.Adam(model.parameters())\n"),
            line=12,
        ),
        Invalid(  # the BatchNorm is in a submodule class
            "import torch\nimport torch.nn as nn\nfrom torch.distributed.fsdp import fully_shard\n"
            "class Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))\n"
            "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.block = Block()\n"
            + _TRAIN,
            line=13,
        ),
        Invalid(  # the BatchNorm layers are a library model's, kept as an attribute
            "import torch\nimport torch.nn as nn\nimport torchvision\nfrom torch.distributed.fsdp import fully_shard\n"
            "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.backbone = torchvision.models.resnet18(num_classes=4)\n" + _TRAIN,
            line=10,
        ),
    )

    def check(self, ctx):
        shards = ctx.shards
        if not shards.uses_fully_shard:
            return
        text = ctx.module.code
        if any(word in text for word in _SYNC):
            return
        trained = {root for o in shards.optimizers for root in o.models}
        seen: Set[str] = set()
        for site in shards.sites:
            if site.legacy or not site.whole or site.root in seen or site.root not in trained:
                continue
            info = ctx.root_class(site)
            if info is not None and class_batchnorm(ctx.classes(), info.name, ctx.resolver) is not None:
                seen.add(site.root)
                yield site.call, {"root": site.root, "cls": f"class `{info.name}`"}, None
