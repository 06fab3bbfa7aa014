"""Execution tests of checkpoints: a resumed run equals the uninterrupted one, on
any number of ranks.

For every fixture with a ``[resume]`` table in its case.toml: ``expected.py``
trains K steps on 2 ranks and saves; the checkpoint is then resumed for K more
steps on each of ``ranks`` (the global batch kept: the per-rank batch is
``global_batch // ranks``), and the final weights must equal those of
``input.py`` run uninterrupted for 2K steps in one process (max abs diff <= the
case's tolerance). Every step of the first run and of the resumed one passes
verify's per-step check against the matching step of the reference (loss and
gradient norm). The runs go through the engine of ``fsdp2-retrofit verify`` to
the end of the script. ``pytest -s`` shows the measured differences.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fsdp2_retrofit.verify import (
    LOSS_ATOL,
    LOSS_RTOL,
    VerifyError,
    compare_saved,
    compare_steps,
    launch_distributed,
    launch_single,
)

if os.environ.get("CI"):
    import torch  # CI installs the test extra: a missing torch must fail there, not skip
else:
    torch = pytest.importorskip("torch", reason="the execution tests need torch (pip install -e .[test])")

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite"
DEFAULT_TOLERANCE = 1e-4


def _config(case: Path) -> dict:
    if tomllib is None:
        pytest.skip("reading case.toml needs Python 3.11+ (tomllib)")
    return tomllib.loads((case / "case.toml").read_text(encoding="utf-8"))


def _resume_cases():
    out = []
    for case in sorted(p for p in FIXTURES.iterdir() if (p / "case.toml").is_file()):
        text = (case / "case.toml").read_text(encoding="utf-8")
        if "[resume]" not in text:
            continue
        ranks = [2, 1, 4]
        if tomllib is not None:
            ranks = tomllib.loads(text)["resume"].get("ranks", ranks)
        # one xdist group a case: its first runs (module fixture) are made once, on one worker
        out.extend(pytest.param(case, n, id=f"{case.name}-2to{n}", marks=pytest.mark.xdist_group(f"resume-{case.name}"))
                   for n in ranks)
    return out


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory):
    """Per case: the uninterrupted single-process reference, and the 2-rank run that
    trains the first K steps and leaves its checkpoint behind (each run once)."""
    done = {}

    def get(case: Path):
        if case.name not in done:
            resume = _config(case)["resume"]
            root = tmp_path_factory.mktemp(case.name)
            reference = launch_single(case / "input.py", ["--out", str(root / "ref" / "out.pt"),
                                                          *resume["reference_args"]], root / "ref")
            batch = [resume["batch_flag"], str(resume["global_batch"] // 2)]
            first = launch_distributed(case / "expected.py", ["--out", str(root / "first" / "out.pt"), *batch,
                                                              *resume["first_args"]], root / "first", nproc=2)
            done[case.name] = (root, reference, first)
        return done[case.name]

    return get


def _steps_agree(reference, run, start: int) -> list:
    """verify's per-step check on a part of the reference: `run`'s steps are the
    reference's steps start+1, start+2, ..."""
    part = {"losses": reference.ranks[0]["losses"][start:start + run.ranks[0]["steps"]],
            "grad_norms": reference.ranks[0]["grad_norms"][start:start + run.ranks[0]["steps"]]}
    return [f"step {start + r.step}: {r.problem}" for r in compare_steps(part, run.ranks, LOSS_RTOL, LOSS_ATOL)
            if r.problem]


@pytest.mark.e2e
@pytest.mark.parametrize("case, nproc", _resume_cases())
def test_resumed_run_equals_the_uninterrupted_run(case: Path, nproc: int, first_runs, tmp_path: Path):
    config = _config(case)
    resume, weights = config["resume"], config["run"]["weights"]
    tolerance = config["run"].get("tolerance", DEFAULT_TOLERANCE)
    root, reference, first = first_runs(case)
    # the comparison can fail: K steps are not 2K steps
    halfway = compare_saved(root / "ref" / "out.pt", root / "first" / "out.pt", weights, tolerance)
    assert not halfway.ok and halfway.max_abs_diff > tolerance, halfway.problem
    assert _steps_agree(reference, first, 0) == [], "the first K steps differ from the reference's"

    saved = root / "first" / resume["checkpoint"]
    assert saved.is_dir() and (saved / ".metadata").is_file(), "the checkpoint must be a DCP directory"
    shutil.copytree(saved, tmp_path / resume["checkpoint"])
    batch = [resume["batch_flag"], str(resume["global_batch"] // nproc)]
    resumed = launch_distributed(case / "expected.py", ["--out", str(tmp_path / "out.pt"), *batch,
                                                        *resume["resume_args"]], tmp_path, nproc=nproc)
    assert resume["resumed_marker"] in resumed.stdout, "the run did not resume from the checkpoint"
    result = compare_saved(root / "ref" / "out.pt", tmp_path / "out.pt", weights, tolerance)
    print(f"\n{case.name}: saved on 2 ranks, resumed on {nproc}: max |uninterrupted - resumed| = "
          f"{result.max_abs_diff} ({resumed.ranks[0]['steps']} steps after the resume)")
    assert result.ok, f"{case.name} 2->{nproc}: {result.problem}"
    assert _steps_agree(reference, resumed, first.ranks[0]["steps"]) == []


@pytest.mark.e2e
def test_a_save_left_under_the_rank_gate_fails_the_run(tmp_path: Path):
    """The rank-gated fixture is a real test: with its save put back under
    `if master_process:` the run deadlocks (or gloo aborts it), and the timeout fails it."""
    case = FIXTURES / "rank_gated_save"
    save = '                dcp.save(checkpoint, checkpoint_id=os.path.join(args.out_dir, "best.pt"))\n'
    text = (case / "expected.py").read_text(encoding="utf-8")
    assert save in text
    gated = text.replace(save, "                if master_process:\n    " + save)
    script = tmp_path / "gated.py"
    script.write_text(gated, encoding="utf-8")
    with pytest.raises(VerifyError):
        launch_distributed(script, ["--out", str(tmp_path / "out.pt"), "--batch-size", "16"], tmp_path, nproc=2,
                           timeout=40)


@pytest.mark.e2e
def test_full_export_loads_into_the_unsharded_model(tmp_path: Path):
    """--export full: the files are plain torch.save files that single-GPU code loads
    with torch.load + load_state_dict (strict), with the single-process weights."""
    import importlib.util

    case = FIXTURES / "export_full"
    launch_single(case / "input.py", ["--out", str(tmp_path / "single" / "model.pt"), "--batch-size", "32"],
                  tmp_path / "single")
    launch_distributed(case / "expected.py", ["--out", str(tmp_path / "dist" / "model.pt"), "--batch-size", "16"],
                       tmp_path / "dist", nproc=2)
    for name in ("model.pt", "best.pt"):
        assert (tmp_path / "dist" / name).is_file(), f"{name} must stay one file"

    spec = importlib.util.spec_from_file_location("export_full_input", case / "input.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the classes; main() runs only as __main__
    model = module.Classifier()
    model.load_state_dict(torch.load(tmp_path / "dist" / "model.pt", weights_only=True))
    best = torch.load(tmp_path / "dist" / "best.pt", weights_only=True)
    model.load_state_dict(best["model"])  # the best checkpoint loads too
    model.load_state_dict(torch.load(tmp_path / "dist" / "model.pt", weights_only=True))
    torch.save(model.state_dict(), tmp_path / "loaded.pt")
    result = compare_saved(tmp_path / "single" / "model.pt", tmp_path / "loaded.pt", [], DEFAULT_TOLERANCE)
    print(f"\nexport_full: torch.load of the exported file into Classifier() vs single process: "
          f"{result.max_abs_diff}")
    assert result.ok, result.problem


# --- a checkpoint named by a flag: this script's DCP directory, or a single file ----------

WARM = FIXTURES / "warm_start_flag"
WARM_STEPS = ["--steps", "6"]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    """The single-GPU script's own file after 6 steps, and the reference: the single-GPU
    script warm-started from it (--init-from) for 6 more (saved to ref/out.pt)."""
    root = tmp_path_factory.mktemp("warm_start")
    launch_single(WARM / "input.py", ["--out", str(root / "single" / "model.pt"), "--batch-size", "32", *WARM_STEPS],
                  root / "single")
    init = ["--init-from", str(root / "single" / "model.pt")]
    launch_single(WARM / "input.py", ["--out", str(root / "ref" / "out.pt"), "--batch-size", "32", *WARM_STEPS, *init],
                  root / "ref")
    # the comparison can fail: the warm start trained on from the file, not from scratch
    assert not compare_saved(root / "ref" / "out.pt", root / "single" / "model.pt", []).ok
    return root


def _warm_started_run(script: Path, init_from: Path, directory: Path) -> Path:
    """`script` on 2 ranks, warm-started from `init_from`: the file it saved."""
    out = directory / "out.pt"
    run = launch_distributed(script, ["--out", str(out), "--batch-size", "16", *WARM_STEPS, "--init-from",
                                      str(init_from)], directory, nproc=2)
    assert f"initialised from {init_from}" in run.stdout
    return out


@pytest.mark.e2e
@pytest.mark.xdist_group("warm_start")
def test_a_single_gpu_file_and_this_scripts_directory_both_warm_start_the_fsdp2_run(warm_start, tmp_path: Path):
    """--init-from names a path the script never saves to: a single-GPU run's file (full
    state, broadcast from rank 0) and the FSDP2 run's own --out (a DCP directory) both
    load, told apart at run time, and train on like the single-GPU warm start."""
    root = warm_start
    from_file = _warm_started_run(WARM / "expected.py", root / "single" / "model.pt", tmp_path / "file")
    own = tmp_path / "own" / "model.pt"
    launch_distributed(WARM / "expected.py", ["--out", str(own), "--batch-size", "16", *WARM_STEPS], own.parent,
                       nproc=2)
    assert own.is_dir(), "the FSDP2 run's --out must be a DCP directory"
    from_dir = _warm_started_run(WARM / "expected.py", own, tmp_path / "dir")
    for what, saved in (("single-GPU file", from_file), ("DCP directory", from_dir)):
        result = compare_saved(root / "ref" / "out.pt", saved, [], DEFAULT_TOLERANCE)
        print(f"\nwarm_start_flag: --init-from a {what} on 2 ranks vs single process: {result.max_abs_diff}")
        assert result.ok, f"--init-from a {what}: {result.problem}"


@pytest.mark.e2e
@pytest.mark.xdist_group("warm_start")
def test_export_full_output_warm_starts_the_original_single_gpu_script(warm_start, tmp_path: Path):
    """--export full: the FSDP2 run's --out is one torch.save file the original script
    loads with its own torch.load + load_state_dict."""
    from fsdp2_retrofit.options import RetrofitOptions
    from fsdp2_retrofit.pipeline import rewrite_source

    root = warm_start
    result = rewrite_source((WARM / "input.py").read_bytes(), str(WARM / "input.py"), RetrofitOptions(export="full"))
    assert not result.refusals
    script = tmp_path / "export_full.py"
    script.write_bytes(result.code)
    exported = tmp_path / "dist" / "model.pt"
    launch_distributed(script, ["--out", str(exported), "--batch-size", "16", *WARM_STEPS], exported.parent, nproc=2)
    assert exported.is_file(), "--export full must write one file"
    out = tmp_path / "single" / "out.pt"
    launch_single(WARM / "input.py", ["--out", str(out), "--batch-size", "32", *WARM_STEPS, "--init-from",
                                      str(exported)], out.parent)
    result = compare_saved(root / "ref" / "out.pt", out, [], DEFAULT_TOLERANCE)
    print(f"\nwarm_start_flag: single-GPU script warm-started from the --export full file vs from its own: "
          f"{result.max_abs_diff}")
    assert result.ok, result.problem


# --- a run switched to FSDP2 resumes from the file its single-GPU run left ----------------

SINGLE_FILE = FIXTURES / "resume_single_gpu_file"


@pytest.mark.e2e
@pytest.mark.xdist_group("resume-resume_single_gpu_file")
def test_the_single_gpu_scripts_own_checkpoint_resumes_the_fsdp2_run(tmp_path: Path):
    """The original trains one epoch in one process and leaves checkpoint/last.pth (a
    torch.save file: weights, Adam state keyed by parameter number, epoch); the rewrite,
    started with --resume on 2 ranks at the same path, loads that file and trains the
    second epoch like the single-GPU run of two epochs. It then saves a DCP directory at
    the path, with the file moved aside; the weights file the single-GPU run left at --out
    is moved aside too by the final save (dcp.save where a file is: FileExistsError)."""
    single = tmp_path / "single"
    launch_single(SINGLE_FILE / "input.py", ["--out", str(single / "out.pt"), "--batch-size", "32", "--epochs", "1"],
                  single)
    saved = single / "checkpoint" / "last.pth"
    assert saved.is_file(), "the single-GPU script writes one file"
    reference = launch_single(SINGLE_FILE / "input.py", ["--out", str(tmp_path / "ref" / "out.pt"), "--batch-size",
                                                         "32", "--epochs", "2"], tmp_path / "ref")
    # the comparison can fail: one epoch is not two
    assert not compare_saved(tmp_path / "ref" / "out.pt", single / "out.pt", [], DEFAULT_TOLERANCE).ok

    switched = tmp_path / "switched"
    (switched / "checkpoint").mkdir(parents=True)
    shutil.copy(saved, switched / "checkpoint" / "last.pth")
    shutil.copy(single / "out.pt", switched / "out.pt")
    resumed = launch_distributed(SINGLE_FILE / "expected.py", ["--out", str(switched / "out.pt"), "--batch-size", "16",
                                                               "--epochs", "2", "--resume"], switched, nproc=2)
    assert "resumed after epoch 0" in resumed.stdout
    result = compare_saved(tmp_path / "ref" / "out.pt", switched / "out.pt", [], DEFAULT_TOLERANCE)
    print(f"\nresume_single_gpu_file: single-GPU file resumed on 2 ranks vs single process, 2 epochs: "
          f"{result.max_abs_diff} ({resumed.ranks[0]['steps']} steps after the resume)")
    assert result.ok, result.problem
    assert _steps_agree(reference, resumed, 6) == []
    assert (switched / "checkpoint" / "last.pth" / ".metadata").is_file(), "the FSDP2 run saves a DCP directory"
    assert (switched / "checkpoint" / "last.pth.single-gpu").is_file(), "the single-GPU file is kept, moved aside"
    assert (switched / "out.pt.single-gpu").read_bytes() == (single / "out.pt").read_bytes(), "its weights, kept"


CONFIG_FIRST = FIXTURES / "resume_config_first"


@pytest.mark.e2e
@pytest.mark.xdist_group("resume-resume_config_first")
def test_the_single_gpu_file_resumes_the_config_first_fsdp2_run(tmp_path: Path):
    """nanoGPT's order from a single-GPU checkpoint: the original trains 6 steps in one
    process and leaves ckpt.pt (model_args, weights, AdamW state keyed by parameter
    number, scheduler, step); the rewrite, started with --init-from resume on 2 ranks,
    reads the config from that file, builds the model from it, and trains on like the
    single-GPU run of 12 steps. It then saves a DCP directory there, the file moved aside."""
    single = tmp_path / "single"
    launch_single(CONFIG_FIRST / "input.py", ["--out", str(single / "out.pt"), "--out-dir", str(single),
                                              "--batch-size", "32", "--steps", "6"], single)
    saved = single / "ckpt.pt"
    assert saved.is_file(), "the single-GPU script writes one file"
    reference = launch_single(CONFIG_FIRST / "input.py", ["--out", str(tmp_path / "ref" / "out.pt"), "--out-dir",
                                                          str(tmp_path / "ref"), "--batch-size", "32", "--steps", "12"],
                              tmp_path / "ref")
    # the comparison can fail: 6 steps are not 12
    assert not compare_saved(tmp_path / "ref" / "out.pt", single / "out.pt", [], DEFAULT_TOLERANCE).ok

    switched = tmp_path / "switched"
    switched.mkdir()
    shutil.copy(saved, switched / "ckpt.pt")
    # --depth 1 on the command line: the checkpoint's config (depth 3) must win
    resumed = launch_distributed(CONFIG_FIRST / "expected.py", [
        "--out", str(switched / "out.pt"), "--out-dir", str(switched), "--batch-size", "16", "--steps", "12",
        "--init-from", "resume", "--depth", "1"], switched, nproc=2)
    assert "resumed from step 6" in resumed.stdout
    result = compare_saved(tmp_path / "ref" / "out.pt", switched / "out.pt", [], DEFAULT_TOLERANCE)
    print(f"\nresume_config_first: single-GPU file resumed on 2 ranks vs single process, 12 steps: "
          f"{result.max_abs_diff} ({resumed.ranks[0]['steps']} steps after the resume)")
    assert result.ok, result.problem
    assert (switched / "ckpt.pt" / ".metadata").is_file(), "the FSDP2 run saves a DCP directory"
    assert (switched / "ckpt.pt.single-gpu").is_file(), "the single-GPU file is kept, moved aside"
