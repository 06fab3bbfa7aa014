"""--meta-init: what it re-creates after to_empty, and what it refuses (one line,
the file's line, exit 2, the file untouched)."""
from __future__ import annotations

from textwrap import dedent

import pytest
from click.testing import CliRunner
from libcst.codemod import CodemodTest

from codemods.meta_init import InitOnMetaDeviceCommand

from fsdp2_retrofit import cli
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

HEAD = '''\
import torch
import torch.nn as nn


'''

LOOP = '''

def main():
    model = {build}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x in [torch.randn(2, 8)]:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
'''

NET = '''\
class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
{extra}
    def forward(self, x):
        return self.fc(x)
'''


def script(extra: str = "", build: str = "Net()", classes: str = "", loop: str = LOOP) -> str:
    body = dedent(extra).strip("\n")
    extra = "".join("        " + line + "\n" if line else "\n" for line in body.splitlines())
    return HEAD + classes + NET.format(extra=extra) + loop.format(build=build)


def meta(code: str, path: str = "train.py"):
    return rewrite_source(code.encode(), path, RetrofitOptions(meta_init=True))


def out(code: str) -> str:
    result = meta(code)
    assert not result.refusals, result.refusals
    return result.code.decode()


def line_of(code: str, fragment: str) -> int:
    return next(i for i, line in enumerate(code.splitlines(), 1) if fragment in line)


# --- what it re-creates --------------------------------------------------------------------


def test_without_the_flag_the_model_is_built_as_written():
    result = rewrite_source(script().encode(), "train.py", RetrofitOptions())
    assert "meta" not in result.code.decode() and "to_empty" not in result.code.decode()


def test_plain_model_meta_build_shard_to_empty_reset():
    text = out(script())
    assert (
        '    with torch.device("meta"):\n'
        "        model = Net()\n"
        "    fully_shard(model, mesh=mesh)\n"
        "    # --meta-init: memory for this rank's shards only; then re-run the model's initialisation\n"
        '    model.to_empty(device="cuda" if torch.cuda.is_available() else "cpu")\n'
        "    with torch.no_grad():\n"
        "        for module in model.modules():\n"
        '            if callable(getattr(module, "reset_parameters", None)):\n'
        "                module.reset_parameters()\n"
        "    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
    ) in text


@pytest.mark.parametrize(
    "build, placement, device",
    [
        ("Net().to(device)", "", "device"),
        ("Net().cuda()", "", '"cuda"'),
        ("Net()", "model = model.to(device)", "device"),
        ("Net()", "if torch.cuda.is_available():\n        model.cuda()", '"cuda" if torch.cuda.is_available() else "cpu"'),
        ("Net().to(torch.bfloat16)", "", '"cuda" if torch.cuda.is_available() else "cpu"'),
    ],
)
def test_device_moves_become_the_to_empty_device(build, placement, device):
    loop = LOOP.replace("    model = {build}\n", "    device = 'cpu'\n    model = {build}\n" + (
        f"    {placement}\n" if placement else ""))
    text = out(script(build=build, loop=loop))
    assert f"    model.to_empty(device={device})\n" in text
    assert ".cuda()" not in text and "model.to(device)" not in text
    if "bfloat16" in build:  # a dtype change works on meta tensors: it stays in the build
        assert "        model = Net().to(torch.bfloat16)\n" in text


def test_script_level_apply_is_rerun_after_to_empty():
    loop = LOOP.replace("    model = {build}\n", "    model = {build}\n    model.apply(init_weights)\n")
    classes = "def init_weights(m):\n    if isinstance(m, nn.Linear):\n        nn.init.zeros_(m.bias)\n\n\n"
    text = out(script(classes=classes, loop=loop))
    assert text.count("model.apply(init_weights)") == 1
    assert "                module.reset_parameters()\n        model.apply(init_weights)\n" in text


def test_parameters_from_factories_become_nn_init_calls():
    text = out(script('''
        self.pos = nn.Parameter(torch.randn(1, 4, dim) * 0.02)
        self.scale = nn.Parameter(torch.ones(dim))
        self.gate = nn.Parameter(torch.full((dim,), 0.5))
        self.empty = nn.Parameter(torch.empty(dim))
        nn.init.uniform_(self.empty, -1, 1)
    '''))
    assert (
        "        torch.nn.init.normal_(model.pos, std=0.02)\n"
        "        torch.nn.init.ones_(model.scale)\n"
        "        torch.nn.init.constant_(model.gate, 0.5)\n"
        "        nn.init.uniform_(model.empty, -1, 1)\n"
    ) in text


def test_rotary_buffer_from_a_pure_module_function_and_constructor_arguments():
    classes = '''\
def precompute_freqs(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    return torch.outer(torch.arange(end).float(), freqs)


'''
    text = out(script('''
        self.register_buffer("freqs", precompute_freqs(dim, 16), persistent=False)
        self.flash = hasattr(torch.nn.functional, "scaled_dot_product_attention")
        if not self.flash:
            self.register_buffer("mask", torch.tril(torch.ones(16, 16)))
    ''', classes=classes, build="Net(dim=8)"))
    assert (
        "        model.freqs.copy_(precompute_freqs(8, 16))\n"
        "        if not model.flash:\n"
        "            model.mask.copy_(torch.tril(torch.ones(16, 16)))\n"
    ) in text


def test_buffer_of_a_block_class_is_rebuilt_on_every_instance():
    classes = '''\
class Block(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        mask = torch.tril(torch.ones(size, size))
        self.register_buffer("mask", mask)


'''
    text = out(script("self.blocks = nn.ModuleList([Block(size) for _ in range(2)])",
                      classes=classes, build="Net()").replace("dim=8", "dim=8, size=4"))
    assert (
        "        for module in model.modules():\n"
        "            if isinstance(module, Block):\n"
        "                module.mask.copy_(torch.tril(torch.ones(4, 4)))\n"
    ) in text


def test_output_is_left_alone_by_a_second_rewrite():
    first = out(script("nn.init.zeros_(self.fc.bias)"))
    assert "        nn.init.zeros_(model.fc.bias)\n" in first
    second = meta(first)
    assert not second.refusals and second.code.decode() == first and second.changes == []


def test_cli_flag_reaches_the_options_and_help_names_the_trade(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(script())
    runner = CliRunner()
    help_text = runner.invoke(cli.main, ["rewrite", "--help"]).output
    assert "--meta-init" in help_text and "exact initialisation for memory" in " ".join(help_text.split())
    result = runner.invoke(cli.main, ["rewrite", str(path), "--meta-init", "--no-cache", "--quiet"])
    assert result.exit_code == 0, result.output
    assert 'with torch.device("meta"):' in path.read_text()


class TestAlone(CodemodTest):
    """The stage on its own (no shard stage): a valid single-process meta build."""

    TRANSFORM = InitOnMetaDeviceCommand

    def test_meta_build_then_to_empty_and_reset(self) -> None:
        before = HEAD + NET.format(extra="") + "\nmodel = Net().cuda()\noptimizer = torch.optim.SGD(model.parameters(), 0.1)\n"
        after = HEAD + NET.format(extra="") + (
            '\nwith torch.device("meta"):\n'
            "    model = Net()\n"
            "# --meta-init: memory for this rank's shards only; then re-run the model's initialisation\n"
            'model.to_empty(device="cuda")\n'
            "with torch.no_grad():\n"
            "    for module in model.modules():\n"
            '        if callable(getattr(module, "reset_parameters", None)):\n'
            "            module.reset_parameters()\n"
            "optimizer = torch.optim.SGD(model.parameters(), 0.1)\n"
        )
        self.assertCodemod(before, after)


# --- what it refuses ----------------------------------------------------------------------

REFUSED = [
    pytest.param(
        script('self.register_buffer("mean", torch.load("stats.pt"))'),
        'torch.load("stats.pt")', "buffer `mean` of Net cannot be re-computed",
        id="buffer-loaded-from-a-file",
    ),
    pytest.param(
        script('self.register_buffer("mean", stats)').replace("dim=8", "dim=8, stats=None").replace(
            "model = Net()", "model = Net(stats=torch.randn(64, 8).mean(0))"),
        'register_buffer("mean", stats)', "buffer `mean` of Net cannot be re-computed",
        id="buffer-from-data-computed-at-the-call-site",
    ),
    pytest.param(
        script('table = read_table()\nself.register_buffer("table", table)',
               classes="def read_table():\n    return torch.tensor(list(open('t.txt').read().encode()))\n\n\n"),
        'register_buffer("table", table)', "buffer `table` of Net cannot be re-computed",
        id="buffer-from-a-function-that-reads-a-file",
    ),
    pytest.param(
        script("for p in self.parameters():\n    p.data = torch.randn_like(p) * 0.02"),
        "p.data = torch.randn_like(p)", "`p.data = ...` in Net.__init__",
        id="init-loop-storing-whole-tensors",
    ),
    pytest.param(
        script('state = torch.load("init.pt")\nfor name, p in self.named_parameters():\n    p.copy_(state[name])'),
        'state = torch.load("init.pt")', "`torch.load(\"init.pt\")`",
        id="init-loop-copying-loaded-weights",
    ),
    pytest.param(
        script('self.register_buffer("mask", torch.ones(4) if dim > 4 else None)'),
        "self.register_buffer", "buffer `mask` of Net is `None` or a tensor",
        id="buffer-that-may-be-none",
    ),
    pytest.param(
        script("self.pos = nn.Parameter(torch.randn(4, dim) * 0.02 + 1.0)"),
        "self.pos = nn.Parameter", "parameter `self.pos` of Net is `nn.Parameter(torch.randn(4, dim) * 0.02 + 1.0)`",
        id="parameter-from-an-expression",
    ),
    pytest.param(
        script("self.attn = nn.MultiheadAttention(dim, 2)"),
        "self.attn = nn.MultiheadAttention", "--meta-init: the model builds `torch.nn.MultiheadAttention`",
        id="torch-class-without-a-complete-reset_parameters",
    ),
    pytest.param(
        script().replace(
            "    def forward", "    def reset_parameters(self):\n        self.fc = nn.Linear(8, 8)\n\n    def forward"),
        "self.fc = nn.Linear(8, 8)", "`reset_parameters` stores `self.fc`",
        id="reset_parameters-that-rebuilds",
    ),
    pytest.param(
        script('logger.info("built")\ninit_fn(self.fc.weight)').replace(
            "class Net", "import logging\nlogger = logging.getLogger()\ninit_fn = torch.nn.init.zeros_\n\n\nclass Net"),
        "init_fn(self.fc.weight)", "`init_fn(self.fc.weight)`",
        id="init-through-a-variable",
    ),
    pytest.param(
        script("self.setup_weights()", classes=""),
        "self.setup_weights()", "--meta-init: `self.setup_weights()`",
        id="unknown-method-in-init",
    ),
    pytest.param(
        script().replace("model = Net()", "model = build()").replace(
            "\n\ndef main", "\n\ndef build():\n    return Net()\n\n\ndef main"),
        "model = build()", "--meta-init: `model` is built by `build()`, not by its class",
        id="factory-function",
    ),
    pytest.param(
        script().replace("    model = Net()\n", "    model = Net()\n    model.load_state_dict(torch.load('w.pt'))\n"
                         "    model.to('cpu')\n"),
        "model.load_state_dict", "--meta-init: `model.load_state_dict(torch.load('w.pt'))` uses `model` between",
        id="weights-loaded-before-sharding",
    ),
    pytest.param(
        script(build="Net().to('cuda', torch.bfloat16)"),
        "model = Net()", "--meta-init: `Net().to('cuda', torch.bfloat16)` moves and converts the model at once",
        id="move-and-convert-in-one-call",
    ),
]


@pytest.mark.parametrize("code, where, what", REFUSED)
def test_refusals_name_the_line_and_leave_the_file(code, where, what):
    result = meta(code)
    assert result.refusals, "expected a refusal"
    refusal = result.refusals[0]
    assert what in refusal.what
    assert refusal.line == line_of(code, where), (refusal, code)
    assert refusal.why and refusal.hint
    assert result.code == code.encode()


def test_refusal_in_a_sibling_module_names_its_file_and_line(tmp_path):
    (tmp_path / "model.py").write_text(HEAD + NET.format(extra='        self.register_buffer("m", torch.load("x.pt"))\n'))
    train = tmp_path / "train.py"
    code = "import torch\nfrom model import Net\n" + LOOP.format(build="Net()")
    train.write_text(code)
    result = meta(code, str(train))
    refusal = result.refusals[0]
    assert refusal.line == line_of(code, "model = Net()")
    assert f"{tmp_path / 'model.py'}:9" in refusal.what


def test_cli_refusal_is_one_line_with_exit_2_and_the_file_untouched(tmp_path):
    path = tmp_path / "train.py"
    code = script("self.attn = nn.MultiheadAttention(dim, 2)")
    path.write_text(code)
    result = CliRunner().invoke(cli.main, ["rewrite", str(path), "--meta-init", "--no-cache", "--quiet"])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"{path}:{line_of(code, 'MultiheadAttention')}: FSR503 --meta-init: the model builds")
    assert len([l for l in lines if not l.lstrip().startswith("hint:")]) == 1
    assert path.read_text() == code
