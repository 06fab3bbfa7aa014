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
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
{rank}, {world_size} = dist.get_rank(), dist.get_world_size()
{mesh} = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", ({world_size},))
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
        preamble = cst.parse_module(PREAMBLE.format(**names), config=self.config).body
        editor.insert_paragraph_before(anchor, preamble, first_in_block=anchor is block.body[0])
        editor.append_to(block, [self.stmt("dist.destroy_process_group()\n")])
        self.add_import("os")
        self.add_import("torch")
        self.add_import("torch.distributed", asname="dist")
        self.add_import("torch.distributed.device_mesh", "init_device_mesh")
        self.change(
            anchor,
            "read LOCAL_RANK, set the CUDA device, init the process group (nccl, or gloo without CUDA), "
            "build a 1-D device mesh over all ranks",
            "torchrun starts one process per GPU; each must pick its own device before any CUDA work",
            "every rank on GPU 0 (hang or OOM) when set_device is missing",
        )
        self.change(block.body[-1], "destroy the process group at the end", "a clean exit under torchrun")

    def _first_torch_statement(self, block, facts: ScriptFacts):
        """The first statement of the entry block that touches torch or builds the model."""
        model_names = {m.name for m in facts.models}
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
