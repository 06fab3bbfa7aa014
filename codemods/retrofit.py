"""retrofit: every stage, in order, with one option set."""
from __future__ import annotations

from typing import List, Type

import libcst as cst

from fsdp2_retrofit.rewrite.context import RewriteContext
from fsdp2_retrofit.rewrite.imports import add_imports
from fsdp2_retrofit.rewrite.stage import (
    ATTENTION_KEY,
    CHANGES_KEY,
    DEFERRED_IMPORTS_KEY,
    FACTS_KEY,
    IMPORTS_KEY,
    OPTIONS_KEY,
    ORIGINS_KEY,
    CombinedEditor,
    RetrofitStage,
)
from fsdp2_retrofit.syntax.names import Origins

from .accumulation import SyncGradientsOncePerStepCommand
from .batch_coupling import FlagBatchCouplingCommand
from .batch_draws import SplitDrawnBatchesCommand
from .checkpoint import ConvertSavesCommand
from .checkpoint_files import UseCheckpointPathsCommand
from .clipping import ReadGlobalGradNormCommand
from .data import DistributeDataCommand
from .device_placement import PlaceOnRankDeviceCommand
from .forward_calls import ReplaceForwardCallsCommand
from .launch import LaunchDistributedCommand
from .loop_sums import CombineLoopSumsCommand
from .loss_scale import ScaleSummedLossCommand
from .make_dirs import CreateFoldersOnceCommand
from .library_saves import GatherLibrarySavesCommand
from .meta_init import InitOnMetaDeviceCommand
from .migrate_ddp import MigrateDistributedWrappersCommand
from .migrate_fsdp1 import MigrateFsdp1Command
from .migrate_spawn import MigrateSpawnCommand
from .optimizer import MoveOptimizerCommand
from .penalty_reshard import ReshardBeforePenaltyStepCommand
from .rank_decisions import CheckRankDecisionsCommand
from .rank_zero import GateRankZeroCommand
from .resume import ConvertLoadsCommand
from .resume_init import SplitResumeInitCommand
from .handed_models import NameHandedModelsCommand
from .returned_builds import NameReturnedBuildsCommand
from .shard import ShardModelCommand
from .shared_downloads import DownloadOnRankZeroCommand
from .shared_names import ShareRankLocalNamesCommand
from .zero_grad import ClearThroughOptimizerCommand

# Stages in one group plan their edits on the same analysis and are applied in one
# pass: none of them reads what another in its group writes, but for the mesh's name,
# which launch sets on the analysis they share before shard plans (its edits insert
# statements only: shard's sites are the same nodes). launch binds the names (mesh,
# rank, dist) the later groups use: its imports are added right after its group;
# meta_init (only with --meta-init) wraps the build in `with torch.device("meta")` and
# adds to_empty and the re-initialisation after it, so that shard's fully_shard calls
# land between the two; shard writes the fully_shard calls the optimizer and
# forward_calls stages place themselves after.
GROUPS: List[List[Type[RetrofitStage]]] = [
    [MigrateSpawnCommand],  # an mp.spawn launcher becomes a torchrun program
    [MigrateDistributedWrappersCommand],  # DDP/DataParallel go first: the rest sees one plain model
    [MigrateFsdp1Command],  # an FSDP1 script becomes what the others read; its settings become their options
    # `return model, AdamW(...)`, `return DataLoader(...)`, `Trainer(Net().to(device), ...)`: named, so later
    # stages follow them (one edits `return` lines, the other never does)
    [NameReturnedBuildsCommand, NameHandedModelsCommand],
    [SplitResumeInitCommand],  # `if resume: load else: init` splits: the init before fully_shard, the load after
    [InitOnMetaDeviceCommand],
    # one analysis for both: launch tells shard the mesh it builds (ScriptFacts.mesh_name)
    [LaunchDistributedCommand, ShardModelCommand],
    [UseCheckpointPathsCommand],  # a checkpoint saved or loaded through a file object takes the path
    [
        MoveOptimizerCommand,
        ReplaceForwardCallsCommand,
        DistributeDataCommand,
        SplitDrawnBatchesCommand,
        ConvertSavesCommand,
        GatherLibrarySavesCommand,
        ConvertLoadsCommand,
        ReadGlobalGradNormCommand,
        SyncGradientsOncePerStepCommand,
        GateRankZeroCommand,
        CombineLoopSumsCommand,
        CheckRankDecisionsCommand,
        ClearThroughOptimizerCommand,
        ScaleSummedLossCommand,
        CreateFoldersOnceCommand,
        ReshardBeforePenaltyStepCommand,
        FlagBatchCouplingCommand,
        PlaceOnRankDeviceCommand,  # what meets the outputs on the rank's device; no literal GPU 0
    ],
    [ShareRankLocalNamesCommand],  # after the saves run on every rank: a clock-made path they read is rank 0's
    [DownloadOnRankZeroCommand],  # `download=True` datasets: rank 0 first, a barrier, then the others
]


STAGES: List[Type[RetrofitStage]] = [stage for group in GROUPS for stage in group]


class RetrofitCommand(RetrofitStage):
    DESCRIPTION = "Rewrite a single-GPU training script into torchrun-ready FSDP2 (all stages)."
    CODE = "retrofit"

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if self.origins is None:
            self.context.scratch[ORIGINS_KEY] = Origins(tree)
        self.deferred_imports: list = []
        for group in GROUPS:
            tree = self.run_group(group, tree)
        return add_imports(tree, self.deferred_imports, self.carry)

    def stage_context(self) -> RewriteContext:
        """Each stage gets its own context (its imports, its report), sharing the analysis."""
        context = RewriteContext(filename=self.context.filename, full_module_name=self.context.full_module_name)
        context.scratch[OPTIONS_KEY] = self.options
        context.scratch[DEFERRED_IMPORTS_KEY] = self.deferred_imports
        context.scratch[ORIGINS_KEY] = self.origins
        if FACTS_KEY in self.context.scratch:
            context.scratch[FACTS_KEY] = self.context.scratch[FACTS_KEY]
        return context

    def run_stage(self, stage: Type[RetrofitStage], tree: cst.Module) -> cst.Module:
        known = self.context.scratch.get(FACTS_KEY)
        if known is not None and known.module is not tree and not stage.may_edit(known):
            return tree  # nothing for it in the script, said the last analysis: no new one for it
        context = self.stage_context()
        command = stage(context, self.options)
        tree = command.transform_module(tree)
        self.options = getattr(command, "options_for_later", self.options)  # migrate_fsdp1: the wrap's settings
        self.context.scratch[FACTS_KEY] = context.scratch.get(FACTS_KEY)
        self.after_stage(stage, tree, context)
        return tree

    def run_group(self, group: List[Type[RetrofitStage]], tree: cst.Module) -> cst.Module:
        if len(group) == 1:
            return self.run_stage(group[0], tree)
        planned = []
        for stage_class in group:
            context = self.stage_context()
            stage = stage_class(context, self.options)
            planned.append((stage_class, context, stage.plan(tree, stage.facts_for(tree))))
            self.context.scratch[FACTS_KEY] = context.scratch[FACTS_KEY]
        editor = CombinedEditor([e for _, _, e in planned])
        editor.origins = self.origins
        facts = self.context.scratch.get(FACTS_KEY)
        editor.resolver = facts.resolver if facts is not None and facts.module is tree else None
        new_tree = tree.visit(editor) if editor.has_work() else tree
        now = []  # the imports whose names the later groups' analysis must resolve
        for i, (stage_class, context, _) in enumerate(planned):
            needed = context.scratch.get(IMPORTS_KEY, [])
            (now if stage_class.LATER_STAGES_READ_IMPORTS else self.deferred_imports).extend(needed)
            self.after_stage(stage_class, new_tree if i == len(planned) - 1 else tree, context)
        return add_imports(new_tree, now, self.carry) if now else new_tree

    def after_stage(self, stage, tree: cst.Module, context: RewriteContext) -> None:
        for key in (CHANGES_KEY, ATTENTION_KEY):
            self.context.scratch.setdefault(key, []).extend(context.scratch.get(key, []))
