"""`fsdp2-retrofit check` on a tree, cold and warm (the results cache), as ratios to a bare parse.

    python benchmarks/check_tree_speed.py [--runs N] [--json]

Conventions of benchmarks/check_speed.py (whose helpers it uses): everything measured in this
one run, side by side, in fresh subprocesses of this venv's interpreter; CPU time is user + sys
of the child and its descendants (the worker processes check starts are counted); both sides
include interpreter start-up; the subprocesses write and reuse .pyc files in a private
PYTHONPYCACHEPREFIX, filled by a warm-up run of each command first.

The tree: every .py file under the installed torch's `torch/distributed` (located with
importlib.util.find_spec, which does not import torch; 300+ files), passed to check as an
explicit list (check skips site-packages when it walks a folder); `check --show-files FILES`
must give back the same list.

Each run, interleaved:
  parse   a subprocess that imports libcst and runs libcst.parse_module on every file's bytes
  cold    `check --exit-zero FILES` with an empty cache folder (FSDP2_RETROFIT_CACHE_DIR, a new
          temporary folder): every file prefiltered, parsed where it may apply, analysed, and
          its result written to the cache (check/results_cache.py)
  warm    the same command again, same cache: every result read back
  nocache the same command with --no-cache (for information: the cost of writing the cache)
Targets: cold CPU <= 1.5x the parse's, warm <= 0.5x. The warm run's output must be the cold
run's, byte for byte (text), and so must the JSON output of a cold and a warm run (checked once).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_speed  # noqa: E402  (its helpers and its subprocess environment, check_speed.ENV)

CLI, PY, PARSE_ALL = check_speed.CLI, check_speed.PY, check_speed.PARSE_ALL
TARGET_COLD, TARGET_WARM = 1.5, 0.5


def run_check(command: Sequence[str], cwd: str, cache: str) -> Tuple[float, float, bytes]:
    """(wall seconds, CPU seconds of the child and its descendants, stdout) with this cache folder."""
    env = dict(check_speed.ENV, FSDP2_RETROFIT_CACHE_DIR=cache)
    env.pop("FSDP2_RETROFIT_NO_CACHE", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"`{check_speed._short(list(command))}` exited {proc.returncode}:\n{proc.stderr.decode()}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc.stdout


def tree_files() -> List[str]:
    root = check_speed.torch_distributed()
    return sorted(str(p) for p in root.rglob("*.py") if p.is_file())


def bench(runs: int, workdir: str) -> dict:
    files = tree_files()
    shown = check_speed.output(CLI + ["check", "--show-files"] + files, workdir)
    if shown.returncode != 0 or shown.stdout.splitlines() != files:
        sys.exit("check --show-files does not list exactly the tree's files: the sides would differ\n" + shown.stderr)
    list_file = os.path.join(workdir, "tree.txt")
    with open(list_file, "w", encoding="utf-8") as f:
        f.write("\n".join(files) + "\n")
    parse = [PY, "-c", PARSE_ALL, list_file]
    check = CLI + ["check", "--exit-zero"] + files

    # warm-up: the byte code of what both sides import, on a few files
    few = os.path.join(workdir, "few.txt")
    with open(few, "w", encoding="utf-8") as f:
        f.write("\n".join(files[:3]) + "\n")
    check_speed.measured([PY, "-c", PARSE_ALL, few], workdir)
    run_check(CLI + ["check", "--exit-zero", "--no-cache"] + files[:3], workdir, os.path.join(workdir, "c0"))

    # the outputs: warm is cold, byte for byte (JSON, checked once; text, every run below)
    jcache = os.path.join(workdir, "json-cache")
    jcold = run_check(check + ["--output-format", "json"], workdir, jcache)[2]
    jwarm = run_check(check + ["--output-format", "json"], workdir, jcache)[2]
    if jcold != jwarm:
        sys.exit("the warm run's JSON output differs from the cold run's")
    shutil.rmtree(jcache, ignore_errors=True)

    timed = {"parse": [], "cold": [], "warm": [], "nocache": []}
    for n in range(runs):  # interleaved, so machine noise hits all alike
        cache = os.path.join(workdir, f"cache{n}")
        timed["parse"].append(check_speed.measured(parse, workdir))
        wall, cpu, cold_out = run_check(check, workdir, cache)
        timed["cold"].append((wall, cpu))
        wall, cpu, warm_out = run_check(check, workdir, cache)
        timed["warm"].append((wall, cpu))
        if warm_out != cold_out:
            sys.exit("the warm run's output differs from the cold run's")
        timed["nocache"].append(run_check(check + ["--no-cache"], workdir, cache)[:2])
        entries = sum(len(names) for _, _, names in os.walk(cache))
        shutil.rmtree(cache, ignore_errors=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in timed.items()}
    findings = sum(1 for line in cold_out.decode().splitlines() if line.startswith("/"))
    return {
        "files": len(files),
        "tree": str(check_speed.torch_distributed()),
        "bytes": sum(os.path.getsize(p) for p in files),
        "findings": findings,
        "cache_entries": entries,
        "runs": runs,
        **{f"{k}_wall_s": v[0] for k, v in med.items()},
        **{f"{k}_cpu_s": v[1] for k, v in med.items()},
        "cold_ratio": med["cold"][1] / med["parse"][1],
        "warm_ratio": med["warm"][1] / med["parse"][1],
        "nocache_ratio": med["nocache"][1] / med["parse"][1],
    }


def report(r: dict) -> None:
    print(f"tree: {r['files']} files, {r['bytes'] / 1e6:.1f} MB under {r['tree']}; "
          f"{r['findings']} findings; {r['cache_entries']} cache entries after a run")
    print(f"{r['runs']} run(s) each, interleaved, median; CPU = user+sys including child processes")
    rows = [("parse", "libcst.parse_module on every file"), ("cold", "check FILES, empty cache"),
            ("warm", "check FILES again, same cache"), ("nocache", "check --no-cache FILES")]
    for key, what in rows:
        ratio = "" if key == "parse" else f"   CPU ratio {r[key + '_cpu_s'] / r['parse_cpu_s']:5.2f}"
        print(f"  {what:<36} wall {r[key + '_wall_s']:7.2f} s   CPU {r[key + '_cpu_s']:7.2f} s{ratio}")
    for key, target in (("cold", TARGET_COLD), ("warm", TARGET_WARM)):
        print(f"{key} ratio {r[key + '_ratio']:.2f}: {check_speed.verdict(r[key + '_ratio'], target)}")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, metavar="N", help="timed rounds (default 2)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    workdir = tempfile.mkdtemp(prefix="fsdp2-retrofit-tree-bench-")
    check_speed.ENV.pop("PYTHONDONTWRITEBYTECODE", None)
    check_speed.ENV["PYTHONPYCACHEPREFIX"] = os.path.join(workdir, "pycache")
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        r = bench(args.runs, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.json:
        print(json.dumps(dict(r, python=sys.version.split()[0], cpus=os.cpu_count(),
                              load_before=load_before, load_after=load_after), indent=2))
    else:
        report(r)
        print(f"{os.cpu_count()} CPUs; load average before/after {load_before} / {load_after}")


if __name__ == "__main__":
    main()
