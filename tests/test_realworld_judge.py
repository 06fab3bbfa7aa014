"""The corpus runner's verdicts (benchmarks/realworld/run.py): a wrong run the report flagged is not silent."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "realworld" / "run.py"


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("realworld_run", RUN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def script(run, **spec):
    return run.Script("o/r", "0" * 40, "o/r-train", "train.py", dict(run.DEFAULTS, **spec), "m.toml")


REWRITTEN = {"refusal": None, "error": None, "compiles": True, "differs": []}
SAME_DATA = {"exit_code": 0, "equivalent": False, "summary": "diverged", "same_data_on_every_rank": True,
             "rank_weights": {"ok": True}, "initial_weights": {"ok": True}}
DIVERGED = {"exit_code": 0, "equivalent": False, "summary": "diverged at step 1", "rank_weights": {"ok": True}}


def test_unflagged_divergence_is_silently_wrong(run):
    verdict, detail, _ = run.judge(script(run), REWRITTEN, DIVERGED)
    assert verdict == "silently-wrong" and "diverged at step 1" in detail


def test_a_divergence_the_report_marked_is_flagged_with_its_words_and_the_measurement(run):
    rw = dict(REWRITTEN, differs=[{"line": 68, "what": "no DataLoader"}])
    verdict, detail, _ = run.judge(script(run, split_data=True), rw, SAME_DATA)
    assert verdict == "flagged"
    assert "line 68: no DataLoader" in detail and "data not split" in detail


def test_a_flag_does_not_change_parity_or_a_crash(run):
    rw = dict(REWRITTEN, differs=[{"line": 3, "what": "BatchNorm"}])
    assert run.judge(script(run), rw, {"exit_code": 0, "equivalent": True, "summary": "ok"})[0] == "parity"
    crashed = {"exit_code": 2, "error": "the distributed run failed", "detail": "RuntimeError: boom"}
    assert run.judge(script(run), rw, crashed)[0] == "crash"


def test_summary_line_counts_flagged(run):
    rows = [{"verdict": v} for v in ("parity", "flagged", "flagged", "silently-wrong")]
    assert run.summary_line(rows) == ("4 scripts: 1 parity, 0 trains, 2 flagged, 0 refused, 0 crash, "
                                      "1 silently-wrong")
