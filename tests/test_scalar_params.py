"""0-dim parameters (issue 29): fully_shard raises on them ("doesn't support scalar
parameters"), so the shard stage keeps them out of its calls, whole on every rank, with a
hook that averages their gradients; --meta-init with one is refused (FSR628). The run
itself is checked by fixtures/rewrite/scalar_parameter (2 ranks against 1 process, and
as plain `python train.py`)."""
from __future__ import annotations

from textwrap import dedent

import libcst as cst
import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.analysis.scalar_params import zero_dim
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.syntax.names import Resolver

HIDE = "        module.register_parameter(name, None)\n"
HOOK = "param.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad.div_(dist.get_world_size())))"


@pytest.mark.parametrize("expr, expected", [
    ("torch.tensor(0.5)", True),
    ("torch.tensor(-1)", True),
    ("torch.tensor(math.log(1 / 0.07))", True),
    ("torch.as_tensor(np.log(10.0))", True),
    ("torch.ones([]) * np.log(1 / 0.07)", True),  # CLIP's logit scale
    ("torch.zeros(())", True),
    ("torch.full((), 2.0)", True),
    ("torch.ones(size=[])", True),
    ("torch.log(torch.tensor(10.0))", True),
    ("torch.tensor(1.0).float()", True),
    ("torch.tensor(init_value)", None),  # a number or a list: which, the script decides
    ("torch.ones([]) * init_logit_scale", None),  # open_clip's: a number or a tensor
    ("torch.tensor([0.5])", False),
    ("torch.tensor([[1.0, 2.0]])", False),
    ("torch.zeros(4)", False),
    ("torch.ones(1)", False),
    ("torch.randn(dim, dim)", False),
    ("torch.ones([]) * torch.ones(4)", False),  # broadcast to 1-dim
    ("torch.ones(4) * 0.5", False),
    ("2.0 * 3", False),  # no tensor at all
])
def test_zero_dim_reads_the_shape_the_expression_builds(expr, expected):
    module = cst.parse_module(f"import math\nimport numpy as np\nimport torch\nx = {expr}\n")
    value = module.body[-1].body[0].value
    assert zero_dim(value, Resolver(module)) is expected


CLASSES = """\
import math

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
{block_extra}
    def forward(self, x):
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self, dim=4{net_args}):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])
{net_extra}
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
"""

MAIN = """

def main():
    torch.manual_seed(0)
    model = {build}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
"""


def script(block_extra: str = "", net_extra: str = "", net_args: str = "", build: str = "Net()", tail: str = "") -> str:
    return CLASSES.format(block_extra=block_extra, net_extra=net_extra, net_args=net_args) + tail + MAIN.format(
        build=build)


def rewrite(source: str, path: str = "train.py", **options):
    result = rewrite_source(source.encode(), path, RetrofitOptions(**options))
    assert not result.refusals, result.refusals
    return result


def test_a_root_scalar_leaves_the_model_while_fully_shard_runs_and_comes_back_with_a_hook():
    source = script(net_extra="        self.logit_scale = nn.Parameter(torch.tensor(0.5))\n")
    result = rewrite(source)
    code = result.code.decode()
    hide = code.index(HIDE)
    blocks = code.index("fully_shard(block, mesh=mesh")
    root = code.index("fully_shard(model, mesh=mesh)")
    back = code.index("        module.register_parameter(name, param)\n")
    hook = code.index(HOOK)
    optimizer = code.index("optimizer = torch.optim.SGD(model.parameters()")
    assert hide < blocks < root < back < hook < optimizer, code
    assert "param.data = param.data.to(mesh.device_type)" in code
    line = source.splitlines().index("        self.logit_scale = nn.Parameter(torch.tensor(0.5))") + 1
    what = [c.what for c in result.changes if "0-dim" in c.what]
    assert what == [f"0-dim parameters of `model` (`Net.logit_scale` (line {line})) stay whole on every rank, "
                    "outside fully_shard; a hook averages their gradients over the ranks in backward"], what


def test_a_block_scalar_and_a_registered_one_are_found():
    """ReZero's gate in each repeated block (its own FSDP unit), and `register_parameter`."""
    source = script(
        block_extra="        self.alpha = nn.Parameter(torch.zeros(()))\n",
        net_extra="        self.register_parameter(\"temperature\", nn.Parameter(torch.ones([]) * math.log(10)))\n",
    )
    result = rewrite(source)
    assert HIDE in result.code.decode()
    lines = source.splitlines()
    alpha = next(n for n, text in enumerate(lines, 1) if "self.alpha" in text)
    temperature = next(n for n, text in enumerate(lines, 1) if '"temperature"' in text)
    what = next(c.what for c in result.changes if "0-dim" in c.what)
    assert f"`Block.alpha` (line {alpha})" in what and f"`Net.temperature` (line {temperature})" in what, what


def test_a_scalar_of_a_class_handed_to_the_model_is_handled():
    """`Net(head=Head())`: Head is reached by no model's class, so every model gets the run-time search."""
    head = dedent("""\


        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = nn.Parameter(torch.tensor(init_scale))
    """)
    source = script(net_args=", head=None", net_extra="        self.head = head\n", build="Net(head=Head())", tail=head)
    result = rewrite(source)
    assert HIDE in result.code.decode()
    assert any("`Head.scale` (may be 0-dim)" in c.what for c in result.changes), result.changes


def test_a_scalar_in_a_sibling_module_is_named_with_its_file(tmp_path):
    (tmp_path / "model.py").write_text(CLASSES.format(
        block_extra="", net_args="", net_extra="        self.logit_scale = nn.Parameter(torch.tensor(2.0))\n"))
    source = "import torch\n\nfrom model import Net\n" + MAIN.format(build="Net()")
    path = tmp_path / "train.py"
    path.write_text(source)
    result = rewrite(source, str(path))
    assert HIDE in result.code.decode()
    assert any("`Net.logit_scale` (model.py:20)" in c.what for c in result.changes), result.changes


@pytest.mark.parametrize("param", ["nn.Parameter(torch.zeros(4))", "nn.Parameter(torch.ones(1))",
                                   "nn.Parameter(torch.tensor([0.5]))"])
def test_parameters_with_a_dimension_add_nothing(param):
    code = rewrite(script(net_extra=f"        self.gain = {param}\n")).code.decode()
    assert "register_parameter" not in code and "scalar_params" not in code


def test_meta_init_with_a_scalar_is_refused_at_its_line(tmp_path, monkeypatch):
    """After the fully_shard calls, to_empty would replace the plain 0-dim tensor with an
    uninitialised one the hook is not on: FSR628, the file untouched."""
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    source = script(net_extra="        self.gate = nn.Parameter(torch.zeros(()))\n")
    path = tmp_path / "train.py"
    path.write_text(source)
    result = CliRunner().invoke(cli.main, ["rewrite", "--meta-init", str(path)])
    assert result.exit_code == 2, result.output
    assert path.read_text() == source
    line = source.splitlines().index("        self.gate = nn.Parameter(torch.zeros(()))") + 1
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"{path}:{line}: FSR628 --meta-init with a 0-dim parameter: `Net.gate`"), first


def test_a_scalar_the_script_sets_on_a_library_model_is_handled():
    """`model.logit_scale = nn.Parameter(...)` on a torchvision model: no class to read, the
    script's own assignment says it; fully_shard comes after it, and so does the put-back."""
    source = dedent("""\
        import torch
        import torch.nn as nn
        import torchvision


        def main():
            torch.manual_seed(0)
            model = torchvision.models.resnet18(num_classes=4)
            model.logit_scale = nn.Parameter(torch.tensor(1.0))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                loss = model(torch.randn(2, 3, 32, 32)).pow(2).mean() * model.logit_scale
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        """)
    result = rewrite(source)
    code = result.code.decode()
    assert code.index("model.logit_scale = nn.Parameter") < code.index(HIDE) < code.index(
        "fully_shard(model, mesh=mesh)") < code.index(HOOK), code
    assert any("`model.logit_scale` (line 9)" in c.what for c in result.changes), result.changes
