"""--keep-global-batch with a training batch of one sample is refused at the loader (FSR905):
the option divides the global batch between the ranks, and one sample has no part for a
second rank. Without the option the same script converts (each rank reads one sample)."""
from __future__ import annotations

from textwrap import dedent

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = '''
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

{size_binding}
net = nn.Linear(4, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)), batch_size={size})
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()
'''


def rewrite(size_binding: str, size: str, keep: bool):
    code = dedent(SCRIPT).format(size_binding=size_binding, size=size)
    return code, rewrite_source(code.encode(), "train.py", RetrofitOptions(keep_global_batch=keep))


@pytest.mark.parametrize("binding, size", [("", "1"), ("BATCH = 1", "BATCH"), ("ONE = 1\nB = ONE", "B")])
def test_a_batch_of_one_is_refused_at_the_loader_with_keep_global_batch(binding, size):
    code, result = rewrite(binding, size, keep=True)
    assert [r.code for r in result.refusals] == ["FSR905"], result.refusals
    assert result.refusals[0].line == code.splitlines().index(
        next(line for line in code.splitlines() if line.startswith("loader = "))) + 1
    assert result.code == code.encode()


@pytest.mark.parametrize("binding, size, keep", [("BATCH = 1", "BATCH", False), ("BATCH = 2", "BATCH", True)])
def test_without_the_option_or_with_a_larger_batch_it_converts(binding, size, keep):
    _, result = rewrite(binding, size, keep=keep)
    assert not result.refusals, result.refusals
    assert "DistributedSampler" in result.code.decode()
