"""Execution tests: a retrofitted script trains exactly like the original.

Each ``fixtures/rewrite/<case>`` runs ``input.py`` in one process and
``expected.py`` under torchrun (CPU, gloo), at the same global batch, both to the
end of the script, through the engine of ``fsdp2-retrofit verify``
(``fsdp2_retrofit.verify``: launch_single, launch_distributed, compare_saved,
compare_runs). Equivalent means: the weights each script saves agree within the
case's tolerance (by key, EMA/SWA copies included), and so do verify's per-step
checks: every optimizer step's loss (single vs mean over ranks) and gradient
norm, and the final parameters of the optimizers. Cases whose ``[run]`` says
``mode = "trains"`` (``--meta-init``: new random initial weights, nothing to
compare with) run only ``expected.py``, whose per-step loss must fall by
``min_drop`` (default 20 %) from the first step to the last. Cases whose ``[run]``
says ``mode = "flagged"`` cannot match on CPU and are reported so (an attention item
with ``differs``); their own test below runs both and bounds the difference. A ``[run]``
``left_by_single`` list names files of the reference run that are copied where the
distributed run saves before it starts (a single-GPU run's checkpoints left at the paths);
each must come out byte for byte at PATH.single-gpu. The e2e tests take
a few seconds each; deselect them with ``-m "not e2e"``. ``pytest -s`` shows the
measured differences.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rewrite_cases import edits_siblings, project_copy
from fsdp2_retrofit.verify import (
    COMPARE_SCRIPT,
    Run,
    VerifyError,
    Verdict,
    compare_runs,
    compare_saved,
    compare_weights,
    launch_distributed,
    launch_single,
    trains,
    within_noise,
)

if os.environ.get("CI"):
    import torch  # CI installs the test extra: a missing torch must fail there, not skip
else:
    torch = pytest.importorskip("torch", reason="the execution tests need torch (pip install -e .[test])")

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures" / "rewrite"
SHARED_EXAMPLES = REPO / "fixtures" / "examples"
DEFAULT_TOLERANCE = 1e-4
DEFAULT_MIN_DROP = 0.2
DEFAULT_TIMEOUT_S = 180  # a deadlock fails, it does not hang


def _cases() -> list[Path]:
    return sorted(p for p in FIXTURES.iterdir() if (p / "input.py").is_file())


def _run_config(case: Path) -> dict:
    if tomllib is None:
        pytest.skip("reading case.toml needs Python 3.11+ (tomllib)")
    return tomllib.loads((case / "case.toml").read_text(encoding="utf-8"))["run"]


def _mode(case: Path) -> str:
    if tomllib is None:
        return "parity"
    return tomllib.loads((case / "case.toml").read_text(encoding="utf-8"))["run"].get("mode", "parity")


def _figures(name: str, verdict: Verdict) -> str:
    """One line of what was measured, for ``pytest -s``."""
    diffs = [r.loss_diff for r in verdict.rows if r.loss_diff is not None]
    norms = [abs(r.grad_norm_single - r.grad_norm_dist) for r in verdict.rows
             if r.grad_norm_single is not None and r.grad_norm_dist is not None]
    saved = verdict.saved.max_abs_diff if verdict.saved else None
    final = verdict.weights.max_abs_diff if verdict.weights else None
    steps = f"{len(verdict.rows)} steps" if verdict.judge_steps else "steps not judged"
    return (f"\n{name}: {steps}, max loss diff {max(diffs, default=None)}, max grad-norm diff "
            f"{max(norms, default=None)}, saved weights {saved}, final parameters {final}: {verdict.summary()}")


def _reference(case: Path, run: dict, directory: Path, timeout: float) -> Run:
    """The original, the way its case says it runs, to its end; it saves to directory/out.pt."""
    args = ["--out", str(directory / "out.pt"), *run["single_args"]]
    reference = run.get("reference", "single")
    if reference == "torchrun":  # a DDP original: itself under torchrun, same ranks and data
        return launch_distributed(case / "input.py", args, directory, nproc=run.get("nproc", 2), timeout=timeout)
    if reference == "plain":  # an original that spawns its own workers: not instrumented, no reference sampler
        return launch_single(case / "input.py", args, directory, instrument=False, sampler=False, timeout=timeout)
    # reference_script: a hand-written single-process twin, for inputs that cannot run in one process (FSDP1)
    return launch_single(case / run.get("reference_script", "input.py"), args, directory, timeout=timeout)


def _leave_single_files(names, single: Path, dist: Path) -> dict:
    """Copy the reference run's files `names` into the distributed run's folder (what a
    single-GPU run of the script left where the FSDP2 run saves); name -> their bytes."""
    left = {}
    for name in names:
        data = (single / name).read_bytes()
        (dist / name).parent.mkdir(parents=True, exist_ok=True)
        (dist / name).write_bytes(data)
        left[name] = data
    return left


def _expected(case: Path, directory: Path) -> Path:
    """The rewritten script to run: expected.py, or for a case that edits modules beside the
    script, the script in a copy of the project whose modules are the goldens of expected/."""
    if not edits_siblings(case):
        return case / "expected.py"
    return project_copy(case, "expected.py", into=directory / "project") / "input.py"


# --- the fixtures -----------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("case", [
    # the bundled example of the README's first command: the smoke loop's one torchrun run
    pytest.param(c, marks=pytest.mark.smoke) if c.name == "main_modulelist" else c
    for c in _cases() if _mode(c) == "parity"
], ids=lambda p: p.name)
def test_retrofit_trains_like_the_original(case: Path, tmp_path: Path):
    if not (case / "expected.py").is_file():
        pytest.skip(f"{case.name}: no expected.py yet (the rewriter generates it)")
    _parity(case, _run_config(case), tmp_path)


def _parity(case: Path, run: dict, tmp_path: Path) -> None:
    """The original in one process and the rewrite under torchrun, as `run` says, agree."""
    tolerance = run.get("tolerance", DEFAULT_TOLERANCE)
    timeout = run.get("timeout", DEFAULT_TIMEOUT_S)

    # each run in its own folder: scripts that save periodically to relative paths
    # write plain files in one and DCP directories in the other
    single = _reference(case, run, tmp_path / "single", timeout)
    left = _leave_single_files(run.get("left_by_single", []), tmp_path / "single", tmp_path / "dist")
    dist = launch_distributed(_expected(case, tmp_path), ["--out", str(tmp_path / "dist" / "out.pt"), *run["dist_args"]],
                              tmp_path / "dist", nproc=run.get("nproc", 2), timeout=timeout)
    for name, data in left.items():
        aside = tmp_path / "dist" / (name + ".single-gpu")
        assert aside.is_file() and aside.read_bytes() == data, f"{case.name}: the single-GPU run's {name} was lost"
        assert (tmp_path / "dist" / name / ".metadata").is_file(), f"{case.name}: no DCP directory at {name}"
    saved = compare_saved(tmp_path / "single" / "out.pt", tmp_path / "dist" / "out.pt", run["weights"], tolerance,
                          single_prefix=run.get("single_prefix", ""))
    verdict = compare_runs(single, dist, tolerance=tolerance, saved=saved)
    print(_figures(case.name, verdict))
    assert saved.ok, f"{case.name}: {saved.problem}"
    assert verdict.equivalent, f"{case.name}: {verdict.summary()}"


@pytest.mark.e2e
@pytest.mark.parametrize("name, args", [
    # the defaults made tok_emb and [final_ln, lm_head] units; at this vocabulary they hold less than a block
    ("leaf_units_argparse", ["--vocab-size", "40"]),
    # the run-time comparison makes no unit at this width (166 x 64 against a block's 33,152): the other branch
    ("leaf_units_runtime_vocab", ["--d-model", "64"]),
])
def test_leaf_units_when_the_command_line_changes_the_sizes(name: str, args: list, tmp_path: Path):
    """A layout read from defaults, or decided when the script runs, is numerically neutral whatever sizes
    the command line gives: the run still matches one process."""
    case = FIXTURES / name
    run = dict(_run_config(case))
    run["single_args"], run["dist_args"] = [*run["single_args"], *args], [*run["dist_args"], *args]
    _parity(case, run, tmp_path)


@pytest.mark.e2e
@pytest.mark.parametrize("case", [c for c in _cases() if _mode(c) == "trains"], ids=lambda p: p.name)
def test_retrofit_trains(case: Path, tmp_path: Path):
    """--meta-init and bf16 outputs: the distributed run learns (its loss falls)."""
    run = _run_config(case)
    dist = launch_distributed(_expected(case, tmp_path), ["--out", str(tmp_path / "out.pt"), *run["dist_args"]], tmp_path,
                              nproc=run.get("nproc", 2), timeout=run.get("timeout", DEFAULT_TIMEOUT_S))
    result = trains(dist, run.get("min_drop", DEFAULT_MIN_DROP))
    print(f"\n{case.name}: {len(result.losses)} steps, losses {[round(v, 4) for v in result.losses if v is not None]}")
    assert result.ok, f"{case.name}: {result.problem}"


@pytest.mark.e2e
@pytest.mark.parametrize("name, line", [
    ("batchnorm_per_rank", 14),  # an nn.BatchNorm1d of the script's class
    ("library_attribute_batchnorm", 14),  # the BatchNorm2d layers of a library ResNet the class holds
    ("project_package_batchnorm", 23),  # a block of another module of the model's package (a star import)
])
def test_batchnorm_on_cpu_trains_within_noise_and_is_flagged(name: str, line: int, tmp_path: Path):
    """BatchNorm: SyncBatchNorm runs on GPUs only, so on CPU (gloo) each rank normalises
    with its own half of the batch. The report says so (differs, at the line that builds
    the layer or the library model), the output still trains like the original within
    the single run's noise, and it is not equivalent (the flag is needed)."""
    from rewrite_cases import rewrite_case

    case = FIXTURES / name
    run = _run_config(case)
    result = rewrite_case(case)
    flagged = [a for a in result.attention if a.differs and "BatchNorm" in a.what]
    assert [a.line for a in flagged] == [line], result.attention
    timeout = run.get("timeout", DEFAULT_TIMEOUT_S)
    single = _reference(case, run, tmp_path / "single", timeout)
    dist = launch_distributed(case / "expected.py", ["--out", str(tmp_path / "dist" / "out.pt"), *run["dist_args"]],
                              tmp_path / "dist", nproc=run.get("nproc", 2), timeout=timeout)
    verdict = compare_runs(single, dist, tolerance=run.get("tolerance", DEFAULT_TOLERANCE))
    ok, why = within_noise(verdict.rows)
    print(_figures(case.name, verdict) + f"; {why}")
    assert len(verdict.rows) == 18 and not verdict.start_apart and not verdict.ranks_disagree
    assert ok, why
    assert not verdict.equivalent, "per-rank BatchNorm statistics on CPU: the runs should differ"


@pytest.mark.e2e
@pytest.mark.parametrize("name, lines", [
    ("batch_coupled_contrastive", [41]),  # `za @ zb.T` with arange targets (InfoNCE), inline
    ("batch_coupled_relativistic", [14, 15]),  # `real - torch.mean(fake, dim=0)` in a helper, module level
    ("batch_weighted_cross_entropy", [22]),  # CrossEntropyLoss(weight=...): a mean over each part's total weight
])
def test_a_batch_coupled_objective_is_flagged_and_differs(name: str, lines: list, tmp_path: Path):
    """A loss term that reads the other samples of its batch (analysis/batch_coupling.py) is computed by each
    rank over its own part of the batch: the report flags each line (differs), and the runs do differ at the
    same global batch (the flag is needed; without the coupling the same scripts would be at parity)."""
    from rewrite_cases import rewrite_case

    case = FIXTURES / name
    run = _run_config(case)
    result = rewrite_case(case)
    flagged = [a for a in result.attention if a.differs and a.code == "batch_coupling"]
    assert [a.line for a in flagged] == lines, result.attention
    timeout = run.get("timeout", DEFAULT_TIMEOUT_S)
    single = _reference(case, run, tmp_path / "single", timeout)
    dist = launch_distributed(case / "expected.py", ["--out", str(tmp_path / "dist" / "out.pt"), *run["dist_args"]],
                              tmp_path / "dist", nproc=run.get("nproc", 2), timeout=timeout)
    verdict = compare_runs(single, dist, tolerance=run.get("tolerance", DEFAULT_TOLERANCE))
    print(_figures(case.name, verdict))
    assert verdict.rows and not verdict.start_apart and not verdict.ranks_disagree
    assert not verdict.equivalent, "each rank's objective covers half the batch: the runs should differ"


@pytest.mark.e2e
def test_trains_check_fails_when_nothing_is_learned(tmp_path: Path):
    """The check can fail: the same run at learning rate 0 keeps its loss."""
    case = FIXTURES / "meta_init_plain"
    run = _run_config(case)
    dist = launch_distributed(case / "expected.py", ["--out", str(tmp_path / "out.pt"), *run["dist_args"], "--lr", "0"],
                              tmp_path)
    result = trains(dist, DEFAULT_MIN_DROP)
    print(f"\nlr 0: first {result.losses[0]}, last {result.losses[-1]}")
    assert not result.ok and "did not fall" in result.problem


# --- plain `python train.py`: one process, no torchrun ----------------------

# A representative set: the README's shape, a shuffled two-epoch loader (DistributedSampler
# of one rank against the reference order), accumulation with clipping, periodic DCP
# checkpoints with a resume guard, the torch 2.4 import spelling, and an optional-DDP
# script whose plain branch now starts a group of its one process, and 0-dim parameters kept out of
# fully_shard (their gradient hooks all-reduce over a group of one).
PLAIN_CASES = [
    "main_modulelist", "kwargs_shuffle", "accumulation_modulo", "resume_periodic", "torch_2_4_generate", "optional_ddp",
    "helper_returns_model_optimizer", "scalar_parameter",
]


@pytest.mark.e2e
@pytest.mark.parametrize("name", PLAIN_CASES)
def test_retrofit_runs_as_plain_python(name: str, tmp_path: Path):
    """The output runs without torchrun (a process group of one process, fully_shard on a
    1-rank mesh) and trains exactly like the original at the same batch."""
    case = FIXTURES / name
    run = _run_config(case)
    tolerance = run.get("tolerance", DEFAULT_TOLERANCE)
    timeout = run.get("timeout", DEFAULT_TIMEOUT_S)
    single = _reference(case, run, tmp_path / "single", timeout)
    plain = launch_single(_expected(case, tmp_path), ["--out", str(tmp_path / "plain" / "out.pt"), *run["single_args"]],
                          tmp_path / "plain", timeout=timeout)
    saved = compare_saved(tmp_path / "single" / "out.pt", tmp_path / "plain" / "out.pt", run["weights"], tolerance,
                          single_prefix=run.get("single_prefix", ""))
    verdict = compare_runs(single, plain, tolerance=tolerance, saved=saved)
    print(_figures(f"{name}, plain python", verdict))
    assert saved.ok, f"{name}: {saved.problem}"
    assert verdict.equivalent, f"{name}: {verdict.summary()}"


@pytest.mark.e2e
@pytest.mark.xdist_group("shared_reference")
def test_shared_example_rewrite_runs_as_plain_python(shared_reference: Path, tmp_path: Path):
    """The rewrite of the shared single-GPU example, run as `python train.py` at batch 64,
    equals the original at batch 64."""
    from fsdp2_retrofit.pipeline import rewrite_source

    source = SHARED_EXAMPLES / "train_single.py"
    result = rewrite_source(source.read_bytes(), str(source))
    assert not result.refusals, result.refusals
    script = tmp_path / "train.py"
    script.write_bytes(result.code)
    plain = launch_single(script, ["--out", str(tmp_path / "out.pt"), "--batch-size", "64"], tmp_path)
    saved = compare_saved(shared_reference.directory / "out.pt", tmp_path / "out.pt", [])
    verdict = compare_runs(shared_reference, plain, saved=saved)
    print(_figures("shared example rewritten, plain python at 64 vs the original at 64", verdict))
    assert verdict.equivalent, verdict.summary()


# --- the hand-written example pair (fixtures/examples) -------------------------


def _require_shared_examples():
    assert (SHARED_EXAMPLES / "train_single.py").is_file(), f"the example pair is missing from {SHARED_EXAMPLES}"


@pytest.fixture(scope="module")
def shared_reference(tmp_path_factory) -> Run:
    """train_single.py at batch 64 in one process: the reference for both tests below."""
    _require_shared_examples()
    root = tmp_path_factory.mktemp("shared_single")
    return launch_single(SHARED_EXAMPLES / "train_single.py", ["--out", str(root / "out.pt"), "--batch-size", "64"],
                         root)


def _shared_pair(shared_reference: Run, per_rank_batch: int, directory: Path) -> Verdict:
    dist = launch_distributed(SHARED_EXAMPLES / "train_fsdp2.py",
                              ["--out", str(directory / "out.pt"), "--batch-size", str(per_rank_batch)], directory)
    saved = compare_saved(shared_reference.directory / "out.pt", directory / "out.pt", [])
    return compare_runs(shared_reference, dist, saved=saved)


@pytest.mark.e2e
@pytest.mark.xdist_group("shared_reference")  # one reference run for both tests under --dist loadgroup
def test_shared_example_pair_matches(shared_reference: Run, tmp_path: Path):
    verdict = _shared_pair(shared_reference, 32, tmp_path)
    print(_figures("shared example, 2 x 32 vs 1 x 64", verdict))
    assert verdict.saved.max_abs_diff <= DEFAULT_TOLERANCE
    assert verdict.equivalent, verdict.summary()


@pytest.mark.e2e
@pytest.mark.xdist_group("shared_reference")
def test_wrong_global_batch_is_caught(shared_reference: Run, tmp_path: Path):
    """The comparison can fail: 2 ranks x 16 is not the single run at 64."""
    verdict = _shared_pair(shared_reference, 16, tmp_path)
    print(_figures("shared example, 2 x 16 vs 1 x 64", verdict))
    assert verdict.saved.max_abs_diff > DEFAULT_TOLERANCE
    assert not verdict.equivalent and verdict.first_divergence.step == 1


@pytest.mark.e2e
def test_the_logged_loss_is_the_global_batch_loss(tmp_path: Path):
    """Rank 0 prints the mean over ranks (the all_reduce the rewrite adds), so the
    distributed log reads like the single-process log at the same global batch."""
    case = FIXTURES / "main_modulelist"
    single = launch_single(case / "input.py", ["--out", str(tmp_path / "single" / "s.pt"), "--batch-size", "64"],
                           tmp_path / "single")
    dist = launch_distributed(case / "expected.py", ["--out", str(tmp_path / "dist" / "d.pt"), "--batch-size", "32"],
                              tmp_path / "dist")

    def losses(text: str) -> list:
        return [float(m.group(1)) for m in re.finditer(r"loss (\d+\.\d+)", text)]

    expected, got = losses(single.stdout), losses(dist.stdout)
    print(f"\nsingle {expected}\ndistributed {got}")
    assert len(expected) == len(got) == 6
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 2e-4


@pytest.mark.e2e
@pytest.mark.parametrize("name, pattern", [
    ("loader_helper_shared", r"val accuracy (\d+\.\d+)"),
    ("loader_helper_shared_kwonly", r"held-out accuracy (\d+\.\d+)"),
    ("loader_helper_shared_handed", r"val accuracy (\d+\.\d+)"),
    ("loader_helper_shared_epoch_fn", r"held-out mse (\d+\.\d+)"),
    ("loader_method_shared", r"val accuracy (\d+\.\d+)"),
    ("project_trainer_loader_method", r"held-out accuracy (\d+\.\d+)"),
])
def test_a_validation_loader_of_a_shared_helper_stays_whole(name: str, pattern: str, tmp_path: Path):
    """The helper that builds the training loader builds the validation loader too: only the training
    call passes `distributed=True`, so every rank counts the hits over the whole validation set and
    rank 0 prints the single run's accuracy (when both read through a DistributedSampler, each rank
    counted half the hits and the printed accuracy was about half)."""
    case = FIXTURES / name
    run = _run_config(case)
    single = launch_single(case / "input.py", ["--out", str(tmp_path / "single" / "s.pt"), *run["single_args"]],
                           tmp_path / "single")
    dist = launch_distributed(_expected(case, tmp_path), ["--out", str(tmp_path / "dist" / "d.pt"), *run["dist_args"]],
                              tmp_path / "dist", nproc=run["nproc"])
    expected = [float(v) for v in re.findall(pattern, single.stdout)]
    got = [float(v) for v in re.findall(pattern, dist.stdout)]
    print(f"\nsingle {expected}\ndistributed {got}")
    assert len(expected) == len(got) == 2
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 1e-5


@pytest.mark.e2e
def test_the_generated_text_is_the_original_one(tmp_path: Path):
    """alias_generate: after training, `m.generate(...)` (`m = model.to(device)`) runs on
    every rank (a forward of the sharded model; under a rank-0 `if` the run crashed) and
    prints the text the single-process run prints."""
    case = FIXTURES / "alias_generate"
    run = _run_config(case)
    single = launch_single(case / "input.py", ["--out", str(tmp_path / "single" / "s.pt"), *run["single_args"]],
                           tmp_path / "single")
    dist = launch_distributed(case / "expected.py", ["--out", str(tmp_path / "dist" / "d.pt"), *run["dist_args"]],
                              tmp_path / "dist", nproc=run["nproc"])

    def samples(text: str) -> list:
        return re.findall(r"^t[a-z ]{20}$", text, flags=re.M)  # the context "t" and 20 new characters

    expected = samples(single.stdout)
    assert len(expected) == 1, single.stdout
    # the ranks print into one log: a rank's text and its newline are two writes, which the other
    # rank's line can come between ("<text><text>\n\n"); count the text, not the lines
    got = dist.stdout.count(expected[0])
    print(f"\nsingle {expected}\ndistributed {got} times in {dist.stdout[-200:]!r}")
    assert got == run["nproc"]


# --- the engine's reference sampler and failures (these start a torch process) ---

_ORDER_SCRIPT = """\
import argparse, json
import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser.add_argument("--batch-size", type=int)
args = parser.parse_args()
torch.manual_seed(0)
before = torch.rand(1).item()
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.arange(32)), batch_size=args.batch_size, shuffle=True)
epochs = [[batch.tolist() for (batch,) in loader] for _ in range(2)]
with open(args.out, "w") as f:
    json.dump({"epochs": epochs}, f)
"""


def _order(tmp_path: Path, name: str, sampler: bool) -> list:
    script = tmp_path / "order.py"
    script.write_text(_ORDER_SCRIPT)
    out = tmp_path / name / "order.json"
    # no optimizer step: a run without records
    launch_single(script, ["--out", str(out), "--batch-size", "8"], tmp_path / name, instrument=False, sampler=sampler)
    return json.loads(out.read_text())["epochs"]


@pytest.mark.e2e  # runs a script that imports torch in a fresh interpreter: seconds, like the runs it serves
def test_reference_sampler_follows_distributed_sampler(tmp_path: Path):
    """Single run at batch 8 == union of the 2 ranks' DistributedSampler batches at 4, per epoch."""
    from torch.utils.data.distributed import DistributedSampler

    single = _order(tmp_path, "single", sampler=True)
    dataset = list(range(32))
    for epoch, batches in enumerate(single):
        per_rank = []
        for rank in range(2):
            sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            order = list(sampler)
            per_rank.append([order[i:i + 4] for i in range(0, len(order), 4)])
        expected = [sorted(a + b) for a, b in zip(*per_rank)]
        assert [sorted(b) for b in batches] == expected, f"epoch {epoch}"
    assert single[0] != single[1], "each epoch must draw a new permutation"


@pytest.mark.e2e
def test_reference_sampler_is_off_without_the_flag(tmp_path: Path):
    """sampler=False (and a plain interpreter) keeps torch's own order."""
    patched = _order(tmp_path, "patched", sampler=True)
    off = _order(tmp_path, "off", sampler=False)
    script = tmp_path / "order.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP2_RETROFIT_VERIFY_")}
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "plain.json"), "--batch-size", "8"],
                   check=True, env=env, cwd=tmp_path)
    plain = json.loads((tmp_path / "plain.json").read_text())["epochs"]
    assert patched != plain and off == plain


@pytest.mark.e2e
def test_failed_run_names_the_exception(tmp_path: Path):
    script = tmp_path / "boom.py"
    script.write_text("raise ValueError('no such layer: fc3')\n")
    with pytest.raises(VerifyError) as failure:
        launch_single(script, [], tmp_path / "run")
    assert "exit code 1" in failure.value.message
    assert "ValueError: no such layer: fc3" in failure.value.detail


# --- comparing saved files (the compare child's functions, here in-process) ---


def _compare_module():
    spec = importlib.util.spec_from_file_location("_fsdp2_verify_compare", COMPARE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_select_flattens_and_prefixes():
    select = _compare_module().select
    g, d = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    assert select(g, []) == g
    assert select({"model": g, "step": 3}, ["model"]) == g
    assert set(select({"G": g, "D": d}, ["G", "D"])) == {"G.w", "D.w"}
    with pytest.raises(KeyError, match="no key"):
        select({"model": g}, ["ema"])
    with pytest.raises(TypeError, match="not a tensor"):
        select({"model": g, "step": 3}, [])


def _saved(tmp_path: Path, name: str, obj) -> str:
    path = tmp_path / name
    torch.save(obj, path)
    return str(path)


def test_saved_files_are_compared_by_key_and_shape(tmp_path: Path):
    compare = _compare_module().compare_saved
    a = _saved(tmp_path, "a.pt", {"x": torch.zeros(3), "y": torch.zeros(2)})
    b = _saved(tmp_path, "b.pt", {"x": torch.tensor([0.0, -0.5, 0.25]), "y": torch.zeros(2)})
    result = compare_weights(compare({"single": a, "dist": b, "keys": []}), 1e-4)
    assert not result.ok and result.max_abs_diff == 0.5 and result.worst_name == "x"
    assert "'x'" in result.problem and "5.000e-01" in result.problem
    assert compare_weights(compare({"single": a, "dist": a, "keys": []}), 1e-4).ok

    c = _saved(tmp_path, "c.pt", {"x": torch.zeros(3), "z": torch.zeros(2)})
    keys = compare_weights(compare({"single": a, "dist": c, "keys": []}), 1e-4)
    assert not keys.ok and "only in the single run ['y']" in keys.problem and "['z']" in keys.problem
    d = _saved(tmp_path, "d.pt", {"x": torch.zeros(4), "y": torch.zeros(2)})
    shape = compare_weights(compare({"single": a, "dist": d, "keys": []}), 1e-4)
    assert not shape.ok and "shape (3,)" in shape.problem
    missing = compare_weights(compare({"single": a, "dist": a, "keys": ["ema"]}), 1e-4)
    assert not missing.ok and "no key" in missing.problem


def test_the_ema_copy_is_compared_too(tmp_path: Path):
    compare = _compare_module().compare_saved
    w = {"w": torch.ones(2)}
    a = _saved(tmp_path, "a.pt", {"model": w, "ema": w, "step": 3})
    b = _saved(tmp_path, "b.pt", {"model": w, "ema": {"w": torch.tensor([1.0, 1.5])}, "step": 3})
    assert compare_weights(compare({"single": a, "dist": b, "keys": ["model"]}), 1e-4).ok
    both = compare_weights(compare({"single": a, "dist": b, "keys": ["model", "ema"]}), 1e-4)
    assert not both.ok and both.worst_name == "ema.w"


def test_the_single_prefix_is_dropped(tmp_path: Path):
    compare = _compare_module().compare_saved
    a = _saved(tmp_path, "a.pt", {"_orig_mod.w": torch.ones(2)})
    b = _saved(tmp_path, "b.pt", {"w": torch.ones(2)})
    assert not compare_weights(compare({"single": a, "dist": b, "keys": []}), 1e-4).ok
    assert compare_weights(compare({"single": a, "dist": b, "keys": [], "single_prefix": "_orig_mod."}), 1e-4).ok
    bad = compare_weights(compare({"single": b, "dist": b, "keys": [], "single_prefix": "_orig_mod."}), 1e-4)
    assert not bad.ok and "does not start with" in bad.problem


def test_load_saved_reads_torch_save_and_dcp(tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    load_saved = _compare_module().load_saved
    state = {"model": {"w": torch.arange(4.0)}, "step": 7}
    torch.save(state, tmp_path / "plain.pt")
    with pytest.warns(UserWarning):  # DCP in one process without a process group
        dcp.save(state, checkpoint_id=tmp_path / "dcp")
    for path in (tmp_path / "plain.pt", tmp_path / "dcp"):
        loaded = load_saved(str(path))
        assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], state["model"]["w"])


@pytest.mark.e2e  # the engine's compare child: a fresh interpreter that imports torch
def test_compare_saved_runs_the_child(tmp_path: Path):
    a = _saved(tmp_path, "a.pt", {"w": torch.zeros(2)})
    b = _saved(tmp_path, "b.pt", {"w": torch.tensor([0.0, 2e-4])})
    assert compare_saved(Path(a), Path(b), [], 1e-4).max_abs_diff == pytest.approx(2e-4)
    assert not compare_saved(Path(a), Path(b), [], 1e-4).ok
    assert compare_saved(Path(a), Path(b), [], 1e-3).ok
    missing = compare_saved(Path(a), tmp_path / "none.pt", [], 1e-4)
    assert not missing.ok and "does not exist" in missing.problem


@pytest.mark.e2e
@pytest.mark.parametrize("name, flag", [
    ("forward_method_class_choice", ["--model", "Bag"]),
    ("forward_method_class_ternary", ["--arch", "conv"]),  # the class picked by a conditional expression
])
def test_a_forward_method_of_one_of_the_classes_chosen_at_run_time_is_registered_where_it_exists(
        name: str, flag: list, tmp_path: Path):
    """forward_method_class_choice: init_hidden exists on RNNModel only; the registration sits under
    `if hasattr(model, "init_hidden")`, so the run with the other class starts and trains too (registered
    unconditionally, it stopped at start-up: 'FSDPBagModel does not have a method init_hidden')."""
    case = FIXTURES / name
    dist = launch_distributed(case / "expected.py", flag + ["--batch-size", "4", "--out",
                                                            str(tmp_path / "bag.pt")], tmp_path, nproc=2)
    assert (tmp_path / "bag.pt" / ".metadata").is_file(), dist.stdout[-2000:]


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["ddp_trainer_attribute", "ddp_trainer_sibling"])
def test_a_ddp_trainer_resumes_from_its_own_snapshot_like_the_original(name: str, tmp_path: Path):
    """The snapshot a DDP Trainer saves and resumes from (converted together: DCP save on every rank,
    dcp.load + set_model_state_dict): a run of 2 epochs, then one to epoch 3 in the same folder that
    resumes from the first one's snapshot, ends with the weights and epoch of the DDP original doing
    the same under torchrun (its torch.save file read back by torch.load). Fails if the load is left
    as torch.load (a DCP directory is no file) or restores other weights or another epoch."""
    case = FIXTURES / name
    run = _run_config(case)
    timeout = run.get("timeout", DEFAULT_TIMEOUT_S)
    expected = _expected(case, tmp_path)
    for script, folder, extra in ((case / "input.py", tmp_path / "single", run["single_args"]),
                                  (expected, tmp_path / "dist", run["dist_args"])):
        for epochs in ("2", "3"):
            second = launch_distributed(script, ["--out", str(folder / "out.pt"), *extra, "--epochs", epochs], folder,
                                        nproc=run.get("nproc", 2), timeout=timeout)
        # the second run resumed (the sibling's would end with the same weights trained from scratch)
        resumed = {"ddp_trainer_attribute": "Resuming training from snapshot at epoch 1", "ddp_trainer_sibling": "epoch 2:"}
        assert resumed[name] in second.stdout and "epoch 0:" not in second.stdout, second.stdout[-2000:]
    assert (tmp_path / "dist" / "out.pt" / ".metadata").is_file(), "the converted Trainer saved no DCP directory"
    saved = compare_saved(tmp_path / "single" / "out.pt", tmp_path / "dist" / "out.pt", run["weights"],
                          run.get("tolerance", DEFAULT_TOLERANCE))
    print(f"\n{name}, resumed: saved weights {saved.max_abs_diff}")
    assert saved.ok, f"{name}: {saved.problem}"
    epoch_key = {"ddp_trainer_attribute": "EPOCHS_RUN", "ddp_trainer_sibling": "epoch"}[name]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "dist" / "out.pt", tmp_path / "dist.pt")
    original = torch.load(tmp_path / "single" / "out.pt", map_location="cpu", weights_only=False)
    converted = torch.load(tmp_path / "dist.pt", map_location="cpu", weights_only=False)
    assert converted[epoch_key] == original[epoch_key] == 2
