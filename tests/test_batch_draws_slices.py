"""Batches a script slices by hand in a counted loop (codemods/batch_draws.py, SliceLoop).

`for k in range(rows // B):` training on `data[k * B:(k + 1) * B]` (the bounds inline or
bound to names in the loop's body) is split between the ranks: by default each rank runs the
batches k = rank, rank + W, ... (every rank the same number of steps), with
--keep-global-batch each rank keeps its 1/world_size of every batch. A loop of that look the
analysis cannot prove (the index read elsewhere, a count that is not `rows // B`, batches of
two sizes, evaluation under torch.no_grad()) stays flagged, with the reason where it is
known. Before: every such script got "no DataLoader: the batches do not come from a sampler
this tool can shard" at its loop, and every rank trained on the same batches."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from textwrap import dedent

import pytest
from click.testing import CliRunner

from alpha_rename import alpha_rename, unrename
from fsdp2_retrofit import cli
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = '''
import torch
import torch.nn as nn


def train(model, loss, optimizer, x, y):
    optimizer.zero_grad()
    output = loss(model(x), y)
    output.backward()
    optimizer.step()
    return output.item()


def main():
    torch.manual_seed(0)
    trX, trY = torch.randn(64, 4), torch.randint(0, 3, (64,))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    loss = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch_size = 8
    n_examples = len(trX)
    for i in range(5):
        cost = 0.0
        num_batches = n_examples // batch_size
        for k in range(num_batches):
            start, end = k * batch_size, (k + 1) * batch_size
            cost += train(model, loss, optimizer, trX[start:end], trY[start:end])
        print(cost / num_batches)


main()
'''

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite" / "hand_sliced_batches" / "input.py"
GENERIC = "no DataLoader: the batches do not come from a sampler"
BINDING = "            start, end = k * batch_size, (k + 1) * batch_size\n"
SPLIT = ("for k in range(dist.get_rank(), num_batches // dist.get_world_size() * dist.get_world_size(), "
         "dist.get_world_size()):")


def _rewrite(source: str, **options):
    result = rewrite_source(dedent(source).encode(), "train.py", RetrofitOptions(**options))
    assert not result.refusals, result.refusals
    return result


def _line_of(source: str, fragment: str, nth: int = 0) -> int:
    return [i for i, line in enumerate(dedent(source).splitlines(), 1) if fragment in line][nth]


def _flags(result):
    return [(a.line, a.differs, a.what) for a in result.attention if a.code == "batch_draws" and a.differs]


def _generic(result):
    return [a.line for a in result.attention if GENERIC in a.what]


def test_each_rank_runs_every_world_size_th_batch_and_the_same_number_of_steps():
    result = _rewrite(SCRIPT)
    out = result.code.decode()
    assert SPLIT in out
    assert BINDING in out  # the bounds as written: the per-rank batch stays batch_size
    assert not _flags(result) and not _generic(result)
    assert [c.line for c in result.changes if c.code == "batch_draws"] == [_line_of(SCRIPT, "for k in range")]
    # the running sum is this rank's own: said, not flagged as a training difference
    notes = [a for a in result.attention if a.code == "batch_draws"]
    assert [(a.line, a.differs) for a in notes] == [(_line_of(SCRIPT, "cost += train"), False)]
    assert "`cost` adds up the batches of this rank only" in notes[0].what


def test_renamed_locals_give_the_same_outcome():
    original = _rewrite(SCRIPT)
    renamed = _rewrite(alpha_rename(dedent(SCRIPT)))
    assert SPLIT in original.code.decode()
    assert unrename(renamed.code.decode()) == original.code.decode()
    assert sorted((c.line, c.code) for c in renamed.changes) == sorted((c.line, c.code) for c in original.changes)
    assert sorted((a.line, a.differs) for a in renamed.attention) == sorted(
        (a.line, a.differs) for a in original.attention)


def test_bounds_in_other_spellings_are_the_same_shape():
    for binding in ("            start = batch_size * k\n            end = start + batch_size\n",
                    "            start, end = k * batch_size, k * batch_size + batch_size\n",
                    "            start, end = batch_size * k, batch_size * (1 + k)\n"):
        result = _rewrite(SCRIPT.replace(BINDING, binding))
        assert SPLIT in result.code.decode(), binding
        assert not _flags(result) and not _generic(result)
    cut = "[k * batch_size:(k + 1) * batch_size]"
    inline = SCRIPT.replace(BINDING, "").replace("trX[start:end], trY[start:end]", f"trX{cut}, trY{cut}")
    assert SPLIT in _rewrite(inline).code.decode()
    other_dim = SCRIPT.replace("trX[start:end]", "trX[:, start:end]")  # a sequence-first tensor, cut along dim 1
    assert SPLIT in _rewrite(other_dim).code.decode()


def test_keep_global_batch_keeps_the_rank_part_of_every_batch():
    out = _rewrite(SCRIPT, keep_global_batch=True).code.decode()
    assert "        for k in range(num_batches):\n" in out
    assert 'assert batch_size % dist.get_world_size() == 0, "the batch size must divide' in out
    assert BINDING + ("            start, end = start + batch_size * dist.get_rank() // dist.get_world_size(), "
                      "start + batch_size * (dist.get_rank() + 1) // dist.get_world_size()\n") in out
    inline = SCRIPT.replace(BINDING, "").replace("trX[start:end], trY[start:end]",
                                                 "trX[k * batch_size:(k + 1) * batch_size], trY")
    out = _rewrite(inline, keep_global_batch=True).code.decode()
    assert ("trX[k * batch_size + batch_size * dist.get_rank() // dist.get_world_size():k * batch_size + batch_size "
            "* (dist.get_rank() + 1) // dist.get_world_size()]") in out
    # a bound name read in another slice's bound: every slice is edited in place, no name rebound
    mixed = SCRIPT.replace("trY[start:end]", "trY[start:start + batch_size]")
    out = _rewrite(mixed, keep_global_batch=True).code.decode()
    assert BINDING in out and "start, end = start +" not in out
    assert ("trX[start + batch_size * dist.get_rank() // dist.get_world_size():start + batch_size * "
            "(dist.get_rank() + 1) // dist.get_world_size()]") in out
    assert out.count("start + batch_size * (dist.get_rank() + 1) // dist.get_world_size()]") == 2


def test_an_index_read_elsewhere_in_the_loop_is_flagged_there():
    source = SCRIPT.replace("            cost += train(", "            print(k)\n            cost += train(")
    result = _rewrite(source)
    out = result.code.decode()
    assert "dist.get_rank(), num_batches" not in out
    flags = _flags(result)
    assert [(line, differs) for line, differs, _ in flags] == [(_line_of(source, "print(k)"), True)]
    assert "`k`, the batch index of `for k in range(num_batches)`" in flags[0][2]
    assert "is also read at line" in flags[0][2]
    assert not _generic(result)  # one flag, with the true reason


def test_evaluation_under_no_grad_is_left_alone_and_flagged():
    source = SCRIPT.replace("        for k in range(num_batches):\n            start",
                            "        with torch.no_grad():\n          for k in range(num_batches):\n            start")
    result = _rewrite(source)
    assert "dist.get_rank(), num_batches" not in result.code.decode()
    assert _generic(result) == [_line_of(source, "for k in range")]
    assert SPLIT in _rewrite(SCRIPT).code.decode()  # the same loop, training: split


def test_an_evaluation_loop_beside_the_split_training_loop_keeps_the_whole_data():
    evaluation = ("        with torch.no_grad():\n"
                  "            for j in range(num_batches):\n"
                  "                first, last = j * batch_size, (j + 1) * batch_size\n"
                  "                print(model(trX[first:last]).sum().item())\n")
    source = SCRIPT.replace("        print(cost / num_batches)\n", evaluation + "        print(cost / num_batches)\n")
    result = _rewrite(source)
    out = result.code.decode()
    assert SPLIT in out and "for j in range(num_batches):" in out
    assert not _flags(result) and not _generic(result)


def test_a_count_that_is_not_rows_over_the_batch_size_is_flagged():
    source = SCRIPT.replace("num_batches = n_examples // batch_size", "num_batches = 7")
    result = _rewrite(source)
    assert "dist.get_rank(), num_batches" not in result.code.decode()
    flags = _flags(result)
    assert [(line, differs) for line, differs, _ in flags] == [(_line_of(source, "for k in range"), True)]
    assert "not `rows // batch_size`" in flags[0][2]


def test_batches_of_two_sizes_are_flagged():
    source = SCRIPT.replace("trY[start:end]", "trY[k * 4:(k + 1) * 4]")
    result = _rewrite(source)
    assert "dist.get_rank(), num_batches" not in result.code.decode()
    assert any("the rewrite splits only batches of one size" in what for _, _, what in _flags(result))


def test_the_rewritten_output_is_left_as_is():
    for options in ({}, {"keep_global_batch": True}):
        once = _rewrite(SCRIPT, **options).code.decode()
        assert ("start + batch_size * dist.get_rank()" if options else SPLIT) in once
        assert _rewrite(once, **options).code.decode() == once


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="verify runs the scripts: it needs torch")
def test_verify_finds_the_keep_global_batch_retrofit_of_the_fixture_equivalent(tmp_path: Path):
    """verify retrofits with --keep-global-batch: every rank runs every batch, keeping its half of
    the rows, so 2 ranks match the single run at the same arguments, step by step."""
    report = tmp_path / "r.json"
    result = CliRunner().invoke(cli.main, ["verify", str(FIXTURE), "--steps", "4", "--json", str(report)])
    figures = json.loads(report.read_text())
    print(f"\nhand_sliced_batches, verify --keep-global-batch: max weight diff {figures['weights']['max_abs_diff']}")
    assert result.exit_code == 0, result.output
    assert figures["equivalent"] and len(figures["steps"]) == 4
    assert figures["same_data_on_every_rank"] is False


def test_a_summed_loss_is_scaled_where_the_loop_is_split():
    # each rank's sum covers its own batches: FSDP2's average needs the world size back (data_split)
    source = SCRIPT.replace("output = loss(model(x), y)",
                            'output = nn.functional.cross_entropy(model(x), y, reduction="sum")')
    out = _rewrite(source).code.decode()
    assert SPLIT in out and "(output * dist.get_world_size()).backward()" in out
