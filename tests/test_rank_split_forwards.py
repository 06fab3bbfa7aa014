"""A forward of the sharded model that each rank runs a number of times read from its rank (issue 44
class 7: an evaluation split by `if i % world_size != rank: continue`) is refused at the line that
splits it (FSR646): where the world size does not divide the work, one rank runs one forward more and
waits in its all-gather for the others (measured before this refusal: the rewrite of the first script
below with two sharded blocks in Net hung on 2 ranks with 5 items, killed after 100 s; with the root
unit alone it ended, as FSDP2 keeps the root's parameters gathered after its forward under no_grad:
the refusal does not count on that). A count every rank shares passes."""
from __future__ import annotations

from textwrap import dedent

import pytest

from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = dedent('''\
    import os

    import torch
    import torch.nn as nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x)

    {helper}
    def main():
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            loss = model(torch.randn(8, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        held_out = torch.randn(5, 3, 8)
        total = 0.0
        with torch.no_grad():
    {eval}
        print(total)


    main()
    ''')


def _refusals(helper: str, evaluation: str):
    source = SCRIPT.format(helper=helper, eval=evaluation)
    result = rewrite_source(source.encode(), "/tmp/rank_split_case.py")
    return source, [(r.code, r.line) for r in result.refusals]


def _line(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


@pytest.mark.parametrize("helper, evaluation, at", [
    # the shape: the items of each rank by a `continue`
    ("", "            for i in range(len(held_out)):\n                if i % world_size != rank:\n"
         "                    continue\n                total += model(held_out[i]).sum().item()\n",
     "if i % world_size != rank:"),
    # a stride starting at the rank
    ("", "            for i in range(rank, len(held_out), world_size):\n"
         "                total += model(held_out[i]).sum().item()\n",
     "for i in range(rank, len(held_out), world_size):"),
    # a helper function, other names, the rank handed to it, the forward under the `if`
    ("\ndef score(net, chunks, me, world):\n    out = 0.0\n    for k, chunk in enumerate(chunks):\n"
     "        if k % world == me:\n            out += float(net(chunk).mean())\n    return out\n\n",
     "            total = score(model, held_out, rank, world_size)\n",
     "if k % world == me:"),
    # the rank read from torch.distributed where it is used, a `break`
    ("", "            for i in range(len(held_out)):\n"
         "                if i >= len(held_out) // world_size + int(os.environ.get(\"LOCAL_RANK\", 0)):\n"
         "                    break\n                total += model(held_out[i]).sum().item()\n",
     "if i >= len(held_out)"),
])
def test_a_forward_count_read_from_the_rank_is_refused_at_the_split(helper, evaluation, at):
    source, refusals = _refusals(helper, evaluation)
    assert refusals == [("FSR646", _line(source, at))], refusals


@pytest.mark.parametrize("evaluation", [
    # every rank runs every item
    "            for i in range(len(held_out)):\n                total += model(held_out[i]).sum().item()\n",
    # whole rounds: every rank gets len // world_size items
    "            for i in range(rank, len(held_out) // world_size * world_size, world_size):\n"
    "                total += model(held_out[i]).sum().item()\n",
    # the count read from the world size alone
    "            for i in range(world_size):\n                total += model(held_out[i]).sum().item()\n",
])
def test_a_count_every_rank_shares_passes(evaluation):
    _, refusals = _refusals("", evaluation)
    assert not refusals, refusals
