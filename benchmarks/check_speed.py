"""Cost of `fsdp2-retrofit check`, as ratios to what it cannot avoid: parsing, and importing its dependencies.

    python benchmarks/check_speed.py [--repeat N] [--corpus-runs N] [--corpus DIR ...] [--json]

Everything is measured in this one run, side by side, in fresh subprocesses of this
venv's interpreter. CPU time is user + sys of the child *and its descendants*
(resource.getrusage(RUSAGE_CHILDREN) around each run), so the worker processes
`check` starts for many files are counted; both sides of each ratio include
interpreter start-up.

(a) corpus: CPU time of `python -m fsdp2_retrofit.cli check --exit-zero -q FILES`
    divided by the CPU time of a subprocess that imports libcst and runs
    `libcst.parse_module(data)` on the bytes of every one of the same FILES.
    Target <= 2. FILES: every .py file under the installed torch's
    `torch/distributed` (located with importlib.util.find_spec, which does not
    import torch), the repository's fixtures/ as `check --show-files` lists them,
    and every .py file under each --corpus DIR. They are passed to check as an
    explicit list (a directory inside site-packages would be skipped by check's
    default excludes); `check --show-files FILES` must give back the same list.
    Also shown: wall times, and how many files pass check's text prefilter
    (only those are parsed and analysed; the baseline parses all of them).
    Worst case: the same two commands on only the files that pass the prefilter,
    so check parses and analyses every file it is given. Target <= 2 there too.

(b) one file: `check --exit-zero -q FILE` divided by
    `python -c "import libcst, click, rich"`. Target <= 1.3 (1.2 until the records went back
    to the standard library's dataclasses, which cost ~80 M instructions at import). Two files: the
    shared example fixtures/examples/train_fsdp2.py (correct FSDP2: it passes
    the prefilter and is fully parsed and analysed, with no findings) and a small
    temporary script with pitfalls (`model.forward(x)` and `torch.save` of the
    state dict after `fully_shard(model)`). The three commands run --repeat times,
    interleaved, after one warm-up each; medians of wall and CPU time.

The check subprocesses run in an empty temporary directory, so no pyproject.toml
changes the rule selection: the default rules, as the prefilter count assumes.
Byte code: the subprocesses write and reuse .pyc files in a private
PYTHONPYCACHEPREFIX (removed afterwards), as an installed tool would, even where
PYTHONDONTWRITEBYTECODE is set; a warm-up run of every command fills it first.
With --no-pyc-cache they inherit the environment as it is (with
PYTHONDONTWRITEBYTECODE=1 the project's modules are then compiled on every run).
"""
from __future__ import annotations

import argparse
import importlib.util
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
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
EXAMPLE = Path(__file__).resolve().parents[1] / "fixtures/examples/train_fsdp2.py"
PY = sys.executable
CLI = [PY, "-m", "fsdp2_retrofit.cli"]
BASELINE_IMPORT = [PY, "-c", "import libcst, click, rich"]
TARGET_CORPUS = 2.0
TARGET_ONE_FILE = 1.3

PITFALLS = '''\
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

model = nn.Linear(8, 8)
fully_shard(model)
x = torch.randn(2, 8)
y = model.forward(x)
torch.save(model.state_dict(), "model.pt")
'''

# Parses every file named (one per line) in the list file argv[1], as check would.
PARSE_ALL = """\
import sys, libcst
with open(sys.argv[1], encoding="utf-8") as f:
    paths = f.read().splitlines()
for path in paths:
    with open(path, "rb") as f:
        data = f.read()
    libcst.parse_module(data)
"""


ENV = dict(os.environ)  # the subprocesses' environment (see main)


def measured(command: Sequence[str], cwd: str, ok_codes=(0,)) -> Tuple[float, float]:
    """(wall seconds, CPU seconds of the child and everything it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in ok_codes:
        sys.exit(f"`{_short(command)}` exited {proc.returncode}:\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _short(command: Sequence[str]) -> str:
    text = " ".join(command)
    return text if len(text) < 300 else text[:300] + f" ... ({len(command)} arguments)"


def output(command: Sequence[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, check=False)


def torch_distributed() -> Path:
    spec = importlib.util.find_spec("torch")  # finds the package; does not import it
    if spec is None or not spec.submodule_search_locations:
        sys.exit("torch is not installed in this venv: the corpus is its torch/distributed sources")
    path = Path(next(iter(spec.submodule_search_locations))) / "distributed"
    if not path.is_dir():
        sys.exit(f"no torch/distributed at {path}")
    return path


def corpus_files(extra: Sequence[Path], workdir: str) -> Tuple[List[str], Dict[str, int]]:
    """Absolute paths, and how many came from each source."""
    counts: Dict[str, int] = {}
    files: List[str] = []
    tdist = torch_distributed()
    found = sorted(str(p) for p in tdist.rglob("*.py") if p.is_file())
    counts[str(tdist)] = len(found)
    files += found
    listed = output(CLI + ["check", "--show-files", str(FIXTURES)], workdir)
    if listed.returncode != 0:
        sys.exit(f"check --show-files {FIXTURES} exited {listed.returncode}:\n{listed.stderr}")
    found = [str(Path(line).resolve()) for line in listed.stdout.splitlines() if line.strip()]
    counts[str(FIXTURES)] = len(found)
    files += found
    for d in extra:
        d = d.resolve()
        if not d.is_dir():
            sys.exit(f"--corpus: not a directory: {d}")
        found = sorted(str(p) for p in d.rglob("*.py") if p.is_file())
        counts[str(d)] = len(found)
        files += found
    unique = list(dict.fromkeys(files))
    return unique, counts


def prefilter_count(files: Sequence[str]) -> Tuple[List[str], int, int, int]:
    """(the files passing, their bytes, all bytes, files passing with every rule selected)."""
    from fsdp2_retrofit.check.lint import applicable
    from fsdp2_retrofit.check.rules import all_rules, selected

    default, every = tuple(selected([], [])), tuple(all_rules())
    passing: List[str] = []
    passing_all = size = total = 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        total += len(data)
        if applicable(data, default):
            passing.append(path)
            size += len(data)
        if applicable(data, every):
            passing_all += 1
    return passing, size, total, passing_all


def side_by_side(files: Sequence[str], runs: int, workdir: str, name: str) -> dict:
    """check on FILES against a bare parse of FILES: medians of `runs` interleaved runs."""
    list_file = os.path.join(workdir, f"{name}.txt")
    with open(list_file, "w", encoding="utf-8") as f:
        f.write("\n".join(files) + "\n")
    check = CLI + ["check", "--exit-zero", "-q"] + list(files)
    parse = [PY, "-c", PARSE_ALL, list_file]
    measured_runs = {"check": [], "parse": []}
    for _ in range(runs):  # interleaved
        measured_runs["check"].append(measured(check, workdir))
        measured_runs["parse"].append(measured(parse, workdir))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for k, v in measured_runs.items()}
    return {
        "files": len(files),
        "check_wall_s": med["check"][0],
        "check_cpu_s": med["check"][1],
        "parse_wall_s": med["parse"][0],
        "parse_cpu_s": med["parse"][1],
        "cpu_ratio": med["check"][1] / med["parse"][1],
        "wall_ratio": med["check"][0] / med["parse"][0],
    }


def bench_corpus(args, workdir: str) -> dict:
    files, counts = corpus_files(args.corpus, workdir)
    shown = output(CLI + ["check", "--show-files"] + files, workdir)
    if shown.returncode != 0:
        sys.exit(f"check --show-files FILES exited {shown.returncode}:\n{shown.stderr}")
    if shown.stdout.splitlines() != files:
        sys.exit("check --show-files does not list exactly the corpus files: the two sides would differ")
    passing, passing_bytes, total_bytes, passing_all = prefilter_count(files)

    # warm-up (byte code of everything both sides import): each on the few fixture files
    few = [f for f in files if f.startswith(str(FIXTURES))][:3] or files[:3]
    warm_list = os.path.join(workdir, "warm.txt")
    with open(warm_list, "w", encoding="utf-8") as f:
        f.write("\n".join(few) + "\n")
    measured(CLI + ["check", "--exit-zero", "-q"] + few, workdir)
    measured([PY, "-c", PARSE_ALL, warm_list], workdir)
    whole = side_by_side(files, args.corpus_runs, workdir, "corpus")
    # the worst case: only files that pass the prefilter, so check parses and analyses every one
    worst = side_by_side(passing, args.corpus_runs, workdir, "worst") if passing else None
    return dict(
        whole,
        sources=counts,
        bytes=total_bytes,
        prefilter_pass=len(passing),
        prefilter_pass_bytes=passing_bytes,
        prefilter_pass_all_rules=passing_all,
        runs=args.corpus_runs,
        target=TARGET_CORPUS,
        worst=worst,
    )


def bench_one_file(args, workdir: str) -> dict:
    if not EXAMPLE.is_file():
        sys.exit(f"example not found: {EXAMPLE}")
    bad = os.path.join(workdir, "pitfalls.py")
    with open(bad, "w", encoding="utf-8") as f:
        f.write(PITFALLS)
    # What each file is: the example has no findings, the pitfalls file has some.
    good_run = output(CLI + ["check", str(EXAMPLE)], workdir)
    bad_run = output(CLI + ["check", bad], workdir)
    if bad_run.returncode != 1 or "FSD101" not in bad_run.stdout:
        sys.exit(f"the pitfalls file should be flagged FSD101 (exit 1); got exit {bad_run.returncode}:\n"
                 f"{bad_run.stdout}{bad_run.stderr}")
    findings = {
        "example": [line.split()[1] for line in good_run.stdout.splitlines() if line.startswith(str(EXAMPLE))],
        "pitfalls": [line.split()[1] for line in bad_run.stdout.splitlines() if line.startswith(bad)],
    }
    # check must never import torch: ask the interpreter what it imported.
    traced = output([PY, "-X", "importtime", "-m", "fsdp2_retrofit.cli", "check", "--exit-zero", "-q", str(EXAMPLE)], workdir)
    imported_torch = any(line.rstrip().split("|")[-1].strip().split(".")[0] == "torch"
                         for line in traced.stderr.splitlines() if line.startswith("import time:"))

    commands = {
        "example": CLI + ["check", "--exit-zero", "-q", str(EXAMPLE)],
        "pitfalls": CLI + ["check", "--exit-zero", "-q", bad],
        "base": BASELINE_IMPORT,
    }
    for command in commands.values():  # warm-up: .pyc files, page cache
        measured(command, workdir)
    runs: Dict[str, List[Tuple[float, float]]] = {k: [] for k in commands}
    for _ in range(args.repeat):  # interleaved, so machine noise hits all alike
        for key, command in commands.items():
            runs[key].append(measured(command, workdir))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    out = {"repeat": args.repeat, "target": TARGET_ONE_FILE, "imported_torch": imported_torch,
           "base_wall_s": med["base"][0], "base_cpu_s": med["base"][1]}
    for key in ("example", "pitfalls"):
        out[key] = {
            "file": str(EXAMPLE) if key == "example" else "(temporary) pitfalls.py",
            "findings": findings[key],
            "wall_s": med[key][0],
            "cpu_s": med[key][1],
            "wall_ratio": med[key][0] / med["base"][0],
            "cpu_ratio": med[key][1] / med["base"][1],
        }
    return out


def bytecode_mode(args) -> str:
    if not args.no_pyc_cache:
        return ".pyc written and reused (private PYTHONPYCACHEPREFIX)"
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return "environment as is: PYTHONDONTWRITEBYTECODE set, uncached modules compile every run"
    return "environment as is"


def verdict(ratio: float, target: float) -> str:
    return f"target <= {target}: {'ok' if ratio <= target else 'OVER TARGET'}"


def report(a: dict, b: dict) -> None:
    print(f"(a) corpus: {a['files']} files, {a['bytes'] / 1e6:.1f} MB "
          f"({', '.join(f'{n} from {s}' for s, n in a['sources'].items())})")
    print(f"    prefilter: {a['prefilter_pass']} of {a['files']} files pass "
          f"({a['prefilter_pass_bytes'] / 1e6:.2f} MB; {a['prefilter_pass_all_rules']} with every rule selected); "
          "only those are parsed and analysed by check")
    print(f"    {a['runs']} run(s) each, interleaved, median; CPU = user+sys including child processes")
    print(f"    libcst.parse_module on every file   wall {a['parse_wall_s']:7.2f} s   CPU {a['parse_cpu_s']:7.2f} s")
    print(f"    check --exit-zero -q FILES          wall {a['check_wall_s']:7.2f} s   CPU {a['check_cpu_s']:7.2f} s")
    print(f"    CPU ratio  {a['cpu_ratio']:5.2f}  ({verdict(a['cpu_ratio'], a['target'])})")
    print(f"    wall ratio {a['wall_ratio']:5.2f}  (for information: check runs worker processes, the parse does not)")
    w = a.get("worst")
    if w:
        print(f"  worst case: the {w['files']} files that pass the prefilter, each parsed and analysed by check")
        print(f"    libcst.parse_module on every file   wall {w['parse_wall_s']:7.2f} s   CPU {w['parse_cpu_s']:7.2f} s")
        print(f"    check --exit-zero -q FILES          wall {w['check_wall_s']:7.2f} s   CPU {w['check_cpu_s']:7.2f} s")
        print(f"    CPU ratio  {w['cpu_ratio']:5.2f}  ({verdict(w['cpu_ratio'], a['target'])})")
    print()
    print(f"(b) one file: {b['repeat']} runs each, interleaved, after a warm-up; median")
    print(f"    python -c 'import libcst, click, rich'   wall {b['base_wall_s'] * 1000:7.1f} ms   "
          f"CPU {b['base_cpu_s'] * 1000:7.1f} ms")
    for key in ("example", "pitfalls"):
        r = b[key]
        found = ", ".join(r["findings"]) or "no findings"
        print(f"    check {key:<8} ({found})")
        print(f"        {r['file']}")
        print(f"        wall {r['wall_s'] * 1000:7.1f} ms  ratio {r['wall_ratio']:5.2f}  ({verdict(r['wall_ratio'], b['target'])})")
        print(f"        CPU  {r['cpu_s'] * 1000:7.1f} ms  ratio {r['cpu_ratio']:5.2f}  ({verdict(r['cpu_ratio'], b['target'])})")
    print(f"    check imported torch: {'YES (a bug)' if b['imported_torch'] else 'no'}")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repeat", type=int, default=10, metavar="N",
                        help="(b): timed runs of each one-file command (default 10)")
    parser.add_argument("--corpus-runs", type=int, default=2, metavar="N",
                        help="(a): timed runs of check and of the parse baseline over the corpus (default 2; ~35 s a pair on 2 cores)")
    parser.add_argument("--corpus", action="append", type=Path, default=[], metavar="DIR",
                        help="(a): also every .py file under DIR (repeatable)")
    parser.add_argument("--no-pyc-cache", action="store_true",
                        help="run the subprocesses in this environment as it is (no private .pyc cache)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of text")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.corpus_runs < 1:
        parser.error("--repeat and --corpus-runs must be >= 1")

    workdir = tempfile.mkdtemp(prefix="fsdp2-retrofit-check-bench-")
    if not args.no_pyc_cache:
        ENV.pop("PYTHONDONTWRITEBYTECODE", None)
        ENV["PYTHONPYCACHEPREFIX"] = os.path.join(workdir, "pycache")
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        a = bench_corpus(args, workdir)
        b = bench_one_file(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps({"corpus": a, "one_file": b, "python": sys.version.split()[0],
                          "cpus": os.cpu_count(), "bytecode": bytecode_mode(args)}, indent=2))
    else:
        report(a, b)
        print(f"byte code: {bytecode_mode(args)}; {os.cpu_count()} CPUs; load average before/after "
              f"{load_before} / {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
