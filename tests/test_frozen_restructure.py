"""A model no optimizer trains (frozen), changed after its build: fully_shard and rank 0's
broadcast follow the last change before its first use (a new head assigned after the
freezing loop, as in a fine-tuning demo), not the freezing loop. A small model trained first
makes the script one the rewrite takes."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

LIBRARY_MODEL = '''
import torch
import torchvision
from torch import nn

probe = nn.Linear(3, 2)
optimizer = torch.optim.SGD(probe.parameters(), lr=0.01)
for x, y in batches:
    nn.functional.mse_loss(probe(x), y).backward()
    optimizer.step()

resnet = torchvision.models.resnet18()
for param in resnet.parameters():
    param.requires_grad = False
resnet.fc = nn.Linear(resnet.fc.in_features, 100)
images = torch.randn(4, 3, 32, 32)
outputs = resnet(images)
'''


def _text(source: str) -> str:
    result = rewrite_source(dedent(source).encode(), "train.py", RetrofitOptions())
    assert not result.refusals, result.refusals
    return result.code.decode()


def test_a_new_head_after_freezing_comes_before_fully_shard_and_the_broadcast():
    text = _text(LIBRARY_MODEL)
    head = text.index("resnet.fc = nn.Linear(")
    assert head < text.index("for tensor in [*resnet.parameters()") < text.index("fully_shard(resnet, mesh=mesh")
    assert text.index("fully_shard(resnet, mesh=mesh") < text.index("outputs = resnet(images)")


def test_a_change_after_the_first_forward_stays_after_fully_shard():
    source = LIBRARY_MODEL.replace(
        "resnet.fc = nn.Linear(resnet.fc.in_features, 100)\nimages = torch.randn(4, 3, 32, 32)\noutputs = resnet(images)\n",
        "images = torch.randn(4, 3, 32, 32)\noutputs = resnet(images)\nresnet.fc = nn.Linear(resnet.fc.in_features, 100)\n",
    )
    text = _text(source)
    assert text.index("fully_shard(resnet, mesh=mesh") < text.index("outputs = resnet(images)") < text.index("resnet.fc =")


def test_a_checkpoint_load_after_freezing_stays_after_fully_shard():
    source = LIBRARY_MODEL.replace(
        "resnet.fc = nn.Linear(resnet.fc.in_features, 100)\n", "resnet.load_state_dict(torch.load('r.pt'))\n"
    )
    text = _text(source)
    assert text.index("fully_shard(resnet, mesh=mesh") < text.index("set_model_state_dict(resnet, torch.load('r.pt')")
