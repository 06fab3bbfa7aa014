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


def test_a_failure_after_training_is_a_crash_and_another_global_batch_is_named(run):
    after = {"exit_code": 1, "equivalent": False, "summary": "the retrofit failed after training: ...",
             "rank_weights": {"ok": True}, "epilogue": "it failed after the 5 recorded steps (exit code 1): rank 1: X"}
    verdict, detail, error = run.judge(script(run), REWRITTEN, after)
    assert verdict == "crash" and detail.startswith("after training (verify --to-end): it failed after")
    batch = {"exit_code": 2, "equivalent": False, "summary": "not comparable", "rank_weights": {"ok": True},
             "global_batch": "step 1: the single run read 8 samples, the 2 ranks together 16 (8 + 8)"}
    verdict, detail, _ = run.judge(script(run), REWRITTEN, batch)
    assert verdict == "silently-wrong" and detail.startswith("global batch not kept: step 1")


def test_the_harness_runs_verify_to_the_end_unless_the_manifest_says_not(run, tmp_path, monkeypatch):
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        raise RuntimeError("stop")

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    src = tmp_path / "train.py"
    for spec, expected in (({}, True), ({"to_end": False}, False)):
        with pytest.raises(RuntimeError):
            run.verify_step(script(run, **spec), src, tmp_path, None, sys.executable)
        assert ("--to-end" in seen[-1]) is expected


def test_each_trains_row_gets_a_deterministic_twin_and_the_summary_counts_parity_by_either(run):
    rows = [script(run), script(run, compare="trains"), script(run, compare="trains", twin=False)]
    rows[1].id, rows[2].id = "o/gan", "o/bn"
    out = run.twins(rows)
    assert [s.id for s in out] == ["o/r-train", "o/gan", "o/gan~det", "o/bn"]
    assert out[2].env == {"REALWORLD_DETERMINISTIC": "1"} and out[1].env == {}
    results = [{"id": "o/r-train", "verdict": "parity"}, {"id": "o/gan", "verdict": "trains"},
               {"id": "o/gan~det", "verdict": "parity"}, {"id": "o/bn", "verdict": "trains"},
               {"id": "o/x", "verdict": "refused"}]
    assert run.summary_line(results) == (
        "4 scripts: 1 parity, 2 trains, 0 flagged, 1 refused, 0 crash, 0 silently-wrong; deterministic twins of "
        "the trains rows: 1/1 parity; at parity (as given or by the twin): 2/3 runnable scripts")


def test_a_twin_that_only_trains_quotes_what_the_report_says_differs(run):
    twin = run.twins([script(run, compare="trains")])[1]
    flagged = dict(REWRITTEN, differs=[{"line": 41, "what": "each rank's BatchNorm normalises its own part"}])
    noisy = {"exit_code": 1, "equivalent": False, "summary": "diverged", "rank_weights": {"ok": True},
             "within_noise": {"ok": True, "why": "mean |loss difference| 1e-05"}, "weights": {"max_abs_diff": 1e-3}}
    verdict, detail, _ = run.judge(twin, flagged, noisy)
    assert verdict == "trains" and detail.endswith("the report says: line 41: each rank's BatchNorm normalises its own part")
    assert "the report says" not in run.judge(script(run, compare="trains"), flagged, noisy)[1]
