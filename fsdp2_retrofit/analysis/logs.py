"""Log statements (print, logger calls, stdout writes) and whether a rank test gates them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import libcst as cst

from .site_analysis import Scope, SiteAnalysis
from fsdp2_retrofit.syntax.names import Resolver, root_name
from fsdp2_retrofit.syntax.rank import mentions_rank


LOG_CALLS = {"print"}
WRITE_CALLS = {"sys.stdout.write", "sys.stderr.write", "tqdm.tqdm.write", "tqdm.auto.tqdm.write"}
LOGGER_METHODS = {"debug", "info", "warning", "warn", "error", "critical", "exception", "log"}


@dataclass
class LogSite:
    stmt: cst.SimpleStatementLine
    scope: Scope
    gated: bool


class LogAnalysis(SiteAnalysis):
    """Finds the log statements."""

    def _logs(self, stmts, rank_name) -> List[LogSite]:
        out = []
        for stmt in stmts:
            if not all(type(s) is cst.Expr and self._is_log_call(s.value) for s in stmt.body):
                continue
            cls = self.r.enclosing_class(stmt)
            if cls is not None and (self.classes.is_module_class(cls.name.value)
                                    or self.r.enclosing_function(stmt) is None):
                continue  # a module's own prints, a class body: left to the script (a trainer's methods are not)
            out.append(
                LogSite(
                    stmt=stmt,
                    scope=self.r.enclosing_function(stmt) or self.module,
                    gated=self._is_rank_gated(stmt),
                )
            )
        return out

    def _is_log_call(self, node) -> bool:
        if not isinstance(node, cst.Call):
            return False
        if isinstance(node.func, cst.Name) and node.func.value in LOG_CALLS:
            return True
        if self.r.qnames(node) & WRITE_CALLS:
            return True
        if isinstance(node.func, cst.Attribute) and node.func.attr.value in LOGGER_METHODS:
            base = node.func.value
            if any(q.startswith("logging") for q in self.r.qnames(base)):
                return True
            base_name = root_name(base)
            return bool(base_name) and ("log" in base_name.lower())
        return False

    def _is_rank_gated(self, node) -> bool:
        for anc in self.r.ancestors(node):
            if isinstance(anc, (cst.If,)) and mentions_rank(anc.test):
                return True
            if isinstance(anc, cst.FunctionDef):
                return False
        return False


def log_sites(module: cst.Module, resolver: Resolver) -> List[LogSite]:
    """The statements of a script that only log (outside classes)."""
    return LogAnalysis(module, resolver)._logs(resolver.nodes(cst.SimpleStatementLine), None)
