"""A dtype cast of the trained model after its build (`model.to(device).to(torch.bfloat16)`):
fully_shard comes after it wherever the rewrite can show it is part of the build (inline, in an
if/elif/else whose branches only move or cast, in a function of the script or of a sibling module
that only moves and casts the module it is handed), so the model is sharded in its training dtype
(fixtures cast_after_build_if_else and cast_after_build_sibling_helper run it on 2 ranks). A cast
that runs later, on the sharded model, is refused at its line (FSR645): FSDP2 fixes the dtype of
its all-gathers at the first forward, and a cast after it fails in the next one (torch 2.13)."""
from __future__ import annotations

from textwrap import dedent

import pytest

from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = dedent("""\
    import sys

    import torch
    import torch.nn as nn

    HELPERS
    def main():
        device = "cpu"
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    CAST
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in torch.randn(3, 8, 4):
    LOOP
            loss = model(x.to(device, next(model.parameters()).dtype)).float().sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


    main()
    """)


def _rewrite(cast: str, helpers: str = "", loop: str = "", files=None, tmp_path=None):
    source = SCRIPT.replace("HELPERS\n", helpers).replace("CAST\n", cast).replace("LOOP\n", loop)
    path = "train.py"
    if files:
        for name, text in files.items():
            (tmp_path / name).write_text(text)
        (tmp_path / path).write_text(source)
        path = str(tmp_path / path)
    return rewrite_source(source.encode(), path)


def _body_before_optimizer(code: str) -> str:
    return code[code.index("    model = nn.Sequential("):code.index("    optimizer = ")]


@pytest.mark.parametrize("cast", [
    "    model.to(device).to(torch.bfloat16)\n",
    "    model = model.to(device=device, dtype=torch.bfloat16)\n",
    "    model = model.to(device).half()\n",
    "    if len(sys.argv) > 1:\n        model = model.to(device).to(torch.bfloat16)\n"
    "    else:\n        model = model.to(device)\n",
    "    if len(sys.argv) > 2:\n        model.bfloat16()\n    elif len(sys.argv) > 1:\n        model.half()\n"
    "    else:\n        model.to(device)\n",
    "    probe = model(torch.zeros(1, 4))\n    if len(sys.argv) > 1:\n        model.to(torch.bfloat16)\n"
    "    else:\n        model.to(device)\n",
], ids=["chained", "keywords", "method", "if-else", "if-elif-else", "forward-then-if-else"])
def test_a_cast_of_the_build_comes_before_fully_shard(cast):
    result = _rewrite(cast)
    assert not result.refusals, result.refusals
    code = result.code.decode()
    assert _body_before_optimizer(code).endswith(cast + "    fully_shard(model, mesh=mesh)\n"), code


@pytest.mark.parametrize("helpers, cast", [
    ("def to_bf16(m, device):\n    return m.to(device).to(torch.bfloat16)\n\n\n",
     "    model = to_bf16(model, device)\n"),
    ("def to_bf16(m, device):\n    \"\"\"Move and cast.\"\"\"\n    m.to(device)\n    m.bfloat16()\n\n\n",
     "    to_bf16(model, device)\n"),
    ("def place(net, where, low=True):\n    if low:\n        net = net.to(where).half()\n    else:\n"
     "        net = net.to(where)\n    return net\n\n\n", "    model = place(model, device)\n"),
], ids=["returns-the-cast", "in-place", "if-else-then-return"])
def test_a_function_that_only_moves_and_casts_the_model_is_part_of_the_build(helpers, cast):
    result = _rewrite(cast, helpers)
    assert not result.refusals, result.refusals
    assert _body_before_optimizer(result.code.decode()).endswith(cast + "    fully_shard(model, mesh=mesh)\n")


def test_a_sibling_module_function_that_only_casts_the_model_is_part_of_the_build(tmp_path):
    sibling = {"precision.py": "import torch\n\n\ndef lower(module):\n    module.to(torch.bfloat16)\n"}
    result = _rewrite("    lower(model)\n", "from precision import lower\n\n\n", files=sibling, tmp_path=tmp_path)
    assert not result.refusals, result.refusals
    assert _body_before_optimizer(result.code.decode()).endswith("    lower(model)\n    fully_shard(model, mesh=mesh)\n")


@pytest.mark.parametrize("helpers, cast, loop, line", [
    ("", "", "        model.to(torch.bfloat16)\n", 12),  # every step, after the first step's forward
    ("", "    with torch.no_grad():\n        model(torch.zeros(1, 4))\n    model.half()\n", "", 12),
    ("def to_bf16(m):\n    m.bfloat16()\n    print('cast')\n\n\n", "    to_bf16(model)\n", "", 7),  # does more
    ("def warm_up(m):\n    m(torch.zeros(1, 4))\n    m.to(dtype=torch.bfloat16)\n\n\n", "", "", 8),
], ids=["in-the-loop", "after-a-forward-in-with", "helper-that-does-more", "helper-after-its-forward"])
def test_a_cast_after_fully_shard_is_refused_at_its_line(helpers, cast, loop, line):
    if helpers.startswith("def warm_up"):
        cast = "    warm_up(model)\n"
    result = _rewrite(cast, helpers, loop)
    assert [r.code for r in result.refusals] == ["FSR645"], result.refusals
    refusal = result.refusals[0]
    assert refusal.line == line, refusal
    assert "after fully_shard" in refusal.what and "first forward" in refusal.why


def test_a_float32_cast_of_a_float32_model_changes_nothing():
    result = _rewrite("", loop="        model.float()\n")
    assert not result.refusals, result.refusals
