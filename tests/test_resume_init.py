"""The resume-or-initialise `if` after the build (codemods/resume_init.py): split so
the initialisation runs on the whole model before fully_shard and the load after it,
or, where the split would not be the same program, left as it is and flagged."""
from __future__ import annotations

import libcst as cst

from fsdp2_retrofit.analysis.init_branches import init_branch, initialised_name
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = '''\
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def init_fn(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0.0, 0.02)


torch.manual_seed(0)
epoch = int(os.environ.get("EPOCH", 0))
net = Net()
critic = Net()
{resume}
optimizer = torch.optim.Adam([*net.parameters(), *critic.parameters()], lr=1e-3)
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 4)), batch_size=4)
for x, y in loader:
    loss = ((critic(net(x)) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
torch.save(net.state_dict(), "net_%d.pt" % (epoch + 1))
'''

LOAD = "    net.load_state_dict(torch.load('net_%d.pt' % epoch))\n"


def _rewrite(resume: str):
    result = rewrite_source(SCRIPT.format(resume=resume).encode(), "train.py")
    assert not result.refusals, result.refusals
    return result, result.code.decode()


def _flagged(result):
    return [a.what.split(":")[0] for a in result.attention if a.differs]


def test_the_init_in_the_else_runs_on_the_whole_models_before_fully_shard():
    result, code = _rewrite("if epoch != 0:\n" + LOAD + "else:\n    net.apply(init_fn)\n    critic.apply(init_fn)\n")
    assert code.index("if epoch == 0:  # on the whole models, before fully_shard") < code.index("net.apply(init_fn)") \
        < code.index("critic.apply(init_fn)") < code.index("fully_shard(net") < code.index("fully_shard(critic") \
        < code.index("if epoch != 0:") < code.index("dcp.load(")
    assert "else:\n    net.apply" not in code
    assert not _flagged(result)
    assert any(c.code == "resume_init" and "split `if epoch != 0`" in c.what for c in result.changes)


def test_the_init_in_the_body_keeps_its_test_and_the_load_gets_the_inverse():
    result, code = _rewrite("if not epoch:\n    net.apply(init_fn)\n    nn.init.zeros_(critic.blocks[0].bias)\n"
                            "else:\n" + LOAD)
    assert code.index("if not epoch:  # on the whole models") < code.index("nn.init.zeros_(critic.blocks[0].bias)") \
        < code.index("fully_shard(critic") < code.index("if epoch:")
    assert not _flagged(result)


def test_a_test_that_calls_something_is_not_split_and_stays_flagged():
    resume = "if os.path.exists('net_%d.pt' % epoch):\n" + LOAD + "else:\n    net.apply(init_fn)\n"
    result, code = _rewrite(resume)
    assert code.index("fully_shard(net, mesh=mesh)") < code.index("else:\n    net.apply(init_fn)")
    assert _flagged(result) == ["`net.apply(init_fn)` runs on the sharded `net`"]


def test_an_init_branch_doing_more_than_initialising_is_not_split_and_stays_flagged():
    resume = "if epoch != 0:\n" + LOAD + "else:\n    print('fresh start')\n    net.apply(init_fn)\n"
    result, code = _rewrite(resume)
    assert code.index("fully_shard(net, mesh=mesh)") < code.index("    net.apply(init_fn)")
    assert _flagged(result) == ["`net.apply(init_fn)` runs on the sharded `net`"]


def test_a_plain_in_place_init_after_the_build_comes_before_fully_shard():
    result, code = _rewrite("nn.init.normal_(net.blocks[1].weight, 0.0, 0.1)\n")
    assert code.index("nn.init.normal_(net.blocks[1].weight") < code.index("fully_shard(net, mesh=mesh)")
    assert not _flagged(result)


def test_what_counts_as_an_initialisation_and_a_splittable_if():
    def call(text):
        return cst.parse_expression(text)

    assert initialised_name(call("net.apply(init_fn)")) == "net"
    assert initialised_name(call("torch.nn.init.xavier_uniform_(net.fc.weight)")) == "net"
    assert initialised_name(call("init.zeros_(net.blocks[0].bias)")) == "net"
    assert initialised_name(call("nn.init.calculate_gain('relu')")) is None
    assert initialised_name(call("net.apply(fn, extra)")) is None
    assert initialised_name(call("helpers.apply(init_fn)")) == "helpers"  # any name: the anchor decides
    split = cst.parse_statement("if a.b != 0:\n    m.load_state_dict(x)\nelse:\n    m.apply(f)\n")
    assert init_branch(split).init_in_else and init_branch(split).models == {"m"}
    for shape in ("if (n := a.b):\n    m.load_state_dict(x)\nelse:\n    m.apply(f)\n",
                  "if a:\n    m.apply(f)\nelse:\n    m.apply(g)\n",
                  "if a:\n    m.load_state_dict(x)\nelif b:\n    m.apply(f)\nelse:\n    m.apply(g)\n"):
        assert init_branch(cst.parse_statement(shape)) is None, shape
