"""`check` on code written by people who know FSDP2 (issue 31): the classes of false
positive found on torchtitan, torchtune, OLMo-core, lingua, verl and axolotl, each as a
small project of our own, and the misses of FSD107 and FSD109 found there."""
from __future__ import annotations

from pathlib import Path

from fsdp2_retrofit.check.lint import lint_source
from fsdp2_retrofit.check.rules import all_rules


def _project(tmp_path: Path, files: dict) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _codes(path: Path):
    result = lint_source(path.read_bytes(), str(path), all_rules())
    assert result.error is None, result.error
    return [(f.line, f.code) for f in result.findings]


FSDP_UTILS = """\
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard


def fsdp_version(module):
    if isinstance(module, FSDP):
        return 1
    return 2


def shard(module):
    fully_shard(module)
    return module
"""

VERSIONED_WORKER = """\
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, ShardedStateDictConfig
from fsdp_utils import fsdp_version


class Worker:
    def weights(self):
        if fsdp_version(self.module) == 1:
            FSDP.set_state_dict_type(self.module, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())
        return self.module.state_dict()
"""


def test_fsdp1_behind_a_project_version_test_is_not_flagged(tmp_path):
    _project(tmp_path, {"fsdp_utils.py": FSDP_UTILS, "worker.py": VERSIONED_WORKER})
    assert _codes(tmp_path / "worker.py") == []
    # the same call with no such test: FSDP1 is the file's only path
    unguarded = VERSIONED_WORKER.replace("        if fsdp_version(self.module) == 1:\n    ", "")
    _project(tmp_path, {"worker.py": unguarded})
    assert [c for _, c in _codes(tmp_path / "worker.py")] == ["FSD111"]


DEEP_ENGINE = """\
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType, ShardedStateDictConfig
from proj.utils.fsdp_utils import fsdp_version, shard


def build(module, strategy):
    if strategy == "fsdp":
        module = FSDP(module)
    else:
        shard(module)
    if fsdp_version(module) == 1:
        FSDP.set_state_dict_type(module, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())
    return module
"""


def test_the_version_test_is_found_from_a_script_four_packages_deep_with_no_root_marker(tmp_path):
    """verl's engine module (proj/workers/engine/fsdp/impl.py): no pyproject.toml within three
    folders, the version test in proj/utils, found from the folder above the outermost package
    (where `python -m proj.workers...` imports from), as the sharding analysis finds the sharder."""
    init = {f"{d}/__init__.py": "" for d in ("proj", "proj/utils", "proj/workers", "proj/workers/engine",
                                             "proj/workers/engine/fsdp")}
    _project(tmp_path, {**init, "proj/utils/fsdp_utils.py": FSDP_UTILS, "proj/workers/engine/fsdp/impl.py": DEEP_ENGINE})
    assert _codes(tmp_path / "proj/workers/engine/fsdp/impl.py") == []


def test_a_function_returning_an_fsdp1_wrap_is_no_fully_shard_path(tmp_path):
    # prepare() wraps with FSDP1: the caller's name is an FSDP1 module, not an FSDP2 one
    text = (
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n\n"
        "def prepare(model):\n    wrapped = FSDP(model)\n    return wrapped\n\n\n"
        "def main(net):\n    model = prepare(net)\n    return model\n"
    )
    _project(tmp_path, {"rollout.py": text})
    assert _codes(tmp_path / "rollout.py") == [(5, "FSD111")]


DEVICE_UTILS = """\
import os
import torch


def get_device(kind):
    device = torch.device(kind, int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    return device
"""

RECIPE = """\
from torch.distributed import init_process_group
from torch.distributed.fsdp import fully_shard
from utils import get_device


class Recipe:
    def __init__(self, model):
        self.device = get_device("cuda")
        init_process_group("nccl")
        fully_shard(model)
"""


def test_set_device_in_a_project_helper_called_before_init(tmp_path):
    _project(tmp_path, {"utils/__init__.py": "from ._device import get_device\n",
                        "utils/_device.py": DEVICE_UTILS, "recipe.py": RECIPE})
    assert _codes(tmp_path / "recipe.py") == []
    # the helper selects no device: the finding stays
    _project(tmp_path, {"utils/_device.py": DEVICE_UTILS.replace("    torch.cuda.set_device(device)\n", "")})
    assert _codes(tmp_path / "recipe.py") == [(9, "FSD106")]


MOE = """\
import torch.nn as nn


class Expert(nn.Module):
    def forward(self, x):
        return x


class Experts(nn.ModuleDict):
    pass


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleDict({str(i): Expert() for i in range(4)})
        self.grouped = Experts({"a": Expert(), "b": Expert()})


def build_experts(n):
    return nn.ModuleDict({str(i): Expert() for i in range(n)})
"""

SHARD_MOE = """\
from torch.distributed.fsdp import fully_shard
from moe import MoE, build_experts

model = MoE()
fully_shard(model.experts)
fully_shard(model.grouped)
extra = build_experts(2)
fully_shard(extra)
fully_shard(model)
"""


def test_a_module_dict_whose_class_is_in_another_module(tmp_path):
    _project(tmp_path, {"moe.py": MOE, "train.py": SHARD_MOE})
    assert _codes(tmp_path / "train.py") == [(5, "FSD109"), (6, "FSD109"), (8, "FSD109")]


def test_a_sharder_that_only_reshards_an_fsdp2_module_does_not_shard_a_plain_one(tmp_path):
    """torchtune's resize_token_embeddings: `fully_shard(model.tok_embeddings)` only when
    `isinstance(model, FSDPModule)`; a single-device recipe calling it has no sharded model."""
    resize = (
        "import torch.nn as nn\nfrom torch.distributed.fsdp import FSDPModule, fully_shard\n\n\n"
        "def resize(model, n):\n    is_fsdp = isinstance(model, FSDPModule)\n"
        "    model.tok_embeddings = nn.Embedding(n, 8)\n"
        "    if is_fsdp:\n        fully_shard(model.tok_embeddings)\n"
    )
    recipe = (
        "import torch\nfrom resize import resize\n\n\n"
        "def train(model, n):\n    resize(model, n)\n"
        "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    print(float(norm))\n"
    )
    _project(tmp_path, {"resize.py": resize, "single_device.py": recipe})
    assert _codes(tmp_path / "single_device.py") == []
