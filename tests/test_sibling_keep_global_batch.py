"""--keep-global-batch and a training DataLoader a function of a sibling module builds
(`loader = create_loader(data, batch_size=settings["batch_size"])`, the DistributedSampler
placed in the sibling, the program linked into one analysis): the DataLoader's batch size is
divided where it is built, in the helper, with its assert, whatever value the call passes for
it (or none: the parameter's default, a batch size fixed in the function). Where it cannot be
divided (no batch size: the DataLoader's default, 1), the sibling gets a `differs` item at
its line and verify exits 2 before any run, naming that file and line."""
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


DIVIDED = ('    assert {value} % dist.get_world_size() == 0, "the batch size must divide by the number of ranks"\n'
           "    # --keep-global-batch: each rank reads 1/world_size of the batch; the global batch stays as written.\n"
           "    loader = DataLoader(data, batch_size={value} // dist.get_world_size(), drop_last=drop_last, "
           "sampler=sampler)\n")


@pytest.mark.parametrize("call, helper, value", [
    ('train_loader = create_loader(data, batch_size=settings["batch_size"], shuffle=True)', HELPER, "batch_size"),
    ('train_loader = create_loader(data, settings["batch_size"])', HELPER, "batch_size"),
    ("train_loader = create_loader(data, batch_size=2 * 8)", HELPER, "batch_size"),
    ("train_loader = create_loader(data, shuffle=True)", HELPER, "batch_size"),
    ('train_loader = create_loader(data, **{"batch_size": 2})', HELPER, "batch_size"),
    ('train_loader = create_loader(data, batch_size=settings["batch_size"])',
     HELPER.replace("    return DataLoader", "    print(batch_size)\n    return DataLoader"), "batch_size"),
    ('train_loader = create_loader(data, batch_size=settings["batch_size"])',
     HELPER.replace("batch_size=batch_size,", "batch_size=32,"), "32"),
], ids=["keyword", "positional", "expression", "default", "star-kwargs", "used-otherwise", "fixed-in-helper"])
def test_the_batch_size_is_divided_where_the_loader_is_built(tmp_path: Path, call: str, helper: str, value: str):
    """Whatever the call passes (or leaves to a default), the helper's DataLoader reads 1/world_size of it;
    the helper's other reads of its parameter (a print) keep the value as given; the call stays as written."""
    _, result = _rewrite(tmp_path, call, helper)
    assert f"    {call}\n" in result.code.decode()
    assert not _kept(result)
    (sibling,) = result.siblings
    text = sibling.code.decode()
    assert DIVIDED.format(value=value) in text, text
    assert "    sampler = DistributedSampler(data, shuffle=shuffle, drop_last=drop_last)\n" in text
    if "print" in helper:
        assert "    print(batch_size)\n" in text


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


NO_BATCH_SIZE = HELPER.replace("batch_size=batch_size, ", "")


def test_a_batch_size_that_cannot_be_divided_is_reported_where_the_loader_is_built(tmp_path: Path):
    """A DataLoader given no batch size (the default, 1): nothing to divide; said at its line in loaders.py."""
    _, result = _rewrite(tmp_path, 'train_loader = create_loader(data, batch_size=settings["batch_size"])',
                         NO_BATCH_SIZE)
    kept = _kept(result)
    line = _line_of(dedent(NO_BATCH_SIZE), "return DataLoader(")
    assert [k[0] for k in kept] == [line], kept
    assert "the DataLoader default, 1" in kept[0][1] and "world_size x larger" in kept[0][1]
    (sibling,) = result.siblings
    assert [a.line for a in sibling.attention if a.differs] == [line]
    assert "world_size ==" not in result.code.decode() + sibling.code.decode()


def test_verify_refuses_a_global_batch_it_cannot_keep_before_any_run(tmp_path: Path):
    _rewrite(tmp_path, 'train_loader = create_loader(data, batch_size=settings["batch_size"])', NO_BATCH_SIZE)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(cli.main, ["verify", str(tmp_path / "train.py")])
    assert result.exit_code == EXIT_ERROR, result.output
    line = _line_of(dedent(NO_BATCH_SIZE), "return DataLoader(")
    assert f"loaders.py:{line}: cannot keep the global batch" in result.output.replace("\n", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_verify_also_reads_the_items_of_the_modules_the_retrofit_edits(tmp_path: Path, monkeypatch):
    """A global batch not kept, said on a sibling module (as the rewrite did before), is refused too."""
    import fsdp2_retrofit.pipeline as pipeline
    from fsdp2_retrofit.report import Attention

    rewrite = pipeline.rewrite_source

    def with_item_on_the_sibling(source, filename, options, **more):
        result = rewrite(source, filename, options, **more)
        if more:  # the linked program's own run (rewrite/link.py), inside the outer one
            return result
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
