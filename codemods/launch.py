"""launch: make the script a torchrun program (process group, device, mesh)."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.names import is_main_guard, names_in
from fsdp2_retrofit.stage import RetrofitStage, StatementEditor

PREAMBLE = """\
{local_rank} = int(os.environ["LOCAL_RANK"])
if torch.cuda.is_available():
    torch.cuda.set_device({local_rank})
dist.init_process_group({backend} if torch.cuda.is_available() else "gloo")
{rank}, {world_size} = dist.get_rank(), dist.get_world_size()
"""
MESH = """{mesh} = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", ({world_size},))\n"""
# HSDP: a named 2-D mesh, replicas x shards; fully_shard replicates over dim 0 and shards over dim 1
HSDP_MESH = """\
assert {world_size} % {replicas} == 0, "HSDP: the number of ranks must be a multiple of {replicas} replicas"
{mesh} = init_device_mesh(
    "cuda" if torch.cuda.is_available() else "cpu",
    ({replicas}, {world_size} // {replicas}),
    mesh_dim_names=("replicate", "shard"),
)
"""


class LaunchDistributedCommand(RetrofitStage):
    DESCRIPTION = "Start a process group and a device mesh where the model is built; tear it down at the end."
    CODE = "launch"
    LATER_STAGES_READ_IMPORTS = True  # they find the mesh, rank and fully_shard by name

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if facts.distributed_init is not None or facts.entry_block is None:
            return
        block = facts.entry_block
        anchor = self._first_torch_statement(block, facts)
        names = {
            key: self.fresh_name(key, facts.entry_scope)
            for key in ("local_rank", "rank", "world_size", "mesh")
        }
        # with CPU offload the optimizer step and clipping run on CPU tensors: they need gloo too
        backend = '"cpu:gloo,cuda:nccl"' if self.options.cpu_offload else '"nccl"'
        mesh = HSDP_MESH if self.options.hsdp else MESH
        text = (PREAMBLE + mesh).format(backend=backend, replicas=self.options.hsdp, **names)
        preamble = cst.parse_module(text, config=self.config).body
        editor.insert_paragraph_before(anchor, preamble, first_in_block=anchor is block.body[0])
        editor.append_to(block, [self.stmt("dist.destroy_process_group()\n")])
        self.add_import("os")
        self.add_import("torch")
        self.add_import("torch.distributed", asname="dist")
        self.add_import("torch.distributed.device_mesh", "init_device_mesh")
        self.change(
            anchor,
            "read LOCAL_RANK, set the CUDA device, init the process group ("
            + ("cpu:gloo,cuda:nccl for CPU offload" if self.options.cpu_offload else "nccl")
            + ", or gloo without CUDA), "
            + (f"build a 2-D (replicate, shard) device mesh of {self.options.hsdp} replicas for HSDP"
               if self.options.hsdp else "build a 1-D device mesh over all ranks"),
            "torchrun starts one process per GPU; each must pick its own device before any CUDA work",
            "every rank on GPU 0 (hang or OOM) when set_device is missing",
        )
        self.change(block.body[-1], "destroy the process group at the end", "a clean exit under torchrun")

    def _first_torch_statement(self, block, facts: ScriptFacts):
        """The first statement of the entry block that touches torch or builds the model."""
        model_names = {m.name for m in facts.models + facts.copies + facts.frozen_models}
        for stmt in block.body:
            if isinstance(stmt, (cst.Import, cst.ImportFrom, cst.FunctionDef, cst.ClassDef)):
                continue
            if isinstance(stmt, cst.SimpleStatementLine) and all(
                isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
            ):
                continue
            if _is_docstring(stmt) or is_main_guard(stmt):
                continue
            if _touches_torch(stmt, facts) or names_in(stmt) & model_names:
                return stmt
        return facts.models[0].stmt


def _touches_torch(stmt, facts: ScriptFacts) -> bool:
    found = []

    class _T(cst.CSTVisitor):
        def visit_Name(self, node: cst.Name) -> None:
            if any(q == "torch" or q.startswith("torch.") for q in facts.resolver.qnames(node)):
                found.append(node)

    stmt.visit(_T())
    return bool(found)


def _is_docstring(stmt) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )
