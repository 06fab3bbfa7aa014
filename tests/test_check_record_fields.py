"""`check` follows a sharding function held in a callable field of a project record class
(analysis/record_fields.py): torchtitan's `model_spec.parallelize_fn(model, ...)` shape, by the
values the project stores in the field, never by names. Static: torch is not imported."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fsdp2_retrofit.check.lint import lint_source
from fsdp2_retrofit.check.rules import selected

PROJECTS = Path(__file__).resolve().parents[1] / "fixtures" / "check" / "projects"


def _codes(path: Path, *edits: str) -> list:
    """The rule codes `check` reports on the file at `path`, its text edited (old, new pairs)."""
    text = path.read_text()
    for old, new in zip(edits[::2], edits[1::2]):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    result = lint_source(text.encode(), str(path), selected([], []))
    assert result.error is None, result.error
    return sorted(f.code for f in result.findings)


_FORWARD = ("logits = model_parts[0](tokens)", "logits = model_parts[0].forward(tokens)")
_SAVE = ("        loss.backward()\n", "        loss.backward()\n        torch.save(model_parts[0].state_dict(), 'm.pt')\n")


@pytest.mark.parametrize("edit, code", [(_FORWARD, "FSD101"), (_SAVE, "FSD102")], ids=["forward", "torch-save"])
def test_a_dataclass_field_filled_by_a_model_package_shards(edit, code):
    """`model = recipe.shard_fn(model, mesh)`; `model_parts = [model]`: the field's one value
    (models/gpt/__init__.py: `ModelRecipe(..., shard_fn=shard_gpt)`) shards its first parameter."""
    assert _codes(PROJECTS / "registry" / "train.py", *edit) == [code]


@pytest.mark.parametrize("edit, code", [
    (('out = nets["main"](x)', 'out = nets["main"].forward(x)'), "FSD101"),
    (("        optimizer.step()\n", '        torch.save(nets["main"].state_dict(), "m.pt")\n        optimizer.step()\n'),
     "FSD102"),
], ids=["forward", "torch-save"])
def test_a_plain_class_field_set_by_attribute_assignment_shards_in_place(edit, code):
    """`bp = lookup("moe")` (a function, not the class), `bp.distribute(net, mesh)` with no result
    bound: the value is set by `MOE.distribute = apply_sharding` in a package's module."""
    assert _codes(PROJECTS / "registry_alt" / "run.py", *edit) == [code]


def test_the_goldens_are_clean():
    for name in ("registry/train.py", "registry_alt/run.py", "registry_mixed/main.py"):
        assert _codes(PROJECTS / name) == [], name


_MIXED_FORWARD = ("out = model(torch.randn(4, 8))", "out = model.forward(torch.randn(4, 8))")


def test_a_field_one_of_whose_values_does_not_shard_is_still_followed():
    """PLANS holds Plan("fsdp", shard_all) and Plan("compiled", compile_blocks): which one runs is
    decided at run time, so `model.forward(...)` after `plan.prepare(model, ...)` is wrong whenever
    the fsdp plan is chosen; compile_blocks, a project function that does not shard, hides nothing."""
    assert _codes(PROJECTS / "registry_mixed" / "main.py", *_MIXED_FORWARD) == ["FSD101"]


@pytest.fixture
def mixed(tmp_path):
    """A copy of registry_mixed outside the repository (a project of its own)."""
    target = tmp_path / "mixed"
    shutil.copytree(PROJECTS / "registry_mixed", target)
    return target


def _rewrite(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))


def test_without_the_value_that_shards_the_field_is_not_followed(mixed):
    _rewrite(mixed / "variants.py", 'Plan("fsdp", shard_all), ', "")
    assert _codes(mixed / "main.py", *_MIXED_FORWARD) == []


def test_a_dataclass_given_the_field_by_position_only_is_followed(mixed):
    """`Plan("fsdp", shard_all)` never writes the field's name: the file that builds the records is
    read all the same (it was skipped by the text search for the field's name before)."""
    text = (mixed / "variants.py").read_text().replace(', Plan("compiled", compile_blocks)', "")
    (mixed / "variants.py").write_text(text.replace("`plan.prepare`", "it"))
    assert "prepare" not in (mixed / "variants.py").read_text()
    assert _codes(mixed / "main.py", *_MIXED_FORWARD) == ["FSD101"]


def test_a_file_that_imports_only_the_record_class_is_not_skipped(tmp_path):
    """The train step moved to trainer.py, which imports only recipe.py (no sharding API anywhere in
    what it imports): the prefilter used to skip it, so the planted `.forward` went unseen, checked
    alone or with the project. It calls the record's field `recipe.shard_fn(...)`: it is analysed."""
    project = tmp_path / "registry"
    shutil.copytree(PROJECTS / "registry", project)
    entry = (project / "train.py").read_text()
    start, end = entry.index("def train("), entry.index("def main():")
    header = "import torch\nimport torch.distributed.checkpoint as dcp\nimport torch.nn.functional as F\n" \
             "from torch.distributed.checkpoint.state_dict import get_model_state_dict\n\nfrom recipe import ModelRecipe\n\n\n"
    (project / "trainer.py").write_text('"""The train step."""\n' + header + entry[start:end].rstrip() + "\n")
    (project / "train.py").write_text(entry[:start].replace("from recipe import ModelRecipe\n", "from trainer import train\n")
                                      + entry[end:])
    assert _codes(project / "trainer.py") == []
    assert _codes(project / "trainer.py", *_FORWARD) == ["FSD101"]


def test_the_fields_a_file_may_call_are_those_annotated_callable(tmp_path):
    """What the prefilter reads of an imported module, by text: a `.dim(` or `.items(` call is no
    reason to analyse a file that imports no sharding API; a field annotated `Callable`, through
    Optional, a string or a module-level alias, is; a parameter of a split signature is no field."""
    from fsdp2_retrofit.analysis.record_fields import _callable_fields

    text = (b"from dataclasses import dataclass\nfrom typing import Callable, Optional\n\n"
            b"Shard = Callable[..., object]\n\n\n@dataclass\nclass Spec:\n    dim: int\n    items: list\n"
            b"    shard_fn: Shard\n    hook: Optional[Callable] = None\n    note: 'Callable[[], None]' = None\n"
            b"\n\ndef run(\n    step_fn: Callable,\n    other: int,\n):\n    pass\n")
    assert _callable_fields(text) == {b"shard_fn", b"hook", b"note"}
