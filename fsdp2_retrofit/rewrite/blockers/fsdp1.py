"""FSR3.. fsdp1: FSDP1 code the migration cannot express with fully_shard (FSR301, FSR302, FSR303, FSR304, FSR305, FSR306, FSR307, FSR308, FSR309, FSR310)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class Fsdp1WrapShape(Blocker):
    """An FSDP(...) wrap is not `name = FSDP(module, key=...)` on its own line.

    ## Why
    The rewrite replaces the wrap statement by fully_shard calls on the model it names and reads
    FSDP1's settings by keyword.

    ## What to do
    Write `model = FSDP(model, ...)` on its own line, settings by keyword.
    """

    CODE = "FSR301"
    NAME = "fsdp1-wrap-shape"
    INVALID = (
        Invalid(
            """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def build_model(local_rank):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    return FSDP(model, device_id=local_rank)


dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = build_model(local_rank)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
""",
            line=11,
        ),
        Invalid(
            """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
model = FSDP(model, None, None, None, device_id=local_rank)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
""",
            line=12,
        ),
    )


class Fsdp1UnknownArgument(Blocker):
    """FSDP(...) is given an argument the rewrite cannot migrate.

    ## Why
    The rewrite does not know how FSDP2 does what the argument does.

    ## What to do
    Remove the argument, or migrate this part by hand.
    """

    CODE = "FSR302"
    NAME = "fsdp1-unknown-argument"
    INVALID = (Invalid(
        """\
import functools
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    CPUOffload, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType,
)
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy, lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy,
)
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 4))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = Net()
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=init)
    opt = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        pass
        opt.step()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        torch.save(sd, "m.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
""",
        line=45,
    ),)


class Fsdp1UnreadableSetting(Blocker):
    """An FSDP1 setting (auto_wrap_policy, sharding_strategy, MixedPrecision, CPUOffload) cannot be
    read.

    ## Why
    Each setting becomes an FSDP2 option (units, reshard_after_forward, MixedPrecisionPolicy,
    CPUOffloadPolicy); its value must be known when rewriting.

    ## What to do
    Write the setting in the call (or one assignment) with literal values and known members.
    """

    CODE = "FSR303"
    NAME = "fsdp1-unreadable-setting"
    INVALID = (Invalid(
        """\
from policies import wrap_policy
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    CPUOffload, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType,
)
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy, lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy,
)
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 4))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = Net()
    model = FSDP(model, auto_wrap_policy=wrap_policy)
    opt = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        pass
        opt.step()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        torch.save(sd, "m.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
""",
        line=45,
        files={"policies.py": """\
def wrap_policy(module, recurse, nonwrapped_numel):
    return recurse
"""},
    ),)


class Fsdp1NoShard(Blocker):
    """sharding_strategy=ShardingStrategy.NO_SHARD.

    ## Why
    NO_SHARD is data parallelism without sharding (DDP); FSDP2 always shards over the mesh.

    ## What to do
    Use DistributedDataParallel (or let the rewrite shard: remove sharding_strategy).
    """

    CODE = "FSR304"
    NAME = "fsdp1-no-shard"
    INVALID = (Invalid(
        """\
import functools
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    CPUOffload, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType,
)
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy, lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy,
)
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 4))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = Net()
    model = FSDP(model, sharding_strategy=ShardingStrategy.NO_SHARD)
    opt = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        pass
        opt.step()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        torch.save(sd, "m.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
""",
        line=45,
    ),)


class Fsdp1StateDictType(Blocker):
    """A state dict type the rewrite does not convert (set_state_dict_type, LOCAL_STATE_DICT, a shared
    `with`, an unreadable config).

    ## Why
    The rewrite converts FULL_STATE_DICT and SHARDED_STATE_DICT blocks of their own (`with
    FSDP.state_dict_type(model, ...):`) into get_/set_*_state_dict calls.

    ## What to do
    Take the state dicts inside `with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):`.
    """

    CODE = "FSR305"
    NAME = "fsdp1-state-dict-type"
    INVALID = (Invalid(
        """\
import functools
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    CPUOffload, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType,
)
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy, lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy,
)
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 4))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = Net()
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    opt = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        pass
        opt.step()
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        sd = model.state_dict()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
""",
        line=53,
    ),)


class Fsdp1UnconvertedApi(Blocker):
    """FSDP1 API the rewrite does not convert is left in the script.

    ## Why
    No FSDP1 API may be left in an FSDP2 script (the two cannot be mixed on one model).

    ## What to do
    Migrate this use by hand (FSDP2: get_model_state_dict, DTensor.full_tensor,
    set_requires_gradient_sync).
    """

    CODE = "FSR306"
    NAME = "fsdp1-unconverted-api"
    INVALID = (Invalid(
        """\
import functools
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    CPUOffload, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType,
)
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy, lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy,
)
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 4))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = Net()
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    opt = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        pass
        opt.step()
    with FSDP.summon_full_params(model):
        print(model.blocks[0].fc.weight.sum())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
""",
        line=53,
    ),)


class Fsdp1MixedWrapSettings(Blocker):
    """Several FSDP(...) wraps with different settings.

    ## Why
    The rewrite gives every fully_shard the same policy and unit rule.

    ## What to do
    Use the same FSDP settings for every model.
    """

    CODE = "FSR307"
    NAME = "fsdp1-mixed-wrap-settings"
    INVALID = (Invalid(
        """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()
teacher = FSDP(teacher, device_id=local_rank)
student = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)).cuda()
student = FSDP(student, device_id=local_rank, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
for step in range(100):
    x = torch.randn(8, 16, device="cuda")
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    loss = F.cross_entropy(student(x), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
""",
        line=15,
    ),)


class Fsdp1PrecisionCombination(Blocker):
    """MixedPrecision(...) with a combination of dtypes the rewrite does not map.

    ## Why
    The rewrite maps a bfloat16/float16 param_dtype (and its reduce_dtype) only.

    ## What to do
    Use param_dtype=torch.bfloat16 or torch.float16.
    """

    CODE = "FSR308"
    NAME = "fsdp1-precision-combination"
    INVALID = (Invalid(
        """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
model = FSDP(
    model,
    device_id=local_rank,
    mixed_precision=MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.bfloat16),
    )
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
""",
        line=15,
    ),)


class Fsdp1HybridWithoutHsdp(Blocker):
    """ShardingStrategy.HYBRID_SHARD without `--hsdp`.

    ## Why
    FSDP2's HSDP is a 2-D (replicate, shard) mesh whose shape the rewrite cannot know.

    ## What to do
    Pass --hsdp N (N = the number of nodes, i.e. replicas).
    """

    CODE = "FSR309"
    NAME = "fsdp1-hybrid-without-hsdp"
    INVALID = (Invalid(
        """\
import functools
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import (
    CPUOffload, FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType,
)
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy, lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy,
)
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 4))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    model = Net()
    model = FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    opt = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        pass
        opt.step()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        torch.save(sd, "m.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
""",
        line=45,
    ),)


class Fsdp1StateDictRankGated(Blocker):
    """An FSDP1 state dict is taken under a rank-0 `if`.

    ## Why
    Gathering or scattering a state dict is a collective every rank must call.

    ## What to do
    Take it on every rank, then write the file under the rank-0 `if`.
    """

    CODE = "FSR310"
    NAME = "fsdp1-state-dict-rank-gated"
    INVALID = (
        Invalid(
            """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
model = FSDP(model, device_id=local_rank)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 0:
    state = model.state_dict()
    torch.save(state, "model.pt")
dist.destroy_process_group()
""",
            line=20,
        ),
        Invalid(
            """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
model = FSDP(model, device_id=local_rank)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 0:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        torch.save(model.state_dict(), "model.pt")
dist.destroy_process_group()
""",
            line=21,
        ),
    )
    VALID = (Valid(
        """\
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
model = FSDP(model, device_id=local_rank, mixed_precision=bf16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(100):
    loss = model(torch.randn(8, 16, device="cuda")).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
state = model.state_dict()
if dist.get_rank() == 0:
    torch.save(state, "model.pt")
dist.destroy_process_group()
""",
    ),)
