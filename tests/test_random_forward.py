"""A forward of the sharded model whose control flow reads a random draw each process makes
for itself (jcjohnson's dynamic_net: `for _ in range(random.randint(0, 3))`): the ranks run
different layers and fully_shard's collectives no longer pair up. Refused at the loop's line
(FSR641) unless the generator is seeded alike on every rank."""
from __future__ import annotations

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

HEAD = """\
import os
import random

import numpy as np
import torch
from torch import nn
{seed}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.middle = nn.Linear(16, 16)
        self.last = nn.Linear(16, 2)

    def forward(self, x):
        h = self.first(x).relu()
{forward}
        return self.last(h)


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randn(32, 2)
for step in range(3):
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

LOOP = "        for _ in range({draw}):\n            h = self.middle(h).relu()"
BOUND = "        depth = {draw}\n        for _ in range(depth):\n            h = self.middle(h).relu()"
BRANCH = "        if {draw} < 0.5:\n            h = self.middle(h).relu()"


def rewrite(seed: str, forward: str):
    source = HEAD.format(seed=seed, forward=forward)
    return source, rewrite_source(source.encode(), "train.py", RetrofitOptions())


def line_of(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


@pytest.mark.parametrize(
    "seed, forward, at",
    [
        ("", LOOP.format(draw="random.randint(0, 3)"), "for _ in range"),  # dynamic_net itself
        ("", BOUND.format(draw="np.random.randint(1, 4)"), "for _ in range"),  # through a name
        ("", BRANCH.format(draw="random.random()"), "if random.random()"),
        ("random.seed()", LOOP.format(draw="random.randint(0, 3)"), "for _ in range"),  # the OS's entropy
        ("random.seed(int(os.environ.get('RANK', 0)))", LOOP.format(draw="random.randint(0, 3)"), "for _ in range"),
        ("torch.manual_seed(int(os.environ.get('RANK', 0)))", BRANCH.format(draw="torch.rand(1).item()"),
         "if torch.rand"),
    ],
    ids=["unseeded-random", "numpy-bound", "random-if", "seed-no-arg", "seed-per-rank", "torch-seed-per-rank"],
)
def test_random_control_flow_in_forward_is_refused_at_its_line(seed, forward, at):
    source, result = rewrite(seed, forward)
    assert [r.code for r in result.refusals] == ["FSR641"], result.refusals
    assert result.refusals[0].line == line_of(source, at)
    assert "Net" in result.refusals[0].what


@pytest.mark.parametrize(
    "seed, forward",
    [
        ("random.seed(0)", LOOP.format(draw="random.randint(0, 3)")),
        ("np.random.seed(1234)", BOUND.format(draw="np.random.randint(1, 4)")),
        # torch's default generator starts from the same fixed seed in every process
        ("", BRANCH.format(draw="torch.rand(1).item()")),
        ("torch.manual_seed(0)", BRANCH.format(draw="torch.rand(1).item()")),
        ("", "        h = h + 0.01 * torch.randn_like(h)"),  # a draw that decides no control flow
    ],
    ids=["random-seeded", "numpy-seeded", "torch-default", "torch-seeded", "noise-only"],
)
def test_draws_alike_on_every_rank_are_not_refused(seed, forward):
    _, result = rewrite(seed, forward)
    assert not [r for r in result.refusals if r.code == "FSR641"], result.refusals


HANDED = """\
import random

import numpy as np
import torch
from torch import nn
{seed}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.label = nn.Embedding(4, 16)
        self.last = nn.Linear(16, 2)

    def forward(self, x, y):
        h = self.first(x)
{use}
        return self.last(h.relu())


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y, target = torch.randn(32, 8), torch.randint(0, 4, (32,)), torch.randn(32, 2)
for step in range(3):
    labels = y
    if {draw} < 0.1:
        labels = None
    loss = (model(x, labels) - target).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
BRANCHED = "        if y is not None:\n            h = h + self.label(y)"


def test_a_model_argument_chosen_by_a_draw_the_forward_branches_on_is_refused_at_the_draw():
    """dome272's ddpm_conditional: `if np.random.random() < 0.1: labels = None` then
    `model(x_t, t, labels)`, whose forward runs the label embedding only `if y is not None`:
    each rank drops its labels on its own steps, the label layer's collectives stop pairing up
    (measured: gloo 'Received data size doesn't match expected size' at step 3)."""
    source = HANDED.format(seed="", use=BRANCHED, draw="np.random.random()")
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert [r.code for r in result.refusals] == ["FSR641"], result.refusals
    assert result.refusals[0].line == line_of(source, "if np.random.random() < 0.1")
    assert "`labels`" in result.refusals[0].what and "as `y`" in result.refusals[0].what


@pytest.mark.parametrize(
    "seed, use, draw",
    [
        ("np.random.seed(0)", BRANCHED, "np.random.random()"),  # every rank draws alike
        ("", "        h = h + self.label(y if y is not None else torch.zeros_like(x[:, 0]).long())",
         "torch.rand(1).item()"),  # torch's default generator: alike on every rank
        ("", "        h = h + 0.0", "random.random()"),  # the forward does not branch on it
    ],
    ids=["numpy-seeded", "torch-default", "no-branch-on-it"],
)
def test_a_model_argument_drawn_alike_or_not_branched_on_is_not_refused(seed, use, draw):
    source = HANDED.format(seed=seed, use=use, draw=draw)
    result = rewrite_source(source.encode(), "train.py", RetrofitOptions())
    assert not [r for r in result.refusals if r.code == "FSR641"], result.refusals
