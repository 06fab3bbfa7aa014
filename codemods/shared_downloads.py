"""shared_downloads: a dataset built with `download=True` downloads on rank 0 alone.

Every rank would run `datasets.MNIST(root, download=True)` at once: each finds the files
missing and fetches them into the same folder, writing the same files together. Rank 0
builds it first (downloading), then the others build it from the files it wrote:

    if rank != 0:
        dist.barrier()  # rank 0 downloads first
    train_set = datasets.MNIST(root, train=True, download=True)
    if rank == 0:
        dist.barrier()  # the files are there: the other ranks read them

Each rank calls `barrier` exactly once (rank 0 after building, the others before), so
the two calls meet; consecutive such statements share one pair. On several nodes without
a shared file system the other nodes' ranks find no files and download for themselves
(torchvision then writes on one node per... no: on each of them at once): the report says
so. A download inside a Dataset class's `__init__` or a top-level function of the script gets
the pair around each statement that builds that class or calls that function, followed outward
(analysis/downloads.py). Where no rank test can go (before the process group starts, a function
whose callers are not known), the file is refused at the dataset's line, with that reason."""
from __future__ import annotations

from typing import List

import libcst as cst

from fsdp2_retrofit.analysis import ScriptFacts
from fsdp2_retrofit.analysis.checkpoints import rank_gate
from fsdp2_retrofit.analysis.downloads import DownloadSite, download_sites
from fsdp2_retrofit.rewrite.stage import RetrofitStage, StatementEditor
from fsdp2_retrofit.syntax.names import code


class DownloadOnRankZeroCommand(RetrofitStage):
    DESCRIPTION = "Let rank 0 download a `download=True` dataset before the other ranks build it."
    CODE = "shared_downloads"

    @classmethod
    def may_edit(cls, earlier: ScriptFacts) -> bool:
        """Only a call the user wrote with `download=` can download (no stage writes one), here or in
        the `__init__` of a sibling module's Dataset this file builds."""
        return any(a.keyword is not None and a.keyword.value == "download"
                   for call in earlier.resolver.nodes(cst.Call) for a in call.args) or bool(download_sites(earlier))

    def edit(self, tree: cst.Module, facts: ScriptFacts, editor: StatementEditor) -> None:
        if facts.distributed_init is None:
            return
        for run in self._runs(download_sites(facts), facts):
            first, last = run[0], run[-1]
            if any(rank_gate(site.stmt, facts) is not None for site in run):
                continue  # built on rank 0 alone already: nobody races it
            if _barrier_around(first.stmt, facts):
                continue  # the script (or an earlier rewrite) already lets one rank go first
            test = self.rank_zero_test(first.stmt, facts)
            if test is None or not test.endswith(" == 0"):
                self.refuse("FSR637", first.call, *self._unplaced(first),
                            "build the dataset after the process group starts (in the function that starts it), or "
                            "download it before the run (download=False in the script)")
                continue
            other = test[: -len(" == 0")] + " != 0"
            editor.insert_before(first.stmt, [self.stmt(f"if {other}:\n    dist.barrier()  # rank 0 downloads first\n")])
            editor.insert_after(last.stmt, [self.stmt(
                f"if {test}:\n    dist.barrier()  # the files are there: the other ranks read them\n"
            )])
            self.add_import("torch.distributed", asname="dist")
            names = ", ".join(dict.fromkeys(
                s.dataset.rsplit(".", 1)[-1] if s.via is None else f"`{_callee(s.via)}(...)` builds {s.dataset.rsplit('.', 1)[-1]}"
                for s in run))
            self.change(
                first.stmt,
                f"{names} (`download=...`): rank 0 builds it first, the other ranks after a barrier",
                "every rank would find the files missing and download into the same folder at once; each rank "
                "calls barrier once (rank 0 after, the others before), so the calls meet",
                "ranks writing the same archive together: a truncated file, a rank reading one still written",
            )

    def _unplaced(self, site: DownloadSite) -> tuple:
        """(what, why) of a download no rank test can go around."""
        what = f"`{code(site.call)}` downloads on every rank at once"
        if site.unplaced is not None:
            return (f"{what}, in `{site.unplaced.name.value}`, whose callers are not known",
                    "every rank finds the files missing and downloads into the same folder together; the barriers that "
                    "let rank 0 download first go around the call that runs it, and no call of "
                    f"`{site.unplaced.name.value}` was found in this file")
        if site.via is not None:
            return (f"{what}: `{code(site.via)}` (line {self.line(site.via)}) runs it before the process group starts",
                    "every rank finds the files missing and downloads into the same folder together; rank 0 can "
                    "download first and the others wait for it only once the process group runs")
        return (f"{what}, before the process group starts",
                "every rank finds the files missing and downloads into the same folder together; rank 0 can "
                "download first and the others wait for it only once the process group runs")

    def _runs(self, sites: List[DownloadSite], facts: ScriptFacts) -> List[List[DownloadSite]]:
        """The sites grouped by consecutive statements of one block (one barrier pair each)."""
        runs: List[List[DownloadSite]] = []
        seen = set()
        for site in sites:
            if id(site.stmt) in seen:
                continue
            seen.add(id(site.stmt))
            if runs:
                prev = runs[-1][-1].stmt
                block = facts.resolver.block_of(prev)
                body = list(getattr(block, "body", ()))
                if site.stmt in body and prev in body and body.index(site.stmt) == body.index(prev) + 1:
                    runs[-1].append(site)
                    continue
            runs.append([site])
        return runs


def _barrier_around(stmt, facts: ScriptFacts) -> bool:
    """The statement before `stmt` in its block is an `if` holding a barrier (a second rewrite)."""
    r = facts.resolver
    body = list(getattr(r.block_of(stmt), "body", ()))
    if stmt not in body or body.index(stmt) == 0:
        return False
    before = body[body.index(stmt) - 1]
    return isinstance(before, cst.If) and any(
        r.is_call_to(c, {"torch.distributed.barrier"}) for c in r.descendants(before, cst.Call)
    )


def _callee(call: cst.Call) -> str:
    """`Pairs` of `Pairs(root)`, `data.Pairs` of `data.Pairs(root)`."""
    return code(call.func)
