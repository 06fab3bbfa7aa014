"""--keep-global-batch and a training DataLoader a function of a sibling module builds
(`loader = create_loader(data, batch_size=settings["batch_size"])`, the DistributedSampler
placed in the sibling): the value the script's call passes for the function's parameter that
is the DataLoader's batch size is divided at the call, with its assert; where no such value
can be divided (the parameter's default, a parameter the function also uses otherwise, a
batch size fixed in the function), the call gets a `differs` item and verify exits 2 before
any run. Before: the batch size stayed whole, the global batch world_size times the single
run's, with only a note on the sibling that verify did not read."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from textwrap import dedent

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.verify import EXIT_EQUIVALENT, EXIT_ERROR

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "fixtures" / "rewrite" / "sibling_loader_keep_global_batch" / "input.py"

HELPER = '''
from torch.utils.data import DataLoader


def create_loader(data, batch_size=4, shuffle=True, drop_last=True):
    return DataLoader(data, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
'''

SCRIPT = '''
import torch
from torch import nn

from loaders import create_loader

settings = {{"batch_size": 2, "lr": 1e-3}}


def main(data):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=settings["lr"])
    {call}
    for epoch in range(2):
        for x in train_loader:
            model(x).sum().backward()
            opt.step()
'''

ASSERT = 'assert {value} % world_size == 0, "the batch size must divide by the number of ranks"'


def _rewrite(tmp_path: Path, call: str, helper: str = HELPER, keep: bool = True):
    (tmp_path / "loaders.py").write_text(dedent(helper))
    source = dedent(SCRIPT).format(call=call)
    script = tmp_path / "train.py"
    script.write_text(source)
    result = rewrite_source(source.encode(), str(script), RetrofitOptions(keep_global_batch=keep))
    return source, result


def _kept(result):
    """The items saying the global batch is not kept, of the script and of the modules it edits."""
    items = [*result.attention, *(a for s in result.siblings for a in s.attention)]
    return [(a.line, a.what) for a in items if a.differs and "--keep-global-batch" in a.what]


def _line_of(source: str, fragment: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if fragment in line)


@pytest.mark.parametrize("call, value", [
    ('train_loader = create_loader(data, batch_size=settings["batch_size"], shuffle=True)', 'settings["batch_size"]'),
    ('train_loader = create_loader(data, settings["batch_size"])', 'settings["batch_size"]'),
    ("train_loader = create_loader(data, batch_size=2 * 8)", "(2 * 8)"),
], ids=["keyword", "positional", "expression"])
def test_the_value_the_call_passes_is_divided_there(tmp_path: Path, call: str, value: str):
    _, result = _rewrite(tmp_path, call)
    text = result.code.decode()
    divided = call.replace(value.strip("()"), f"{value} // world_size")
    assert f"    {ASSERT.format(value=value)}\n    {divided}\n" in text, text
    assert not _kept(result)
    assert any("is divided by the world size here" in c.what for c in result.changes)
    (sibling,) = result.siblings  # the sampler goes in the helper; its batch size stays its parameter
    assert "sampler=DistributedSampler(data, shuffle=shuffle, drop_last=drop_last)" in sibling.code.decode()
    assert "batch_size=batch_size," in sibling.code.decode()


def test_renaming_the_locals_changes_nothing(tmp_path: Path):
    _, first = _rewrite(tmp_path, 'train_loader = create_loader(data, batch_size=settings["batch_size"])')
    renamed = HELPER.replace("batch_size=4", "size=4").replace("batch_size=batch_size", "batch_size=size")
    _, second = _rewrite(tmp_path, 'train_loader = create_loader(data, size=settings["batch_size"])', renamed)
    assert first.code.decode().replace("create_loader(data, batch_size=", "create_loader(data, size=") \
        == second.code.decode()
    assert not _kept(first) and not _kept(second)


def test_without_the_option_the_batch_size_stays(tmp_path: Path):
    call = 'train_loader = create_loader(data, batch_size=settings["batch_size"])'
    _, result = _rewrite(tmp_path, call, keep=False)
    assert f"    {call}\n" in result.code.decode() and "world_size ==" not in result.code.decode()


@pytest.mark.parametrize("call, helper, how", [
    ("train_loader = create_loader(data, shuffle=True)", HELPER, "which the call does not pass (its default is used)"),
    ('train_loader = create_loader(data, **{"batch_size": 2})', HELPER, "which the call may set through `**"),
    ('train_loader = create_loader(data, batch_size=settings["batch_size"])',
     HELPER.replace("    return DataLoader", "    print(batch_size)\n    return DataLoader"),
     "its parameter `batch_size`, which create_loader() also uses otherwise"),
    ('train_loader = create_loader(data, batch_size=settings["batch_size"])',
     HELPER.replace("batch_size=batch_size,", "batch_size=32,"), "is `32` there, not a parameter of create_loader()"),
    ('train_loader = create_loader(data, batch_size=settings["batch_size"])',
     HELPER.replace("batch_size=batch_size, ", ""), "is not an argument of its call there (the DataLoader default, 1)"),
], ids=["default", "star-kwargs", "used-otherwise", "fixed-in-helper", "dataloader-default"])
def test_a_batch_size_that_cannot_be_divided_at_the_call_is_reported_there(tmp_path: Path, call, helper, how):
    source, result = _rewrite(tmp_path, call, helper)
    line = _line_of(source, "train_loader = create_loader(")
    kept = _kept(result)
    assert [k[0] for k in kept] == [line], kept
    assert how in kept[0][1] and "world_size x larger" in kept[0][1]
    assert [a for a in result.attention if a.differs and "--keep-global-batch" in a.what]  # the script's, for verify
    assert "world_size ==" not in result.code.decode()


def test_verify_refuses_a_global_batch_it_cannot_keep_before_any_run(tmp_path: Path):
    source, _ = _rewrite(tmp_path, "train_loader = create_loader(data, shuffle=True)")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(cli.main, ["verify", str(tmp_path / "train.py")])
    assert result.exit_code == EXIT_ERROR, result.output
    line = _line_of(source, "train_loader = create_loader(")
    assert f"train.py:{line}: cannot keep the global batch" in result.output.replace("\n", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_verify_also_reads_the_items_of_the_modules_the_retrofit_edits(tmp_path: Path, monkeypatch):
    """A global batch not kept, said on a sibling module (as the rewrite did before), is refused too."""
    import fsdp2_retrofit.pipeline as pipeline
    from fsdp2_retrofit.report import Attention

    rewrite = pipeline.rewrite_source

    def with_item_on_the_sibling(source, filename, options):
        result = rewrite(source, filename, options)
        sibling = result.siblings[0]
        sibling.attention.append(Attention(5, "data", "--keep-global-batch: not divided there", "why", True,
                                           path=sibling.path))
        return result

    _rewrite(tmp_path, 'train_loader = create_loader(data, batch_size=settings["batch_size"])')
    monkeypatch.setattr(pipeline, "rewrite_source", with_item_on_the_sibling)
    result = CliRunner().invoke(cli.main, ["verify", str(tmp_path / "train.py")])
    assert result.exit_code == EXIT_ERROR, result.output
    assert "loaders.py:5: cannot keep the global batch" in result.output.replace("\n", "")


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the verify runs need torch")
def test_verify_of_the_fixture_keeps_the_global_batch_and_is_equivalent(tmp_path: Path):
    # the script and its module alone, as in a project: expected.py beside them names create_loader() too
    # (another script calling it, for which the rewrite would leave the helper as it is)
    project = tmp_path / "project"
    project.mkdir()
    for name in ("input.py", "loaders.py"):
        (project / name).write_bytes((FIXTURE.parent / name).read_bytes())
    result = CliRunner().invoke(cli.main, ["verify", str(project / "input.py"), "--steps", "6",
                                           "--json", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    print(f"\nsibling_loader_keep_global_batch verify: exit {report.get('exit_code')}, global batch "
          f"{report.get('global_batch')}, max loss diff {report.get('max_loss_diff')}, "
          f"max weight diff {(report.get('weights') or {}).get('max_abs_diff')}")
    assert report["global_batch"] is None, result.output
    assert result.exit_code == EXIT_EQUIVALENT, result.output
    assert report["equivalent"]
