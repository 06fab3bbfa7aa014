"""`fsdp2-retrofit verify`: the comparison logic, and real runs that pass or fail.

The unit tests (no torch, no processes) cover the argument scaling, the per-step
and weight comparison, the verdict and the chart. The e2e tests run real scripts:
one single-process reference of the example pair is recorded once
(`--keep-runs`) and reused (`--reuse-single`) by the broken twins, which are
made from the in-memory retrofit of that example by one small edit each.
`pytest -s` prints the figures each run produced.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.verify import (
    EXIT_DIVERGED,
    EXIT_EQUIVALENT,
    EXIT_ERROR,
    TEARDOWN_ABORT,
    TEARDOWN_RETRIES,
    Run,
    Verdict,
    VerifyError,
    close,
    compare_rank_weights,
    compare_steps,
    compare_weights,
    link_run_files,
    loss_chart,
    loss_falls,
    reference_record,
    ranks_read_the_same_data,
    report_json,
    run_script,
    single_run_args,
    VerifySettings,
    within_noise,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "fixtures" / "examples"  # the example pair: train_single.py, its hand-written FSDP2 twin
FIXTURE = REPO / "fixtures" / "rewrite" / "main_modulelist" / "input.py"
STEPS = 6


# --- units: no torch, no processes ---------------------------------------------


def test_per_rank_arg_is_multiplied_for_the_single_run():
    assert single_run_args(["--batch-size", "32", "--lr", "1"], ["--batch-size"], 2) == ["--batch-size", "64", "--lr", "1"]
    assert single_run_args(["--batch-size=16"], ["--batch-size"], 4) == ["--batch-size=64"]
    assert single_run_args(["--batch-size", "32"], [], 2) == ["--batch-size", "32"]
    with pytest.raises(VerifyError, match="not in the script arguments"):
        single_run_args(["--lr", "1"], ["--batch-size"], 2)
    with pytest.raises(VerifyError, match="not an integer"):
        single_run_args(["--batch-size", "big"], ["--batch-size"], 2)


def _rec(losses, norms, rank=0):
    return {"rank": rank, "losses": losses, "grad_norms": norms, "peak_memory_bytes": 100, "memory_kind": "rss"}


def test_fp32_reduction_order_noise_passes_and_real_differences_do_not():
    assert close(2.3559277, 2.3559277 + 3.6e-7, 1e-4, 1e-5)
    assert close(1e-9, 2e-9, 1e-4, 1e-5)  # the absolute floor for losses near zero
    assert not close(2.3559, 2.3621, 1e-4, 1e-5)
    assert not close(1.0, None, 1e-4, 1e-5) and close(None, None, 1e-4, 1e-5)
    assert not close(float("nan"), float("nan"), 1e-4, 1e-5)


def test_the_distributed_loss_is_the_mean_over_ranks():
    single = _rec([2.0, 1.5], [1.0, 0.9])
    ranks = [_rec([1.9, 1.4], [1.0, 0.9], 0), _rec([2.1, 1.6], [1.0, 0.9], 1)]
    rows = compare_steps(single, ranks)
    assert [r.loss_dist for r in rows] == pytest.approx([2.0, 1.5])
    assert not any(r.problem for r in rows)


def test_the_first_diverging_step_is_named_loss_then_grad_norm_then_length():
    single = _rec([2.0, 1.5, 1.2], [1.0, 0.9, 0.8])
    loss_off = compare_steps(single, [_rec([2.0, 1.6, 1.3], [1.0, 0.9, 0.8])])
    assert [r.step for r in loss_off if r.problem] == [2, 3]
    assert "loss 1.5 (single) vs 1.6" in loss_off[1].problem

    norm_off = compare_steps(single, [_rec([2.0, 1.5, 1.2], [1.41, 0.9, 0.8])])
    assert norm_off[0].problem.startswith("gradient norm 1 (single) vs 1.41")

    short = compare_steps(single, [_rec([2.0, 1.5], [1.0, 0.9])])
    assert short[2].problem == "the distributed run stopped before this step"
    longer = compare_steps(_rec([2.0], [1.0]), [_rec([2.0, 1.5], [1.0, 0.9])])
    assert longer[1].problem == "the single run stopped before this step"


def _summary(diffs, shapes=None, count=None):
    shapes = shapes or [([4, 4], [4, 4])] * len(diffs)
    rows = [{"index": i, "shape_single": a, "shape_dist": b, "max_abs_diff": d}
            for i, (d, (a, b)) in enumerate(zip(diffs, shapes))]
    return {"count": count or [len(diffs), len(diffs)], "tensors": rows}


def test_weights_within_tolerance_and_the_ways_they_differ():
    ok = compare_weights(_summary([1e-7, 3e-8]), 1e-4)
    assert ok.ok and ok.max_abs_diff == 1e-7 and ok.worst_index == 0
    far = compare_weights(_summary([1e-7, 2e-3]), 1e-4)
    assert not far.ok and far.worst_index == 1 and "2.000e-03 > 0.0001" in far.problem
    count = compare_weights(_summary([0.0], count=[2, 1]), 1e-4)
    assert not count.ok and "2 tensors in the single run, 1" in count.problem
    shape = compare_weights(_summary([None], shapes=[([4, 4], [2, 4])]), 1e-4)
    assert not shape.ok and "(4, 4) (single) vs (2, 4)" in shape.problem


def test_verdict_exit_codes_and_json():
    single = _rec([2.0, 1.5], [1.0, 0.9])
    same = [_rec([2.0, 1.5], [1.0, 0.9])]
    good = compare_weights(_summary([1e-7]), 1e-4)
    bad = compare_weights(_summary([1e-2]), 1e-4)
    assert Verdict(compare_steps(single, same), good, single, same).exit_code == EXIT_EQUIVALENT
    weights_only = Verdict(compare_steps(single, same), bad, single, same)
    assert weights_only.exit_code == EXIT_DIVERGED and weights_only.summary().startswith("diverged: final weights")
    assert Verdict(compare_steps(single, same), None, single, same).exit_code == EXIT_ERROR
    diverged = Verdict(compare_steps(single, [_rec([2.0, 1.7], [1.0, 0.9])]), good, single, same)
    assert diverged.exit_code == EXIT_DIVERGED
    data = report_json(diverged, VerifySettings(script=Path("train.py")))
    assert data["first_diverging_step"] == 2 and data["equivalent"] is False
    assert data["max_loss_diff"] == pytest.approx(0.2)
    assert data["steps"][1]["ok"] is False and data["memory"]["ranks"][0]["peak_bytes"] == 100
    json.dumps(data)


def test_saved_weights_join_the_verdict():
    single = _rec([2.0, 1.5], [1.0, 0.9])
    same = [_rec([2.0, 1.5], [1.0, 0.9])]
    good = compare_weights(_summary([1e-7]), 1e-4)
    bad_saved = compare_weights({"count": [1, 1], "tensors": [
        {"index": 0, "name": "ema.w", "shape_single": [2], "shape_dist": [2], "max_abs_diff": 3e-3}]}, 1e-4)
    assert "'ema.w'" in bad_saved.problem and bad_saved.worst_name == "ema.w"
    verdict = Verdict(compare_steps(single, same), good, single, same, saved=bad_saved)
    assert verdict.exit_code == EXIT_DIVERGED and "ema.w" in verdict.summary()
    saved_only = Verdict(compare_steps(single, same), None, single, same, saved=good)
    assert saved_only.equivalent and "saved weights within" in saved_only.summary()
    # steps shown but not judged (a reference without records): only the weights decide
    unjudged = Verdict(compare_steps(single, [_rec([9.0, 9.0], [1.0, 0.9])]), None, single, same, saved=good,
                       judge_steps=False)
    assert unjudged.equivalent and "steps not compared" in unjudged.summary()
    error = compare_weights({"error": "saved object has no key(s) ['ema']"}, 1e-4)
    assert not error.ok and "no key" in error.problem


def test_a_torchrun_reference_is_the_mean_over_its_ranks():
    ranks = [_rec([2.0, 1.0], [0.5, 0.4]), _rec([4.0, 3.0], [0.5, 0.4])]
    record = reference_record(Run(Path("."), ranks, None))
    assert record["losses"] == [3.0, 2.0] and record["grad_norms"] == [0.5, 0.4]


@pytest.mark.parametrize(
    "losses, error",
    [
        ([2.3, 1.9, 1.2], None),
        ([2.3, 2.2, 2.25], "did not fall by 20%"),  # flat
        ([1.0, 1.5, 3.0], "did not fall"),  # diverging
        ([2.3, float("nan"), 0.1], "non-finite"),  # garbage memory left by to_empty
        ([2.3, None, 0.1], "non-finite"),  # a step without a backward() on a scalar
        ([2.3], "at least two"),
        ([], "at least two"),
    ],
)
def test_loss_must_fall(losses, error):
    result = loss_falls(losses, 0.2)
    assert result.ok is (error is None)
    if error:
        assert error in result.problem


def _fake_launches(outcomes, seen=None):
    """A launch that plays `outcomes` (exit code, stderr) in turn; each attempt
    overwrites the checkpoint it finds (what a resumed run does)."""

    def launch(cmd, env, cwd, timeout, what):
        if seen is not None:
            seen.append((cwd / "ckpt").read_text() if (cwd / "ckpt").is_file() else None)
            (cwd / "ckpt").write_text("step 12")
            (cwd / "extra").write_text("left by this attempt")
        return outcomes.pop(0)

    return launch


def test_a_retried_run_starts_from_the_files_the_first_attempt_found(tmp_path: Path):
    """An attempt aborted at teardown may already have written a later checkpoint:
    the retry must not resume from it."""
    (tmp_path / "ckpt").write_text("step 6")
    seen = []
    launch = _fake_launches([(-6, f"...\n{TEARDOWN_ABORT}\n"), (0, "")], seen)
    run = run_script(["x"], tmp_path, {}, 2, 10, "run", steps=0, instrument=False, launch=launch)
    assert seen == ["step 6", "step 6"] and run.attempts == 2


def test_only_the_gloo_teardown_abort_is_retried(tmp_path: Path):
    run = run_script(["x"], tmp_path, {}, 2, 10, "run", steps=0, instrument=False,
                     launch=_fake_launches([(1, TEARDOWN_ABORT), (0, "")]))
    assert run.attempts == 2
    with pytest.raises(VerifyError, match="exit code 1"):
        run_script(["x"], tmp_path, {}, 2, 10, "run", steps=0, instrument=False,
                   launch=_fake_launches([(1, "ValueError: boom"), (0, "")]))
    with pytest.raises(VerifyError, match="exit code -6"):
        run_script(["x"], tmp_path, {}, 2, 10, "run", steps=0, instrument=False,
                   launch=_fake_launches([(-6, TEARDOWN_ABORT)] * (TEARDOWN_RETRIES + 1)))


def _recording_launches(outcomes, exits=None):
    """A launch that writes both ranks' records, as an instrumented run does, then plays
    `outcomes`; `exits` (one per attempt): what each rank's exit record says (None: none)."""
    attempts = iter(exits or [[None, None]] * len(outcomes))

    def launch(cmd, env, cwd, timeout, what):
        for r, clean in enumerate(next(attempts)):
            (cwd / f"rank{r}.json").write_text(json.dumps({**_rec([2.0], [1.0]), "rank": r, "world_size": 2,
                                                            "steps": 1}))
            if clean is not None:
                (cwd / f"exit_rank{r}.json").write_text(json.dumps({"clean": clean}))
        return outcomes.pop(0)

    return launch


def test_a_stopped_run_with_every_record_is_not_retried(tmp_path: Path):
    """verify's K-step runs: the records were written before the abort; they are the result."""
    run = run_script(["x"], tmp_path, {}, 2, 10, "run", steps=5, launch=_recording_launches([(-6, TEARDOWN_ABORT)]))
    assert run.attempts == 1 and len(run.ranks) == 2


def test_a_run_to_its_end_aborted_after_every_rank_finished_cleanly_is_not_retried(tmp_path: Path):
    """steps 0 (the execution tests): the abort came after every rank's code ended without
    an error, which each rank's exit record says; the run is its records."""
    run = run_script(["x"], tmp_path, {}, 2, 10, "run", steps=0,
                     launch=_recording_launches([(-6, TEARDOWN_ABORT)], [[True, True]]))
    assert run.attempts == 1 and len(run.ranks) == 2


@pytest.mark.parametrize("exits", [[True, None], [True, False]], ids=["a rank never got to its end", "a rank failed"])
def test_a_run_to_its_end_aborted_before_every_rank_finished_cleanly_is_retried(tmp_path: Path, exits):
    run = run_script(["x"], tmp_path, {}, 2, 10, "run", steps=0,
                     launch=_recording_launches([(-6, TEARDOWN_ABORT), (0, "")], [exits, [True, True]]))
    assert run.attempts == 2
    with pytest.raises(VerifyError, match="exit code -6"):
        run_script(["x"], tmp_path, {}, 2, 10, "run", steps=0,
                   launch=_recording_launches([(-6, TEARDOWN_ABORT)] * 3, [exits] * 3))


def test_records_an_earlier_run_left_in_the_folder_do_not_stand_for_this_one(tmp_path: Path):
    """A resumed run in the folder of the run it resumes: that run's clean exit records must not
    make an abort before this one's own records look finished."""
    for r in range(2):
        (tmp_path / f"rank{r}.json").write_text(json.dumps({**_rec([2.0], [1.0]), "rank": r, "world_size": 2}))
        (tmp_path / f"exit_rank{r}.json").write_text(json.dumps({"clean": True}))
    with pytest.raises(VerifyError, match="exit code -6"):
        run_script(["x"], tmp_path, {}, 2, 10, "run", steps=0,
                   launch=_fake_launches([(-6, TEARDOWN_ABORT)] * (TEARDOWN_RETRIES + 1)))


def test_ranks_must_end_with_exactly_the_same_weights():
    same = compare_rank_weights([(1, _summary([0.0, 0.0]))])
    assert same.ok and same.max_abs_diff == 0.0
    apart = compare_rank_weights([(1, _summary([0.0, 3e-9]))])
    assert not apart.ok and "rank 1's final weights differ from rank 0's" in apart.problem
    count = compare_rank_weights([(1, _summary([0.0], count=[2, 1]))])
    assert not count.ok and "2 tensors in rank 0, 1 in rank 1" in count.problem
    single = _rec([2.0, 1.5], [1.0, 0.9])
    same_ranks = [_rec([2.0, 1.5], [1.0, 0.9])]
    verdict = Verdict(compare_steps(single, same_ranks), compare_weights(_summary([1e-7]), 1e-4), single, same_ranks,
                      rank_weights=apart)
    assert not verdict.equivalent and verdict.exit_code == EXIT_DIVERGED
    assert verdict.summary().startswith("diverged: rank 1's final weights")
    data = report_json(verdict, VerifySettings(script=Path("train.py")))
    assert data["rank_weights"]["ok"] is False


def test_identical_per_rank_losses_mean_the_ranks_read_the_same_data():
    assert ranks_read_the_same_data([_rec([2.0, 1.5, 1.2], [1, 1, 1], 0), _rec([2.0, 1.5, 1.2], [1, 1, 1], 1)])
    assert not ranks_read_the_same_data([_rec([2.0, 1.5], [1, 1], 0), _rec([2.0, 1.6], [1, 1], 1)])
    assert not ranks_read_the_same_data([_rec([2.0], [1], 0), _rec([2.0], [1], 1)])  # one step proves nothing
    assert not ranks_read_the_same_data([_rec([2.0, 1.5], [1, 1], 0)])  # one rank


def test_within_noise_accepts_random_draw_differences_and_rejects_divergence():
    single = _rec([1.40, 1.10, 1.30, 0.95, 1.20], [1.0] * 5)
    noisy = compare_steps(single, [_rec([1.35, 1.22, 1.18, 1.05, 1.12], [1.0] * 5)])
    ok, why = within_noise(noisy)
    assert ok, why
    blown = compare_steps(single, [_rec([1.4, 3.0, 9.0, 20.0, 40.0], [1.0] * 5)])
    assert within_noise(blown) == (False, within_noise(blown)[1]) and "exceeds the noise bound" in within_noise(blown)[1]
    nan = compare_steps(single, [_rec([1.4, float("nan"), 1.3, 1.0, 1.2], [1.0] * 5)])
    assert within_noise(nan) == (False, "a loss is not finite")
    short = compare_steps(_rec([1.0, 0.9], [1, 1]), [_rec([1.0, 0.9], [1, 1])])
    assert not within_noise(short)[0]


def test_run_files_are_copied_into_each_run_directory_or_linked_when_large(tmp_path: Path, monkeypatch):
    """Each run gets its own copy of small inputs: kuangliu's --resume saves its checkpoint where it
    loaded it from, and through a link the single run's save became the retrofit's start."""
    import fsdp2_retrofit.verify as v

    files = tmp_path / "files"
    (files / "data").mkdir(parents=True)
    (files / "data" / "train.txt").write_text("a b c")
    (files / "vocab.pkl").write_bytes(b"x")
    run, other = tmp_path / "runs" / "single", tmp_path / "runs" / "dist"
    link_run_files(files, run)
    link_run_files(files, other)
    assert (run / "data" / "train.txt").read_text() == "a b c" and not (run / "vocab.pkl").is_symlink()
    (run / "data" / "train.txt").write_text("written by the single run")
    assert (other / "data" / "train.txt").read_text() == "a b c"
    assert (files / "data" / "train.txt").read_text() == "a b c"
    monkeypatch.setattr(v, "RUN_FILES_COPY_LIMIT", 3)  # large inputs are linked, not copied
    linked = tmp_path / "runs" / "linked"
    link_run_files(files, linked)
    assert (linked / "vocab.pkl").is_symlink() and (linked / "data").is_symlink()
    link_run_files(None, tmp_path / "none")
    assert not (tmp_path / "none").exists()
    with pytest.raises(VerifyError, match="not a directory"):
        link_run_files(tmp_path / "missing", run)


def test_loss_chart_marks_both_curves():
    lines = loss_chart([2.0, 1.5, 1.0], [2.0, 1.6, 1.0], height=5)
    body = "\n".join(lines)
    assert lines[0].startswith("2.0000 |*") and "1.0000 |" in lines[4]
    assert "s" in body and "d" in body
    assert loss_chart([], []) == []


def test_help_says_verify_runs_your_code():
    result = CliRunner().invoke(cli.main, ["verify", "--help"])
    assert result.exit_code == 0
    assert "EXECUTES YOUR CODE" in result.output


def test_importing_verify_does_not_import_torch():
    code = "import sys, fsdp2_retrofit.cli, fsdp2_retrofit.verify; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_a_refused_retrofit_exits_2_with_its_reason(tmp_path: Path):
    script = tmp_path / "no_model.py"
    script.write_text("import torch\nprint(torch.ones(2))\n")
    result = CliRunner().invoke(cli.main, ["verify", str(script)])
    assert result.exit_code == EXIT_ERROR
    assert "cannot retrofit: FSR611 " in result.output and "no_model.py:" in result.output
    assert list(tmp_path.iterdir()) == [script]  # nothing written next to the user's file


def test_a_global_batch_the_retrofit_cannot_keep_exits_2_before_any_run(tmp_path: Path):
    script = tmp_path / "kwargs_loader.py"
    script.write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader\n\n\n"
        "def main(data, settings):\n    model = nn.Linear(4, 1)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    loader = DataLoader(data, **settings.loader_options())\n"
        "    for x in loader:\n        model(x).sum().backward()\n        opt.step()\n"
    )
    result = CliRunner().invoke(cli.main, ["verify", str(script)])
    assert result.exit_code == EXIT_ERROR
    assert "kwargs_loader.py:9: cannot keep the global batch" in result.output
    assert "world_size x larger" in result.output
    assert list(tmp_path.iterdir()) == [script]


# --- real runs ----------------------------------------------------------------

def e2e(test):
    """Runs real scripts (torchrun for most): marked e2e, skipped without torch."""
    needs_torch = pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="the verify runs need torch (pip install -e .[test])"
    )
    return pytest.mark.e2e(needs_torch(test))


def _verify(*args) -> tuple[int, str, dict]:
    json_path = Path(args[args.index("--json") + 1]) if "--json" in args else None
    result = CliRunner().invoke(cli.main, ["verify", *map(str, args)])
    report = json.loads(json_path.read_text()) if json_path and json_path.is_file() else {}
    return result.exit_code, result.output, report


def _figures(name: str, report: dict) -> str:
    w = report.get("weights") or {}
    return (f"\n{name}: exit {report.get('exit_code')}, first diverging step {report.get('first_diverging_step')} "
            f"({report.get('first_divergence')}), max loss diff {report.get('max_loss_diff')}, "
            f"max weight diff {w.get('max_abs_diff')}")


@pytest.fixture(scope="module")
def shared_pass(tmp_path_factory):
    """The example pair (fixtures/examples) (per-rank batch 32 on 2 ranks vs 64 in one process), runs kept for reuse."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the verify runs need torch")
    assert (EXAMPLES / "train_single.py").is_file(), f"the example pair is missing from {EXAMPLES}"
    root = tmp_path_factory.mktemp("shared")
    code, output, report = _verify(
        EXAMPLES / "train_single.py", "--retrofitted", EXAMPLES / "train_fsdp2.py", "--per-rank-arg", "--batch-size",
        "--steps", STEPS, "--keep-runs", root / "runs", "--json", root / "report.json", "--", "--batch-size", "32",
    )
    return code, output, report, root / "runs" / "single"


@e2e
@pytest.mark.xdist_group("verify_shared")  # shared_pass runs once for these under --dist loadgroup
def test_the_shared_example_pair_is_equivalent(shared_pass):
    code, output, report, _ = shared_pass
    print(_figures("shared example", report))
    assert code == EXIT_EQUIVALENT, output
    assert report["equivalent"] and len(report["steps"]) == STEPS
    assert report["weights"]["max_abs_diff"] <= 1e-4
    assert "equivalent" in output and "peak memory" in output
    assert report["rank_weights"] == {"ok": True, "max_abs_diff": 0.0, "problem": None}
    assert report["same_data_on_every_rank"] is False and report["within_noise"]["ok"]
    assert "every rank ended with the same weights" in output


@e2e
def test_an_in_memory_retrofit_of_a_shuffled_fixture_is_equivalent(tmp_path: Path):
    code, output, report = _verify(FIXTURE, "--steps", STEPS, "--json", tmp_path / "r.json", "--", "--batch-size", "64")
    print(_figures("main_modulelist, in-memory retrofit", report))
    assert code == EXIT_EQUIVALENT, output
    assert not list(FIXTURE.parent.glob("*.pt"))  # the runs wrote into their own folders


def _twin(tmp_path: Path, old: str, new: str, name: str, base: Path = EXAMPLES / "train_single.py") -> Path:
    """The in-memory retrofit of `base` (the example; keep-global-batch), with one edit."""
    from fsdp2_retrofit.verify import retrofit_in_memory

    code = retrofit_in_memory(base, tmp_path / "retrofit").read_text()
    assert code.count(old) == 1, f"the retrofit no longer contains {old!r}"
    twin = tmp_path / name
    twin.write_text(code.replace(old, new))
    return twin


def _verify_twin(shared_pass, twin: Path, tmp_path: Path):
    *_, single_dir = shared_pass
    return _verify(EXAMPLES / "train_single.py", "--retrofitted", twin, "--steps", STEPS, "--reuse-single", single_dir,
                   "--json", tmp_path / "r.json", "--", "--batch-size", "64")


@e2e
@pytest.mark.xdist_group("verify_shared")
def test_a_twin_without_the_distributed_sampler_diverges(shared_pass, tmp_path: Path):
    twin = _twin(tmp_path, "batch_size=args.batch_size // world_size, sampler=sampler)",
                 "batch_size=args.batch_size // world_size, shuffle=False)", "no_sampler.py")
    code, output, report = _verify_twin(shared_pass, twin, tmp_path)
    print(_figures("twin without DistributedSampler", report))
    assert code == EXIT_DIVERGED, output
    assert report["first_diverging_step"] == 1  # every rank trains on the first half of the batch
    assert "diverged at step 1: loss" in output
    assert report["same_data_on_every_rank"] is True and "the ranks read the same data" in " ".join(output.split())


@e2e
@pytest.mark.xdist_group("verify_shared")
def test_a_twin_with_the_optimizer_built_before_sharding_diverges(shared_pass, tmp_path: Path):
    optimizer = "    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
    build = "    model = Classifier().to(device)\n"
    source = _twin(tmp_path, optimizer, "", "tmp.py").read_text()
    twin = tmp_path / "optimizer_first.py"
    twin.write_text(source.replace(build, build + optimizer))
    code, output, report = _verify_twin(shared_pass, twin, tmp_path)
    print(_figures("twin with the optimizer built before fully_shard", report))
    assert code == EXIT_DIVERGED, output
    # it holds the unsharded tensors: no gradient ever reaches them, so the norm it sees is 0
    assert report["first_diverging_step"] == 1 and "gradient norm" in report["first_divergence"]


@e2e
@pytest.mark.xdist_group("verify_shared")
def test_a_twin_whose_ranks_build_their_own_weights_starts_apart(shared_pass, tmp_path: Path):
    """Each rank builds the model under its own seed and shards the mix: caught before
    the first step, from the weights each optimizer starts from (also where the steps
    themselves could not be compared)."""
    build = "    model = Classifier().to(device)\n"
    twin = _twin(tmp_path, build, "    torch.manual_seed(dist.get_rank())\n" + build, "own_weights.py")
    code, output, report = _verify_twin(shared_pass, twin, tmp_path)
    print(_figures("twin whose ranks build their own weights", report))
    assert code == EXIT_DIVERGED, output
    assert report["initial_weights"]["ok"] is False and report["initial_weights"]["max_abs_diff"] > 1e-2
    assert "diverged before the first step: the weights before the first step differ" in " ".join(output.split())


def test_runs_that_start_apart_are_not_equivalent():
    single = _rec([2.0, 1.5], [1.0, 0.9])
    same = [_rec([2.0, 1.5], [1.0, 0.9])]
    apart = compare_weights(_summary([0.3]), 1e-4)
    apart.problem = apart.problem.replace("final weights differ", "the weights before the first step differ")
    verdict = Verdict(compare_steps(single, same), compare_weights(_summary([1e-7]), 1e-4), single, same,
                      initial=apart)
    assert not verdict.equivalent and verdict.exit_code == EXIT_DIVERGED
    assert verdict.summary().startswith("diverged before the first step: the weights before the first step differ")
    data = report_json(verdict, VerifySettings(script=Path("train.py")))
    assert data["initial_weights"]["ok"] is False
    verdict.initial = compare_weights(_summary([0.0]), 1e-4)
    assert verdict.equivalent and report_json(verdict, VerifySettings(script=Path("train.py")))["initial_weights"]["ok"]


LOCAL_CLIP = """\
        # clip on this rank's shard only: no all-reduce of the norm
        local_norm = sum(float(p.grad.to_local().pow(2).sum()) for p in model.parameters()) ** 0.5
        for p in model.parameters():
            p.grad.mul_(min(1.0, MAX_NORM / (local_norm + 1e-6)))
"""


@e2e
def test_a_twin_clipping_on_local_norms_diverges(tmp_path: Path):
    """At max_norm 1.0 the example clips every step in one process (whole-gradient norms 1.17 to
    1.47 over the first 6 steps) while each rank's local norm (0.88 and 0.92 at step 1) stays
    under it; at 0.25 both runs clip every step, the twin with a different factor on each rank."""
    clip = "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"
    original = (EXAMPLES / "train_single.py").read_text()
    assert original.count(clip) == 1
    script = tmp_path / "train_clip.py"
    script.write_text(original.replace(clip, clip.replace("1.0)", "0.25)")))
    twin = _twin(tmp_path, "        " + clip.replace("1.0)", "0.25)") + "\n",
                 LOCAL_CLIP.replace("MAX_NORM", "0.25"), "local_clip.py", base=script)
    code, output, report = _verify(script, "--retrofitted", twin, "--steps", STEPS, "--json", tmp_path / "r.json",
                                   "--", "--batch-size", "64")
    print(_figures("twin clipping on local norms (max_norm 0.25)", report))
    # the clip is active in both runs: the single run's norms are clipped to 0.25 ...
    assert all(row["grad_norm_single"] == pytest.approx(0.25, rel=1e-4) for row in report["steps"])
    # ... and each rank clips its own shard to 0.25, so the whole gradient's norm is larger
    assert report["steps"][0]["grad_norm_dist"] > 0.3
    assert code == EXIT_DIVERGED, output
    assert report["first_diverging_step"] == 1


@e2e
def test_a_script_that_crashes_exits_2_with_its_error(tmp_path: Path):
    script = tmp_path / "crash.py"
    script.write_text("import sys\nraise FileNotFoundError('no data at /nonexistent/train.bin')\n")
    code, output, report = _verify(script, "--retrofitted", script, "--json", tmp_path / "r.json")
    assert code == EXIT_ERROR
    assert "single-process run" in output and "FileNotFoundError: no data at /nonexistent/train.bin" in output
    assert report["exit_code"] == EXIT_ERROR


INIT_STATE_SCRIPT = """\
import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
_init_optim_state(optimizer)  # what get/set_optimizer_state_dict do on resume, before the first step
for _ in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


@e2e
def test_the_optimizer_state_init_step_of_dcp_is_not_a_training_step(tmp_path: Path):
    """DCP's get/set_optimizer_state_dict create an empty optimizer's state with a
    step() at lr 0: counting it would shift every later step by one."""
    from fsdp2_retrofit.verify import launch_single

    script = tmp_path / "init_state.py"
    script.write_text(INIT_STATE_SCRIPT)
    run = launch_single(script, [], tmp_path / "run")
    record = run.ranks[0]
    assert record["steps"] == 3 and None not in record["losses"] and len(record["grad_norms"]) == 3


EXIT_SCRIPT = """\
import sys

import torch.distributed as dist

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.destroy_process_group()
how = sys.argv[1]
if how == "raises":
    raise ValueError("boom")
if how.startswith("exit"):
    sys.exit(int(how[4:]))
"""


@e2e
@pytest.mark.parametrize("how, clean", [("ends", True), ("exit0", True), ("exit3", False), ("raises", False)])
def test_each_rank_records_whether_its_code_ended_cleanly(tmp_path: Path, how: str, clean: bool):
    """The exit record run_script trusts after a teardown abort: written once the script's
    own code is over, clean only without an uncaught exception or a failing sys.exit."""
    from fsdp2_retrofit.verify import _child_env

    script = tmp_path / "ends.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), how], env=_child_env(tmp_path, 0, "single"),
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == (0 if clean else 1 if how == "raises" else 3), proc.stderr[-2000:]
    record = json.loads((tmp_path / "exit_rank0.json").read_text())
    assert record["clean"] is clean, record


# -- the global batch and the epochs the samplers were at (the evidence issue, item 1) ----------------------


def test_the_global_batch_is_the_single_runs_batch_against_the_ranks_sum():
    from fsdp2_retrofit.verify import global_batch_problem

    single = {"samples": [16, 16, 16]}
    assert global_batch_problem(single, [{"samples": [8, 8, 8]}, {"samples": [8, 8, 8]}]) is None
    problem = global_batch_problem(single, [{"samples": [8, 16, 8]}, {"samples": [8, 16, 8]}])
    assert problem is not None and problem.startswith("step 2: the single run read 16 samples, the 2 ranks "
                                                      "together 32 (16 + 16)")
    # data that does not come through a DataLoader counts nothing: not judged
    assert global_batch_problem({"samples": [0, 0]}, [{"samples": [0, 0]}, {"samples": [0, 0]}]) is None
    assert global_batch_problem({}, [{}, {}]) is None


def test_a_global_batch_mismatch_is_not_a_training_defect():
    from fsdp2_retrofit.verify import Verdict

    verdict = Verdict([], None, {}, [], global_batch="step 1: ...")
    assert verdict.exit_code == EXIT_ERROR and not verdict.equivalent
    assert verdict.summary().startswith("not comparable: the global batch differs at step 1")


def test_the_single_run_replays_the_epochs_the_distributed_samplers_were_at(tmp_path: Path):
    from fsdp2_retrofit.verify import Run, _child_env, sampler_epochs

    def run(epochs):
        return Run(tmp_path, [{"sampler_epochs": epochs}], None)

    assert sampler_epochs(run([0, 1, 2])) == []  # what the single run's sampler does anyway
    assert sampler_epochs(run([1, 2, 3])) == [1, 2, 3]
    assert sampler_epochs(run([0, 0, 1, 1])) == [0, 0, 1, 1]  # two shuffled loaders
    assert sampler_epochs(run([-1, 0, 1])) == [-1, 0, 1]  # a shuffled pass left to a RandomSampler first
    env = _child_env(tmp_path, 4, "single", epochs=[1, 2])
    assert env["FSDP2_RETROFIT_VERIFY_EPOCHS"] == "1,2"
    assert "FSDP2_RETROFIT_VERIFY_EPOCHS" not in _child_env(tmp_path, 4, "dist", epochs=[1, 2])


EPOCHS_FROM_ONE = '''\
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(1, args.epochs + 1):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
'''


@e2e
def test_a_script_counting_epochs_from_one_is_equivalent(tmp_path: Path):
    """The retrofit calls set_epoch(1), set_epoch(2), ...: the single run's sampler draws those
    epochs' permutations too (it drew epoch 0, 1, ... before, and verify called a correct
    retrofit diverged at step 1)."""
    script = tmp_path / "train.py"
    script.write_text(EPOCHS_FROM_ONE)
    code, output, report = _verify(script, "--steps", "10", "--json", tmp_path / "r.json")
    print(_figures("epochs counted from 1, in-memory retrofit", report))
    assert report["sampler_epochs"][:3] == [1, 2, 3]
    assert code == EXIT_EQUIVALENT, output
    assert report["global_batch"] is None


EVAL_SHUFFLED_FIRST = '''
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    val_loader = DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8, shuffle=True)
    first, _ = next(iter(val_loader))  # a shuffled pass of a loader the retrofit does not split
    print(f"a look at the data: mean {first.mean().item():.3f}")
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    for epoch in range(2):
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
'''


@e2e
def test_a_shuffled_pass_the_retrofit_leaves_unsplit_draws_as_in_the_original(tmp_path: Path):
    """An evaluation loader shuffled before the build: its RandomSampler takes a seed from the global
    generator in both scripts; the single run's reference sampler replaced that pass too and skipped
    the draw, so the model was built from another point of the stream and verify reported weights
    differing before the first step (pytorch-vqvae's vqvae.py). That pass is now recorded (-1) and
    drawn as the original draws it."""
    script = tmp_path / "train.py"
    script.write_text(EVAL_SHUFFLED_FIRST)
    code, output, report = _verify(script, "--steps", "6", "--json", tmp_path / "r.json")
    print(_figures("a shuffled evaluation pass before the build", report))
    assert report["sampler_epochs"][:2] == [-1, 0]
    assert code == EXIT_EQUIVALENT, output


@e2e
def test_a_retrofit_on_another_global_batch_is_not_comparable(tmp_path: Path):
    """A retrofit whose ranks each read the whole global batch: verify says the batches differ
    (exit 2), it does not call the retrofit diverged."""
    from fsdp2_retrofit.verify import retrofit_in_memory

    script = tmp_path / "train.py"
    script.write_text(EPOCHS_FROM_ONE)
    code = retrofit_in_memory(script, tmp_path / "retrofit").read_text()
    old = "batch_size=args.batch_size // world_size"
    assert code.count(old) == 1, "the retrofit no longer divides the batch size this way"
    twin = tmp_path / "twin.py"
    twin.write_text(code.replace(old, "batch_size=args.batch_size"))
    code, output, report = _verify(script, "--retrofitted", twin, "--steps", "4", "--json", tmp_path / "r.json")
    assert code == EXIT_ERROR, output
    assert report["global_batch"].startswith("step 1: the single run read 8 samples, the 2 ranks together 16")
    assert "not comparable: the global batch differs" in output


def _to_end_launch(outcome, exits):
    """A launch whose ranks record their steps (reason "steps"), go on, and end as `exits`
    says (True clean, a text: the exception that ended the rank); `outcome`: (exit code,
    stderr), or a VerifyError to raise (a timeout)."""

    def launch(cmd, env, cwd, timeout, what):
        for r, how in enumerate(exits):
            (cwd / f"rank{r}.json").write_text(json.dumps({**_rec([2.0], [1.0]), "rank": r, "world_size": 2,
                                                            "steps": 1, "reason": "steps"}))
            if how is not None:
                (cwd / f"exit_rank{r}.json").write_text(
                    json.dumps({"clean": how is True, "uncaught": None if how is True else how}))
        if isinstance(outcome, VerifyError):
            raise outcome
        return outcome

    return launch


def test_to_end_a_failure_after_the_recorded_steps_is_the_runs_epilogue(tmp_path: Path):
    run = run_script(["x"], tmp_path, {}, 2, 10, "run", steps=1, to_end=True,
                     launch=_to_end_launch((1, "Traceback ...\nRuntimeError: boom\n"),
                                           [True, "RuntimeError: rank 1 only"]))
    assert len(run.ranks) == 2
    assert run.epilogue == "it failed after the 1 recorded steps (exit code 1): rank 1: RuntimeError: rank 1 only"
    hang = VerifyError("the run did not finish within 10 s and was killed: rank 1 (pid 7) still running, 1 step(s) "
                       "done, at train.py:9 in main (waiting in torch.distributed). every rank still running was "
                       "waiting in torch.distributed: a hang", "stderr tail")
    run = run_script(["x"], tmp_path, {}, 2, 10, "run", steps=1, to_end=True, launch=_to_end_launch(hang, [None, None]))
    # the epilogue says what the ranks were doing (the timeout's diagnosis), not "a hang" on its own
    assert run.epilogue.startswith("it did not end within 10 s after the 1 recorded steps: rank 1 (pid 7) still")
    assert run.epilogue.endswith("waiting in torch.distributed: a hang")
    # without to_end the same failure is the run's failure
    with pytest.raises(VerifyError, match="exit code 1"):
        run_script(["x"], tmp_path, {}, 2, 10, "run", steps=1,
                   launch=_to_end_launch((1, "RuntimeError: boom"), [True, "RuntimeError: boom"]))


def test_a_retrofit_failing_after_training_is_diverged():
    verdict = Verdict([], None, {}, [], epilogue="it failed after the 4 recorded steps (exit code 1): rank 1: ...")
    assert verdict.exit_code == EXIT_DIVERGED and not verdict.equivalent
    assert verdict.summary().startswith("the retrofit failed after training: it failed after the 4 recorded steps")


EPILOGUE = '''
    model.eval()
    with torch.no_grad():
        total = sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in DataLoader(data, batch_size=8))
    print(f"final loss {total / len(data):.4f}")
'''


@e2e
def test_to_end_runs_the_epilogue_and_catches_a_retrofit_failing_there(tmp_path: Path):
    """The original evaluates after training. Its retrofit with one rank failing after the loop:
    stopped after the steps (the default) verify cannot see it; with --to-end it is diverged.
    The faithful retrofit runs to its end on both sides and stays equivalent."""
    from fsdp2_retrofit.verify import retrofit_in_memory

    script = tmp_path / "train.py"
    anchor = '        print(f"epoch {epoch}: loss {loss.item():.4f}")\n'
    assert EPOCHS_FROM_ONE.count(anchor) == 1
    script.write_text(EPOCHS_FROM_ONE.replace(anchor, anchor + EPILOGUE))
    code, output, report = _verify(script, "--steps", "4", "--to-end", "--json", tmp_path / "ok.json")
    assert code == EXIT_EQUIVALENT, output
    assert report["to_end"] and report["epilogue"] is None
    assert "both scripts ran to their end after the recorded steps" in report["notes"]

    retrofit = retrofit_in_memory(script, tmp_path / "retrofit").read_text()
    old = "    model.eval()\n"
    assert retrofit.count(old) == 1, "the retrofit no longer has the final evaluation's model.eval()"
    twin = tmp_path / "twin.py"
    twin.write_text(retrofit.replace(old, "    if dist.get_rank() == 1:\n        raise RuntimeError('after training')\n"
                                     + old))
    code, output, report = _verify(script, "--retrofitted", twin, "--steps", "4", "--json", tmp_path / "r.json")
    assert code == EXIT_EQUIVALENT, output  # stopped after 4 steps: the failure is never reached
    code, output, report = _verify(script, "--retrofitted", twin, "--steps", "4", "--to-end",
                                   "--json", tmp_path / "r2.json")
    print(f"\n--to-end on a retrofit failing after training: exit {code}: {report.get('summary')}")
    assert code == EXIT_DIVERGED, output
    assert "rank 1: RuntimeError: after training" in report["epilogue"]
    assert "the retrofit failed after training" in output


def test_keep_runs_may_hold_the_inputs_a_script_reads_beside_its_run_folder(tmp_path: Path):
    """A script reading ../data from its run folder: the data sits in the --keep-runs directory
    (the harness puts it there); only an earlier run's folders are refused."""
    from fsdp2_retrofit.verify import VerifySettings, _work_root

    root = tmp_path / "runs"
    (root / "data").mkdir(parents=True)
    assert _work_root(VerifySettings(script=tmp_path / "x.py", keep_runs=root)) == (root.resolve(), False)
    (root / "single").mkdir()
    with pytest.raises(VerifyError, match="holds single of an earlier run"):
        _work_root(VerifySettings(script=tmp_path / "x.py", keep_runs=root))
    (tmp_path / "file").write_text("")
    with pytest.raises(VerifyError, match="not a directory"):
        _work_root(VerifySettings(script=tmp_path / "file", keep_runs=tmp_path / "file"))


@pytest.mark.parametrize("epochs", [[0, 1, 2], [1, 2, 3]], ids=["epochs from 0", "epochs from 1"])
def test_the_single_run_goes_first_and_again_only_at_other_epochs(tmp_path: Path, monkeypatch, epochs):
    """The original runs before its retrofit: a retrofit may write into inputs both runs read
    (kuangliu's --resume: its DCP save replaced the linked checkpoint file with a directory, and
    the single run after it failed to load it). Only where the retrofit's samplers were set to
    other epochs than 0, 1, 2, ... does the single run run again, drawing those."""
    import fsdp2_retrofit.verify as v

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    calls = []

    def single(settings, args, directory, epochs=()):
        calls.append(("single", directory.name, list(epochs)))
        return Run(directory, [{"losses": [], "grad_norms": []}], None)

    def distributed(settings, script, directory, import_root=()):
        calls.append(("dist", directory.name, []))
        return Run(directory, [{"sampler_epochs": epochs, "losses": [], "grad_norms": []}], None)

    monkeypatch.setattr(v, "run_single", single)
    monkeypatch.setattr(v, "run_distributed", distributed)
    monkeypatch.setattr(v, "compare_runs", lambda *a, **k: Verdict([], None, {}, []))
    monkeypatch.setattr(v, "compare_rank_weight_files", lambda *a: None)
    monkeypatch.setattr(v, "compare_initial_weights", lambda *a: None)
    v._run_and_compare(v.VerifySettings(script=script, retrofitted=script), tmp_path / "runs")
    expected = [("single", "single", []), ("dist", "dist", [])]
    if epochs[0] != 0:
        expected.append(("single", "single-epochs", epochs))
    assert calls == expected


SCALED_SCRIPT = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
for _ in range(2):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print(f"loss {loss.item():.6f}")
"""


@e2e
def test_the_loss_a_grad_scaler_scaled_is_recorded_not_the_scaled_one(tmp_path: Path):
    """`scaler.scale(loss).backward()`: the record holds loss, not loss * 1024 (an overflowing
    step's scaled loss is inf, which compares with nothing)."""
    from fsdp2_retrofit.verify import launch_single

    script = tmp_path / "scaled.py"
    script.write_text(SCALED_SCRIPT, encoding="utf-8")
    run = launch_single(script, [], tmp_path / "run")
    printed = [float(v) for v in run.stdout.split()[1::2]]
    assert len(printed) == 2 and run.ranks[0]["losses"] == pytest.approx(printed, abs=1e-6), (run.ranks[0]["losses"],
                                                                                              printed)
