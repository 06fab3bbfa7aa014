"""The generated code against a hand-written expert FSDP2 version of the same model, in one run:
per-rank state, peak RSS, collectives and bytes per optimizer step, step time.

    python benchmarks/collectives.py [--quick] [--memory-dim 1024] [--time-dim 256] [--repeat 2]

The model is a GPT of our own (token and position embeddings, pre-norm blocks of attention and
an MLP, a final LayerNorm, an untied head), trained with AdamW for a few steps on random tokens.
Its sizes are written into the single-device script as module constants, as a user writes them,
so the rewrite can read them. Four programs run, each under
`python -m torch.distributed.run --nproc_per_node=2` (CPU, gloo), one after the other:

  - `single`: the single-device script in one process (the memory baseline);
  - `generated`: that script rewritten by this tool's CLI (`fsdp2-retrofit rewrite -o`);
  - `expert`: FSDP2 written by hand for the same model (benchmarks/expert_gpt.py), with
    torchtitan's unit layout: the token embedding, each block, `[final norm, head]`, then the
    root, the `[norm, head]` unit kept gathered after forward (backward starts there);
  - `blocks+root`: the same hand-written script with the layout this tool generated before
    (each block, then the root, the last block kept gathered after forward).

Every process counts, per optimizer step, the collectives it calls: torch.distributed's
all-gather, reduce-scatter, all-reduce and broadcast functions are wrapped before the script
runs (an outer call counts once, never the function it calls inside), with their bytes: an
all-gather's gathered output, a reduce-scatter's input, an all-reduce's tensor. "Per step" is
the count between two optimizer steps (torch.optim's global step hook), the median over the
steps after the first. Step time: the median of the same intervals, on the smaller model,
`--repeat` runs of each program interleaved, the lowest median kept (the machine is shared).
State and peak RSS: as benchmarks/memory.py measures them (local shards by storage; ru_maxrss;
MALLOC_MMAP_THRESHOLD_=1048576), on the larger model.

Two sizes: the larger (default width 1024, vocabulary 32768, 6 blocks: 142.8M parameters) for
memory, the smaller (width 256, vocabulary 4096: 6.87M) for collectives and time; the counts do
not depend on the size, the bytes scale with it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from expert_gpt import EXPERT, EXPERT_ACCUM, WORKLOAD, WORKLOAD_ACCUM  # noqa: E402  (the scripts, as text)

RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": "1048576"}  # see benchmarks/memory.py

# Runs the script named by argv[1] as __main__ with torch.distributed's collectives wrapped.
COUNTER = '''\
import functools, inspect, json, os, resource, runpy, sys, time
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

COUNTS = {}
STEPS = []
_depth = [0]


def _bytes(t):
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def _wrap(name, kind, which):
    original = getattr(dist, name, None)
    if original is None:
        return
    signature = inspect.signature(original)
    measured = list(signature.parameters)[which]  # the gathered output, the scattered input, the tensor

    @functools.wraps(original)
    def counted(*args, **kwargs):
        if _depth[0] == 0:
            calls, nbytes = COUNTS.get(kind, (0, 0))
            tensor = signature.bind_partial(*args, **kwargs).arguments.get(measured)
            COUNTS[kind] = (calls + 1, nbytes + (_bytes(tensor) if not isinstance(tensor, list) else sum(map(_bytes, tensor))))
        _depth[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _depth[0] -= 1

    setattr(dist, name, counted)


for name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather"):
    _wrap(name, "all-gather", 0)
for name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter"):
    _wrap(name, "reduce-scatter", 1)
_wrap("all_reduce", "all-reduce", 0)
_wrap("broadcast", "broadcast", 0)


def _after_step(optimizer, args, kwargs):
    STEPS.append((time.perf_counter(), {k: v for k, v in COUNTS.items()}))


register_optimizer_step_post_hook(_after_step)
script = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    folder = os.environ["BENCH_REPORT_DIR"]
    with open(os.path.join(folder, f"steps-{os.getpid()}.json"), "w") as f:
        json.dump({"steps": STEPS, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f)
'''


def console_script() -> str:
    found = shutil.which("fsdp2-retrofit", path=str(Path(sys.executable).parent))
    if found is None:
        sys.exit(f"fsdp2-retrofit is not installed beside {sys.executable}: run `pip install -e .`")
    return found


def run(cmd: List[str], cwd: Path, timeout: float, extra_env: Dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", **extra_env)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def sizes(dim: int, vocab: int, depth: int, seq: int, batch: int, steps: int, accum: int = 0) -> Dict[str, int]:
    values = dict(DIM=dim, VOCAB=vocab, DEPTH=depth, SEQ=seq, BATCH=batch, STEPS=steps)
    if accum > 1:
        values["ACCUM"] = accum
    return values


def write_scripts(folder: Path, values: Dict[str, int], tool: str) -> Dict[str, Path]:
    """single.py (the user's script), generated.py (its rewrite), expert.py (hand-written); with
    ACCUM in `values` (gradient accumulation) also generated-reshard.py, the rewrite with
    `--accumulation-params reshard` (parameters freed after every micro-batch's backward)."""
    consts = "\n".join(f"{k} = {v}" for k, v in values.items())
    accum = "ACCUM" in values
    single = folder / "single.py"
    single.write_text((WORKLOAD_ACCUM if accum else WORKLOAD).replace("# SIZES", consts))
    generated = folder / "generated.py"
    run([tool, "rewrite", str(single), "-o", str(generated), "--quiet", "--no-cache"], folder, 120, {})
    expert = folder / "expert.py"
    expert.write_text((EXPERT_ACCUM if accum else EXPERT).replace("# SIZES", consts))
    (folder / "counter.py").write_text(COUNTER)
    scripts = {"single": single, "generated": generated, "expert": expert, "blocks+root": expert}
    if accum:
        scripts["generated-reshard"] = folder / "generated-reshard.py"
        run([tool, "rewrite", str(single), "-o", str(scripts["generated-reshard"]), "--quiet", "--no-cache",
             "--accumulation-params", "reshard"], folder, 120, {})
    return scripts


def measure(kind: str, scripts: Dict[str, Path], folder: Path, timeout: float) -> List[dict]:
    """Runs one program; one dict per rank: memory figures and per-step collectives."""
    out = folder / f"{kind.replace('+', '_')}-{time.monotonic_ns()}"
    out.mkdir()
    cmd = [sys.executable, str(folder / "counter.py"), str(scripts[kind]), "--report-dir", str(out)]
    if kind == "blocks+root":
        cmd.append("--blocks-and-root")
    if kind != "single":
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run(cmd, out, timeout, dict(RETURN_FREED, BENCH_REPORT_DIR=str(out)))
    # the generated code writes its memory report on rank 0 only (a plain-file write): the state
    # held is read from the reports written, the peak RSS and the steps from every rank's wrapper
    held = [json.loads(p.read_text()) for p in sorted(out.glob("memory-*.json"))]
    ranks = []
    for found in sorted(out.glob("steps-*.json")):
        figures = json.loads(found.read_text())
        ranks.append(dict(held[0], per_step=_per_step(figures["steps"]), peak_rss=figures["peak_rss"],
                          state=max(state(h) for h in held)))
    if not ranks or not held:
        sys.exit(f"{kind}: no report written in {out}")
    return ranks


def _per_step(steps) -> dict:
    """Median over the intervals between optimizer steps, after the first step."""
    out = {"seconds": statistics.median(b[0] - a[0] for a, b in zip(steps, steps[1:]))}
    for kind in ("all-gather", "reduce-scatter", "all-reduce", "broadcast"):
        calls = [b[1].get(kind, (0, 0))[0] - a[1].get(kind, (0, 0))[0] for a, b in zip(steps, steps[1:])]
        nbytes = [b[1].get(kind, (0, 0))[1] - a[1].get(kind, (0, 0))[1] for a, b in zip(steps, steps[1:])]
        out[kind] = (statistics.median(calls), statistics.median(nbytes))
    return out


def state(f) -> int:
    return f["params"] + f["grads"] + f["optimizer"]


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--memory-dim", type=int, default=1024)
    parser.add_argument("--memory-vocab", type=int, default=32768)
    parser.add_argument("--time-dim", type=int, default=256)
    parser.add_argument("--time-vocab", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run of the smaller model")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs of each program, interleaved")
    parser.add_argument("--quick", action="store_true", help="skip the larger model (no memory figures)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the larger model: state and peak RSS (benchmarks/memory.py --versus-expert)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--accumulate", type=int, default=0, metavar="N",
                        help="N micro-batches per optimizer step (gradient accumulation): the programs are the "
                        "generated code (parameters held between micro-batches), the generated code with "
                        "--accumulation-params reshard, and the expert version holding them too")
    args = parser.parse_args(argv)

    tool = console_script()
    work = Path(tempfile.mkdtemp(prefix="fsdp2-retrofit-collectives-"))
    accum = args.accumulate if args.accumulate > 1 else 0
    programs = ["generated", "generated-reshard", "expert"] if accum else ["generated", "expert", "blocks+root"]
    try:
        small = work / "small"
        small.mkdir()
        scripts = write_scripts(small, sizes(args.time_dim, args.time_vocab, args.depth, 64, 8, args.steps, accum),
                                tool)
        units = [line.strip() for line in scripts["generated"].read_text().splitlines() if "fully_shard(" in line
                 and not line.lstrip().startswith(("from", "import"))]
        timed: Dict[str, List[List[dict]]] = {k: [] for k in programs}
        for _ in range(0 if args.memory_only else args.repeat):
            for kind in programs:
                timed[kind].append(measure(kind, scripts, small, args.timeout))
        memory = {}
        if not args.quick or args.memory_only:
            big = work / "big"
            big.mkdir()
            scripts = write_scripts(big, sizes(args.memory_dim, args.memory_vocab, args.depth, 32, 4, 3, accum), tool)
            for kind in ["single"] + programs:
                memory[kind] = measure(kind, scripts, big, args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"GPT of {args.depth} blocks; CPU/gloo, 2 ranks; load average {os.getloadavg()[0]:.1f} at the end"
          + (f"; {accum} micro-batches per optimizer step" if accum else ""))
    print("generated fully_shard calls: " + "; ".join(units))
    if not args.memory_only:
        _print_collectives(args, timed, programs)
    _print_memory(args, memory, programs)


def _print_collectives(args, timed, programs) -> None:
    one = timed["generated"][0][0]
    print()
    print(f"(a) collectives per optimizer step, per rank (width {args.time_dim}, vocabulary {args.time_vocab}: "
          f"{one['n_params'] / 1e6:.2f}M parameters; median over steps 2..{args.steps})")
    print(f"    {'':<18} {'all-gathers':>12} {'bytes':>12} {'reduce-scatters':>16} {'bytes':>12} {'all-reduces':>12} "
          f"{'step s':>8} {'ratio':>6}")
    seconds = {k: min(statistics.median(r["per_step"]["seconds"] for r in ranks) for ranks in timed[k])
               for k in programs}
    for kind in programs:
        p = timed[kind][0][0]["per_step"]
        print(f"    {kind:<18} {p['all-gather'][0]:>12.0f} {mib(p['all-gather'][1]):>12} {p['reduce-scatter'][0]:>16.0f} "
              f"{mib(p['reduce-scatter'][1]):>12} {p['all-reduce'][0]:>12.0f} {seconds[kind]:>8.3f} "
              f"{seconds[kind] / seconds['expert']:>6.2f}")
    print("    (step s: the lowest of the runs' medians; ratio: to expert)")
    for kind in programs:
        runs = sorted(statistics.median(r["per_step"]["seconds"] for r in ranks) for ranks in timed[kind])
        print(f"    {kind:<18} each run's median step s: {' '.join(f'{x:.3f}' for x in runs)}")


def _print_memory(args, memory, programs) -> None:
    if memory:
        single = memory["single"][0]
        print()
        print(f"(b) memory per rank (width {args.memory_dim}, vocabulary {args.memory_vocab}: "
              f"{single['n_params'] / 1e6:.1f}M parameters), ratios to the single process")
        print(f"    {'':<18} {'state':>12} {'ratio':>7} {'peak RSS':>12} {'ratio':>7}")
        print(f"    {'single':<18} {mib(state(single)):>12} {1:>7.3f} {mib(single['peak_rss']):>12} {1:>7.3f}")
        for kind in programs:
            worst = max(memory[kind], key=lambda f: f["peak_rss"])
            most = worst["state"]
            print(f"    {kind:<18} {mib(most):>12} {most / state(single):>7.3f} "
                  f"{mib(worst['peak_rss']):>12} {worst['peak_rss'] / single['peak_rss']:>7.3f}")
        print("    (state: the most any rank reports; peak RSS: the highest rank's, from ru_maxrss at exit)")


if __name__ == "__main__":
    main()
