"""How often a rank aborts at exit under torchrun (CPU, gloo), with and without the
instrumentation's exit grace, measured side by side in one run.

    python benchmarks/teardown.py [--fixture star_import_gan] [--runs 20] [--grace 0.2]   (Python 3.11+)

What it measures: gloo's worker threads release the last collective's work (and the
Python-owned tensors in it) under the GIL. When that happens after the interpreter began
to finalize, taking the GIL ends the worker thread inside a destructor: std::terminate,
"terminate called without an active exception", exit -6, after the script finished. The
verify instrumentation (fsdp2_retrofit/verify/_site/sitecustomize.py) waits EXIT_GRACE_S
at exit so the worker releases it first.

Each round runs the fixture's expected.py twice under `torchrun --standalone
--nproc_per_node=2`, the instrumentation on (as the execution tests run it): once with
the grace set to 0, once with --grace, in alternating order. A run is "ok" (exit 0),
"abort" (the teardown abort in stderr) or "other" (any other failure: its stderr's last
lines are printed). No retries: every attempt counts.
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsdp2_retrofit.verify import TEARDOWN_ABORT, _child_env, _launch  # noqa: E402


def dist_args(fixture: Path) -> list:
    """The arguments the fixture's execution test gives its distributed run (case.toml [run])."""
    case = tomllib.loads((fixture / "case.toml").read_text(encoding="utf-8"))
    return list(case.get("run", {}).get("dist_args", []))


def one_run(fixture: Path, grace: float) -> str:
    directory = Path(tempfile.mkdtemp(prefix="fsdp2-teardown-"))
    env = _child_env(directory, 0, "dist")
    env["FSDP2_RETROFIT_VERIFY_EXIT_GRACE"] = str(grace)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(fixture / "expected.py"), "--out", str(directory / "out.pt"), *dist_args(fixture)]
    rc, stderr = _launch(cmd, env, directory, 300, f"run of {fixture.name}")
    if rc == 0:
        return "ok"
    if TEARDOWN_ABORT in stderr:
        return "abort"
    print("\n".join(stderr.splitlines()[-8:]), file=sys.stderr)
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default="star_import_gan", help="a folder under fixtures/rewrite")
    parser.add_argument("--runs", type=int, default=20, help="runs of each setting")
    parser.add_argument("--grace", type=float, default=0.2, help="the exit grace to compare with none (seconds)")
    args = parser.parse_args()
    fixture = REPO / "fixtures" / "rewrite" / args.fixture
    counts = {0.0: collections.Counter(), args.grace: collections.Counter()}
    seconds = {0.0: 0.0, args.grace: 0.0}
    for i in range(args.runs):
        for grace in ((0.0, args.grace) if i % 2 == 0 else (args.grace, 0.0)):
            started = time.perf_counter()
            counts[grace][one_run(fixture, grace)] += 1
            seconds[grace] += time.perf_counter() - started
        print(f"round {i + 1}/{args.runs}: " + ", ".join(f"grace {g}: {dict(c)}" for g, c in counts.items()),
              file=sys.stderr)
    print(f"{args.fixture}, {args.runs} runs each, torchrun --nproc_per_node=2 (gloo), no retries")
    for grace, count in counts.items():
        print(f"  exit grace {grace:.2f} s: ok {count['ok']}, abort {count['abort']}, other {count['other']}; "
              f"mean wall {seconds[grace] / args.runs:.1f} s")


if __name__ == "__main__":
    main()
