"""Execution tests: a retrofitted script trains exactly like the original.

Each ``fixtures/rewrite/<case>`` runs ``input.py`` in one process and
``expected.py`` under torchrun (CPU, gloo), at the same global batch, and the
final weights must agree within the case's tolerance. Cases whose ``[run]`` says
``mode = "trains"`` (``--meta-init``: new random initial weights, nothing to
compare with) run only ``expected.py`` and must print losses that fall by
``min_drop`` (default 20 %) from the first to the last. The e2e tests take a few
seconds each; deselect them with ``-m "not e2e"``. ``pytest -s`` shows the
measured differences.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from harness import (
    RunError,
    assert_loss_falls,
    load_weights,
    losses_in,
    max_abs_diff,
    run_distributed,
    run_plain,
    run_single,
    select,
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
SHARED_EXAMPLES = REPO.parent / "shared" / "examples"
DEFAULT_TOLERANCE = 1e-4
DEFAULT_MIN_DROP = 0.2


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


def _compare(single_out: Path, dist_out: Path, keys: list[str], single_prefix: str = "") -> float:
    """Max |difference| of the weights; `single_prefix` is dropped from the single run's
    names (torch.compile's `_orig_mod.`, which get_model_state_dict does not write)."""
    single = select(load_weights(single_out), keys)
    if single_prefix:
        assert all(k.startswith(single_prefix) for k in single), f"not every key starts with {single_prefix}"
        single = {k[len(single_prefix):]: v for k, v in single.items()}
    return max_abs_diff(single, select(load_weights(dist_out), keys))


# --- the fixtures -----------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("case", [c for c in _cases() if _mode(c) == "parity"], ids=lambda p: p.name)
def test_retrofit_trains_like_the_original(case: Path, tmp_path: Path):
    if not (case / "expected.py").is_file():
        pytest.skip(f"{case.name}: no expected.py yet (the rewriter generates it)")
    run = _run_config(case)
    tolerance = run.get("tolerance", DEFAULT_TOLERANCE)

    # each run in its own folder: scripts that save periodically to relative paths
    # write plain files in one and DCP directories in the other
    (tmp_path / "single").mkdir()
    (tmp_path / "dist").mkdir()
    timeout = {"timeout": run["timeout"]} if "timeout" in run else {}  # a deadlock fails, it does not hang
    reference = run.get("reference", "single")
    if reference == "torchrun":  # a DDP original: itself under torchrun, same ranks and data
        run_distributed(case / "input.py", run["single_args"], tmp_path / "single.pt", nproc=run.get("nproc", 2),
                        cwd=tmp_path / "single", **timeout)
    elif reference == "plain":  # an original that spawns its own workers
        run_plain(case / "input.py", run["single_args"], tmp_path / "single.pt", cwd=tmp_path / "single", **timeout)
    else:  # reference_script: a hand-written single-process twin, for inputs that cannot run in one process (FSDP1)
        run_single(case / run.get("reference_script", "input.py"), run["single_args"], tmp_path / "single.pt",
                   cwd=tmp_path / "single")
    run_distributed(
        case / "expected.py", run["dist_args"], tmp_path / "dist.pt", nproc=run.get("nproc", 2), cwd=tmp_path / "dist",
        **timeout,
    )
    diff = _compare(tmp_path / "single.pt", tmp_path / "dist.pt", run["weights"], run.get("single_prefix", ""))
    print(f"\n{case.name}: max |single - distributed| = {diff:.3e} (tolerance {tolerance:g})")
    assert diff <= tolerance, f"{case.name}: weights differ by {diff:.3e} > {tolerance:g}"


@pytest.mark.e2e
@pytest.mark.parametrize("case", [c for c in _cases() if _mode(c) == "trains"], ids=lambda p: p.name)
def test_retrofit_trains(case: Path, tmp_path: Path):
    """--meta-init outputs: the distributed run learns (its loss falls)."""
    run = _run_config(case)
    stdout = run_distributed(
        case / "expected.py", run["dist_args"], tmp_path / "dist.pt", nproc=run.get("nproc", 2), cwd=tmp_path
    )
    losses = losses_in(stdout)
    print(f"\n{case.name}: {len(losses)} losses, first {losses[0] if losses else None}, "
          f"last {losses[-1] if losses else None}")
    assert_loss_falls(losses, run.get("min_drop", DEFAULT_MIN_DROP))


@pytest.mark.e2e
def test_trains_check_fails_when_nothing_is_learned(tmp_path: Path):
    """The check can fail: the same run at learning rate 0 keeps its loss."""
    case = FIXTURES / "meta_init_plain"
    run = _run_config(case)
    stdout = run_distributed(case / "expected.py", [*run["dist_args"], "--lr", "0"], tmp_path / "dist.pt", cwd=tmp_path)
    losses = losses_in(stdout)
    print(f"\nlr 0: first {losses[0]}, last {losses[-1]}")
    with pytest.raises(AssertionError, match="did not fall"):
        assert_loss_falls(losses, DEFAULT_MIN_DROP)


# --- plain `python train.py`: one process, no torchrun ----------------------

# A representative set: the README's shape, a shuffled two-epoch loader (DistributedSampler
# of one rank against the reference order), accumulation with clipping, periodic DCP
# checkpoints with a resume guard, the torch 2.4 import spelling, and an optional-DDP
# script whose plain branch now starts a group of its one process.
PLAIN_CASES = [
    "main_modulelist", "kwargs_shuffle", "accumulation_modulo", "resume_periodic", "torch_2_4_generate", "optional_ddp",
]


@pytest.mark.e2e
@pytest.mark.parametrize("name", PLAIN_CASES)
def test_retrofit_runs_as_plain_python(name: str, tmp_path: Path):
    """The output runs without torchrun (a process group of one process, fully_shard on a
    1-rank mesh) and trains exactly like the original at the same batch."""
    case = FIXTURES / name
    run = _run_config(case)
    (tmp_path / "single").mkdir()
    (tmp_path / "plain").mkdir()
    run_single(case / "input.py", run["single_args"], tmp_path / "single.pt", cwd=tmp_path / "single")
    run_plain(case / "expected.py", run["single_args"], tmp_path / "plain.pt", cwd=tmp_path / "plain")
    diff = _compare(tmp_path / "single.pt", tmp_path / "plain.pt", run["weights"])
    print(f"\n{name}: max |original - plain python retrofit| = {diff:.3e}")
    assert diff <= DEFAULT_TOLERANCE, f"{name}: weights differ by {diff:.3e}"


@pytest.mark.e2e
@pytest.mark.xdist_group("shared_reference")
def test_shared_example_rewrite_runs_as_plain_python(shared_reference: Path, tmp_path: Path):
    """The rewrite of the shared single-GPU example, run as `python train.py` at batch 64,
    equals the original at batch 64."""
    from fsdp2_retrofit.rewrite.pipeline import rewrite_source

    source = SHARED_EXAMPLES / "train_single.py"
    result = rewrite_source(source.read_bytes(), str(source))
    assert not result.refusals, result.refusals
    script = tmp_path / "train.py"
    script.write_bytes(result.code)
    run_plain(script, ["--batch-size", "64"], tmp_path / "plain.pt")
    diff = _compare(shared_reference, tmp_path / "plain.pt", [])
    print(f"\nshared example rewritten, plain python at 64 vs the original at 64: max diff {diff:.3e}")
    assert diff <= DEFAULT_TOLERANCE


# --- the hand-written example pair in shared/ --------------------------------


def _require_shared_examples():
    if not (SHARED_EXAMPLES / "train_single.py").is_file():
        pytest.skip(f"shared examples not found at {SHARED_EXAMPLES}")


@pytest.fixture(scope="module")
def shared_reference(tmp_path_factory) -> Path:
    """train_single.py at batch 64 in one process: the reference for both tests below."""
    _require_shared_examples()
    out = tmp_path_factory.mktemp("shared_single") / "single.pt"
    run_single(SHARED_EXAMPLES / "train_single.py", ["--batch-size", "64"], out)
    return out


@pytest.mark.e2e
@pytest.mark.xdist_group("shared_reference")  # one reference run for both tests under --dist loadgroup
def test_shared_example_pair_matches(shared_reference: Path, tmp_path: Path):
    run_distributed(SHARED_EXAMPLES / "train_fsdp2.py", ["--batch-size", "32"], tmp_path / "dist.pt")
    diff = _compare(shared_reference, tmp_path / "dist.pt", [])
    print(f"\nshared example, 2 x 32 vs 1 x 64: max diff {diff:.3e}")
    assert diff <= DEFAULT_TOLERANCE


@pytest.mark.e2e
@pytest.mark.xdist_group("shared_reference")
def test_wrong_global_batch_is_caught(shared_reference: Path, tmp_path: Path):
    """The harness can fail: 2 ranks x 16 is not the single run at 64."""
    run_distributed(SHARED_EXAMPLES / "train_fsdp2.py", ["--batch-size", "16"], tmp_path / "dist.pt")
    diff = _compare(shared_reference, tmp_path / "dist.pt", [])
    print(f"\nshared example, 2 x 16 vs 1 x 64: max diff {diff:.3e}")
    assert diff > DEFAULT_TOLERANCE


@pytest.mark.e2e
def test_the_logged_loss_is_the_global_batch_loss(tmp_path: Path):
    """Rank 0 prints the mean over ranks (the all_reduce the rewrite adds), so the
    distributed log reads like the single-process log at the same global batch."""
    case = FIXTURES / "main_modulelist"
    (tmp_path / "single").mkdir()
    (tmp_path / "dist").mkdir()
    single = run_single(case / "input.py", ["--batch-size", "64"], tmp_path / "s.pt", cwd=tmp_path / "single")
    dist = run_distributed(case / "expected.py", ["--batch-size", "32"], tmp_path / "d.pt", cwd=tmp_path / "dist")

    def losses(text: str) -> list:
        return [float(m.group(1)) for m in re.finditer(r"loss (\d+\.\d+)", text)]

    expected, got = losses(single), losses(dist)
    print(f"\nsingle {expected}\ndistributed {got}")
    assert len(expected) == len(got) == 6
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 2e-4


# --- the harness itself (fast, but for the three that start a torch process) ---

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


@pytest.mark.e2e  # runs a script that imports torch in a fresh interpreter: seconds, like the runs it serves
def test_reference_sampler_follows_distributed_sampler(tmp_path: Path):
    """Single run at batch 8 == union of the 2 ranks' DistributedSampler batches at 4, per epoch."""
    from torch.utils.data.distributed import DistributedSampler

    script = tmp_path / "order.py"
    script.write_text(_ORDER_SCRIPT)
    run_single(script, ["--batch-size", "8"], tmp_path / "order.json")
    single = json.loads((tmp_path / "order.json").read_text())["epochs"]

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
def test_reference_sampler_is_off_outside_run_single(tmp_path: Path):
    """Without the harness's environment a shuffled loader keeps torch's own order."""
    import subprocess
    import sys

    script = tmp_path / "order.py"
    script.write_text(_ORDER_SCRIPT)
    run_single(script, ["--batch-size", "8"], tmp_path / "patched.json")
    from harness import SAMPLER_ENV

    env = {k: v for k, v in os.environ.items() if k != SAMPLER_ENV}
    subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path / "plain.json"), "--batch-size", "8"],
        check=True, env=env, cwd=tmp_path,
    )
    patched = json.loads((tmp_path / "patched.json").read_text())
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert patched != plain


def test_select_flattens_and_prefixes():
    g, d = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    assert select(g, []) == g
    assert select({"model": g, "step": 3}, ["model"]) == g
    assert set(select({"G": g, "D": d}, ["G", "D"])) == {"G.w", "D.w"}
    with pytest.raises(KeyError, match="no key"):
        select({"model": g}, ["ema"])
    with pytest.raises(TypeError, match="not a tensor"):
        select({"model": g, "step": 3}, [])


def test_max_abs_diff_reports_keys_and_shapes():
    a = {"x": torch.zeros(3), "y": torch.zeros(2)}
    assert max_abs_diff(a, {"x": torch.tensor([0.0, -0.5, 0.25]), "y": torch.zeros(2)}) == 0.5
    with pytest.raises(AssertionError, match=r"only in first \['y'\], only in second \['z'\]"):
        max_abs_diff(a, {"x": torch.zeros(3), "z": torch.zeros(2)})
    with pytest.raises(AssertionError, match="shape"):
        max_abs_diff(a, {"x": torch.zeros(4), "y": torch.zeros(2)})


def test_load_weights_reads_torch_save_and_dcp(tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(4.0)}, "step": 7}
    torch.save(state, tmp_path / "plain.pt")
    with pytest.warns(UserWarning):  # DCP in one process without a process group
        dcp.save(state, checkpoint_id=tmp_path / "dcp")
    for path in (tmp_path / "plain.pt", tmp_path / "dcp"):
        loaded = load_weights(path)
        assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], state["model"]["w"])


def test_losses_are_read_from_what_the_loop_prints():
    out = "step 0 loss 2.3012\niter 1: loss 1.9\nloss=nan\nlr 0.001\nval_loss 7\nEpoch 3 | loss: 1e-3\n"
    assert losses_in(out)[:2] == [2.3012, 1.9]
    assert str(losses_in(out)[2]) == "nan"
    assert losses_in(out)[3:] == [0.001]


@pytest.mark.parametrize(
    "losses, error",
    [
        ([2.3, 1.9, 1.2], None),
        ([2.3, 2.2, 2.25], "did not fall by 20%"),  # flat
        ([1.0, 1.5, 3.0], "did not fall"),  # diverging
        ([2.3, float("nan"), 0.1], "non-finite"),  # garbage memory left by to_empty
        ([2.3], "at least two"),
        ([], "at least two"),
    ],
)
def test_loss_must_fall(losses, error):
    if error is None:
        assert_loss_falls(losses, 0.2)
    else:
        with pytest.raises(AssertionError, match=error):
            assert_loss_falls(losses, 0.2)


@pytest.mark.e2e
def test_failed_run_names_the_exception(tmp_path: Path):
    script = tmp_path / "boom.py"
    script.write_text("raise ValueError('no such layer: fc3')\n")
    with pytest.raises(RunError, match="ValueError: no such layer: fc3"):
        run_single(script, [], tmp_path / "out.pt")


def test_a_retried_run_starts_from_the_files_the_first_attempt_found(monkeypatch, tmp_path):
    """An attempt aborted at teardown may already have written a later checkpoint:
    the retry must not resume from it."""
    import harness

    (tmp_path / "ckpt").write_text("step 6")
    seen = []

    def fake_run(cmd, env, cwd, timeout):
        seen.append((cwd / "ckpt").read_text())
        (cwd / "ckpt").write_text("step 12")
        (cwd / "extra").write_text("left by the aborted attempt")
        if len(seen) == 1:
            raise harness.RunError(f"exit code 1: ...\n{harness.TEARDOWN_ABORT}\n")
        return "ok"

    monkeypatch.setattr(harness, "_run", fake_run)
    assert run_distributed(tmp_path / "s.py", [], tmp_path / "d.pt") == "ok"
    assert seen == ["step 6", "step 6"]


def test_only_the_gloo_teardown_abort_is_retried(monkeypatch, tmp_path):
    import harness

    outcomes = [harness.RunError(f"exit code 1: ...\n{harness.TEARDOWN_ABORT}\n"), "ok"]

    def fake_run(cmd, env, cwd, timeout):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(harness, "_run", fake_run)
    assert run_distributed(tmp_path / "s.py", [], tmp_path / "d.pt") == "ok"

    outcomes[:] = [harness.RunError("exit code 1: ValueError: boom")]
    with pytest.raises(RunError, match="boom"):
        run_distributed(tmp_path / "s.py", [], tmp_path / "d.pt")

    outcomes[:] = [harness.RunError(harness.TEARDOWN_ABORT)] * (harness.TEARDOWN_RETRIES + 1)
    with pytest.raises(RunError):
        run_distributed(tmp_path / "s.py", [], tmp_path / "d.pt")
