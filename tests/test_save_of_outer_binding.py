"""A save of a dict bound in an enclosing block (`checkpoint = {...}` in the epoch loop,
`torch.save(checkpoint, path)` under `if`/`elif`): its state is converted like a dict
saved in the same block (it was left a torch.save of DTensor shards)."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

SOURCE = dedent("""\
    import torch
    import torch.nn as nn

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for epoch in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        checkpoint = {"epoch": epoch, "model": model.state_dict()}
        if epoch == 0:
            torch.save(checkpoint, "first.pt")
        elif loss.item() <= min(losses):
            if epoch > 1:
                torch.save(checkpoint, "best.pt")
    """)


def test_a_dict_bound_before_the_branch_is_converted():
    result = rewrite_source(SOURCE.encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    out = result.code.decode()
    assert 'checkpoint = {"epoch": epoch, "model": get_model_state_dict(model)}' in out
    assert 'dcp.save(checkpoint, checkpoint_id="first.pt")' in out
    assert 'dcp.save(checkpoint, checkpoint_id="best.pt")' in out
    assert "torch.save" not in out

