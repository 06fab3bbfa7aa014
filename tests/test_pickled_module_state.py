"""A saved dict, list or tuple holding a model itself (`{"net": net}`) is refused
(FSR707) at the model's place in it: pickling a sharded module writes one rank's
DTensor shards, every rank to the same file, and nothing loads it back as the model.
(`torch.save(model, path)` alone is converted to a state-dict save: tests/test_stages.py.)"""
from __future__ import annotations

from textwrap import dedent

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = '''
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def checkpoint(epoch):
    {state}
    torch.save(state, "ckpt.t7")


net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 2)), batch_size=8)
for epoch in range(3):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    checkpoint(epoch)
'''


def rewrite(state: str):
    code = dedent(SCRIPT).replace("{state}", state)
    return code, rewrite_source(code.encode(), "train.py", RetrofitOptions())


@pytest.mark.parametrize("state", [
    'state = {"net": net, "epoch": epoch}',
    'state = [net, epoch]',
    'state = (epoch, net)',
], ids=["dict", "list", "tuple"])
def test_a_module_saved_whole_inside_the_state_is_refused_where_it_is_put(state):
    code, result = rewrite(state)
    assert [r.code for r in result.refusals] == ["FSR707"], result.refusals
    refusal = result.refusals[0]
    assert refusal.line == code.splitlines().index("    " + state) + 1
    assert "holds the sharded module `net` itself" in refusal.what and "line 9" in refusal.what
    assert result.code == code.encode()


def test_its_state_dict_in_the_same_place_is_converted():
    code, result = rewrite('state = {"net": net.state_dict(), "epoch": epoch}')
    assert not result.refusals, result.refusals
    assert "get_model_state_dict(net)" in result.code.decode()
