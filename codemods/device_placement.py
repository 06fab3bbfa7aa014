"""device_placement: every tensor that meets the model's outputs lives on the rank's device.

A script that names no device ran on the CPU. Rewritten, on a GPU it gets NCCL and a CUDA
mesh; `fully_shard` moves the parameters to the GPU and the root's pre-forward moves the
forward's own inputs there, nothing else: the targets, the labels a loop builds, a mask
made by a factory stay on the CPU and the first loss raises, and `.numpy()` of an output
raises on a CUDA tensor (the torch source behind this: analysis/device_placement.py). So:

- a `device` (`torch.device("cuda" if torch.cuda.is_available() else "cpu")`: after the
  preamble's `set_device(local_rank)`, "cuda" is the rank's GPU; without CUDA the CPU, as
  before) is defined once in each function that needs it, before its first use;
- the loop's batch is moved at the loop's head (`x, y = x.to(device), y.to(device)`; a dict
  or a tuple batch element by element), a value taken from a batch or from a tensor made
  elsewhere where it is bound (`y = batch["y"].to(device)`);
- deterministic factories (`torch.ones(n, 1)`) get `device=device`; random ones draw on the
  CPU as before and move (`torch.randn(n).to(device)`), so the numbers are the original's;
- `.numpy()` of an output-derived value gets `.cpu()` first.

What cannot be followed is reported at its line. A literal device 0 (`device = 0`,
`.to(0)`, `.cuda(0)`, "cuda:0", `torch.device("cuda", 0)`) puts every rank on GPU 0: it
becomes the rank's device, in any script. Scripts that place their tensors themselves are
left as they are."""
from __future__ import annotations

from typing import Dict, List, Optional

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.device_placement import (
    RANDOM_FACTORIES,
    Placement,
    device_free,
    literal_devices,
    placements,
)
from fsdp2_retrofit.rewrite.edit import with_keyword
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.names import code, is_main_guard

DEVICE = 'torch.device("cuda" if torch.cuda.is_available() else "cpu")'
LOCAL_RANK = 'int(os.environ.get("LOCAL_RANK", 0))'


def _to(value: cst.BaseExpression, device: str, method: str = "to") -> cst.Call:
    args = [cst.Arg(cst.Name(device))] if device else []
    return cst.Call(func=cst.Attribute(value=value, attr=cst.Name(method)), args=args)


class PlaceOnRankDeviceCommand(RetrofitStage):
    DESCRIPTION = "Put every tensor that meets the model's outputs on the rank's device; no literal GPU 0."
    CODE = "device_placement"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not facts.models:
            return
        self._literal_devices(facts, editor)
        if facts.distributed_init is None or not device_free(facts.resolver, self.origins):
            return
        found, unfollowed = placements(facts)
        names = self._define_devices(found, facts, editor)
        self._edit_placements(found, names, facts, editor)
        for miss in unfollowed:
            self.attention(
                miss.node,
                f"`{miss.name}` meets the model's output at `{code(miss.node).strip()[:60]}`; the rewrite does not "
                "move it to the rank's device",
                f"{miss.why}. On a GPU the outputs are CUDA tensors (fully_shard moves only the forward's inputs): "
                f"move `{miss.name}` with `.to(device)` where it is made, or the step raises a device mismatch",
            )

    # -- the device a function reads ------------------------------------------------

    def _define_devices(self, found: List[Placement], facts: ScriptFacts, editor) -> Dict[int, str]:
        """`device = torch.device(...)` in each scope that needs one, before its first placement."""
        r = facts.resolver
        first: Dict[int, Placement] = {}
        for p in found:
            if p.kind == "numpy":
                continue
            known = first.get(id(p.scope))
            if known is None or r.order(p.node) < r.order(known.node):
                first[id(p.scope)] = p
        names = {}
        for key, p in first.items():
            name = self.fresh_name("device", p.scope)
            names[key] = name
            anchor = self._anchor(p.node, p.scope, facts)
            editor.insert_before(anchor, [self.stmt(f"{name} = {DEVICE}\n")])
            self.add_import("torch")
            self.change(
                anchor,
                f"`{name} = {DEVICE}`: the rank's device",
                "the script names no device; after set_device(local_rank) \"cuda\" is the rank's own GPU, and "
                "without CUDA the script runs on the CPU as before",
            )
        return names

    def _anchor(self, node, scope, facts: ScriptFacts):
        """The statement of the scope's own block (a function's body, the module, the main guard's
        body) that holds `node`."""
        r = facts.resolver
        stmt = None
        for anc in [node, *r.ancestors(node)]:
            if isinstance(anc, cst.BaseStatement):
                stmt = anc
            parent = r.parent(anc)
            if isinstance(anc, (cst.BaseStatement,)) and (
                isinstance(parent, cst.Module)
                or (isinstance(parent, cst.IndentedBlock) and (r.parent(parent) is scope
                                                               or is_main_guard(r.parent(parent))))
            ):
                return anc
        return stmt

    # -- the edits ------------------------------------------------------------------

    def _edit_placements(self, found: List[Placement], names: Dict[int, str], facts: ScriptFacts, editor) -> None:
        loops: Dict[int, List[Placement]] = {}
        unpacked: Dict[int, List[Placement]] = {}
        for p in found:
            device = names.get(id(p.scope))
            if p.kind == "loop":
                loops.setdefault(id(p.node), []).append(p)
            elif p.kind == "unpacked":
                unpacked.setdefault(id(p.node), []).append(p)
            elif p.kind == "factory":
                self._factory(p, device, editor)
            elif p.kind == "binding":
                small = p.node.body[0]
                editor.replace_expression(small.value, lambda u, d=device: _to(u, d))
                self.change(
                    p.node,
                    f"`{p.names[0]}` is moved to `{device}` where it is bound",
                    f"it meets the model's output at `{code(p.meets).strip()[:60]}`; fully_shard moves only the "
                    "forward's inputs to the GPU",
                    "a device mismatch at the first step on a GPU",
                )
            elif p.kind == "use":
                editor.replace_expression(p.node, lambda u, d=device: _to(u, d))
                self.change(
                    p.node,
                    f"`{p.names[0]}` is moved to `{device}` where it meets the model's output",
                    f"a comprehension's batch, read at `{code(p.meets).strip()[:60]}`; fully_shard moves only the "
                    "forward's inputs to the GPU",
                    "a device mismatch on a GPU",
                )
            elif p.kind == "numpy":
                editor.replace_expression(p.node.func.value, lambda u: _to(u, "", "cpu"))
                self.change(
                    p.node,
                    "`.cpu()` before `.numpy()` of a value on the rank's device (the model's output, or moved there)",
                    "on a GPU the output is a CUDA tensor, which has no numpy view",
                    "TypeError: can't convert cuda tensor to numpy",
                )
        for group in loops.values():
            self._loop(group, names.get(id(group[0].scope)), editor)
        for group in unpacked.values():
            stmt, device = group[0].node, names.get(id(group[0].scope))
            moved = sorted({p.names[0] for p in group}, key=code(stmt).index)
            editor.insert_after(stmt, [self._moves(moved, device)])
            self.change(
                stmt,
                f"{', '.join(f'`{n}`' for n in moved)} moved to `{device}` after the batch is unpacked",
                f"they meet the model's output at `{code(group[0].meets).strip()[:60]}`; fully_shard moves only "
                "the forward's inputs to the GPU",
                "a device mismatch at the first step on a GPU",
            )

    def _moves(self, moved: List[str], device: str):
        return self.stmt(f"{', '.join(moved)} = {', '.join(f'{n}.to({device})' for n in moved)}\n")

    def _loop(self, group: List[Placement], device: str, editor) -> None:
        loop = group[0].node
        order = [n for n in _target_names(loop.target)]
        tensors = [n for n in order if any(p.names[0] == n and p.shape == "tensor" for p in group)]
        new = [self._moves(tensors, device)] if tensors else []
        for p in group:
            if p.shape == "dict":
                n = p.names[0]
                new.append(self.stmt(f"{n} = {{k: v.to({device}) if torch.is_tensor(v) else v for k, v in {n}.items()}}\n"))
            elif p.shape == "sequence":
                n = p.names[0]
                new.append(self.stmt(f"{n} = [t.to({device}) if torch.is_tensor(t) else t for t in {n}]\n"))
        if not isinstance(loop.body, cst.IndentedBlock):
            self.attention(loop, "the loop's batch is not moved to the rank's device (a one-line loop body)",
                           "put the body on its own lines and rewrite again")
            return
        editor.insert_before(loop.body.body[0], new)
        moved = [p.names[0] for p in group]
        self.change(
            loop,
            f"the loop's {', '.join(f'`{n}`' for n in moved)} moved to `{device}` at the loop's head",
            f"{'it meets' if len(moved) == 1 else 'they meet'} the model's output (at "
            f"`{code(group[0].meets).strip()[:60]}`); fully_shard moves only the forward's inputs to the GPU",
            "a device mismatch at the first step on a GPU",
        )

    def _factory(self, p: Placement, device: str, editor) -> None:
        call = p.node
        qnames = self.facts.resolver.qnames(call.func) | self.facts.resolver.qnames(call)
        if qnames & RANDOM_FACTORIES:
            editor.replace_expression(call, lambda u: _to(u, device))
            what = f"`{code(call)}` drawn as before, then moved to `{device}`"
            why = "it meets the model's output; drawn on the CPU generator it keeps the original's numbers"
        else:
            editor.replace_expression(call, lambda u: with_keyword(u, "device", cst.Name(device)))
            what = f"`{code(call)}` made on `{device}`"
            why = "it meets the model's output; fully_shard moves only the forward's inputs to the GPU"
        self.change(call, what, f"{why} (at `{code(p.meets).strip()[:60]}`)", "a device mismatch on a GPU")

    def _literal_devices(self, facts: ScriptFacts, editor) -> None:
        for lit in literal_devices(facts):
            node = lit.node
            if lit.kind == "string":
                editor.replace_expression(node, lambda u: u.with_changes(value=u.value.replace("cuda:0", "cuda")))
                what = '"cuda:0" -> "cuda"'
            elif lit.kind == "cuda_call":
                editor.replace_expression(node, lambda u: u.with_changes(args=[]))
                what = "`.cuda(0)` -> `.cuda()`"
            elif lit.kind == "device_call":
                editor.replace_expression(
                    node, lambda u: u.with_changes(args=[u.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)]))
                what = '`torch.device("cuda", 0)` -> `torch.device("cuda")`'
            else:
                local = self._local_rank(node, facts)
                if local is None:
                    local = LOCAL_RANK
                    self.add_import("os")
                editor.replace_expression(node, lambda u, t=local: self.expr(t))
                what = f"the device index 0 -> `{local}`"
            self.change(
                node,
                what + ": the rank's own GPU",
                "after set_device(local_rank) \"cuda\" and `.cuda()` mean the rank's GPU; a literal 0 means GPU 0 on "
                "every rank",
                "every rank on GPU 0 (hang or OOM)",
            )

    def _local_rank(self, node, facts: ScriptFacts) -> Optional[str]:
        """The preamble's local-rank name where `node` reads it (its function, after it)."""
        r = facts.resolver
        fn = r.enclosing_function(node)
        for stmt in r.nodes(cst.SimpleStatementLine):
            if r.enclosing_function(stmt) is not fn or r.order(stmt) > r.order(node):
                continue
            small = stmt.body[0]
            if type(small) is cst.Assign and len(small.targets) == 1 and type(small.targets[0].target) is cst.Name \
                    and "LOCAL_RANK" in code(small.value):
                return small.targets[0].target.value
        return None


def _target_names(target) -> List[str]:
    if type(target) in (cst.Tuple, cst.List):
        return [n for el in target.elements for n in _target_names(el.value)]
    return [target.value] if type(target) is cst.Name else []
