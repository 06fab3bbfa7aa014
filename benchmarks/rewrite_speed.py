"""Cost of one rewrite, as a ratio to what it cannot avoid: parsing the file.

    python benchmarks/rewrite_speed.py [--sizes 200,1000,...] [--repeat N] [--example PATH] [--profile]

For each script: CPU time (time.process_time) of `rewrite_source` (the pipeline
called directly: no cache, no CLI, no file writes) divided by the CPU time of a
bare `libcst.parse_module` of the same bytes, both measured here, side by side,
in this one process, best of --repeat (after a warm-up that also loads every
module). Target (issue 27): a ratio <= 3 at every size (it was 5), and a rewrite time that grows
linearly with the lines.

Scripts: (a) the example (fixtures/examples/train_single.py), and
generated scripts of about --sizes lines in two shapes, both built around the
main_modulelist fixture (a normal training script):

  flat     many small top-level statements: module-level constants and small
           helper functions before its classes;
  classes  few large classes: a handful of big nn.Module classes (long __init__
           and forward, many layers) before its main(), which trains the last.

Projects: the four project fixtures (fixtures/rewrite/project_*), each timed as the parse of
every file of the project against one rewrite from its entry (the entry parsed, the program read,
linked into one tree, analysed and converted as one module, and taken apart into its files), cold:
the process's cache of parsed project files (analysis/project_imports.py) emptied before each rewrite,
as for the first file of a run.

Prints a Markdown table: lines, shape, parse s, rewrite s, ratio, and rewrite
microseconds per line (flat across sizes means linear growth). --profile prints
the cProfile of the largest rewrite (top functions by cumulative time).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXAMPLE = Path(__file__).resolve().parents[1] / "fixtures/examples/train_single.py"

BASE = ROOT / "fixtures" / "rewrite" / "main_modulelist" / "input.py"  # a normal training script


def _base() -> str:
    return BASE.read_text()


def flat(lines: int) -> str:
    """Many small top-level statements (settings, helpers) around the training script."""
    base = _base()
    at = base.index("\n\nclass ")
    parts = []
    used, i = base.count("\n") + 1, 0
    while used < lines:
        if i % 5 == 4:
            parts.append(f"\n\ndef helper_{i}(x, scale=SCALE_{i - 1}):\n    return x * scale + {i}\n")
            used += 4
        else:
            parts.append(f"SCALE_{i} = {i} * 0.5  # a setting\n")
            used += 1
        i += 1
    return base[:at] + "\n\n" + "".join(parts) + base[at:]


def classes(lines: int) -> str:
    """A handful of big model classes (about 1,000 lines each), the last one trained."""
    base = _base()
    n_classes = max(1, min(8, lines // 1000))
    layers = max(2, (lines - base.count("\n")) // n_classes // 4)
    parts = []
    for c in range(n_classes):
        init = "".join(f"        self.layer{k} = nn.Linear(24, 24)\n" for k in range(layers))
        forward = "".join(
            f"        x = x + self.layer{k}(x)\n" + (f"        # layer {k}\n" if k % 2 else "        x = x.relu()\n")
            + "        x = self.norm(x)\n"
            for k in range(layers)
        )
        parts.append(
            f"\n\nclass Model{c}(nn.Module):\n"
            f'    """Model {c}."""\n\n'
            f"    def __init__(self):\n        super().__init__()\n{init}"
            f"        self.norm = nn.LayerNorm(24)\n        self.head = nn.Linear(24, 8)\n\n"
            f"    def forward(self, x):\n{forward}        return self.head(x)\n"
        )
    at = base.index("\n\ndef main")
    text = base[:at] + "".join(parts) + base[at:]
    return text.replace("model = Classifier()", f"model = Model{n_classes - 1}()", 1)


def measure(source: bytes, repeat: int):
    import libcst

    from fsdp2_retrofit.pipeline import rewrite_source

    best_parse = best_rewrite = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        libcst.parse_module(source)
        best_parse = min(best_parse, time.process_time() - t)
        t = time.process_time()
        result = rewrite_source(source, "train.py")
        best_rewrite = min(best_rewrite, time.process_time() - t)
    assert not result.refusals and result.changed, (result.refusals, "the benchmark script must be rewritten")
    return best_parse, best_rewrite


PROJECTS = ("project_course", "project_solver", "project_thin_entry", "project_trainer_method_optimizer")


def measure_project(case: Path, repeat: int):
    """(lines, parse s, rewrite s) of a project fixture: every .py file of the project parsed, against one
    rewrite of its entry (the program read, linked, converted and taken apart)."""
    import libcst

    from fsdp2_retrofit.analysis.project_imports import _TREES
    from fsdp2_retrofit.pipeline import rewrite_source

    files = [p for p in sorted(case.rglob("*.py")) if "expected" not in p.relative_to(case).parts
             and p.name != "expected.py"]
    texts = [p.read_bytes() for p in files]
    entry = case / "input.py"
    best_parse = best_rewrite = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        for text in texts:
            libcst.parse_module(text)
        best_parse = min(best_parse, time.process_time() - t)
        _TREES.clear()  # cold, as the first file of a run: the project's files are parsed again
        t = time.process_time()
        result = rewrite_source(entry.read_bytes(), str(entry))
        best_rewrite = min(best_rewrite, time.process_time() - t)
    assert not result.refusals and result.changed_files, (result.refusals, "the project must be rewritten")
    return sum(t.count(b"\n") for t in texts), best_parse, best_rewrite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="200,1000,5000,10000,20000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--example", type=Path, default=EXAMPLE)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-projects", dest="projects", action="store_false",
                        help="leave out the project fixtures (a program of several files rewritten from its entry)")
    args = parser.parse_args()

    from fsdp2_retrofit.pipeline import rewrite_source

    scripts = []
    if args.example.is_file():
        scripts.append(("example", args.example.read_bytes()))
    for size in (int(s) for s in args.sizes.split(",")):
        scripts.append(("flat", flat(size).encode()))
        scripts.append(("classes", classes(size).encode()))
    rewrite_source(scripts[0][1], "train.py")  # warm-up: loads every module

    print("| lines | shape | parse s | rewrite s | ratio | rewrite µs/line |")
    print("|---:|---|---:|---:|---:|---:|")
    for shape, source in scripts:
        n = source.count(b"\n")
        parse_s, rewrite_s = measure(source, args.repeat)
        print(f"| {n} | {shape} | {parse_s:.3f} | {rewrite_s:.3f} | {rewrite_s / parse_s:.1f} | {1e6 * rewrite_s / n:.0f} |")
        sys.stdout.flush()
    if args.projects:
        for name in PROJECTS:  # a program: the parse of every file against the rewrite from its entry
            n, parse_s, rewrite_s = measure_project(ROOT / "fixtures" / "rewrite" / name, args.repeat)
            print(f"| {n} | {name} | {parse_s:.3f} | {rewrite_s:.3f} | {rewrite_s / parse_s:.1f} | "
                  f"{1e6 * rewrite_s / n:.0f} |")
            sys.stdout.flush()
    if args.profile:
        import cProfile
        import pstats

        shape, source = max(scripts, key=lambda s: len(s[1]))
        profiler = cProfile.Profile()
        profiler.runcall(rewrite_source, source, "train.py")
        lines = source.count(b"\n")
        print(f"\nprofile of the {shape} script of {lines} lines:")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
