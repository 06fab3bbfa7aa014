"""FSDP1 -> FSDP2 (migrate_fsdp1): each FSDP1 form maps to its FSDP2 form, what
cannot be mapped is refused with its line, and no FSDP1 API is left."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = '''\
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
    model = FSDP(model, {wrap})
    opt = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        {clip}
        opt.step()
{save}
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

FULL_SAVE = '''\
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        torch.save(sd, "m.pt")'''

FSDP1_TOKENS = ("FullyShardedDataParallel", "fully_sharded_data_parallel", "StateDictType", "ShardedGradScaler",
                "FSDP.", "FSDP(", "MixedPrecision(", "CPUOffload(", "ShardingStrategy", "auto_wrap_policy")


DEFAULT_WRAP = "auto_wrap_policy=ModuleWrapPolicy({Block})"


def source_of(wrap=DEFAULT_WRAP, clip="pass", save=FULL_SAVE) -> str:
    return SCRIPT.format(wrap=wrap, clip=clip, save=save)


def rewrite(wrap=DEFAULT_WRAP, clip="pass", save=FULL_SAVE, **options):
    return rewrite_source(source_of(wrap, clip, save).encode(), "train.py", RetrofitOptions(**options))


def out(*args, **kwargs) -> str:
    result = rewrite(*args, **kwargs)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    for token in FSDP1_TOKENS:
        assert token not in code, f"{token} left in:\n{code}"
    return code


def refusal(wrap=DEFAULT_WRAP, clip="pass", save=FULL_SAVE, **options):
    """The refusal; the file is left as it was."""
    result = rewrite(wrap, clip, save, **options)
    assert result.refusals, result.code.decode()
    assert result.code == source_of(wrap, clip, save).encode()
    return result.refusals[0]


def line_of(text: str, source: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


SHARD_BLOCKS = '''\
    for module in reversed(list(model.modules())):
        if type(module).__name__ in ("Block",) and module is not model:
            fully_shard(module, mesh=mesh{extra})
    fully_shard(model, mesh=mesh{extra})
'''


@pytest.mark.parametrize("wrap", [
    "auto_wrap_policy=ModuleWrapPolicy({Block})",
    "auto_wrap_policy=ModuleWrapPolicy([Block])",
    "auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})",
    "auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block))",
    "auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, Block)",
])
def test_policies_name_the_units(wrap):
    code = out(wrap)
    assert SHARD_BLOCKS.format(extra="") in code
    assert "model = FSDP" not in code and "import functools" in code  # the user's imports stay


def test_a_policy_bound_to_a_name_is_read_and_its_statement_removed():
    source = SCRIPT.format(wrap="auto_wrap_policy=policy", clip="pass", save=FULL_SAVE).replace(
        "    model = Net()\n",
        "    model = Net()\n    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})\n",
    )
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    code = result.code.decode()
    assert "policy = " not in code and SHARD_BLOCKS.format(extra="") in code


@pytest.mark.parametrize("wrap", ["", "auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=100)"])
def test_no_policy_or_a_size_policy_shards_the_repeated_blocks(wrap):
    code = out(wrap)
    assert "for index, block in enumerate(model.blocks):" in code
    assert "fully_shard(model, mesh=mesh)" in code


@pytest.mark.parametrize("strategy, expected", [
    ("FULL_SHARD", ""),
    ("SHARD_GRAD_OP", ", reshard_after_forward=False"),
])
def test_sharding_strategies(strategy, expected):
    code = out(f"auto_wrap_policy=ModuleWrapPolicy({{Block}}), sharding_strategy=ShardingStrategy.{strategy}")
    assert SHARD_BLOCKS.format(extra=expected) in code


def test_hybrid_shard_becomes_a_2d_mesh_with_hsdp():
    code = out("auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.HYBRID_SHARD", hsdp=2)
    assert 'mesh_dim_names=("replicate", "shard")' in code


NODE_MESH = """    mesh = init_device_mesh(
        "cuda" if torch.cuda.is_available() else "cpu",
        (dist.get_world_size() // int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])),
        mesh_dim_names=("replicate", "shard"),
    )
"""


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_hybrid_shard_without_hsdp_shards_within_each_node_read_at_run_time(strategy):
    """FSDP1's HYBRID_SHARD shards within a node and replicates across nodes: without --hsdp the mesh reads
    the ranks per node from torchrun (LOCAL_WORLD_SIZE) when it starts (was FSR309, needing --hsdp N)."""
    result = rewrite(f"auto_wrap_policy=ModuleWrapPolicy({{Block}}), sharding_strategy=ShardingStrategy.{strategy}")
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert NODE_MESH in code and "import os\n" in code
    assert ("reshard_after_forward=False" in code) is (strategy == "_HYBRID_SHARD_ZERO2")
    assert any("one replica per node" in c.what for c in result.changes)


def test_no_shard_is_a_mesh_of_replicas():
    """NO_SHARD (DDP's data parallelism through FSDP1) becomes fully_shard on a (world, 1) mesh: a shard
    dimension of 1 keeps whole parameters on every rank and all-reduces the gradients (was FSR304)."""
    code = out("auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=ShardingStrategy.NO_SHARD")
    assert "(dist.get_world_size(), 1),\n        mesh_dim_names=(\"replicate\", \"shard\")," in code


def test_mixed_precision_becomes_the_policy_and_buffer_dtype_is_dropped():
    result = rewrite("mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, "
                     "buffer_dtype=torch.bfloat16)")
    code = result.code.decode()
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in code
    assert any("buffer_dtype" in c.what and "buffers" in c.why for c in result.changes)


def test_mixed_precision_without_reduce_dtype_reduces_in_param_dtype():
    code = out("mixed_precision=MixedPrecision(param_dtype=torch.float16)")
    assert "MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)" in code


def test_cpu_offload_becomes_the_policy_and_the_backend_gets_gloo():
    code = out("cpu_offload=CPUOffload(offload_params=True)")
    assert "CPUOffloadPolicy(" in code and "offload_policy=offload_policy" in code
    assert 'dist.init_process_group("cpu:gloo,cuda:nccl")' in code


@pytest.mark.parametrize("arg", ["device_id=local_rank", "use_orig_params=True", "sync_module_states=True",
                                 "limit_all_gathers=True", "forward_prefetch=True",
                                 "cpu_offload=CPUOffload(offload_params=False)"])
def test_dropped_arguments_are_reported_with_their_reason(arg):
    result = rewrite(f"auto_wrap_policy=ModuleWrapPolicy({{Block}}), {arg}")
    assert not result.refusals
    key = arg.split("=")[0]
    assert any(f"dropped `{key}`" in c.what and c.why for c in result.changes), [c.what for c in result.changes]


@pytest.mark.parametrize("arg", ["param_init_fn=init", "ignored_modules=[model.blocks[0]]"])
def test_arguments_without_fsdp2_counterpart_are_refused(arg):
    found = refusal(f"auto_wrap_policy=ModuleWrapPolicy({{Block}}), {arg}")
    assert arg.split("=")[0] in found.what and found.line == line_of("model = FSDP(", source_of())


def test_full_state_dict_is_gathered_on_every_rank_and_saved_by_rank_0():
    code = out()
    assert ("    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
            "    if rank == 0:\n        torch.save(sd, \"m.pt\")\n") in code


def test_a_save_inside_the_block_is_gated_and_the_gather_stays_outside():
    save = ('    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):\n'
            '        torch.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}, "c.pt")')
    code = out(save=save)
    assert ("    model_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))\n"
            "    opt_state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))\n"
            "    if rank == 0:\n"
            '        torch.save({"model": model_state, "optim": opt_state}, "c.pt")\n') in code


def test_sharded_state_dict_becomes_get_state_dict_for_dcp():
    save = ('    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):\n'
            '        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}\n'
            '        dcp.save(state, checkpoint_id="ckpt")')
    source = SCRIPT.format(wrap="", clip="pass", save=save).replace("import os\n", "import os\nimport torch.distributed.checkpoint as dcp\n")
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals
    code = result.code.decode()
    assert ('    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}\n'
            '    dcp.save(state, checkpoint_id="ckpt")\n') in code
    assert "StateDictType" not in code


def test_loads_inside_a_full_state_dict_block():
    save = ('    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):\n'
            '        model.load_state_dict(torch.load("m.pt"))\n'
            '        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, torch.load("o.pt")))')
    code = out(save=save)
    assert 'set_model_state_dict(model, torch.load("m.pt"), options=StateDictOptions(full_state_dict=True))' in code
    assert 'set_optimizer_state_dict(model, opt, torch.load("o.pt"), options=StateDictOptions(full_state_dict=True))' in code


def test_local_state_dict_is_refused():
    save = ('    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):\n'
            '        sd = model.state_dict()')
    found = refusal(save=save)
    assert "LOCAL_STATE_DICT" in found.what or "LOCAL_STATE_DICT" in found.why


def test_clip_grad_norm_method_becomes_the_torch_function_and_its_norm_is_read_whole():
    source = SCRIPT.format(wrap="", clip="norm = model.clip_grad_norm_(1.0)", save=FULL_SAVE).replace(
        "        opt.step()\n", "        opt.step()\n        print(norm.item())\n")
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    code = result.code.decode()
    assert ("        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "        norm = norm.full_tensor()\n") in code


def test_sharded_grad_scaler_becomes_the_amp_scaler():
    source = SCRIPT.format(wrap="", clip="pass", save=FULL_SAVE).replace(
        "    opt = torch.optim.AdamW(model.parameters())\n",
        "    opt = torch.optim.AdamW(model.parameters())\n    scaler = ShardedGradScaler(init_scale=2.0**8)\n",
    ).replace("import os\n", "import os\nfrom torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n")
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    code = result.code.decode()
    assert "scaler = torch.amp.GradScaler(init_scale=2.0**8)" in code and "ShardedGradScaler" not in code


def test_summon_full_params_is_refused_with_the_fsdp2_alternative():
    save = ('    with FSDP.summon_full_params(model):\n'
            '        print(model.blocks[0].fc.weight.sum())')
    found = refusal(save=save)
    assert "summon_full_params" in found.what and "full_tensor" in found.hint
    assert found.line == line_of("summon_full_params", source_of(save=save))


def test_no_sync_is_refused():
    found = refusal(clip="with model.no_sync():\n            pass")
    assert "no_sync" in found.what


def test_an_fsdp1_call_the_rewrite_does_not_know_is_refused():
    clip = "FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)"
    found = refusal(clip=clip)
    assert found.line == line_of("set_state_dict_type", source_of(clip=clip))


def test_cli_refuses_with_file_line_exit_2_and_keeps_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "train.py"
    source = SCRIPT.format(wrap="auto_wrap_policy=my_policy", clip="pass", save=FULL_SAVE)
    path.write_text(source)
    result = CliRunner().invoke(cli.main, ["rewrite", str(path)])
    assert result.exit_code == 2, result.output
    assert f"{path}:{line_of('model = FSDP(', source)}:" in result.output
    assert path.read_text() == source


def test_a_state_dict_outside_state_dict_type_is_fsdp1s_default_full_state_dict():
    save = '    sd = model.state_dict()\n    if rank == 0:\n        torch.save(sd, "m.pt")'
    code = out(save=save)
    assert ('    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))\n'
            '    if rank == 0:\n        torch.save(sd, "m.pt")\n') in code


def test_a_model_built_in_the_wrap_call_is_kept():
    source = source_of().replace("    model = Net()\n    model = FSDP(model, ", "    model = FSDP(Net(), ")
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals
    code = result.code.decode()
    assert "    model = Net()\n" in code and "fully_shard(model, mesh=mesh)" in code


def test_the_wrapped_module_attribute_is_the_model_itself():
    save = '    sd = model.module.state_dict()\n    if rank == 0:\n        torch.save(sd, "m.pt")'
    result = rewrite(save=save, export="full")
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "model.module." not in code and "get_model_state_dict(model" in code


# --- a policy defined in a sibling module (issue 15 item 7) ---------------------

SIBLING_POLICIES = {
    "partial": "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=LAYERS)\nLAYERS = {Block}",
    "module": "ModuleWrapPolicy({Block})",
    "lambda": "lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, Block)",
}


@pytest.mark.parametrize("kind", sorted(SIBLING_POLICIES))
def test_a_policy_imported_from_a_sibling_module_names_the_units(kind, tmp_path):
    """`from policies import wrap_policy`: read in policies.py (the classes it names come
    from model.py there), never imported; policies.py is left as it is."""
    (tmp_path / "model.py").write_text("import torch.nn as nn\n\n\nclass Block(nn.Module):\n    pass\n")
    value = SIBLING_POLICIES[kind]
    policies = (
        "import functools\n"
        "from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy\n"
        "from model import Block\n\n"
        f"wrap_policy = {value}\n"
    )
    (tmp_path / "policies.py").write_text(policies)
    text = source_of("auto_wrap_policy=wrap_policy").replace("import functools\n", "from policies import wrap_policy\n")
    path = tmp_path / "train.py"
    path.write_text(text)
    result = rewrite_source(text.encode(), str(path), RetrofitOptions())
    assert not result.refusals, result.refusals
    assert SHARD_BLOCKS.format(extra="") in result.code.decode()
    assert (tmp_path / "policies.py").read_text() == policies


def test_a_sibling_policy_that_cannot_be_read_is_refused_at_the_wrap(tmp_path):
    (tmp_path / "policies.py").write_text("def wrap_policy(module, recurse, nonwrapped_numel):\n    return recurse\n")
    text = source_of("auto_wrap_policy=wrap_policy").replace("import functools\n", "from policies import wrap_policy\n")
    path = tmp_path / "train.py"
    path.write_text(text)
    result = rewrite_source(text.encode(), str(path), RetrofitOptions())
    assert [r.code for r in result.refusals] == ["FSR303"]
    assert result.refusals[0].line == line_of("model = FSDP(model", text)


# --- settings kept in a policies/ package (issue 28) ------------------------------

PACKAGE_WRAPPING = (
    "import functools\n"
    "from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy\n"
    "from model import Block\n\n"
)
PACKAGE_SHAPES = {
    # a function's return, its local name followed; re-exported by __init__.py
    "function": ("from .wrapping import get_wrapper\n", "def get_wrapper():\n    policy = functools.partial("
                 "transformer_auto_wrap_policy, transformer_layer_cls={Block})\n    return policy\n",
                 "from policies import get_wrapper", "get_wrapper()"),
    # the classes in a local name of the function
    "function_local_classes": ("from .wrapping import *\n", "def get_wrapper():\n    layers = {Block}\n"
                               "    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layers)\n",
                               "from policies import get_wrapper", "get_wrapper()"),
    # the package module itself, its function called through it
    "module_attribute": ("from .wrapping import get_wrapper\n", "def get_wrapper():\n    return functools.partial("
                         "transformer_auto_wrap_policy, transformer_layer_cls={Block})\n",
                         "import policies", "policies.get_wrapper()"),
    # a module-level name of wrapping.py, re-exported under another name
    "module_level_name": ("from .wrapping import block_policy as wrap_policy\n", "block_policy = functools.partial("
                          "transformer_auto_wrap_policy, transformer_layer_cls={Block})\n",
                          "from policies import wrap_policy", "wrap_policy"),
}


def _package(tmp_path, init: str, wrapping: str, mixed: str = "") -> None:
    (tmp_path / "model.py").write_text("import torch.nn as nn\n\n\nclass Block(nn.Module):\n    pass\n")
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "__init__.py").write_text(init)
    (tmp_path / "policies" / "wrapping.py").write_text(PACKAGE_WRAPPING + wrapping)
    (tmp_path / "policies" / "mixed_precision.py").write_text(mixed)


def _package_rewrite(tmp_path, import_line: str, wrap: str):
    text = source_of(wrap).replace("import functools\n", import_line + "\n")
    path = tmp_path / "train.py"
    path.write_text(text)
    return text, rewrite_source(text.encode(), str(path), RetrofitOptions())


@pytest.mark.parametrize("shape", sorted(PACKAGE_SHAPES))
def test_a_policy_built_in_a_policies_package_names_the_units(shape, tmp_path):
    """`FSDP(model, auto_wrap_policy=get_wrapper())` with get_wrapper re-exported by
    policies/__init__.py: followed to policies/wrapping.py and to what it returns."""
    init, wrapping, import_line, call = PACKAGE_SHAPES[shape]
    _package(tmp_path, init, wrapping)
    _, result = _package_rewrite(tmp_path, import_line, f"auto_wrap_policy={call}")
    assert not result.refusals, result.refusals
    assert SHARD_BLOCKS.format(extra="") in result.code.decode()


def test_a_mixed_precision_star_imported_by_a_policies_package_is_read(tmp_path):
    """`from .mixed_precision import *` in policies/__init__.py: bfSixteen is read in
    policies/mixed_precision.py and becomes the MixedPrecisionPolicy."""
    mixed = ("import torch\nfrom torch.distributed.fsdp import MixedPrecision\n\n"
             "bfSixteen = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)\n")
    _package(tmp_path, "from .wrapping import get_wrapper\nfrom .mixed_precision import *\n",
             PACKAGE_SHAPES["function"][1], mixed)
    _, result = _package_rewrite(tmp_path, "from policies import bfSixteen, get_wrapper",
                                 "auto_wrap_policy=get_wrapper(), mixed_precision=bfSixteen")
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in code
    assert SHARD_BLOCKS.format(extra=", mp_policy=mp_policy") in code


@pytest.mark.parametrize("wrapping, call, why", [
    # which policy it returns depends on a value known only when it runs
    ("def get_wrapper(big):\n    if big:\n        return functools.partial(transformer_auto_wrap_policy, "
     "transformer_layer_cls={Block})\n    return None\n", "get_wrapper(True)",
     "get_wrapper() (policies/wrapping.py:5) can return 2 different values"),
    # the classes are its caller's argument (not followed into the other module)
    ("def get_wrapper(layer):\n    return functools.partial(transformer_auto_wrap_policy, "
     "transformer_layer_cls={layer})\n", "get_wrapper(Block)",
     "what get_wrapper() (policies/wrapping.py:5) returns is made from its parameter `layer`"),
])
def test_a_package_policy_that_cannot_be_read_is_refused_with_why(wrapping, call, why, tmp_path):
    _package(tmp_path, "from .wrapping import get_wrapper\n", wrapping)
    text, result = _package_rewrite(tmp_path, "from policies import get_wrapper", f"auto_wrap_policy={call}")
    assert [(r.code, r.why) for r in result.refusals] == [("FSR303", why)]
    assert result.refusals[0].line == line_of("model = FSDP(model", text)


def _helper_policies(tmp_path, mixed_line: str):
    _package(tmp_path, "from .wrapping import get_wrapper\n", PACKAGE_SHAPES["function"][1])
    (tmp_path / "helpers.py").write_text(
        "from policies import get_wrapper\n\n\ndef get_policies(cfg):\n" + mixed_line +
        "    return mixed, get_wrapper()\n")
    text = source_of("auto_wrap_policy=wrap_policy, mixed_precision=mixed").replace(
        "import functools\n", "from helpers import get_policies\n").replace(
        "    model = Net()\n", "    model = Net()\n    mixed, wrap_policy = get_policies(None)\n")
    path = tmp_path / "train.py"
    path.write_text(text)
    return text, rewrite_source(text.encode(), str(path), RetrofitOptions())


def test_policies_unpacked_from_a_helper_of_another_module_are_read_by_value(tmp_path):
    """pytorch/examples' T5 shape: `mixed_precision_policy, wrap_policy = get_policies(cfg)`:
    each element of the tuple the helper returns is followed (was FSR303 before issue 43)."""
    text, result = _helper_policies(tmp_path, "    mixed = None\n")
    assert not result.refusals, result.refusals
    assert SHARD_BLOCKS.format(extra="") in result.code.decode()
    assert "get_policies(None)" not in result.code.decode()


def test_policies_unpacked_from_a_config_dependent_helper_stay_refused(tmp_path):
    """Its mixed precision depends on the config (known only when it runs): refused at the wrap."""
    text, result = _helper_policies(tmp_path, "    mixed = MixedPrecision(param_dtype=torch.bfloat16) if cfg else None\n")
    assert [r.code for r in result.refusals][:1] == ["FSR303"]
    assert result.refusals[0].what.startswith("mixed_precision=mixed")
    assert result.refusals[0].line == line_of("model = FSDP(model", text)


# --- settings read by value from a config dataclass and a helper's tuple (issue 43) -----

CONFIG = '''\
from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    {field}
    lr: float = 1e-3


'''


def _config_rewrite(field_line: str, wrap: str, before_wrap: str = "", **options):
    """The script with a TrainConfig dataclass; `cfg = TrainConfig()` then `before_wrap` come before the wrap."""
    text = source_of(wrap).replace("\n\ndef main():\n", "\n\n" + CONFIG.format(field=field_line) + "def main():\n")
    text = text.replace("    model = Net()\n", "    model = Net()\n    cfg = TrainConfig()\n" + before_wrap)
    return text, rewrite_source(text.encode(), "train.py", RetrofitOptions(**options))


@pytest.mark.parametrize("field_line", [
    "sharding_strategy: ShardingStrategy = ShardingStrategy.SHARD_GRAD_OP",
    "sharding_strategy: ShardingStrategy = field(default=ShardingStrategy.SHARD_GRAD_OP)",
])
def test_a_strategy_from_a_config_dataclass_default_is_read_by_value(field_line):
    text, result = _config_rewrite(field_line, "auto_wrap_policy=ModuleWrapPolicy({Block}), "
                                               "sharding_strategy=cfg.sharding_strategy")
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert SHARD_BLOCKS.format(extra=", reshard_after_forward=False") in code
    assert field_line in code and "import (\n" in code  # the dataclass stays as written, ShardingStrategy imported
    assert "ShardingStrategy" in code.split("class TrainConfig")[0]


def test_a_reassigned_config_field_is_refused_where_it_is_reassigned():
    text, result = _config_rewrite("sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD",
                                   "sharding_strategy=cfg.sharding_strategy",
                                   "    cfg.sharding_strategy = ShardingStrategy.SHARD_GRAD_OP\n")
    assert [r.code for r in result.refusals] == ["FSR303"]
    found = result.refusals[0]
    assert found.line == line_of("cfg.sharding_strategy = ShardingStrategy.SHARD_GRAD_OP", text)
    assert "another value" in found.why and result.code == text.encode()


def test_a_config_built_with_the_field_is_refused_at_the_construction():
    text, result = _config_rewrite("sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD",
                                   "sharding_strategy=cfg.sharding_strategy",
                                   "    cfg = TrainConfig(sharding_strategy=ShardingStrategy.NO_SHARD)\n")
    assert [r.code for r in result.refusals] == ["FSR303"]


def test_hybrid_shard_from_a_config_default_converts_as_inline():
    field_line = "sharding_strategy: ShardingStrategy = ShardingStrategy.HYBRID_SHARD"
    wrap = "auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=cfg.sharding_strategy"
    text, result = _config_rewrite(field_line, wrap)
    assert not result.refusals, result.refusals
    assert 'int(os.environ["LOCAL_WORLD_SIZE"])' in result.code.decode()  # one replica per node, at run time
    _, result = _config_rewrite(field_line, wrap, hsdp=2)
    assert not result.refusals and 'mesh_dim_names=("replicate", "shard")' in result.code.decode()


@pytest.mark.parametrize("unpacked", [
    "    mp_policy, wrap_policy = get_policies(rank)\n",
    "    mp_policy, wrap_policy = None, ModuleWrapPolicy({Block})\n",
])
def test_policies_unpacked_from_a_tuple_are_read_by_value(unpacked):
    helper = ("def get_policies(rank):\n    mixed = None\n    wrapping = ModuleWrapPolicy({Block})\n"
              "    return mixed, wrapping\n\n\n")
    text = source_of("auto_wrap_policy=wrap_policy, mixed_precision=mp_policy")
    if "get_policies" in unpacked:
        text = text.replace("\n\ndef main():\n", "\n\n" + helper + "def main():\n")
    text = text.replace("    model = Net()\n", "    model = Net()\n" + unpacked)
    result = rewrite_source(text.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert SHARD_BLOCKS.format(extra="") in code and unpacked not in code  # the tuple's statement goes with the wrap


def test_a_tuple_of_another_length_is_refused_with_the_reason():
    text = source_of("auto_wrap_policy=wrap_policy")
    text = text.replace("    model = Net()\n", "    model = Net()\n    mp_policy, wrap_policy = get_policies(rank)\n")
    text = text.replace("\n\ndef main():\n", "\n\ndef get_policies(rank):\n    return None, None, rank\n\n\ndef main():\n")
    result = rewrite_source(text.encode(), "train.py", RetrofitOptions())
    assert [r.code for r in result.refusals] == ["FSR303"]
    assert "made from its parameter" in result.refusals[0].why or "tuple of 2" in result.refusals[0].why


def _project(tmp_path, edit=None):
    """fixtures/rewrite/fsdp1_project as a user's folder, `edit(folder)` applied, rewritten."""
    import shutil
    from pathlib import Path

    case = Path(__file__).resolve().parent.parent / "fixtures" / "rewrite" / "fsdp1_project"
    for name in ("input.py", "model.py", "dist_utils.py", "configs.py", "policies.py", "checkpointing.py",
                 "train_utils.py"):
        shutil.copyfile(case / name, tmp_path / name)
    if edit is not None:
        edit(tmp_path)
    path = tmp_path / "input.py"
    return rewrite_source(path.read_bytes(), str(path), RetrofitOptions())


def _replace(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_a_project_whose_config_field_is_reassigned_in_another_module_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    result = _project(tmp_path, lambda d: _replace(
        d / "train_utils.py", "    for epoch in range(cfg.epochs):\n",
        "    cfg.sharding_strategy = None\n    for epoch in range(cfg.epochs):\n"))
    assert [r.code for r in result.refusals] == ["FSR303"]
    refusal = result.refusals[0]
    where = f"{refusal.path}:{refusal.line}"
    assert "train_utils.py:6" in where or "train_utils.py:6" in refusal.why, (where, refusal.why)
    assert "another value" in refusal.why and not result.siblings


def test_a_project_whose_config_default_is_hybrid_shard_gets_a_mesh_per_node(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    result = _project(tmp_path, lambda d: _replace(d / "configs.py", "ShardingStrategy.FULL_SHARD",
                                                   "ShardingStrategy.HYBRID_SHARD"))
    assert not result.refusals, result.refusals
    assert 'int(os.environ["LOCAL_WORLD_SIZE"])' in result.code.decode()


def test_a_policy_a_helper_gives_two_values_is_refused_with_that_reason():
    """`wrap = None` then `wrap = ModuleWrapPolicy({Block})` in the helper whose tuple the wrap unpacks: the
    refusal says the name is given two values (it said only which policies the rewrite reads)."""
    helper = ("def get_policies():\n    mp = None\n    wrap = None\n    wrap = ModuleWrapPolicy({Block})\n"
              "    return mp, wrap\n\n\n")
    source = source_of("auto_wrap_policy=wrap_policy, mixed_precision=mp_policy").replace(
        "def main():\n", helper + "def main():\n    mp_policy, wrap_policy = get_policies()\n")
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert [r.code for r in result.refusals] == ["FSR303"], result.refusals
    assert "`wrap` is given 2 values where it is read (`ModuleWrapPolicy({Block})`, `None`)" in result.refusals[0].why


TRAINER = '''\
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


@dataclass
class Settings:
    strategy: ShardingStrategy = ShardingStrategy.SHARD_GRAD_OP


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(depth)])

    def forward(self, x):
        return self.blocks(x)


class Learner:
    def __init__(self, module, settings):
        self.module = FSDP(module, auto_wrap_policy=ModuleWrapPolicy({{Block}}), sharding_strategy=settings.strategy)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)

    def step(self, x):
        loss = self.module(x).sum()
        loss.backward()
        self.module.clip_grad_norm_(1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()


def main():
    dist.init_process_group("gloo")
    net = Net()
{learners}
    for _ in range(2):
        learner.step(torch.randn(8, 4))


if __name__ == "__main__":
    main()
'''


def test_a_wrap_on_an_attribute_with_a_strategy_the_constructor_is_handed_migrates():
    """`self.module = FSDP(module, ..., sharding_strategy=settings.strategy)` in a class whose one
    construction hands it `Settings()`: was FSR301 'not the whole value of `name = FSDP(...)`'."""
    source = TRAINER.format(learners="    learner = Learner(net, Settings())")
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert "        self.module = module\n" in code
    assert "fully_shard(net, mesh=mesh, reshard_after_forward=False)" in code
    assert "torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)" in code
    assert "FSDP(" not in code


def test_a_strategy_parameter_handed_two_values_is_refused_with_that_reason():
    source = TRAINER.format(learners=(
        "    learner = Learner(net, Settings())\n"
        "    spare = Learner(Net(1), Settings(strategy=ShardingStrategy.FULL_SHARD))"))
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert "FSR303" in [r.code for r in result.refusals], result.refusals
    why = next(r.why for r in result.refusals if r.code == "FSR303")
    assert "`settings` is a parameter handed 2 different values by the calls `Learner(...)`" in why
