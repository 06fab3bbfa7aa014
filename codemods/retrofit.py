"""retrofit: every stage, in order, with one option set."""
from __future__ import annotations

from typing import List, Type

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor

from fsdp2_retrofit.analysis import code
from fsdp2_retrofit.imports import place_added_imports
from fsdp2_retrofit.stage import (
    ATTENTION_KEY,
    CHANGES_KEY,
    DEFERRED_IMPORTS_KEY,
    FACTS_KEY,
    OPTIONS_KEY,
    RetrofitStage,
)

from .checkpoint import ConvertSavesCommand
from .data import DistributeDataCommand
from .forward_calls import ReplaceForwardCallsCommand
from .launch import LaunchDistributedCommand
from .optimizer import MoveOptimizerCommand
from .rank_zero import GateRankZeroCommand
from .shard import ShardModelCommand

STAGES: List[Type[RetrofitStage]] = [
    LaunchDistributedCommand,
    ShardModelCommand,
    MoveOptimizerCommand,
    ReplaceForwardCallsCommand,
    DistributeDataCommand,
    ConvertSavesCommand,
    GateRankZeroCommand,
]


class RetrofitCommand(RetrofitStage):
    DESCRIPTION = "Rewrite a single-GPU training script into torchrun-ready FSDP2 (all stages)."
    CODE = "retrofit"

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        original_imports = {code(s) for s in tree.body}
        self.deferred_imports: list = []
        for stage in STAGES:
            tree = self.run_stage(stage, tree)
        if self.deferred_imports:
            context = CodemodContext(filename=self.context.filename)
            context.scratch[AddImportsVisitor.CONTEXT_KEY] = self.deferred_imports
            tree = AddImportsVisitor(context).transform_module(tree)
        return place_added_imports(tree, original_imports)

    def run_stage(self, stage: Type[RetrofitStage], tree: cst.Module) -> cst.Module:
        """One stage with its own context (imports are added per stage), sharing the report."""
        context = CodemodContext(filename=self.context.filename, full_module_name=self.context.full_module_name)
        context.scratch[OPTIONS_KEY] = self.options
        context.scratch[DEFERRED_IMPORTS_KEY] = self.deferred_imports
        if FACTS_KEY in self.context.scratch:
            context.scratch[FACTS_KEY] = self.context.scratch[FACTS_KEY]
        tree = stage(context, self.options).transform_module(tree)
        self.context.scratch[FACTS_KEY] = context.scratch.get(FACTS_KEY)
        self.after_stage(stage, tree, context)
        return tree

    def after_stage(self, stage, tree: cst.Module, context: CodemodContext) -> None:
        for key in (CHANGES_KEY, ATTENTION_KEY):
            self.context.scratch.setdefault(key, []).extend(context.scratch.get(key, []))
