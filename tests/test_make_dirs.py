"""make_dirs: the check-then-create folder idiom, which every rank runs, becomes one
`os.makedirs(d, exist_ok=True)` (fixture makedirs_every_rank runs it on 2 ranks; mkdir_every_rank the
`os.mkdir` form). Anything
else in or around the `if` leaves it as written."""
from __future__ import annotations

from textwrap import dedent

import pytest

from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = dedent("""\
    import os

    import torch
    import torch.nn as nn

    out = "samples"
    MAKE
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 4)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    """)


def _code(make: str) -> str:
    result = rewrite_source(SCRIPT.replace("MAKE\n", make).encode(), "train.py")
    assert not result.refusals, result.refusals
    return result.code.decode()


@pytest.mark.parametrize("make", [
    "if not os.path.exists(out):\n    os.makedirs(out)\n",
    "# the folder\nif not os.path.isdir(out): os.makedirs(out)\n",
    "if not os.path.exists(out):\n    os.makedirs(out, 0o755)\n",
    "if not os.path.isdir(out):\n    os.mkdir(out)\n",
    "if not os.path.exists(out):\n    os.mkdir(out, 0o755)\n",
    "from os import mkdir\nif not os.path.isdir(out):\n    mkdir(out)\n",
], ids=["exists", "isdir-one-line", "with-mode", "mkdir", "mkdir-with-mode", "mkdir-imported"])
def test_the_check_then_create_idiom_becomes_one_makedirs(make):
    code = _code(make)
    assert "os.path.exists" not in code and "os.path.isdir" not in code and "mkdir(" not in code
    assert ("os.makedirs(out, 0o755, exist_ok=True)\n" if "0o755" in make else "os.makedirs(out, exist_ok=True)\n") in code
    if make.startswith("#"):
        assert "# the folder\nos.makedirs(" in code  # its comment stays


@pytest.mark.parametrize("make", [
    "if not os.path.exists(out):\n    os.makedirs(out)\nelse:\n    print('reusing', out)\n",
    "if not os.path.exists(out):\n    os.makedirs(out)\n    print('made', out)\n",
    "if not os.path.exists(out):\n    os.makedirs(os.path.join(out, 'x'))\n",
    "if not os.path.exists(out):\n    os.mkdir(os.path.join(out, 'x'))\n",
    "if not os.path.exists(out):\n    os.makedirs(out, exist_ok=False)\n",
], ids=["else", "more-in-the-body", "another-folder", "mkdir-another-folder", "own-exist_ok"])
def test_anything_else_stays_as_written(make):
    assert make in _code(make)
