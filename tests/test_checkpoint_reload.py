"""Execution tests of checkpoints a script reads back itself after training (fixtures
with ``mode = "saved"`` in case.toml): a pickled module reloaded with
``model = torch.load(path)``.

After such a reload the original's optimizer still holds the module it trained, which
is no longer ``model``; the rewrite loads the saved state into the sharded ``model``.
So the engine's final parameters (read through the optimizer) differ by design, and
these tests compare what the script itself produces: every step's loss and gradient
norm, the weights it saves at the end (max abs diff <= the case's tolerance), and its
printed evaluation of the reloaded model.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from fsdp2_retrofit.verify import LOSS_ATOL, LOSS_RTOL, compare_saved, compare_steps, launch_distributed, launch_single

if os.environ.get("CI"):
    import torch  # noqa: F401  (CI installs the test extra: a missing torch must fail there, not skip)
else:
    pytest.importorskip("torch", reason="the execution tests need torch (pip install -e .[test])")

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite"


def _cases():
    out = []
    for case in sorted(p for p in FIXTURES.iterdir() if (p / "case.toml").is_file()):
        if 'mode = "saved"' in (case / "case.toml").read_text(encoding="utf-8"):
            out.append(pytest.param(case, id=case.name))
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("case", _cases())
def test_the_reloaded_model_is_the_saved_one(case: Path, tmp_path: Path):
    if tomllib is None:
        pytest.skip("reading case.toml needs Python 3.11+ (tomllib)")
    run = tomllib.loads((case / "case.toml").read_text(encoding="utf-8"))["run"]
    tolerance = run.get("tolerance", 1e-4)
    single = launch_single(case / "input.py", ["--out", str(tmp_path / "single" / "out.pt"), *run["single_args"]],
                           tmp_path / "single")
    dist = launch_distributed(case / "expected.py", ["--out", str(tmp_path / "dist" / "out.pt"), *run["dist_args"]],
                              tmp_path / "dist", nproc=run.get("nproc", 2))
    problems = [f"step {r.step}: {r.problem}" for r in compare_steps(single.ranks[0], dist.ranks, LOSS_RTOL, LOSS_ATOL)
                if r.problem]
    assert problems == [], problems
    saved = compare_saved(tmp_path / "single" / "out.pt", tmp_path / "dist" / "out.pt", run["weights"], tolerance)
    print(f"\n{case.name}: {len(dist.ranks[0]['losses'])} steps agree; saved weights after the reload: "
          f"max |single - 2 ranks| = {saved.max_abs_diff}")
    assert saved.ok, saved.problem
    # the test can fail: the best epoch is not the last, so a reload that did nothing saves other weights
    for run_ in (single, dist):
        output = run_.stdout
        vals = [float(v) for v in re.findall(r"^epoch \d+ val ([\d.]+)$", output, re.MULTILINE)]
        # the line evaluates the sharded model: the evaluation runs on every rank before it
        # (`logged_value = evaluate(...)`) and only rank 0 prints, one whole line
        best = [float(v) for v in re.findall(r"^best val (\d+\.\d{4})$", output, re.MULTILINE)]
        assert vals and len(best) == 1 and best == [min(vals)] and min(vals) != vals[-1], \
            (run_.directory.name, vals, best, run_.attempts, output[-1500:], _stderr_tail(run_))


def _stderr_tail(run) -> str:
    path = run.directory / "stderr.log"
    return path.read_text(errors="replace")[-1500:] if path.is_file() else ""
