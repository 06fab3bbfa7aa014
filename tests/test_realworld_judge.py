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


@pytest.fixture
def verify_commands(run, monkeypatch):
    """The commands the harness would run (each run stops it with RuntimeError("stop"))."""
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        raise RuntimeError("stop")

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    return seen


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


def test_the_harness_runs_verify_to_the_end_unless_the_manifest_says_not(run, tmp_path, verify_commands):
    seen = verify_commands
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
               {"id": "o/gan~det", "verdict": "parity", "dtype": "float64"}, {"id": "o/bn", "verdict": "trains"},
               {"id": "o/x", "verdict": "refused"}, {"id": "o/x~det", "verdict": "refused"}]
    assert run.summary_line(results) == (
        "4 scripts: 1 parity, 2 trains, 0 flagged, 1 refused, 0 crash, 0 silently-wrong; deterministic twins of "
        "the trains rows: 1/1 parity (1 in float64); at parity (as given or by the twin): 2/3 runnable scripts (67%)")


def test_a_twin_runs_both_sides_in_float64_unless_the_manifest_says_why_not(run, tmp_path, verify_commands):
    seen = verify_commands
    rows = [script(run, compare="trains"), script(run, compare="trains", twin_native="it builds float32 buffers")]
    rows[1].id = "o/half"
    row, twin, half, half_twin = run.twins(rows)
    assert (twin.spec["dtype"], half_twin.spec["dtype"]) == ("float64", "native")
    for s, dtype in ((row, None), (twin, "float64"), (half, None), (half_twin, None)):
        with pytest.raises(RuntimeError):
            run.verify_step(s, tmp_path / "train.py", tmp_path, None, sys.executable)
        cmd = seen[-1]
        assert (cmd[cmd.index("--dtype") + 1] if "--dtype" in cmd else None) == dtype


def test_a_twin_native_that_is_not_a_reason_is_a_manifest_error(run, tmp_path):
    (tmp_path / "m.toml").write_text('[repo]\nname = "o/r"\ncommit = "' + "0" * 40 + '"\n'
                                     '[[script]]\nid = "o/x"\npath = "x.py"\ncompare = "trains"\n'
                                     'twin_native = true\n', encoding="utf-8")
    with pytest.raises(SystemExit, match="twin_native"):
        run.load_manifests(tmp_path)


def test_a_twin_that_only_trains_says_what_verify_measured_first(run):
    twin = run.twins([script(run, compare="trains")])[1]
    noisy = {"exit_code": 1, "equivalent": False, "rank_weights": {"ok": True},
             "summary": "diverged: final weights differ by 1.1e-03 > 0.0001 (parameter 2, shape (8,))",
             "within_noise": {"ok": True, "why": "mean |loss difference| 1e-05"}, "weights": {"max_abs_diff": 1e-3}}
    verdict, detail, _ = run.judge(twin, REWRITTEN, noisy)
    assert verdict == "trains" and detail.startswith("not at parity: diverged: final weights differ by 1.1e-03")
    assert "not at parity" not in run.judge(script(run, compare="trains"), REWRITTEN, noisy)[1]
def refused_row(code, verdict="refused", rid="o/r-train"):
    return {"id": rid, "verdict": verdict, "detail": f"{code} line 3: ...",
            "rewrite": {"refusal": {"code": code, "line": 3, "what": "w", "why": "y"}}}


def test_a_refusal_is_judged_only_for_the_refusal_the_manifest_names(run):
    judged = script(run, refusal="avoidable: a hand conversion keeps the second backward", refusal_code="FSR624")
    assert run.refusal_judgement(judged, refused_row("FSR624")) == {
        "status": "avoidable", "code": "FSR624", "why": "a hand conversion keeps the second backward"}
    # the rewrite now gives another refusal: the old judgement does not count, it must be judged again
    stale = run.refusal_judgement(judged, refused_row("FSR605"))
    assert stale["status"] == "stale" and stale["code"] == "FSR605" and stale["judged_code"] == "FSR624"
    assert "RE-JUDGE: judged FSR624 (avoidable), now FSR605" == run.judgement_cell(stale)
    # no longer refused: the judgement is stale too; a row never judged says so
    assert run.refusal_judgement(judged, refused_row("FSR624", verdict="parity"))["status"] == "stale"
    assert run.refusal_judgement(script(run), refused_row("FSR624")) == {"status": "unjudged", "code": "FSR624"}
    assert run.refusal_judgement(script(run), refused_row("FSR624", verdict="parity")) is None
    # a refusal verify reports (no rewrite refusal) is read from its message
    verify_refused = {"id": "o/r-train", "verdict": "refused", "detail": "cannot retrofit: FSR612 line 9: x"}
    assert run.refusal_judgement(script(run, refusal="justified: no model", refusal_code="FSR612"),
                                 verify_refused)["status"] == "justified"


def test_summary_line_counts_avoidable_refusals_after_its_other_parts(run):
    scripts = [script(run, refusal="avoidable: one optimizer would do", refusal_code="FSR950"),
               script(run, refusal="justified: shared submodule", refusal_code="FSR626"),
               script(run, refusal="avoidable: x", refusal_code="FSR624"), script(run)]
    for s, rid in zip(scripts, ("o/a", "o/b", "o/c", "o/d")):
        s.id = rid
    rows = [refused_row("FSR950", rid="o/a"), refused_row("FSR626", rid="o/b"),
            refused_row("FSR605", rid="o/c"), {"id": "o/d", "verdict": "parity"}]
    run.attach_judgements(rows, scripts)
    assert run.summary_line(rows) == ("4 scripts: 1 parity, 0 trains, 0 flagged, 3 refused, 0 crash, "
                                      "0 silently-wrong; refusals judged: 1 avoidable, 1 justified, "
                                      "1 not judged or stale")
    rows += [{"id": "o/g", "verdict": "trains"}, {"id": "o/g~det", "verdict": "parity"}]
    assert run.summary_line(rows).endswith(
        "0 silently-wrong; deterministic twins of the trains rows: 1/1 parity (0 in float64); at parity (as "
        "given or by the twin): 2/2 runnable scripts (100%); refusals judged: 1 avoidable, 1 justified, 1 not judged or stale")
    table = run.markdown([dict({"detail": ""}, **r, repo="o/r", path="t.py", steps=5, patches=[], first_error="") for r in rows])
    assert "| avoidable: one optimizer would do |" in table and "| justified: shared submodule |" in table


def test_a_malformed_refusal_judgement_is_a_manifest_error(run, tmp_path):
    head = '[repo]\nname = "o/r"\ncommit = "' + "0" * 40 + '"\n[[script]]\nid = "o/x"\npath = "t.py"\n'
    for bad in ('refusal = "maybe: x"\nrefusal_code = "FSR624"\n', 'refusal = "avoidable: x"\n',
                'refusal = "justified:"\nrefusal_code = "FSR624"\n'):
        (tmp_path / "m.toml").write_text(head + bad, encoding="utf-8")
        with pytest.raises(SystemExit, match="refusal must read"):
            run.load_manifests(tmp_path)
    (tmp_path / "m.toml").write_text(head + 'refusal = "justified: x"\nrefusal_code = "FSR624"\n', encoding="utf-8")
    assert run.load_manifests(tmp_path)[0].refusal_code == "FSR624"
