"""Every rank starts from the same weights (issue 14): rank 0's parameters and buffers
are broadcast before fully_shard unless a literal seed runs before the build.

The execution test of fixtures/rewrite/rank_offset_seed measures the class: without the
broadcast its 2-rank run ended 0.53 away from the single run, with it 8e-08."""
from __future__ import annotations

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

BODY = """
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
"""


def rewritten(seed_lines: str, **options) -> str:
    source = "import os\n\nimport torch\nfrom torch import nn\n\n\ndef main():\n" + seed_lines + BODY
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions(**options))
    assert not result.refusals, result.refusals
    return result.code.decode()


@pytest.mark.parametrize(
    "seed_lines",
    [
        "",  # no seed: torch seeds every process differently
        "    torch.manual_seed(int(os.environ.get('RANK', 0)))\n",
        "    offset = int(os.environ.get('RANK', 0))\n    torch.manual_seed(1337 + offset)\n",
        "    torch.manual_seed(0)\n    torch.cuda.manual_seed_all(seed)\n",  # a later reseed from a variable
    ],
    ids=["no-seed", "rank-seed", "seed-through-variable", "variable-reseed"],
)
def test_rank_zero_weights_are_broadcast_before_sharding(seed_lines):
    out = rewritten(seed_lines)
    broadcast = out.index("dist.broadcast(on_device, src=0)")
    assert out.index("model = nn.Linear(4, 1)") < broadcast < out.index("fully_shard(model, mesh=mesh)")
    assert "for tensor in [*model.parameters(), *model.buffers()]:" in out


@pytest.mark.parametrize("seed_lines", ["    torch.manual_seed(0)\n"], ids=["literal-seed"])
def test_a_literal_seed_before_the_build_needs_no_broadcast(seed_lines):
    assert "broadcast" not in rewritten(seed_lines)


def test_a_module_level_literal_seed_counts():
    source = "import torch\nfrom torch import nn\n\ntorch.manual_seed(5)\n\n\ndef main():\n" + BODY
    out = rewrite_source(source.encode(), "train.py", RetrofitOptions()).code.decode()
    assert "broadcast" not in out


def test_a_literal_seed_after_the_build_does_not_count():
    source = "import torch\nfrom torch import nn\n\n\ndef main():\n" + BODY.replace(
        "    opt = torch", "    torch.manual_seed(0)\n    opt = torch", 1)
    out = rewrite_source(source.encode(), "train.py", RetrofitOptions()).code.decode()
    assert "dist.broadcast(on_device, src=0)" in out


def test_meta_init_builds_deterministically_and_broadcasts_nothing():
    assert "broadcast" not in rewritten("", meta_init=True)


def test_the_broadcast_is_reported_with_its_reason():
    source = "import torch\nfrom torch import nn\n\n\ndef main():\n" + BODY
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    [change] = [c for c in result.changes if "broadcast rank 0" in c.what]
    assert "no `torch.manual_seed(<literal>)` runs before the build" in change.why
