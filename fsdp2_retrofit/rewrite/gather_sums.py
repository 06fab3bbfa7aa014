"""The statements that combine numbers each rank summed over its own part of the data: one
`all_gather_object` for them all (a collective per value is a wait per value; a Python
object needs no device, under nccl or gloo, and an int count stays an int), then each
number's sum over the ranks, divided by the world size where each term was a batch mean.
Every rank sums the same gathered list in the same order: the result is the same on every
rank. Used by the log stage (codemods/rank_zero.py, at a print) and the loop-sums stage
(codemods/loop_sums.py, after the loop)."""
from __future__ import annotations

from typing import Dict, List, Tuple


def gather_sums(ranks: str, sums: List[Tuple[str, str]], targets: Dict[str, str]) -> List[str]:
    """Source lines: gather every rank's `sums` ((name, "sum" | "mean")) into `ranks`, then
    bind `targets[name]` to the figure over the ranks."""
    one = len(sums) == 1
    value = sums[0][0] if one else "(" + ", ".join(n for n, _ in sums) + ")"
    lines = [
        f"{ranks} = [None] * dist.get_world_size()\n",
        f"dist.all_gather_object({ranks}, {value})  # every rank's own {'sum' if one else 'sums'}\n",
    ]
    for i, (name, kind) in enumerate(sums):
        each = ranks if one else f"r[{i}] for r in {ranks}"
        lines.append(f"{targets[name]} = sum({each}) / dist.get_world_size()\n" if kind == "mean"
                     else f"{targets[name]} = sum({each})\n")
    return lines
