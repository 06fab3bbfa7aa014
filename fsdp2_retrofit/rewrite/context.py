"""The state one rewrite shares between its stages.

`RewriteContext` has the fields of libcst's `CodemodContext`, so either can be
given to a stage (libcst's `CodemodTest` passes its own) and libcst's import
visitors accept ours; it is defined here because importing `libcst.codemod`
loads `libcst.matchers`, most of the tool's start-up time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class RewriteContext:
    warnings: List[str] = field(default_factory=list)
    # what stages hand each other (fsdp2_retrofit.rewrite.stage's *_KEY entries)
    scratch: Dict[str, Any] = field(default_factory=dict)
    filename: Optional[str] = None
    full_module_name: Optional[str] = None
    full_package_name: Optional[str] = None
    wrapper: Any = None  # a libcst MetadataWrapper while libcst's visitors run
    metadata_manager: Any = None

    @property
    def module(self):
        return None if self.wrapper is None else self.wrapper.module
