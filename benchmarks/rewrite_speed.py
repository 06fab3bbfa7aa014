"""Cost of one rewrite, as a ratio to what it cannot avoid: parsing the file.

    python benchmarks/rewrite_speed.py [--sizes 200,1000,...] [--repeat N] [--example PATH] [--profile]

For each script: CPU time (time.process_time) of `rewrite_source` (the pipeline
called directly: no cache, no CLI, no file writes) divided by the CPU time of a
bare `libcst.parse_module` of the same bytes, both measured here, side by side,
in this one process, best of --repeat (after a warm-up that also loads every
module). Target: a ratio <= 5 at every size, and a rewrite time that grows
linearly with the lines.

Scripts: (a) the shared example (/work/shared/examples/train_single.py), and
generated scripts of about --sizes lines in two shapes:

  flat     many small top-level statements: module-level constants and small
           helper functions around a normal training script (the example's body);
  classes  few large classes: a model file of a handful of big nn.Module classes
           (long __init__ and forward, many layers) and a training loop.

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

EXAMPLE = Path("/work/shared/examples/train_single.py")

HEAD = '''\
"""A generated training script."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
'''

TRAIN = '''

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="model.pt")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 10, (512,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)

    model = {model}().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    step = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {{step}} loss {{loss.item():.4f}}")
        step += 1
        if step == args.steps:
            break
    torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
'''

SMALL_MODEL = '''

class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self, dim=16, depth=4, classes=10):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
'''


def flat(lines: int) -> str:
    """Many small top-level statements around the training script."""
    parts = [HEAD, SMALL_MODEL]
    used = sum(p.count("\n") for p in parts) + TRAIN.count("\n")
    i = 0
    while used < lines:
        if i % 5 == 4:
            parts.append(f"\n\ndef helper_{i}(x, scale=SCALE_{i - 1}):\n    return x * scale + {i}\n")
            used += 4
        else:
            parts.append(f"SCALE_{i} = {i} * 0.5  # a setting\n")
            used += 1
        i += 1
    parts.append(TRAIN.format(model="Net"))
    return "".join(parts)


def classes(lines: int) -> str:
    """A handful of big model classes (about 1,000 lines each) and a training loop."""
    parts = [HEAD]
    used = HEAD.count("\n") + TRAIN.count("\n")
    n_classes = max(1, min(8, lines // 1000))
    per_class = max(20, (lines - used) // n_classes)
    layers = max(2, (per_class - 12) // 3)
    for c in range(n_classes):
        init = "".join(f"        self.layer{k} = nn.Linear(16, 16)\n" for k in range(layers))
        # every third line of forward is a comment, as in a real model
        forward = "".join(
            f"        x = x + self.layer{k}(x)\n" + (f"        # layer {k}\n" if k % 2 else "        x = F.gelu(x)\n")
            for k in range(layers)
        )
        parts.append(
            f"\n\nclass Model{c}(nn.Module):\n"
            f'    """Model {c}."""\n\n'
            f"    def __init__(self):\n        super().__init__()\n{init}"
            f"        self.head = nn.Linear(16, 10)\n\n"
            f"    def forward(self, x):\n{forward}        return self.head(x)\n"
        )
    parts.append(TRAIN.format(model=f"Model{n_classes - 1}"))
    return "".join(parts)


def measure(source: bytes, repeat: int):
    import libcst

    from fsdp2_retrofit.rewrite.pipeline import rewrite_source

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="200,1000,5000,10000,20000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--example", type=Path, default=EXAMPLE)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    from fsdp2_retrofit.rewrite.pipeline import rewrite_source

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
