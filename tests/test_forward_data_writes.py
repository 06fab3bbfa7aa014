"""A forward that writes into one of its module's parameters through `.data` (pytorch-vqvae's
Gated PixelCNN: `self.vert_stack.weight.data[:, :, -1].zero_()` in a method its forward calls):
after fully_shard the write lands in the copy FSDP2 all-gathered for the forward, not in the
shards, and the backward re-gathers the unwritten values (measured on a toy, 2 ranks vs 1
process: the embedding before the masked layer ends 3e-4 apart after 3 SGD steps). Refused
at the write's line (FSR644); writes outside the forward, and writes into buffers, pass."""
from __future__ import annotations

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = """\
import torch
from torch import nn


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("mask", torch.ones(4, 4, 3, 3))

    def make_causal(self):
        self.conv.weight.data[:, :, -1].zero_()

    def forward(self, x):
{forward}
        return self.conv(x) * self.scale[:, None, None]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Conv2d(2, 4, 1)
        self.layers = nn.ModuleList()
        for _ in range(2):
            self.layers.append(Masked())

    def forward(self, x):
        x = self.emb(x)
        for layer in self.layers:
            x = layer(x)
        return x


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 2, 6, 6)
for step in range(3):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
{after}
"""


def rewrite(forward: str, after: str = ""):
    source = SCRIPT.format(forward=forward, after=after)
    return source, rewrite_source(source.encode(), "train.py", RetrofitOptions())


def line_of(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


@pytest.mark.parametrize(
    "forward, at",
    [
        ("        self.make_causal()", "self.conv.weight.data[:, :, -1].zero_()"),  # pytorch-vqvae's shape
        ("        self.conv.weight.data.mul_(self.mask)", "self.conv.weight.data.mul_"),
        ("        self.conv.bias.data[0] = 0.0", "self.conv.bias.data[0] = 0.0"),
        ("        self.scale.data = self.scale.data.clamp(0, 1)", "self.scale.data = "),  # an nn.Parameter attribute
    ],
    ids=["method-called-from-forward", "in-place-call", "slice-assignment", "parameter-data-rebound"],
)
def test_forward_writing_a_parameter_through_data_is_refused_at_the_write(forward, at):
    source, result = rewrite(forward)
    assert [r.code for r in result.refusals] == ["FSR644"], result.refusals
    assert result.refusals[0].line == line_of(source, at)
    assert "Masked" in result.refusals[0].what and "`model`" in result.refusals[0].what


@pytest.mark.parametrize(
    "forward, after",
    [
        # weight clipping after the step writes the shards themselves
        ("        pass", "    for p in model.parameters():\n        p.data.clamp_(-0.1, 0.1)"),
        ("        self.mask.data.mul_(0.5)", ""),  # a buffer: not sharded, every rank keeps its own
        ("        masked = self.conv.weight * self.mask", ""),  # reads, writes nothing
    ],
    ids=["clip-after-step", "buffer-write", "functional-mask"],
)
def test_writes_that_reach_the_shards_are_not_refused(forward, after):
    _, result = rewrite(forward, after)
    assert not [r for r in result.refusals if r.code == "FSR644"], result.refusals


def test_a_method_the_forward_does_not_call_is_not_read():
    """make_causal exists but only the forward's own code counts: here it never calls it."""
    _, result = rewrite("        pass")
    assert not result.refusals, result.refusals
