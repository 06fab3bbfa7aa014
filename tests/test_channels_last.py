"""A model moved to channels_last before fully_shard keeps the default layout (channels_last_model has the
golden and execution tests: fully_shard refuses non-contiguous parameters at start-up)."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = dedent('''\
    import torch
    import torch.nn as nn


    def main():
        net = nn.Sequential(nn.Conv3d(2, 4, 3), nn.ReLU(), nn.Conv3d(4, 1, 3))
        net.to("cpu", memory_format=torch.channels_last_3d)
        opt = torch.optim.Adam(net.parameters())
        for x in torch.randn(3, 2, 2, 6, 6, 6):
            net(x.contiguous(memory_format=torch.channels_last_3d)).mean().backward()
            opt.step()


    main()
    ''')


def test_a_placement_call_written_otherwise_gets_the_default_layout_and_the_inputs_keep_theirs():
    result = rewrite_source(SCRIPT.encode(), "train.py")
    assert not result.refusals, result.refusals
    text = result.code.decode()
    assert '    net.to("cpu", memory_format=torch.contiguous_format)\n' in text
    assert "x.contiguous(memory_format=torch.channels_last_3d)" in text
    assert text.index("contiguous_format") < text.index("fully_shard(net")
    assert [c.line for c in result.changes if "contiguous_format" in c.what] == [7]


def test_a_channels_last_move_of_something_else_is_left_alone():
    other = SCRIPT.replace('net.to("cpu", memory_format=torch.channels_last_3d)',
                           'probe = torch.zeros(1, 2, 6, 6, 6).to(memory_format=torch.channels_last_3d)')
    text = rewrite_source(other.encode(), "train.py").code.decode()
    assert "probe = torch.zeros(1, 2, 6, 6, 6).to(memory_format=torch.channels_last_3d)" in text
