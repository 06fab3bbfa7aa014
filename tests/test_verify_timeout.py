"""A run that times out: verify says where each rank was, calls it a hang only on evidence, and
leaves no process of the run behind (torchrun's workers run in sessions of their own).

The units read made-up faulthandler dumps and kill a small process tree whose grandchild
left the launcher's session; the e2e test times out a real torchrun whose rank 1 never
reaches the all_reduce rank 0 waits in (fixtures/verify/hang_rank1.py), each rank with a
child process of its own.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.verify import EXIT_ERROR, VerifyError, _launch, processes

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures" / "verify"
linux = pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="reads processes from /proc")

WAITING = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/work/run/train.py", line 33 in step
  File "/work/run/train.py", line 40 in <module>
"""
WORKING = """\
Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 125 in forward
  File "/work/run/train.py", line 28 in <module>
"""


def _place(rank, stack, steps=3, running=True):
    return processes.RankPlace(rank, 100 + rank, running, steps, stack)


def test_a_timeout_is_called_a_hang_only_when_the_stacks_show_one():
    place = processes.main_thread_place(WAITING)
    assert place.line == "train.py:33 in step" and place.in_collective
    assert place.inner == "torch/distributed/distributed_c10d.py:3252 in all_reduce"
    both = processes.timeout_diagnosis([_place(0, WAITING), _place(1, WAITING)])
    assert "rank 1 (pid 101) still running, 3 step(s) done, at train.py:33 in step" in both
    assert both.endswith("every rank still running was waiting in torch.distributed: a hang (a collective not "
                         "every rank reaches, or ranks in different collectives)")
    one = processes.timeout_diagnosis([_place(0, WAITING), _place(1, WORKING)])
    assert "rank 1 (pid 101) still running, 3 step(s) done, at train.py:28 in <module>" in one
    assert "rank(s) 0 waited in torch.distributed while rank(s) 1 were elsewhere" in one
    slow = processes.timeout_diagnosis([_place(0, WORKING, steps=None)])
    assert "no step done" in slow and "hang" not in slow.replace("not hung", "")
    unknown = processes.timeout_diagnosis([_place(0, "", running=True), _place(1, "", running=False)])
    assert "its stack could not be read" in unknown and "rank 1 (pid 101) had ended" in unknown
    assert unknown.endswith("not known to be a hang")


ESCAPING = """\
import subprocess, sys, time
child = subprocess.Popen(["sleep", "600"], start_new_session=True)  # as torchrun starts its workers
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


@linux
def test_a_timed_out_run_leaves_no_process_even_one_in_a_session_of_its_own(tmp_path: Path):
    script = tmp_path / "escape.py"
    script.write_text(ESCAPING)
    pid_file = tmp_path / "child.pid"
    with pytest.raises(VerifyError) as caught:
        _launch([sys.executable, str(script), str(pid_file)], dict(os.environ), tmp_path, 3.0, "run")
    assert "did not finish within 3 s and was killed" in caught.value.message
    assert "a hang" not in caught.value.message.replace("not known to be a hang", "")
    child = int(pid_file.read_text())
    assert not processes.alive(child)


@linux
def test_the_harness_kills_what_verify_left_running(tmp_path: Path, monkeypatch):
    spec = importlib.util.spec_from_file_location("realworld_run", REPO / "benchmarks" / "realworld" / "run.py")
    run = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, run)  # its dataclasses look their module up
    spec.loader.exec_module(run)
    started = []

    def verify_that_times_out(cmd, **kwargs):  # verify's ranks outlive it: the harness's timeout fired
        started.append(subprocess.Popen(["sleep", "600"], env=kwargs["env"], start_new_session=True))
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(run.subprocess, "run", verify_that_times_out)
    script = run.Script("o/r", "0" * 40, "o/r-train", "train.py", dict(run.DEFAULTS), "m.toml")
    with pytest.raises(subprocess.TimeoutExpired):
        run.verify_step(script, tmp_path / "train.py", tmp_path, None, sys.executable)
    started[0].wait(timeout=10)  # killed (a zombie until then)
    assert started[0].returncode == -9


@linux
@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_a_distributed_run_that_times_out_says_where_each_rank_was_and_leaves_none_running(tmp_path, monkeypatch):
    mark = uuid.uuid4().hex
    monkeypatch.setenv("FSDP2_TEST_TIMEOUT_MARK", mark)  # every process verify starts inherits it
    # Known flake, not understood yet: in about one run in four on a loaded 2-core machine (and once alone)
    # rank 0's faulthandler dump never arrives ("its stack could not be read"), even asked twice over 6 s.
    # On exactly that symptom the run is tried once more (printed); any other difference fails at once.
    for attempt in (1, 2):
        runs = tmp_path / f"runs{attempt}"
        started = time.monotonic()
        result = CliRunner().invoke(cli.main, [
            "verify", str(FIXTURES / "hang_single.py"), "--retrofitted", str(FIXTURES / "hang_rank1.py"),
            "--timeout", "40", "--keep-runs", str(runs)])
        print(f"\nattempt {attempt}: timeout after {time.monotonic() - started:.1f} s: {result.output}")
        text = " ".join(result.output.split())
        if attempt == 1 and re.search(r"rank 0 \(pid \d+\) still running, \d+ step\(s\) done, its stack could not be read",
                                      text):
            continue
        break
    assert result.exit_code == EXIT_ERROR, result.output
    assert "did not finish within 40 s and was killed" in text and "(a deadlock?)" not in text
    assert "rank 0 (pid" in text and "at hang_rank1.py:33 in <module>" in text
    assert "all_reduce (waiting in torch.distributed)" in text
    assert "at hang_rank1.py:31 in <module>" in text  # rank 1, sleeping
    assert "rank(s) 0 waited in torch.distributed while rank(s) 1 were elsewhere" in text
    pids = [int(p) for f in sorted((runs / "dist").glob("pids_rank*.txt")) for p in f.read_text().split()]
    assert len(pids) == 4  # two ranks, each with its child
    assert not [p for p in pids if processes.alive(p)]
    needle = f"FSDP2_TEST_TIMEOUT_MARK={mark}".encode()
    survivors = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid() and processes.alive(int(entry.name)):
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    survivors.append(int(entry.name))
            except OSError:
                pass
    assert not survivors


@linux
def test_a_process_still_in_execve_is_looked_at_again_not_taken_for_unmarked(tmp_path: Path, monkeypatch):
    # Popen returns once close-on-exec fired, before the kernel has set the new image's environment
    # up: /proc/PID/environ reads empty for a moment (98 of 2000 reads right after Popen here; the
    # harness test above failed in CI that way). Simulated: the first two reads of it come back empty.
    env, tag = processes.marked(dict(os.environ))
    child = subprocess.Popen(["sleep", "600"], env=env, start_new_session=True)
    reads = {}
    real = processes._environ

    def first_reads_empty(pid):
        reads[pid] = reads.get(pid, 0) + 1
        return b"" if pid == child.pid and reads[pid] <= 2 else real(pid)

    monkeypatch.setattr(processes, "_environ", first_reads_empty)
    try:
        assert processes.kill_run(None, tag, settle_rounds=0) == set()  # gave up at the first empty read
        assert processes.alive(child.pid)
        reads.clear()
        assert processes.kill_run(None, tag) == set()
        assert child.wait(timeout=10) == -9
        assert reads[child.pid] >= 3  # read until its environment showed the mark
    finally:
        child.kill()
        child.wait()
