"""A rank-0 `if` of the script itself around a backward or a forward of the model: the
checkpoint stage splits the ones around a save (the backward joins every rank); the
others are flagged at their line (the run hangs when the branch is taken)."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.check.lint import lint_source
from fsdp2_retrofit.check.rules import all_rules
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

HEAD = dedent("""\
    import os
    import torch
    import torch.nn as nn
    import torch.distributed as dist


    def main():
        ddp = int(os.environ.get("RANK", -1)) != -1
        if ddp:
            dist.init_process_group("gloo")
            master_process = dist.get_rank() == 0
        else:
            master_process = True
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    """)
TAIL = dedent("""\
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


    if __name__ == "__main__":
        main()
    """)
GATE = "    if master_process:\n        ref = model(torch.randn(8, 4)).pow(2).mean()\n        ref.backward()\n"


def _rewrite(source: str):
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    return result


def test_a_gate_around_a_save_runs_its_backward_on_every_rank():
    source = HEAD + GATE + '        torch.save(model.state_dict(), "ref.pt")\n' + TAIL
    out = _rewrite(source).code.decode()
    assert "    if master_process:\n        ref" not in out
    assert '\n    ref.backward()\n    if dist.get_rank() == 0 and os.path.isfile("ref.pt"):' in out
    assert '\n    dist.barrier()  # the path is free on every rank\n    dcp.save(' in out
    codes = [f.code for f in lint_source(out.encode(), "train_fsdp2.py", all_rules()).findings]
    assert "FSD110" not in codes, codes


def test_a_gate_without_a_save_is_flagged_at_its_line():
    result = _rewrite(HEAD + GATE + TAIL)
    flagged = [a for a in result.attention if a.code == "rank_zero" and "hangs" in a.what]
    assert [a.line for a in flagged] == [15]
    assert flagged[0].differs
    assert "ref.backward()" in flagged[0].what


def test_a_gate_with_prints_only_is_not_flagged():
    gate = '    if master_process:\n        print("start")\n'
    result = _rewrite(HEAD + gate + TAIL)
    assert not [a for a in result.attention if "hangs" in a.what]
