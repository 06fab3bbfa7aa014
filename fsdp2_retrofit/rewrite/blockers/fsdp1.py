"""FSR3.. fsdp1: FSDP1 code the migration cannot express with fully_shard (FSR301, FSR302, FSR303, FSR305, FSR306, FSR307, FSR308, FSR310; FSR304 NO_SHARD and FSR309 HYBRID_SHARD without --hsdp convert since 2026-12-07)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import CUDA_MODEL, CUDA_STEPS, OPT

_HEAD = """\
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy, StateDictType
dist.init_process_group("nccl")
"""  # lines 1-4
_LOOP = OPT + CUDA_STEPS


def _wrapped(wrap: str, after: str = "") -> str:
    """The model built at line 5, wrapped by `wrap` at line 6, trained at lines 7-10, then `after` (line 11 on)."""
    return _HEAD + CUDA_MODEL + wrap + "\n" + _LOOP + after


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
            _HEAD + """\
def build(model):
    return FSDP(model)
model = build(torch.nn.Linear(8, 2).cuda())
""" + _LOOP,
            line=6,
        ),
        Invalid(_wrapped("model = FSDP(model, None, None, None)"), line=6),
    )
    VALID = (Valid(_wrapped("model = FSDP(model, device_id=torch.cuda.current_device())")),)


class Fsdp1UnknownArgument(Blocker):
    """FSDP(...) is given an argument the rewrite cannot migrate.

    ## Why
    The rewrite does not know how FSDP2 does what the argument does.

    ## What to do
    Remove the argument, or migrate this part by hand.
    """

    CODE = "FSR302"
    NAME = "fsdp1-unknown-argument"
    INVALID = (Invalid(_wrapped("model = FSDP(model, param_init_fn=init)"), line=6),)


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
        "from policies import wrap_policy\n" + _wrapped("model = FSDP(model, auto_wrap_policy=wrap_policy)"),
        line=7,
        files={"policies.py": "def wrap_policy(module, recurse, nonwrapped_numel):\n    return recurse\n"},
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
        _wrapped("model = FSDP(model)", """\
with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
    state = model.state_dict()
"""),
        line=11,
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
        _wrapped("model = FSDP(model)", "with FSDP.summon_full_params(model):\n    print(model.weight.sum())\n"),
        line=11,
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
        _HEAD + """\
teacher = torch.nn.Linear(8, 2).cuda()
teacher = FSDP(teacher)
model = torch.nn.Linear(8, 2).cuda()
model = FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
""" + OPT + """\
for step in range(10):
    x = torch.randn(4, 8, device="cuda")
    (model(x) - teacher(x).detach()).pow(2).sum().backward()
    opt.step()
""",
        line=8,
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
        _wrapped("model = FSDP(model, mixed_precision=MixedPrecision("
                 "param_dtype=torch.float32, reduce_dtype=torch.bfloat16))"),
        line=6,
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
            _wrapped("model = FSDP(model)", """\
if dist.get_rank() == 0:
    state = model.state_dict()
    torch.save(state, "model.pt")
"""),
            line=12,
        ),
        Invalid(
            _wrapped("model = FSDP(model)", """\
if dist.get_rank() == 0:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        torch.save(model.state_dict(), "model.pt")
"""),
            line=13,
        ),
    )
    VALID = (Valid(
        _wrapped(
            "model = FSDP(model, mixed_precision=MixedPrecision("
            "param_dtype=torch.bfloat16, reduce_dtype=torch.float32))",
            'state = model.state_dict()\nif dist.get_rank() == 0:\n    torch.save(state, "model.pt")\n',
        ),
    ),)
