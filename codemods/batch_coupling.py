"""batch_coupling: report an objective that couples the samples of a batch (analysis/batch_coupling.py),
where the rewrite splits the batches between the ranks: each rank computes it over its own part."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.batch_coupling import batch_couplings
from fsdp2_retrofit.analysis.data_split import training_data_split
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor


class FlagBatchCouplingCommand(RetrofitStage):
    DESCRIPTION = "Report a loss term that couples the samples of a batch (a batch-by-batch matrix, a batch statistic, a class-weighted mean)."
    CODE = "batch_coupling"

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if not facts.models:
            return
        couplings = batch_couplings(facts)
        if not couplings or training_data_split(facts).split is False:
            return
        for coupling in couplings:
            if coupling.kind == "normalizer":
                self.attention(
                    coupling.node,
                    f"{coupling.what}; each rank divides by its own part's total (batch_size / world_size "
                    "samples), not the global batch's",
                    "FSDP2 averages the ranks' gradients: with class weights the single run's loss is "
                    "sum(w[y] * loss) / sum(w[y]) over the whole batch, the distributed one the mean over the ranks "
                    "of each part's ratio; they agree only when every rank's targets carry the same total weight. "
                    "Keep it if that is close enough; otherwise use reduction=\"sum\", all-reduce the batch's "
                    "total weight and divide by it",
                    differs=True,
                )
                continue
            self.attention(
                coupling.node,
                f"{coupling.what}; each rank computes it over its own part of the batch "
                "(batch_size / world_size samples), not over the global batch",
                "FSDP2 averages the ranks' gradients, which is the global batch's gradient only for a mean of "
                "per-sample terms; here a sample's term reads the other samples of its batch (contrastive "
                "negatives, a pull-away term, a relativistic average, a batch statistic), so the objective itself "
                "changes with the number of ranks. Keep it as is if per-rank batches are what you want; otherwise "
                "all-gather the tensor across ranks before this line (with its gradient: "
                "torch.distributed.nn.functional.all_gather) or all-reduce the statistic",
                differs=True,
            )
