"""Run an original script and its retrofit, and compare the weights they save.

Plain functions, no pytest: ``test_execution.py`` drives them, and they can be
used by hand (with ``tests/`` on ``sys.path``)::

    from harness import run_single, run_distributed, load_weights, select, max_abs_diff
    run_single(Path("input.py"), ["--batch-size", "64"], Path("/tmp/a.pt"))
    run_distributed(Path("expected.py"), ["--batch-size", "32"], Path("/tmp/b"))
    print(max_abs_diff(select(load_weights(Path("/tmp/a.pt")), []),
                       select(load_weights(Path("/tmp/b")), [])))

The single run gets the reference sampler of ``fsdp2-retrofit verify``
(``fsdp2_retrofit/verify/_site/sitecustomize.py`` with only
FSDP2_RETROFIT_VERIFY_SAMPLER set: no instrumentation), which makes a shuffled
DataLoader visit samples in the order DistributedSampler would, so single and
distributed runs see the same global batches.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence

from fsdp2_retrofit.verify import SITE_DIR as REFERENCE_SITE, TEARDOWN_ABORT

SAMPLER_ENV = "FSDP2_RETROFIT_VERIFY_SAMPLER"

SINGLE_TIMEOUT_S = 120
DISTRIBUTED_TIMEOUT_S = 180
_TAIL_CHARS = 4000


class RunError(RuntimeError):
    """A script exited non-zero or ran past its timeout."""


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop(SAMPLER_ENV, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


_ERROR_LINE = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception)\b.*$", re.MULTILINE)


def _tail(text: str) -> str:
    return text if len(text) <= _TAIL_CHARS else "..." + text[-_TAIL_CHARS:]


def _failure(what: str, cmd: list[str], stdout: str, stderr: str) -> RunError:
    """A RunError naming each rank's exception up front: torchrun buries the
    root cause under the other ranks' tracebacks and its own."""
    errors = list(dict.fromkeys(m.group(0) for m in _ERROR_LINE.finditer(stderr)))
    summary = "\n".join(errors[:10]) or "(no exception line found)"
    return RunError(
        f"{what}: {' '.join(cmd)}\n--- exceptions ---\n{summary}\n"
        f"--- stdout ---\n{_tail(stdout)}\n--- stderr ---\n{_tail(stderr)}"
    )


def _run(cmd: list[str], env: Mapping[str, str], cwd: Path, timeout: float) -> str:
    """Run ``cmd`` in its own process group; kill the whole group on timeout.

    torchrun's workers are its children: killing torchrun alone would leave a
    deadlocked pair behind, so the group goes.
    """
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise _failure(f"timed out after {timeout:.0f} s (deadlock?)", cmd, stdout, stderr) from None
    if proc.returncode != 0:
        raise _failure(f"exit code {proc.returncode}", cmd, stdout, stderr)
    return stdout


def run_single(
    script: Path,
    args: Sequence[str],
    out: Path,
    cwd: Optional[Path] = None,
    timeout: float = SINGLE_TIMEOUT_S,
) -> str:
    """Run the original script in one process, shuffling like DistributedSampler.

    Returns its stdout. ``cwd`` defaults to the directory of ``out``.
    """
    env = _base_env()
    env[SAMPLER_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REFERENCE_SITE), env.get("PYTHONPATH", "")) if p
    )
    cmd = [sys.executable, str(Path(script).resolve()), "--out", str(out), *args]
    return _run(cmd, env, Path(cwd or Path(out).parent), timeout)


def run_plain(
    script: Path,
    args: Sequence[str],
    out: Path,
    cwd: Optional[Path] = None,
    timeout: float = DISTRIBUTED_TIMEOUT_S,
) -> str:
    """Run a script as one plain process with no reference shuffling: an original
    that starts its own worker processes (mp.spawn)."""
    cmd = [sys.executable, str(Path(script).resolve()), "--out", str(out), *args]
    return _run(cmd, _base_env(), Path(cwd or Path(out).parent), timeout)


def run_distributed(
    script: Path,
    args: Sequence[str],
    out: Path,
    nproc: int = 2,
    cwd: Optional[Path] = None,
    timeout: float = DISTRIBUTED_TIMEOUT_S,
) -> str:
    """Run a retrofitted script under ``torchrun --standalone`` with ``nproc`` workers.

    ``python -m torch.distributed.run`` is the ``torchrun`` entry point of the
    running interpreter, so the test and the workers use the same torch.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(Path(script).resolve()),
        "--out",
        str(out),
        *args,
    ]
    workdir = Path(cwd or Path(out).parent)
    # A retried run must find the files the first attempt found: a run that resumes
    # from a checkpoint and was aborted after saving a later one would resume from that.
    with tempfile.TemporaryDirectory() as before:
        shutil.copytree(workdir, before, dirs_exist_ok=True)
        for attempt in range(TEARDOWN_RETRIES + 1):
            try:
                return _run(cmd, _base_env(), workdir, timeout)
            except RunError as err:
                # gloo's worker threads can abort a rank while the interpreter shuts down,
                # after the script has finished (std::terminate, exit -6). That flake is
                # retried; any other failure, or the same one every time, fails the test.
                if attempt == TEARDOWN_RETRIES or TEARDOWN_ABORT not in str(err):
                    raise
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(workdir, ignore_errors=True)
                shutil.copytree(before, workdir)
    raise AssertionError("unreachable")


TEARDOWN_RETRIES = 2


# "loss 2.3012", "loss: 2.3", "loss=nan": the numbers a training loop prints
_LOSS = re.compile(r"\bloss\b\s*[:=]?\s*(-?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf))", re.IGNORECASE)


def losses_in(stdout: str) -> list[float]:
    """Every loss a run printed, in order (one per line that prints one)."""
    out = []
    for line in stdout.splitlines():
        match = _LOSS.search(line)
        if match:
            out.append(float(match.group(1)))
    return out


def assert_loss_falls(losses: Sequence[float], min_drop: float) -> None:
    """The run learned: finite losses, and the last below the first by `min_drop` of it.

    For runs that cannot match a single-process reference (--meta-init draws new
    initial weights), this is what "it trains" means."""
    import math

    if len(losses) < 2:
        raise AssertionError(f"need at least two printed losses, found {list(losses)}")
    if not all(math.isfinite(x) for x in losses):
        raise AssertionError(f"non-finite loss: {list(losses)}")
    first, last = losses[0], losses[-1]
    if not last < first * (1 - min_drop):
        raise AssertionError(
            f"loss did not fall by {min_drop:.0%}: first {first:.4f}, last {last:.4f} (all: {list(losses)})"
        )


def load_weights(path: Path):
    """Load what a run saved: a ``torch.save`` file or a DCP checkpoint directory."""
    import torch

    path = Path(path)
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            converted = Path(tmp) / "converted.pt"
            dcp_to_torch_save(path, converted)
            # Written moments ago by the test run itself: safe to unpickle.
            return torch.load(converted, map_location="cpu", weights_only=False)
    return torch.load(path, map_location="cpu", weights_only=False)


def select(obj, keys: Sequence[str]) -> dict:
    """Pick the model weights out of a saved object, as a flat ``name -> tensor`` dict.

    ``keys`` empty: ``obj`` is itself a state dict. One key: ``obj[key]`` is the
    state dict. Several keys: each state dict's names are prefixed ``key.``.
    """
    import torch

    if not keys:
        parts = {"": obj}
    else:
        if not isinstance(obj, Mapping):
            raise TypeError(f"expected a dict with keys {list(keys)}, got {type(obj).__name__}")
        missing = [k for k in keys if k not in obj]
        if missing:
            raise KeyError(f"saved object has no key(s) {missing}; it has {sorted(obj)}")
        parts = {k: obj[k] for k in keys}

    flat = {}
    for prefix, state in parts.items():
        if not isinstance(state, Mapping):
            raise TypeError(f"{prefix or 'saved object'} is a {type(state).__name__}, not a state dict")
        for name, value in state.items():
            full = f"{prefix}.{name}" if len(parts) > 1 else name
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{full} is a {type(value).__name__}, not a tensor")
            flat[full] = value
    return flat


def max_abs_diff(a: Mapping, b: Mapping) -> float:
    """The largest absolute difference between two state dicts with the same names and shapes."""
    missing, extra = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if missing or extra:
        raise AssertionError(
            f"state dicts differ in keys: only in first {missing}, only in second {extra}"
        )
    worst = 0.0
    for name in sorted(a):
        x, y = a[name], b[name]
        if x.shape != y.shape:
            raise AssertionError(f"{name}: shape {tuple(x.shape)} != {tuple(y.shape)}")
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst
