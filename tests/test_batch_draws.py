"""Batches a script draws itself, without a DataLoader (issue 32, item 1; codemods/batch_draws.py).

A torch.randint draw whose rows make the returned batch is drawn alike on every rank and
each training call keeps its rank's rows; a position-counter loader reads its rank's part
of the global batch; whatever the analysis cannot see whole stays flagged, at its line,
with the reason. Before: every such script got "no DataLoader ... every rank trains on the
same data" at its loop, and ran so."""
from __future__ import annotations

from textwrap import dedent

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = '''
import torch
import torch.nn as nn

torch.manual_seed(1337)
batch_size, block = 8, 4
data = torch.arange(500) % 13


def get_batch():
    ix = torch.randint(len(data) - block, (batch_size,))
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
    return x, y


@torch.no_grad()
def evaluate(model):
    xb, yb = get_batch()
    return nn.functional.cross_entropy(model(xb).flatten(0, 1), yb.flatten())


model = nn.Sequential(nn.Embedding(13, 16), nn.Linear(16, 13))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    xb, yb = get_batch()
    loss = nn.functional.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(evaluate(model).item())
'''

COUNTER = '''
import torch
import torch.nn as nn


class Windows:
    def __init__(self, tokens, B, T):
        self.tokens, self.B, self.T = tokens, B, T
        self.pos = 0

    def next_batch(self):
        B, T = self.B, self.T
        buf = self.tokens[self.pos:self.pos + B * T + 1]
        self.pos += B * T
        if self.pos + B * T + 1 > len(self.tokens):
            self.pos = 0
        return buf[:-1].view(B, T), buf[1:].view(B, T)


torch.manual_seed(0)
loader = Windows(torch.arange(400) % 11, 4, 8)
model = nn.Sequential(nn.Embedding(11, 16), nn.Linear(16, 11))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    x, y = loader.next_batch()
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''

GENERIC = "no DataLoader: the batches do not come from a sampler"


def _rewrite(source: str, **options):
    result = rewrite_source(dedent(source).encode(), "train.py", RetrofitOptions(**options))
    assert not result.refusals, result.refusals
    return result


def _line_of(source: str, fragment: str, nth: int = 0) -> int:
    return [i for i, line in enumerate(dedent(source).splitlines(), 1) if fragment in line][nth]


def _flags(result):
    return [(a.line, a.differs, a.what) for a in result.attention if a.code == "batch_draws"]


def test_the_draw_takes_world_size_times_the_batch_and_training_keeps_its_rows():
    result = _rewrite(SCRIPT)
    out = result.code.decode()
    assert "ix = torch.randint(len(data) - block, (batch_size * dist.get_world_size(),))" in out
    training = out.split("for step in range(10):")[1]
    assert "xb = xb.chunk(dist.get_world_size())[dist.get_rank()]" in training
    assert "yb = yb.chunk(dist.get_world_size())[dist.get_rank()]" in training
    evaluation = out.split("def evaluate")[1].split("model = ")[0]
    assert "chunk" not in evaluation  # evaluation keeps the whole batch: the single run's numbers
    assert not _flags(result) and not any(GENERIC in a.what for a in result.attention)
    assert {c.line for c in result.changes if c.code == "batch_draws"} == {
        _line_of(SCRIPT, "ix = torch.randint"), _line_of(SCRIPT, "xb, yb = get_batch()", 1)}


def test_keep_global_batch_leaves_the_draw_and_asserts_the_batch_divides():
    out = _rewrite(SCRIPT, keep_global_batch=True).code.decode()
    assert "ix = torch.randint(len(data) - block, (batch_size,))" in out
    training = out.split("for step in range(10):")[1]
    assert 'assert xb.size(0) % dist.get_world_size() == 0, "the batch size must divide' in training
    assert training.index("assert xb.size(0)") < training.index("xb = xb.chunk(")


def test_a_generator_draw_is_split_too():
    source = SCRIPT.replace("data = torch.arange(500) % 13",
                            "data = torch.arange(500) % 13\ng = torch.Generator().manual_seed(7)").replace(
        "(batch_size,))", "(batch_size,), generator=g)")
    out = _rewrite(source).code.decode()
    assert "(batch_size * dist.get_world_size(),), generator=g)" in out


def test_a_seed_offset_by_the_rank_is_flagged_not_split():
    source = "import os\n" + dedent(SCRIPT).replace(
        "torch.manual_seed(1337)", 'torch.manual_seed(1337 + int(os.environ.get("RANK", "0")))')
    result = _rewrite(source)
    out = result.code.decode()
    assert "chunk(" not in out and "batch_size * dist.get_world_size()" not in out
    flags = _flags(result)
    assert [(line, differs) for line, differs, _ in flags] == [(_line_of(source, "ix = torch.randint"), True)]
    assert "may differ between ranks" in flags[0][2]


def test_a_batch_not_made_of_drawn_rows_is_flagged_at_the_return():
    source = dedent(SCRIPT).replace("    return x, y", "    x = x.flip(0)\n    return x, y")
    result = _rewrite(source)
    assert "chunk(" not in result.code.decode()
    flags = _flags(result)
    assert [(line, differs) for line, differs, _ in flags] == [(_line_of(source, "return x, y"), True)]
    assert "`x`, returned by get_batch(), is not made of rows picked by the draw" in flags[0][2]
    assert not any(GENERIC in a.what for a in result.attention)  # one flag, with the true reason


def test_an_index_drawn_twice_is_flagged():
    source = dedent(SCRIPT).replace("    x = torch.stack",
                                    "    ix = torch.randint(len(data) - block, (batch_size,))\n    x = torch.stack")
    result = _rewrite(source)
    assert "chunk(" not in result.code.decode()
    assert any("is bound again in get_batch()" in what for _, _, what in _flags(result))


def test_a_batch_unpacked_into_the_model_call_is_flagged_at_the_call():
    source = dedent(SCRIPT).replace(
        "    xb, yb = get_batch()\n    loss = nn.functional.cross_entropy(model(xb).flatten(0, 1), yb.flatten())",
        "    loss = nn.functional.cross_entropy(*get_batch())")
    result = _rewrite(source)
    out = result.code.decode()
    assert "chunk(" not in out and "batch_size * dist.get_world_size()" not in out
    flags = _flags(result)
    assert [(line, differs) for line, differs, _ in flags] == [(_line_of(source, "cross_entropy(*get_batch())"), True)]


def test_the_counter_reads_the_rank_part_of_the_global_batch():
    result = _rewrite(COUNTER)
    out = result.code.decode()
    assert "start = self.pos + dist.get_rank() * B * T" in out
    assert "buf = self.tokens[start:start + B * T + 1]" in out
    assert "self.pos += B * T * dist.get_world_size()" in out
    assert "if (self.pos + (dist.get_world_size() - 1) * B * T) + B * T + 1 > len(self.tokens):" in out
    assert "chunk(" not in out and not _flags(result)


def test_the_counter_with_keep_global_batch_keeps_rows_at_the_call():
    out = _rewrite(COUNTER, keep_global_batch=True).code.decode()
    assert "dist.get_rank() * B * T" not in out
    assert "x = x.chunk(dist.get_world_size())[dist.get_rank()]" in out
    assert "assert x.size(0) % dist.get_world_size() == 0" in out


def test_a_counter_read_elsewhere_is_flagged_there():
    source = dedent(COUNTER) + "    print(loader.pos)\n"
    result = _rewrite(source)
    assert "dist.get_rank() * B * T" not in result.code.decode()
    flags = _flags(result)
    assert [(line, differs) for line, differs, _ in flags] == [(_line_of(source, "print(loader.pos)"), True)]


def test_the_rewritten_output_is_left_as_is():
    once = _rewrite(SCRIPT).code.decode()
    assert "chunk(" in once and _rewrite(once).code.decode() == once
    once = _rewrite(COUNTER).code.decode()
    assert "dist.get_rank() * B * T" in once and _rewrite(once).code.decode() == once


EARLY = """
import torch
import torch.nn as nn

batch_size, block = 8, 4
data = torch.arange(500) % 13


def get_batch():
    ix = torch.randint(len(data) - block, (batch_size,))
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
    return x, y


def main():
    xb, yb = get_batch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(13, 16), nn.Linear(16, 13))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        loss = nn.functional.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        xb, yb = get_batch()


main()
"""


def test_a_draw_before_the_process_group_is_flagged():
    result = _rewrite(EARLY)
    out = result.code.decode()
    assert out.index("xb, yb = get_batch()") < out.index("init_process_group")
    assert "dist.get_world_size()," not in out and "chunk(" not in out
    flags = _flags(result)
    assert [(line, differs) for line, differs, _ in flags] == [(_line_of(EARLY, "xb, yb = get_batch()"), True)]
    assert "before the process group starts" in flags[0][2]


def test_keep_global_batch_with_tensors_shaped_by_the_batch_size_is_flagged():
    source = dedent(SCRIPT).replace("    loss = nn.functional.cross_entropy(model(xb).flatten(0, 1), yb.flatten())",
                                    "    logits = model(xb).reshape(batch_size, -1, 13).flatten(0, 1)\n"
                                    "    loss = nn.functional.cross_entropy(logits, yb.flatten())")
    result = _rewrite(source, keep_global_batch=True)
    assert "chunk(" not in result.code.decode()
    flags = _flags(result)
    assert [(line, differs) for line, differs, _ in flags] == [(_line_of(source, "reshape(batch_size, -1"), True)]
    # by default each rank keeps a batch of the size as written: the reshape still fits
    assert "xb = xb.chunk(" in _rewrite(source).code.decode()


def test_a_call_neither_training_nor_evaluation_is_flagged():
    # the training loop reads the batch through a helper of its own: the draw's only caller has no
    # backward() and no torch.no_grad(); split nowhere, the retrofit would train on W x B identical rows
    source = dedent(SCRIPT).replace("def get_batch():", "def train_batch():\n    return get_batch()\n\n\ndef get_batch():")
    source = source.replace("    xb, yb = get_batch()\n    loss =", "    xb, yb = train_batch()\n    loss =")
    result = _rewrite(source)
    out = result.code.decode()
    assert "dist.get_world_size()," not in out and "chunk(" not in out
    flags = _flags(result)
    assert [(line, differs) for line, differs, _ in flags] == [(_line_of(source, "return get_batch()"), True)]
    assert "cannot tell whether" in flags[0][2]


# the windows sliced into a list first, then joined along a new leading axis (pbloem/former's
# experiments/generate.py): row k of the batch is still the window at ix[k]
LISTED = dedent(SCRIPT).replace(
    "    x = torch.stack([data[i:i + block] for i in ix])\n    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])\n",
    "    xs = [data[i:i + block] for i in ix]\n    ys = [data[i + 1:i + 1 + block] for i in ix]\n"
    "    x = torch.cat([s[None, :] for s in xs], dim=0).to(torch.long)\n"
    "    y = torch.stack(ys)\n",
)


def test_windows_listed_then_concatenated_with_a_leading_axis_are_split():
    assert "torch.cat([s[None, :] for s in xs], dim=0)" in LISTED
    result = _rewrite(LISTED)
    out = result.code.decode()
    assert "(batch_size * dist.get_world_size(),))" in out
    training = out.split("for step in range(10):")[1]
    assert "xb = xb.chunk(dist.get_world_size())[dist.get_rank()]" in training
    assert not _flags(result)


def test_a_leading_axis_by_unsqueeze_is_split_too():
    source = LISTED.replace("torch.cat([s[None, :] for s in xs], dim=0)", "torch.cat([s.unsqueeze(0) for s in xs])")
    assert source != LISTED
    result = _rewrite(source)
    assert "xb = xb.chunk(dist.get_world_size())[dist.get_rank()]" in result.code.decode()
    assert not _flags(result)


def test_a_join_that_is_not_one_row_per_window_is_flagged():
    # along dim 1, without the leading axis (windows end to end), or a list reordered before the join
    for old, new in [
        ("torch.cat([s[None, :] for s in xs], dim=0)", "torch.cat([s[None, :] for s in xs], dim=1)"),
        ("torch.cat([s[None, :] for s in xs], dim=0)", "torch.cat([s for s in xs], dim=0)"),
        ("    x = torch.cat(", "    xs.reverse()\n    x = torch.cat("),
        ("    y = torch.stack(ys)", "    ys = ys[::-1]\n    y = torch.stack(ys)"),
    ]:
        source = LISTED.replace(old, new)
        assert source != LISTED
        result = _rewrite(source)
        assert "chunk(" not in result.code.decode(), new
        flags = _flags(result)
        assert flags and all(differs for _, differs, _ in flags), new
        assert "is not made of rows picked by the draw" in flags[0][2], new


# the seed read from a parameter: go(arg) called once with the parsed command line (pbloem/former's
# generate.py). Every call passes a value every rank shares, so every rank draws alike.
FROM_MAIN = '''
import argparse

import torch
import torch.nn as nn

batch_size, block = 8, 4
data = torch.arange(500) % 13


def get_batch():
    ix = torch.randint(len(data) - block, (batch_size,))
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
    return x, y


def go(arg):
    torch.manual_seed(arg.seed)
    model = nn.Sequential(nn.Embedding(13, 16), nn.Linear(16, 13))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        xb, yb = get_batch()
        loss = nn.functional.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=1)
    options = parser.parse_args()
    go(options)
'''


def test_a_seed_passed_down_from_the_parsed_command_line_is_split():
    result = _rewrite(FROM_MAIN)
    assert "xb = xb.chunk(dist.get_world_size())[dist.get_rank()]" in result.code.decode()
    assert not _flags(result)


def test_a_seed_parameter_the_rewrite_cannot_follow_everywhere_is_flagged():
    for old, new in [
        ("    go(options)", "    go(options.seed + int(__import__('os').environ.get('RANK', 0)))"),  # per rank
        ("    go(options)", "    runner = go\n    runner(options)"),  # the function escapes: calls not seen
        ("    go(options)", "    go(options)\n    go(argparse.Namespace(seed=__import__('random').random()))"),
    ]:
        source = FROM_MAIN.replace(old, new)
        assert source != FROM_MAIN
        result = _rewrite(source)
        assert "chunk(" not in result.code.decode(), new
        flags = _flags(result)
        assert flags and "may differ between ranks" in flags[0][2], (new, flags)


DIFFUSION = """\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def sample_timesteps(n):
    return torch.randint(low=1, high=1000, size=(n,))


model = nn.Linear(9, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=16, shuffle=True)
for (x,) in loader:
    t = sample_timesteps(x.shape[0])
    noise = torch.randn_like(x)
    loss = (model(torch.cat([x + noise, t[:, None] / 1000], dim=1)) - noise).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


def test_a_draw_beside_a_training_dataloader_is_not_read_as_a_batch():
    """A diffusion step's timesteps (`return torch.randint(..., size=(n,))` in a helper) while the
    batches come from a DataLoader: no "no DataLoader ... every rank trains on the same batches"
    flag (minDiffusion, dome272/Diffusion-Models-pytorch; was a differs item at the draw)."""
    result = _rewrite(DIFFUSION)
    assert _flags(result) == []
    assert "DistributedSampler" in result.code.decode()
    # without the DataLoader the same draw is still reported
    no_loader = DIFFUSION.replace("loader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=16, shuffle=True)",
                                  "loader = [(torch.randn(16, 8),) for _ in range(4)]")
    assert [differs for _, differs, _ in _flags(_rewrite(no_loader))] == [True]
