"""make_dirs: the check-then-create folder idiom, which every rank runs, becomes one
`os.makedirs(d, exist_ok=True)` (fixture makedirs_every_rank runs it on 2 ranks; mkdir_every_rank the
`os.mkdir` form). Anything else in or around the `if` keeps the `if`; the creation in it gets
exist_ok=True like any bare creation: `os.makedirs(d)`, `os.mkdir(d)` or `Path(d).mkdir()`
without exist_ok, which every rank runs (fixtures makedirs_bare, makedirs_bare_path_sibling run
them on 2 ranks), whatever the names, the spelling or the function it sits in."""
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


@pytest.mark.parametrize("make, made", [
    ("if not os.path.exists(out):\n    os.makedirs(out)\nelse:\n    print('reusing', out)\n",
     "if not os.path.exists(out):\n    os.makedirs(out, exist_ok=True)\nelse:\n    print('reusing', out)\n"),
    ("if not os.path.exists(out):\n    os.makedirs(out)\n    print('made', out)\n",
     "if not os.path.exists(out):\n    os.makedirs(out, exist_ok=True)\n    print('made', out)\n"),
    ("if not os.path.exists(out):\n    os.makedirs(os.path.join(out, 'x'))\n",
     "if not os.path.exists(out):\n    os.makedirs(os.path.join(out, 'x'), exist_ok=True)\n"),
    ("if not os.path.exists(out):\n    os.mkdir(os.path.join(out, 'x'))\n",
     "if not os.path.exists(out):\n    os.makedirs(os.path.join(out, 'x'), exist_ok=True)\n"),
], ids=["else", "more-in-the-body", "another-folder", "mkdir-another-folder"])
def test_anything_else_keeps_its_if_and_creates_with_exist_ok(make, made):
    assert made in _code(make)


# every rank runs these: the first makes the folder, every other raises FileExistsError
@pytest.mark.parametrize("make, made", [
    ("os.makedirs(out)\n", "os.makedirs(out, exist_ok=True)\n"),
    ("os.makedirs(out, 0o755)\n", "os.makedirs(out, 0o755, exist_ok=True)\n"),
    ("os.makedirs(name=out)\n", "os.makedirs(name=out, exist_ok=True)\n"),
    ("os.mkdir(out)\n", "os.makedirs(out, exist_ok=True)\n"),
    ("from os import makedirs as md\nmd(out)\n", "md(out, exist_ok=True)\n"),
    ("import os as o\no.makedirs(os.path.join(out, 'run'))\n", "o.makedirs(os.path.join(out, 'run'), exist_ok=True)\n"),
    ("from pathlib import Path\nPath(out).mkdir()\n", "Path(out).mkdir(exist_ok=True)\n"),
    ("import pathlib\nrun = pathlib.Path(out) / 'run'\nrun.mkdir(parents=True)\n",
     "run.mkdir(parents=True, exist_ok=True)\n"),
    ("from pathlib import Path\ndef folder(root):\n    p = Path(root)\n    p.mkdir()\n    return p\nrun = folder(out)\n",
     "    p.mkdir(exist_ok=True)\n"),
    ("def folder(root):\n    os.makedirs(root)\nfolder(out)\n", "    os.makedirs(root, exist_ok=True)\n"),
], ids=["makedirs", "mode", "keyword", "mkdir", "imported-alias", "module-alias", "path", "path-joined",
        "path-in-helper", "makedirs-in-helper"])
def test_a_bare_creation_every_rank_runs_gets_exist_ok(make, made):
    code = _code(make)
    assert made in code, code
    assert "exist_ok=True, exist_ok" not in code


@pytest.mark.parametrize("make", [
    "os.makedirs(out, exist_ok=True)\n",
    "os.makedirs(out, 0o755, True)\n",
    "from pathlib import Path\nPath(out).mkdir(parents=True, exist_ok=True)\n",
    "try:\n    os.makedirs(out)\nexcept FileExistsError:\n    pass\n",
    "try:\n    os.mkdir(out)\nexcept OSError:\n    ...\n",
    "if int(os.environ.get('RANK', 0)) == 0:\n    os.makedirs(out)\n",
    "class Remote:\n    def mkdir(self, p):\n        pass\nRemote().mkdir(out)\n",  # not a pathlib path
    "os.makedirs(*[out])\n",
], ids=["exist_ok", "exist_ok-positional", "path-exist_ok", "try-pass", "try-oserror", "rank-zero", "not-a-path",
        "star-args"])
def test_creations_that_cannot_raise_on_another_rank_stay_as_written(make):
    assert make.rsplit("\n", 2)[-2] in _code(make)


@pytest.mark.parametrize("make", [
    "if not os.path.exists(out):\n    os.makedirs(out, exist_ok=False)\n",
    "os.makedirs(out, exist_ok=False)\n",
    "try:\n    os.makedirs(out)\nexcept FileExistsError:\n    raise SystemExit('the run folder exists')\n",
], ids=["own-exist_ok", "exist_ok-false", "try-exits"])
def test_a_creation_meant_to_fail_when_the_folder_exists_stays_and_is_reported(make):
    result = rewrite_source(SCRIPT.replace("MAKE\n", make).encode(), "train.py")
    assert not result.refusals, result.refusals
    assert make in result.code.decode()
    flagged = [a for a in result.attention if a.code == "make_dirs"]
    assert len(flagged) == 1 and flagged[0].differs and "every rank but the first" in flagged[0].what, result.attention
