"""Refusals name the real blocker at its own line (issue 14): exit code 2, one line
`file:line: CODE message`, and the user's file left as it was."""
from __future__ import annotations

from textwrap import dedent

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli

LOOP = """
for step in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def refused(tmp_path, monkeypatch, source: str):
    """(line, code, message) of the first stderr line of `rewrite` on `source`."""
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "train.py"
    path.write_text(source)
    result = CliRunner().invoke(cli.main, ["rewrite", str(path)])
    assert result.exit_code == 2, result.output
    assert path.read_text() == source
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"{path}:"), first
    line, code, message = first[len(str(path)) + 1:].split(" ", 2)
    return int(line.rstrip(":")), code, message


@pytest.mark.parametrize(
    "source, line, code, fragment",
    [
        (  # the model comes from a function the analysis cannot see into
            "import torch\nfrom mylib import get_model\n\nmodel = get_model('small')\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + LOOP,
            4, "FSR611", "`model` (trained by the optimizer at line 5) is bound by `get_model('small')`",
        ),
        (  # an optimizer from outside torch.optim
            "import torch\nimport bitsandbytes as bnb\nfrom torch import nn\n\nmodel = nn.Linear(4, 1)\n"
            "opt = bnb.optim.AdamW8bit(model.parameters(), lr=0.1)\n" + LOOP,
            6, "FSR612", "`bnb.optim.AdamW8bit(...)` is given `model`'s parameters but is not a torch.optim",
        ),
        (  # the model is handed in
            "import torch\n\n\ndef train(model):\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "    model(torch.ones(2)).sum().backward()\n    opt.step()\n",
            5, "FSR611", "the optimizer trains `model`, which is not built in this function",
        ),
        (  # the model is handed in by the one call, from a builder the analysis cannot see into
            "import torch\nfrom mylib import get_model\n\n\ndef train(net):\n"
            "    opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
            "    net(torch.ones(2)).sum().backward()\n    opt.step()\n\n\nmodel = get_model('small')\ntrain(model)\n",
            11, "FSR611", "`model` (handed to train() as `net`, which the optimizer at line 6 trains) is bound by "
            "`get_model('small')`",
        ),
    ],
    ids=["unknown-builder", "foreign-optimizer", "model-parameter", "model-handed-from-unknown-builder"],
)
def test_no_model_refusal_points_at_the_blocker(tmp_path, monkeypatch, source, line, code, fragment):
    got_line, got_code, message = refused(tmp_path, monkeypatch, source)
    assert (got_line, got_code) == (line, code), message
    assert fragment in message


def test_no_optimizer_at_all_refuses_at_the_model_it_builds(tmp_path, monkeypatch):
    """A module updated by hand (no optimizer): FSR612 names the line that builds it (it was line 1)."""
    source = dedent("""\
        import torch
        import torch.nn as nn

        x, y = torch.randn(8, 4), torch.randn(8, 2)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        for step in range(3):
            loss = (net(x) - y).pow(2).sum()
            net.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 1e-3 * p.grad
        """)
    line, code, message = refused(tmp_path, monkeypatch, source)
    assert (line, code) == (5, "FSR612"), message
    assert "`net` is built here" in message


def test_no_module_refuses_at_the_training_of_raw_tensors(tmp_path, monkeypatch):
    """No nn.Module and no optimizer (FSR611, raw tensors updated by hand): the first backward()
    is named (it was line 1)."""
    source = dedent("""\
        import torch

        x, y = torch.randn(8, 4), torch.randn(8, 2)
        w = torch.randn(4, 2, requires_grad=True)
        for step in range(3):
            loss = (x @ w - y).pow(2).sum()
            loss.backward()
            with torch.no_grad():
                w -= 1e-3 * w.grad
                w.grad.zero_()
        """)
    line, code, message = refused(tmp_path, monkeypatch, source)
    assert (line, code) == (7, "FSR611"), message
    assert "`loss.backward()` trains tensors here" in message


def test_an_annotated_model_and_optimizer_are_found():
    """`model: nn.Module = Net()` is a model (it was refused at line 1 as 'no nn.Module')."""
    from fsdp2_retrofit.options import RetrofitOptions
    from fsdp2_retrofit.pipeline import rewrite_source

    source = dedent("""\
        import torch
        from torch import nn

        torch.manual_seed(0)
        model: nn.Module = nn.Linear(4, 1)
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        """) + LOOP
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    assert "model: nn.Module = nn.Linear(4, 1)\nfully_shard(model, mesh=mesh)\n" in result.code.decode()


FRAMEWORKS = {
    "accelerate": (
        "import torch\nfrom torch import nn\nfrom accelerate import Accelerator\n\naccelerator = Accelerator()\n"
        "model = nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model, opt = accelerator.prepare(model, opt)\n" + LOOP,
        5, "Accelerate",
    ),
    "lightning-trainer": (
        "import torch\nimport lightning as L\nfrom torch import nn\n\n\nclass Lit(L.LightningModule):\n"
        "    def __init__(self):\n        super().__init__()\n        self.net = nn.Linear(4, 1)\n\n"
        "    def configure_optimizers(self):\n        return torch.optim.SGD(self.parameters(), lr=0.1)\n\n\n"
        "trainer = L.Trainer(max_steps=3)\ntrainer.fit(Lit(), None)\n",
        15, "Lightning",
    ),
    "pytorch-lightning": (
        "import torch\nimport pytorch_lightning as pl\nfrom torch import nn\n\nmodel = nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\npl.Trainer(max_epochs=1).fit(model)\n",
        7, "Lightning",
    ),
    "fabric": (
        "import torch\nfrom lightning.fabric import Fabric\nfrom torch import nn\n\nfabric = Fabric(devices=2)\n"
        "fabric.launch()\nmodel = nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model, opt = fabric.setup(model, opt)\n" + LOOP,
        5, "Lightning Fabric",
    ),
    "deepspeed": (
        "import deepspeed\nimport torch\nfrom torch import nn\n\nmodel = nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config='ds.json')\n",
        7, "DeepSpeed",
    ),
}


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_scripts_training_through_a_framework_are_refused(tmp_path, monkeypatch, name):
    """Rewritten, they failed at start-up: 'trying to initialize the default process group twice'."""
    source, line, framework = FRAMEWORKS[name]
    got = refused(tmp_path, monkeypatch, source)
    assert got[:2] == (line, "FSR403"), got
    assert got[2].startswith(f"the script trains through {framework} ")


def test_an_accelerate_helper_alone_is_not_a_framework(tmp_path):
    """Importing from accelerate for something else does not refuse the script."""
    from fsdp2_retrofit.options import RetrofitOptions
    from fsdp2_retrofit.pipeline import rewrite_source

    source = "import torch\nfrom torch import nn\nfrom accelerate.utils import set_seed\n\nset_seed(0)\n" \
        "model = nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + LOOP
    assert not rewrite_source(source.encode(), "train.py", RetrofitOptions()).refusals


# `dist` bound by the script to something other than torch.distributed: every line the rewrite
# writes calls torch.distributed as `dist` (pbloem/former's generate.py imports torch.distributions
# as dist; rewritten, its process group start raised AttributeError: module 'torch.distributions'
# has no attribute 'init_process_group')
SAMPLER = "    cd = dist.Categorical(logits=model(torch.randn(1, 4)))\n"
DIST_TAKEN = {
    "distributions-import": (
        "import torch\nimport torch.distributions as dist\nfrom torch import nn\n\nmodel = nn.Linear(4, 3)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + LOOP,
        2, "`dist` to `torch.distributions`",
    ),
    "from-import": (
        "import torch\nfrom torch import distributions as dist\nfrom torch import nn\n\nmodel = nn.Linear(4, 3)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + LOOP,
        2, "`dist` to `torch.distributions`",
    ),
    "import-in-a-function": (
        "import torch\nfrom torch import nn\n\n\ndef sample(model):\n    import torch.distributions as dist\n" + SAMPLER
        + "    return cd.sample()\n\n\nmodel = nn.Linear(4, 3)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        + LOOP,
        6, "`dist` to `torch.distributions`",
    ),
    "assignment": (
        "import torch\nfrom torch import nn\n\ndist = torch.distributions\nmodel = nn.Linear(4, 3)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + LOOP,
        4, "`dist` to a value of its own (`dist = torch.distributions`)",
    ),
}


@pytest.mark.parametrize("name", sorted(DIST_TAKEN))
def test_a_script_binding_dist_to_something_else_is_refused_at_the_binding(tmp_path, monkeypatch, name):
    source, line, fragment = DIST_TAKEN[name]
    got = refused(tmp_path, monkeypatch, source)
    assert got[:2] == (line, "FSR405"), got
    assert fragment in got[2], got[2]


@pytest.mark.parametrize("spelling", ["import torch.distributed as dist", "from torch import distributed as dist"])
def test_dist_bound_to_torch_distributed_is_not_refused(spelling):
    from fsdp2_retrofit.options import RetrofitOptions
    from fsdp2_retrofit.pipeline import rewrite_source

    source = f"import torch\n{spelling}\nfrom torch import nn\n\nmodel = nn.Linear(4, 1)\n" \
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + LOOP
    out = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not out.refusals, out.refusals
    assert b"dist.init_process_group" in out.code and spelling.encode() in out.code
