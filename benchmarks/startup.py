"""Start-up cost of `fsdp2-retrofit rewrite --check`, as a ratio to importing its dependencies.

    python benchmarks/startup.py [FIXTURE] [-n RUNS]

Runs, alternately, the console script on FIXTURE (default: the main_modulelist
fixture) and `python -c "import libcst, click, rich"`, both from this venv; prints
the median wall time of each and their ratio; never torch. --check writes
nothing, so the fixture is never modified. Two figures: "cached" (the result
cache answers, as in a pre-commit run over unchanged files; target <= 1.2: little
more than loading libcst, click and rich) and "uncached" (--no-cache: parse,
analyse and run every stage; target <= 2, issue 18). Byte code: the commands
write and reuse .pyc files in a private PYTHONPYCACHEPREFIX, as an installed tool
would, even where PYTHONDONTWRITEBYTECODE is set (it would time compiling every
module of the tool on every run).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Sequence

DEFAULT_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures/rewrite/main_modulelist/input.py"
BASELINE = [sys.executable, "-c", "import libcst, click, rich"]
TARGET = {"cached": 1.2, "uncached": 2.0}


def console_script() -> str:
    bin_dir = Path(sys.executable).parent
    found = shutil.which("fsdp2-retrofit", path=str(bin_dir))
    if found is None:
        sys.exit(f"fsdp2-retrofit is not installed in {bin_dir}: run `pip install -e .`")
    return found


def timed(command: Sequence[str], ok_codes=(0,)) -> float:
    start = time.perf_counter()
    proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode not in ok_codes:
        sys.exit(f"`{' '.join(command)}` exited {proc.returncode}:\n{proc.stderr}")
    return elapsed


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fixture", nargs="?", type=Path, default=DEFAULT_FIXTURE)
    parser.add_argument("-n", "--runs", type=int, default=7, help="timed runs of each command (default 7)")
    args = parser.parse_args(argv)
    if not args.fixture.is_file():
        sys.exit(f"fixture not found: {args.fixture}")

    script = console_script()
    # A private, empty result cache for this run, so "cached" means answered from
    # it after a first run, and "uncached" runs the whole pipeline every time.
    cache = tempfile.mkdtemp(prefix="fsdp2-retrofit-bench-")
    os.environ["FSDP2_RETROFIT_CACHE_DIR"] = cache
    pycache = tempfile.mkdtemp(prefix="fsdp2-retrofit-pyc-")
    os.environ["PYTHONPYCACHEPREFIX"] = pycache
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    cached = [script, "rewrite", "--check", "--quiet", str(args.fixture)]
    uncached = cached[:2] + ["--no-cache"] + cached[2:]
    # --check exits 1 when the fixture would change: that is a successful run.
    ok = (0, 1)
    timed(uncached, ok), timed(cached, ok), timed(BASELINE)  # fill the cache, warm .pyc files

    times = {"cached": [], "uncached": [], "base": []}
    for _ in range(args.runs):  # interleaved, so machine noise hits all three alike
        times["cached"].append(timed(cached, ok))
        times["uncached"].append(timed(uncached, ok))
        times["base"].append(timed(BASELINE))
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(pycache, ignore_errors=True)

    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"fixture: {args.fixture}  runs: {args.runs} each, interleaved, median")
    print(f"import libcst, click, rich                  {median['base'] * 1000:8.1f} ms")
    for kind in ("cached", "uncached"):
        ratio = median[kind] / median["base"]
        verdict = "ok" if ratio <= TARGET[kind] else "over target"
        label = f"rewrite --check ({kind})"
        print(f"{label:<43} {median[kind] * 1000:8.1f} ms   ratio {ratio:5.2f}  (target <= {TARGET[kind]}: {verdict})")


if __name__ == "__main__":
    main()
