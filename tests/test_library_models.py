"""Models built by libraries (transformers, torchvision, timm): the table of layouts,
and scripts that name their model by a class, a config or a string. The libraries
are never imported (the rewriter reads names only)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from textwrap import dedent

import libcst as cst
import pytest

from fsdp2_retrofit.analysis import analyse
from fsdp2_retrofit.analysis.library_models import is_library_builder, library_model
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source


@pytest.mark.parametrize(
    "qname, path, block",
    [
        ("transformers.LlamaForCausalLM", ("model", "layers"), "LlamaDecoderLayer"),
        ("transformers.LlamaForCausalLM.from_pretrained", ("model", "layers"), "LlamaDecoderLayer"),
        ("transformers.models.llama.modeling_llama.LlamaForCausalLM", ("model", "layers"), "LlamaDecoderLayer"),
        ("transformers.LlamaModel.from_pretrained", ("layers",), "LlamaDecoderLayer"),
        ("transformers.MistralForCausalLM.from_pretrained", ("model", "layers"), "MistralDecoderLayer"),
        ("transformers.Qwen2ForCausalLM.from_pretrained", ("model", "layers"), "Qwen2DecoderLayer"),
        ("transformers.Gemma2ForCausalLM.from_pretrained", ("model", "layers"), "Gemma2DecoderLayer"),
        ("transformers.GPT2LMHeadModel.from_pretrained", ("transformer", "h"), "GPT2Block"),
        ("transformers.GPT2Model.from_pretrained", ("h",), "GPT2Block"),
        ("transformers.GPTJForCausalLM.from_pretrained", ("transformer", "h"), "GPTJBlock"),
        ("transformers.GPTNeoXForCausalLM.from_pretrained", ("gpt_neox", "layers"), "GPTNeoXLayer"),
        ("transformers.OPTForCausalLM.from_pretrained", ("model", "decoder", "layers"), "OPTDecoderLayer"),
        ("transformers.BertForSequenceClassification.from_pretrained", ("bert", "encoder", "layer"), "BertLayer"),
        ("transformers.BertModel.from_pretrained", ("encoder", "layer"), "BertLayer"),
    ],
)
def test_transformers_classes_map_to_their_layer_paths(qname, path, block):
    found = library_model(qname, None, None)
    assert found.containers == ((path, block),) and not found.no_split_modules


@pytest.mark.parametrize(
    "qname, paths, block",
    [
        ("torchvision.models.resnet18", [("layer1",), ("layer2",), ("layer3",), ("layer4",)], "BasicBlock"),
        ("torchvision.models.resnet50", [("layer1",), ("layer2",), ("layer3",), ("layer4",)], "Bottleneck"),
        ("torchvision.models.resnet.resnext50_32x4d", [("layer1",), ("layer2",), ("layer3",), ("layer4",)],
         "Bottleneck"),
        ("torchvision.models.vit_b_16", [("encoder", "layers")], "EncoderBlock"),
    ],
)
def test_torchvision_builders_map_to_their_block_paths(qname, paths, block):
    found = library_model(qname, None, None)
    assert found.containers == tuple((p, block) for p in paths)


@pytest.mark.parametrize(
    "qname",
    ["transformers.AutoTokenizer.from_pretrained", "transformers.LlamaConfig", "transformers.AutoConfig.from_pretrained",
     "torchvision.models.ResNet", "torch.nn.Linear", "timm.data.create_transform"],
)
def test_tokenizers_configs_and_others_are_not_library_models(qname):
    assert not is_library_builder(qname)


def test_an_architecture_missing_from_the_table_falls_back_to_no_split_modules():
    found = library_model("transformers.MambaForCausalLM.from_pretrained", None, None)
    assert found.no_split_modules and not found.containers


def _rewrite(script: str, **options):
    return rewrite_source(dedent(script).encode(), "train.py", RetrofitOptions(**options))


def _script(imports: str, build: str) -> str:
    return dedent(imports).strip() + "\nimport torch\n\n\ndef main(name):\n" + "".join(
        f"    {line}\n" for line in dedent(build).strip().splitlines()
    ) + dedent('''
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for batch in range(3):
            loss = model(batch).sum()
            loss.backward()
            optimizer.step()
    ''').replace("\n", "\n    ").rstrip() + "\n"


def _out(imports: str, build: str, **options) -> str:
    result = _rewrite(_script(imports, build), **options)
    assert not result.refusals, result.refusals
    return result.code.decode()


def test_the_qualified_builder_name_is_the_models_class():
    script = _script("import transformers", "model = transformers.AutoModelForCausalLM.from_config(cfg)")
    facts = analyse(cst.parse_module(script))
    assert [m.class_name for m in facts.models] == ["transformers.AutoModelForCausalLM.from_config"]


@pytest.mark.parametrize(
    "imports, build",
    [
        ("import transformers", 'model = transformers.AutoModelForCausalLM.from_pretrained("org/some-model")'),
        ("from transformers import AutoModelForCausalLM as Auto", "model = Auto.from_pretrained(name).cuda()"),
        ("from transformers import AutoConfig, AutoModelForCausalLM",
         "config = AutoConfig.from_pretrained(name)\nmodel = AutoModelForCausalLM.from_config(config)"),
        ("from transformers import AutoModelForCausalLM", "model = AutoModelForCausalLM.from_config(load_config(name))"),
    ],
)
def test_a_model_named_by_a_string_is_sharded_by_no_split_modules_at_run_time(imports, build):
    out = _out(imports, build)
    assert "    no_split = model._no_split_modules or ()\n" in out
    assert "    blocks = [module for module in model.modules() if type(module).__name__ in no_split]\n" in out
    assert "    for block in reversed(blocks):\n" in out
    assert "        fully_shard(block, mesh=mesh, reshard_after_forward=block is not blocks[-1])\n" in out
    assert out.index("fully_shard(block") < out.index("    fully_shard(model, mesh=mesh)\n")


@pytest.mark.parametrize(
    "imports, build, path",
    [
        ("from transformers import AutoModelForCausalLM, GPT2Config",
         "model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2))", "model.transformer.h"),
        ("from transformers import AutoModel, LlamaConfig",
         "cfg = LlamaConfig.from_pretrained(name)\nmodel = AutoModel.from_config(cfg)", "model.layers"),
        ("from transformers.models.opt.modeling_opt import OPTForCausalLM",
         "model = OPTForCausalLM.from_pretrained(name)", "model.model.decoder.layers"),
        ("import torchvision", "model = torchvision.models.vit_b_16(weights=None)", "model.encoder.layers"),
        ("from torchvision.models import get_model", 'model = get_model("vit_b_16")', "model.encoder.layers"),
        ("import timm", 'model = timm.create_model("vit_base_patch16_224.augreg_in1k", pretrained=False)',
         "model.blocks"),
        ("import timm", 'model = timm.create_model(model_name="convnext_tiny")', "model.stages"),
    ],
)
def test_a_known_architecture_is_sharded_by_its_layer_path(imports, build, path):
    out = _out(imports, build)
    assert f"    for index, block in enumerate({path}):\n" in out
    assert "no_split" not in out


def test_torchvision_resnet_shards_the_blocks_of_each_stage():
    out = _out("from torchvision import models", "model = models.resnet50()")
    for n in range(1, 4):
        assert f"    for block in model.layer{n}:\n        fully_shard(block, mesh=mesh)\n" in out
    assert "    for index, block in enumerate(model.layer4):\n" in out


@pytest.mark.parametrize(
    "imports, build, reason",
    [
        ("import timm", "model = timm.create_model(name)", "not a literal string"),
        ("import torchvision", "model = torchvision.models.get_model(name)", "not a literal string"),
        ("import torchvision", "model = torchvision.models.squeezenet1_0()", "not in the table"),
    ],
)
def test_an_unknown_vision_model_keeps_only_the_root_and_says_why(imports, build, reason):
    result = _rewrite(_script(imports, build))
    assert not result.refusals
    assert "    fully_shard(model, mesh=mesh)\n" in result.code.decode()
    assert "for block" not in result.code.decode()
    notes = [a for a in result.attention if "only the root is sharded" in a.what]
    assert notes and reason in notes[0].why


def test_shard_names_the_unit_class_of_an_unknown_vision_model():
    result = _rewrite(_script("import timm", "model = timm.create_model(name)"), shard=("Block",))
    assert 'if type(module).__name__ in ("Block",) and module is not model:' in result.code.decode()


def test_the_report_says_which_layers_became_units_and_why():
    result = _rewrite(_script("from transformers import LlamaForCausalLM", "model = LlamaForCausalLM.from_pretrained(name)"))
    whats = [c.what for c in result.changes if c.code == "shard"]
    assert any("a transformers Llama model (the class is LlamaForCausalLM)" in w and "`.model.layers`" in w
               and "stay in the root unit" in w for w in whats), whats


def test_meta_init_of_a_library_model_is_refused():
    result = _rewrite(_script("import transformers", "model = transformers.AutoModelForCausalLM.from_pretrained(name)"),
                      meta_init=True)
    assert [r.what for r in result.refusals] == ["--meta-init: `model` is built by transformers"]
    assert "pretrained weights" in result.refusals[0].why


@pytest.mark.parametrize("build", ["model = torchvision.models.resnet18()", 'model = timm.create_model("resnet50d")'])
def test_mixed_precision_of_a_library_resnet_is_refused_for_its_batchnorm(build):
    result = _rewrite(_script("import timm\nimport torchvision", build), mixed_precision="bf16")
    assert [r.what for r in result.refusals] == ["--mixed-precision bf16: `model` has BatchNorm layers"]


def test_mixed_precision_of_a_library_vit_is_not_refused():
    result = _rewrite(_script("import timm", 'model = timm.create_model("vit_small_patch16_224")'),
                      mixed_precision="bf16")
    assert not result.refusals


@pytest.mark.parametrize(
    "build, what, line",
    [
        ('model = AutoModelForCausalLM.from_pretrained(name, device_map="auto")',
         "`device_map=` places the model over devices with accelerate hooks", 7),
        ("model = AutoModelForCausalLM.from_pretrained(name, load_in_4bit=True)",
         "`load_in_4bit=` quantizes the model with bitsandbytes", 7),
        ("model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb)",
         "`quantization_config=` quantizes the model", 7),
        ("model = AutoModelForCausalLM.from_pretrained(name)\nmodel = get_peft_model(model, lora)",
         "`model` is wrapped by `get_peft_model` (PEFT) after it is built", 8),
        ("model = AutoModelForCausalLM.from_pretrained(name)\nmodel.push_to_hub(name)",
         "`model.push_to_hub` of a model the rewrite shards", 8),
        ("model = AutoModelForCausalLM.from_pretrained(name)\nif rank == 0:\n    model.save_pretrained(name)",
         "`model.save_pretrained` under a rank test", 9),
        ("model = AutoModelForCausalLM.from_pretrained(name)\nmodel.save_pretrained(name, state_dict=sd)",
         "`model.save_pretrained` is given its own state_dict", 8),
    ],
)
def test_placed_quantized_peft_or_save_pretrained_models_are_refused(build, what, line):
    script = _script("from peft import get_peft_model\nfrom transformers import AutoModelForCausalLM", build)
    result = _rewrite(script)
    assert [r.what for r in result.refusals] == [what]
    assert result.refusals[0].line == line and result.refusals[0].why and result.refusals[0].hint


def test_a_library_model_from_a_factory_function_is_known_by_its_builder():
    script = dedent('''
        import torch
        import torchvision
        from transformers import AutoModelForCausalLM


        def build(name):
            return AutoModelForCausalLM.from_config(name)


        def main(name):
            model = build(name)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for batch in range(3):
                model(batch).sum().backward()
                optimizer.step()
    ''')
    result = _rewrite(script)
    assert not result.refusals
    assert "in no_split]" in result.code.decode()
    assert any("its class is known only at run time" in c.what for c in result.changes)


# -- the units the outputs make, on one process --------------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite"
UNIT_PROBE = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
device = "cpu"
args = type("Args", (), {"model": "stand-in/tiny-llama"})()
def group_norm(channels):
    return torch.nn.GroupNorm(4, channels)
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    "case, units",
    [
        ("hf_causal_lm", {"FSDPLlamaForCausalLM": 1, "FSDPLlamaDecoderLayer": 3}),
        ("hf_pretrained_no_split", {"FSDPLlamaForCausalLM": 1, "FSDPLlamaDecoderLayer": 3}),
        ("torchvision_resnet", {"FSDPResNet": 1, "FSDPBasicBlock": 8}),
    ],
)
def test_the_outputs_shard_the_library_blocks(case, units, tmp_path):
    """The shard statements of expected.py, run on one process against the fixture's
    stand-in library: each decoder layer / residual block is its own FSDP unit (a
    parity run alone would pass with only the root sharded)."""
    pytest.importorskip("torch")
    lines = (FIXTURES / case / "expected.py").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("    device = "))
    end = next(i for i, l in enumerate(lines) if l.startswith("    optimizer = "))
    body = "\n".join(l[4:] for l in lines[start + 1:end])
    imports = "\n".join(l for l in lines if l.startswith(("import ", "from ")))
    probe = imports + UNIT_PROBE + body + "\nprint(sorted(type(m).__name__ for m in model.modules() "
    probe += "if type(m).__name__.startswith('FSDP')))\ndist.destroy_process_group()\n"
    env = dict(os.environ, PYTHONPATH=str(FIXTURES / case), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "pg")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert {name: found.count(name) for name in set(found)} == units


@pytest.mark.e2e
def test_save_pretrained_writes_the_full_weights_once(tmp_path):
    """hf_pretrained_no_split also saves with save_pretrained: the output gathers the
    full state dict on every rank and writes it on rank 0; the folder holds the
    single-process run's weights (a save of the sharded model would hold DTensors)."""
    pytest.importorskip("torch")
    from fsdp2_retrofit.verify import compare_saved, launch_distributed, launch_single

    case = FIXTURES / "hf_pretrained_no_split"
    launch_single(case / "input.py", ["--out", str(tmp_path / "single" / "out.pt"), "--batch-size", "32"],
                  tmp_path / "single")
    launch_distributed(case / "expected.py", ["--out", str(tmp_path / "dist" / "out.pt"), "--batch-size", "16"],
                       tmp_path / "dist")
    # compare_saved refuses a DTensor (a save of the sharded model) as "not a full tensor"
    result = compare_saved(tmp_path / "single" / "out.pt.hf" / "pytorch_model.bin",
                           tmp_path / "dist" / "out.pt.hf" / "pytorch_model.bin", [], 1e-4)
    print(f"\nsave_pretrained: max |single - distributed| = {result.max_abs_diff}")
    assert result.ok, result.problem


def test_save_pretrained_gathers_on_every_rank_and_writes_on_rank_zero():
    script = _script("from transformers import AutoModelForCausalLM",
                     "model = AutoModelForCausalLM.from_pretrained(name)\nmodel.save_pretrained(name)")
    result = _rewrite(script)
    assert not result.refusals
    assert (
        "    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
        "    if rank == 0:\n"
        "        model.save_pretrained(name, state_dict=full_state)\n"
    ) in result.code.decode()
    again = rewrite_source(result.code, "train.py", RetrofitOptions())
    assert not again.refusals and again.code == result.code


@pytest.mark.parametrize(
    "imports, build",
    [
        ("import torchvision.models as models", "model = models.__dict__[name]()"),
        ("from torchvision import models", "model = getattr(models, name)(num_classes=10)"),
        ("import torchvision", "model = torchvision.models.get_model(name)"),
    ],
)
def test_a_torchvision_model_picked_by_name_at_run_time_may_have_batchnorm(imports, build):
    """`models.__dict__[arch]()` is `get_model(arch)`: a module (was FSR612), only the root
    sharded, and SyncBatchNorm made since its BatchNorm layers are not known (flagged on CPU)."""
    result = _rewrite(_script(imports, build))
    assert not result.refusals
    text = result.code.decode()
    assert "    fully_shard(model, mesh=mesh)\n" in text
    assert "SyncBatchNorm.convert_sync_batchnorm(model)" in text
    flagged = [a for a in result.attention if a.differs and "may have BatchNorm layers" in a.what]
    assert len(flagged) == 1


def test_a_run_time_torchvision_choice_with_a_norm_layer_has_no_batchnorm():
    result = _rewrite(_script("import torchvision.models as models", "model = models.__dict__[name](norm_layer=norm)"))
    assert not result.refusals
    assert "SyncBatchNorm" not in result.code.decode()
    assert not [a for a in result.attention if "BatchNorm" in a.what]


def test_a_namespace_lookup_of_another_module_is_not_a_model():
    result = _rewrite(_script("import mymodels", "model = mymodels.__dict__[name]()"))
    assert [r.code for r in result.refusals] == ["FSR611"]  # no module built: not read as a choice
