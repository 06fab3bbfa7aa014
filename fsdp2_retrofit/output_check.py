"""The rewritten script checked for run-time crashes no stage rewrites, and for a save no stage converted.

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

The same way, FSD102 (`torch.save` of a sharded module's or optimizer's state) runs on an output that
calls a save and names a state dict: the checkpoint stage converts every save it connects to the sharded
model; one it does not (a holder or a record it cannot follow) would leave each rank pickling its own
shards to one file, silently. A finding becomes an attention item with `differs` (measured: 11-17 % of
a rewrite's CPU on the example and 1000-line scripts).
"""
from __future__ import annotations

from typing import List

import libcst as cst

from fsdp2_retrofit.report import Attention
from fsdp2_retrofit.syntax.names import Origins


_NUMPY_WHY = (
    "this line ran on one GPU; after fully_shard it raises at run time (on the first step that reaches it). Gather "
    "the values with `.full_tensor()` on every rank (a collective: not inside a rank-0 branch), or compute them in "
    "forward")
_SAVE_WHY = (
    "no stage converted this save: after fully_shard each rank pickles its own shards to the same path (the last "
    "writer wins) and the file cannot be loaded as the model. Save with torch.distributed.checkpoint on every rank "
    "(dcp.save of get_model_state_dict(model)), or gather with get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True)) on every rank and torch.save it on rank 0")


def crashes_in_output(module: cst.Module, data: bytes, path: str, origins: Origins) -> List[Attention]:
    """Attention items for what FSD117 (a shard's `.numpy()`) and FSD102 (`torch.save` of sharded state:
    the safety net under the checkpoint stage) find in the rewritten `module` (`data`: its bytes)."""
    rules = []
    if b".numpy()" in data or b".tolist()" in data:
        from fsdp2_retrofit.check.rules.param_tensor import ShardedParamTensor

        rules.append((ShardedParamTensor, _NUMPY_WHY))
    if b"save(" in data and b"state_dict" in data:
        from fsdp2_retrofit.check.rules.torch_save_dtensor import TorchSaveDTensor

        rules.append((TorchSaveDTensor, _SAVE_WHY))
    if not rules:
        return []  # before the imports: a rewrite that cannot hit the rules does not load check's code
    from fsdp2_retrofit.check.lint import LintContext

    ctx = LintContext(module, path, origins)
    out: List[Attention] = []
    seen = set()
    for rule, why in rules:
        for node, fields, _ in rule().check(ctx):
            line = ctx.resolver.line(node)
            what = rule.MESSAGE.format(**fields)
            if (line, what) in seen:
                continue
            seen.add((line, what))
            out.append(Attention(line, "check", f"{rule.CODE}: {what}", why, differs=True))
    return out
