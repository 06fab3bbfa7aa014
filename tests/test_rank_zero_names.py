"""rank_zero_names: a name a save reads that its function binds only under a rank-0 `if`."""
from __future__ import annotations

from textwrap import dedent

import libcst as cst

from fsdp2_retrofit.analysis import analyse
from fsdp2_retrofit.analysis.checkpoints import rank_zero_names

HEAD = dedent("""\
    import torch
    import torch.distributed as dist
    import torch.nn as nn


    def main():
        rank = dist.get_rank()
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if rank == 0:
            out = "run/model.pt"
    """)
SAVE = '    torch.save(model.state_dict(), out)\n'


def _names(source: str):
    facts = analyse(cst.parse_module(source))
    save = next(s for s in facts.resolver.nodes(cst.SimpleStatementLine) if "torch.save" in facts.module.code_for_node(s))
    return [read.name for read in rank_zero_names(save, facts)]


def test_a_name_bound_on_rank_zero_only_is_found():
    assert _names(HEAD + SAVE) == ["out"]


def test_a_name_also_bound_by_a_loop_on_every_rank_is_not():
    # the `for` binds `out` on every rank: the save finds it there too
    loop = '    for out in ["a.pt", "b.pt"]:\n        pass\n'
    assert _names(HEAD + loop + SAVE) == []


def test_a_name_also_bound_by_a_with_on_every_rank_is_not():
    with_ = '    with open("name.txt") as out:\n        pass\n'
    assert _names(HEAD + with_ + SAVE) == []
