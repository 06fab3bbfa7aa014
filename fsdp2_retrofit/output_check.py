"""The rewritten script checked for run-time crashes no stage rewrites.

Some code is correct on one GPU and raises only once the model is sharded, and no
stage can fix it safely: `.numpy()` of a parameter outside forward (a DTensor
shard has none), a plain tensor mixed with one (FSD117). A fix needs
`.full_tensor()`, a collective that every rank must join, placed by a person (a
logging line is often gated to rank 0, where it would hang). The rewrite must not
stay silent about it either: the lint rule that knows the pitfall runs on the
output, and each finding becomes an attention item at the user's line. It runs
only when the output calls `.numpy()` or `.tolist()` (what the rule's first arm
looks for; its other arm, arithmetic mixing parameters with plain tensors, is then
reported too): a rewrite of a script without them costs nothing more
(benchmarks/rewrite_speed.py measures a rewrite against a bare parse; the target is 3x).
"""
from __future__ import annotations

from typing import List

import libcst as cst

from fsdp2_retrofit.report import Attention
from fsdp2_retrofit.syntax.names import Origins


def crashes_in_output(module: cst.Module, data: bytes, path: str, origins: Origins) -> List[Attention]:
    """Attention items for what FSD117 finds in the rewritten `module` (`data`: its bytes)."""
    if b".numpy()" not in data and b".tolist()" not in data:
        return []  # before the imports: a rewrite that cannot hit the rule does not load check's code
    from fsdp2_retrofit.check.lint import LintContext
    from fsdp2_retrofit.check.rules.param_tensor import ShardedParamTensor as rule

    ctx = LintContext(module, path, origins)
    out: List[Attention] = []
    seen = set()
    for node, fields, _ in rule().check(ctx):
        line = ctx.resolver.line(node)
        if (line, fields["what"]) in seen:
            continue
        seen.add((line, fields["what"]))
        out.append(Attention(
            line,
            "check",
            f"{rule.CODE}: {rule.MESSAGE.format(**fields)}",
            "this line ran on one GPU; after fully_shard it raises at run time (on the first step that reaches "
            "it). Gather the values with `.full_tensor()` on every rank (a collective: not inside a rank-0 "
            "branch), or compute them in forward",
            differs=True,
        ))
    return out
