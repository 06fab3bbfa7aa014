"""BatchNorm in a model being sharded (fsdp2_retrofit/analysis/batchnorm.py and the shard
stage): `model = nn.SyncBatchNorm.convert_sync_batchnorm(model)` under
`if torch.cuda.is_available():` before fully_shard and the optimizer, in the file's own
spelling, reported as a change and as an attention item with `differs` (on CPU the
statistics stay per rank). The execution proof is fixtures/rewrite/batchnorm_per_rank
(tests/test_execution.py::test_batchnorm_on_cpu_trains_within_noise_and_is_flagged)."""
from __future__ import annotations

from pathlib import Path
from textwrap import dedent

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = '''
{imports}


class Net({nn}.Module):
    def __init__(self):
        super().__init__()
        self.fc = {nn}.Linear(4, 4)
        self.norm = {norm}

    def forward(self, x):
        return self.norm(self.fc(x))


def main():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 4)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
'''


def rewrite(code: str, path: str = "train.py", **options):
    return rewrite_source(dedent(code).encode(), path, RetrofitOptions(**options))


def script(imports: str = "import torch\nimport torch.nn as nn", nn: str = "nn", norm: str = "nn.BatchNorm1d(4)"):
    return SCRIPT.format(imports=imports, nn=nn, norm=norm)


def lines_between(result, first: str, last: str) -> list:
    lines = [line.strip() for line in result.code.decode().splitlines()]
    return lines[next(i for i, l in enumerate(lines) if l.startswith(first)):
                 next(i for i, l in enumerate(lines) if l.startswith(last)) + 1]


def test_the_model_is_converted_before_fully_shard_and_the_optimizer():
    result = rewrite(script())
    assert not result.refusals, result.refusals
    assert lines_between(result, "model = Net()", "opt = ") == [
        "model = Net()",
        "if torch.cuda.is_available():  # SyncBatchNorm (GPUs only): batch statistics of all ranks",
        "model = nn.SyncBatchNorm.convert_sync_batchnorm(model)",
        "fully_shard(model, mesh=mesh)",
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
    ]
    change = next(c for c in result.changes if "convert_sync_batchnorm" in c.what)
    assert change.code == "shard" and "`nn.BatchNorm1d(4)`, line 10" in change.what
    flagged = [a for a in result.attention if a.differs and a.code == "shard"]
    assert [(a.line, a.code) for a in flagged] == [(10, "shard")]
    assert "its own part of the batch" in flagged[0].what and "GPUs only" in flagged[0].why


def test_the_files_own_spelling_of_torch_nn():
    cases = {
        "import torch\nfrom torch import nn": ("nn", "nn.BatchNorm1d(4)", "nn.SyncBatchNorm"),
        "import torch": ("torch.nn", "torch.nn.BatchNorm1d(4)", "torch.nn.SyncBatchNorm"),
        "import torch\nfrom torch import nn\nfrom torch.nn import BatchNorm1d, SyncBatchNorm":
            ("nn", "BatchNorm1d(4)", "SyncBatchNorm"),
    }
    for imports, (nn, norm, sync) in cases.items():
        result = rewrite(script(imports, nn, norm))
        assert f"    model = {sync}.convert_sync_batchnorm(model)\n" in result.code.decode(), imports


def test_a_model_without_batchnorm_is_left_as_it_was():
    result = rewrite(script(norm="nn.LayerNorm(4)"))
    assert "SyncBatchNorm" not in result.code.decode()
    assert not [a for a in result.attention if a.differs and a.code == "shard"]


def test_a_batchnorm_in_a_block_class_or_passed_as_an_argument_is_found():
    block = script().replace(
        "class Net(nn.Module):",
        "class Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.bn = nn.BatchNorm2d(4)\n\n\nclass Net(nn.Module):",
    ).replace("self.norm = nn.BatchNorm1d(4)", "self.blocks = nn.ModuleList([Block() for _ in range(2)])\n"
              "        self.norm = nn.Identity()")
    result = rewrite(block)
    change = next(c for c in result.changes if "convert_sync_batchnorm" in c.what)
    assert "`nn.BatchNorm2d(4)`, line 9" in change.what
    argument = script(norm="norm_layer(4)").replace("def __init__(self):", "def __init__(self, norm_layer):").replace(
        "model = Net()", "model = Net(nn.BatchNorm1d)")
    result = rewrite(argument)
    assert "    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n" in result.code.decode()


def test_a_model_that_is_a_batchnorm_is_rebound_to_the_converted_module():
    code = script().replace("model = Net()", "model = nn.BatchNorm1d(4)")
    result = rewrite(code)
    assert "    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n" in result.code.decode()


def test_a_sibling_modules_batchnorm_is_named_by_file_and_line(tmp_path: Path):
    (tmp_path / "nets.py").write_text(
        "import torch.nn as nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.bn = nn.BatchNorm1d(4)\n\n    def forward(self, x):\n        return self.bn(x)\n"
    )
    code = script().split("\n\nclass Net")[0] + "\nfrom nets import Net\n\n\ndef main():" + script().split("def main():")[1]
    result = rewrite(code, str(tmp_path / "train.py"))
    assert not result.refusals, result.refusals
    flagged = [a for a in result.attention if a.differs and a.code == "shard"]
    assert len(flagged) == 1 and "nets.py:7" in flagged[0].what
    assert flagged[0].line == dedent(code).splitlines().index("    model = Net()") + 1


def test_a_torchvision_resnet_is_converted_unless_its_norm_layer_is_another():
    code = script().split("\n\nclass Net")[0] + "\nimport torchvision\n\n\ndef main():" + script().split(
        "def main():")[1].replace("model = Net()", "model = torchvision.models.resnet18(num_classes=4)")
    result = rewrite(code)
    assert "    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n" in result.code.decode()
    assert [a.what for a in result.attention if a.differs and a.code == "shard"] == [
        "on CPU (gloo) each rank's BatchNorm normalises with its own part of the batch "
        "(`torchvision `resnet18` (its BatchNorm layers)`, line 10)"
    ]
    group = rewrite(code.replace("num_classes=4)", "num_classes=4, norm_layer=lambda c: nn.GroupNorm(2, c))"))
    assert "SyncBatchNorm" not in group.code.decode()


def test_a_script_that_converts_already_is_not_converted_twice():
    code = script().replace("    model = Net()\n", "    model = Net()\n    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n")
    result = rewrite(code)
    assert result.code.decode().count("convert_sync_batchnorm") == 1


def test_the_rewrite_of_the_output_converts_nothing_again():
    first = rewrite(script())
    second = rewrite_source(first.code, "train.py", RetrofitOptions())
    assert second.code == first.code and second.changes == []


# --- a library model with BatchNorm held by the model's own class (issue 27) ------------

NET = '''
import torch
import torch.nn as nn
{imports}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = {backbone}
        self.head = nn.Linear(10, 4)

    def forward(self, x):
        return self.head(self.backbone(x))
'''


def class_layer(source: str, name: str = "Net", path: str = None):
    """What the analysis finds in class `name` of `source` (fsdp2_retrofit.analysis.batchnorm.class_batchnorm)."""
    import libcst as cst

    from fsdp2_retrofit.analysis.batchnorm import class_batchnorm
    from fsdp2_retrofit.analysis.model_classes import build_registry
    from fsdp2_retrofit.syntax.names import Resolver

    module = cst.parse_module(dedent(source))
    resolver = Resolver(module)
    return class_batchnorm(build_registry(module, resolver, path), name, resolver)


def test_a_class_holding_a_library_model_with_batchnorm_has_batchnorm_at_the_line_that_builds_it():
    cases = [  # imports, the attribute's value: the value's qualified name decides, not a name
        ("import torchvision", "torchvision.models.resnet18(num_classes=10)"),
        ("from torchvision.models import resnet50 as make", "make(num_classes=10)"),
        ("from torchvision import models as zoo", "nn.Sequential(zoo.resnet34(), nn.ReLU())"),
        ("import torchvision", "nn.ModuleList([torchvision.models.resnet18(), nn.Identity()])"),
        ("import timm", 'timm.create_model("resnet18", num_classes=10)'),
    ]
    for imports, backbone in cases:
        layer = class_layer(NET.format(imports=imports, backbone=backbone))
        assert layer is not None, backbone
        assert layer.line == 10 and layer.file is None and "(its BatchNorm layers)" in layer.what, (backbone, layer)


def test_a_class_holding_a_library_model_without_batchnorm_has_none():
    cases = [
        ("import torchvision", "torchvision.models.resnet18(norm_layer=lambda c: nn.GroupNorm(2, c))"),
        ("import torchvision", "torchvision.models.vit_b_16()"),
        ("import timm", 'timm.create_model("vit_base_patch16_224")'),
        ("import torchvision", "nn.Linear(10, 10)"),
        ("from mylib import resnet18", "resnet18()"),  # a function of the same name, not torchvision's
    ]
    for imports, backbone in cases:
        assert class_layer(NET.format(imports=imports, backbone=backbone)) is None, backbone


def test_a_sibling_modules_class_holding_a_library_model_is_named_by_file_and_line(tmp_path: Path):
    (tmp_path / "nets.py").write_text(dedent(NET.format(
        imports="from torchvision.models import resnet18", backbone="resnet18(num_classes=10)")))
    (tmp_path / "plain.py").write_text(dedent(NET.format(imports="", backbone="nn.Linear(3, 10)")))
    train = "import torch\nfrom nets import Net\nfrom plain import Net as Plain\n"
    layer = class_layer(train, "nets.Net", str(tmp_path / "train.py"))
    assert (layer.file, layer.file_line, layer.where()) == (str(tmp_path / "nets.py"), 10, "nets.py:10"), layer
    assert class_layer(train, "plain.Net", str(tmp_path / "train.py")) is None


def test_a_helper_function_that_builds_the_backbone_is_followed(tmp_path: Path):
    helper = "import torchvision\n\n\ndef build(classes):\n    net = torchvision.models.resnet18(num_classes=classes)\n    return net"
    layer = class_layer(NET.format(imports=helper, backbone="build(10)"))
    assert (layer.line, layer.file) == (8, None), layer  # the line of resnet18(...) in build
    norm = "\n\ndef block(width):\n    return nn.Sequential(nn.Conv2d(3, width, 1), nn.BatchNorm2d(width))"
    assert class_layer(NET.format(imports=norm, backbone="block(10)")).what == "nn.BatchNorm2d(width)"
    (tmp_path / "parts.py").write_text(helper)
    layer = class_layer(NET.format(imports="from parts import build", backbone="build(10)"), path=str(tmp_path / "t.py"))
    assert layer.where() == "parts.py:5", layer
    plain = "\n\ndef build(classes):\n    return nn.Linear(3, classes)"
    assert class_layer(NET.format(imports=plain, backbone="build(10)")) is None


def library_script(backbone: str = "torchvision.models.resnet18(num_classes=10)") -> str:
    return script().replace("self.norm = nn.BatchNorm1d(4)", f"self.norm = {backbone}").replace(
        "import torch.nn as nn", "import torch.nn as nn\nimport torchvision")


def test_a_model_holding_a_library_model_with_batchnorm_is_converted_and_flagged_at_its_build():
    result = rewrite(library_script())
    assert not result.refusals, result.refusals
    assert "    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n" in result.code.decode()
    assert [(a.line, a.what) for a in result.attention if a.differs and a.code == "shard"] == [(
        11, "on CPU (gloo) each rank's BatchNorm normalises with its own part of the batch "
        "(`torchvision `resnet18` (its BatchNorm layers)`, line 11)",
    )]
    group = rewrite(library_script("torchvision.models.resnet18(norm_layer=lambda c: nn.GroupNorm(2, c))"))
    assert "SyncBatchNorm" not in group.code.decode()
    assert not [a for a in group.attention if a.differs and a.code == "shard"]


def test_a_model_built_in_a_sibling_module_holding_a_library_model_is_flagged_at_the_model(tmp_path: Path):
    (tmp_path / "nets.py").write_text(library_script().split("\n\ndef main():")[0])
    code = script().split("\n\nclass Net")[0] + "\nfrom nets import Net\n\n\ndef main():" + script().split("def main():")[1]
    result = rewrite(code, str(tmp_path / "train.py"))
    assert "    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n" in result.code.decode()
    flagged = [a for a in result.attention if a.differs and a.code == "shard"]
    assert len(flagged) == 1 and "nets.py:11" in flagged[0].what, flagged
    assert flagged[0].line == dedent(code).splitlines().index("    model = Net()") + 1


def test_a_library_model_passed_to_the_models_constructor_is_found():
    code = library_script("backbone").replace("def __init__(self):", "def __init__(self, backbone):").replace(
        "model = Net()", "model = Net(torchvision.models.resnet18())")
    result = rewrite(code)
    assert "    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n" in result.code.decode()
    flagged = [a.line for a in result.attention if a.differs and a.code == "shard"]
    assert flagged == [dedent(code).splitlines().index("    model = Net(torchvision.models.resnet18())") + 1]


def test_mixed_precision_is_refused_for_a_model_holding_a_library_model_with_batchnorm():
    result = rewrite(library_script(), mixed_precision="bf16")
    assert [r.code for r in result.refusals] == ["FSR603"], result.refusals


def test_check_flags_a_sibling_class_holding_a_library_model_with_batchnorm(tmp_path: Path):
    """FSD118 reads the same analysis: the script itself never mentions BatchNorm."""
    from fsdp2_retrofit.check.lint import lint_source
    from fsdp2_retrofit.check.rules import all_rules

    (tmp_path / "nets.py").write_text(dedent(NET.format(
        imports="from torchvision.models import resnet50",
        backbone="nn.ModuleList([resnet50(num_classes=10), nn.Identity()])")))
    train = tmp_path / "train.py"
    train.write_text("import torch\nfrom torch.distributed.fsdp import fully_shard\nfrom nets import Net\n\n"
                     "model = Net()\nfully_shard(model)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    findings = lint_source(train.read_bytes(), str(train), all_rules()).findings
    assert [(f.code, f.line) for f in findings] == [("FSD118", 6)], findings


def test_a_scripts_own_sync_batchnorm_conversion_is_not_a_wrapper(tmp_path):
    """`model = nn.SyncBatchNorm.convert_sync_batchnorm(model)` (a DDP script's) returns the same module with
    its BatchNorm layers replaced: fully_shard goes after it and nothing converts it twice (it was refused
    FSR620 as a wrapper). Written differently too: in a function, the name `net`, a placement after it."""
    from fsdp2_retrofit.pipeline import rewrite_source

    loop = ("opt = torch.optim.SGD({m}.parameters(), lr=0.1)\n"
            "for _ in range(3):\n    loss = {m}(torch.randn(8, 4)).pow(2).mean()\n    opt.zero_grad()\n"
            "    loss.backward()\n    opt.step()\n")
    plain = ("import torch\nimport torch.nn as nn\n\nmodel = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))\n"
             "model = nn.SyncBatchNorm.convert_sync_batchnorm(model)\n" + loop.format(m="model"))
    in_function = ("import torch\nfrom torch import nn\n\n\ndef main():\n"
                   "    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))\n"
                   "    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)\n    net = net.to('cpu')\n"
                   + "".join("    " + line + "\n" for line in loop.format(m="net").splitlines()) + "\n\nmain()\n")
    for name, source, convert in (("model", plain, "model = nn.SyncBatchNorm.convert_sync_batchnorm(model)"),
                                  ("net", in_function, "net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)")):
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        result = rewrite_source(source.encode(), str(path))
        assert not result.refusals, result.refusals
        text = result.code.decode()
        assert text.count("convert_sync_batchnorm") == 1, text
        assert text.index(convert) < text.index(f"fully_shard({name}") < text.index("opt = torch.optim.SGD"), text
