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


def test_a_field_one_of_whose_values_does_not_shard_is_not_followed():
    """PLANS holds Plan("fsdp", shard_all) and Plan("compiled", compile_blocks): which one runs is
    decided at run time, and compile_blocks is a project function that does not shard."""
    assert _codes(PROJECTS / "registry_mixed" / "main.py", *_MIXED_FORWARD) == []


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


def test_without_the_value_that_does_not_shard_the_field_is_followed(mixed):
    _rewrite(mixed / "variants.py", ', Plan("compiled", compile_blocks)', "")
    assert _codes(mixed / "main.py", *_MIXED_FORWARD) == ["FSD101"]


def test_a_value_stored_in_a_test_file_is_left_out(mixed):
    _rewrite(mixed / "variants.py", ', Plan("compiled", compile_blocks)', "")
    (mixed / "tests").mkdir()
    (mixed / "tests" / "test_plans.py").write_text(
        "from plans import Plan\nfrom steps import compile_blocks\n\nPLAN = Plan('compiled', compile_blocks)\n")
    assert _codes(mixed / "main.py", *_MIXED_FORWARD) == ["FSD101"]


def test_a_pass_through_is_left_out_and_a_lambda_does_not_shard(mixed):
    _rewrite(mixed / "variants.py", ', Plan("compiled", compile_blocks)', ', Plan("again", PLANS_A[0].prepare)')
    _rewrite(mixed / "variants.py", "PLANS = [", "PLANS_A = [Plan('fsdp', shard_all)]\nPLANS = [")
    assert _codes(mixed / "main.py", *_MIXED_FORWARD) == ["FSD101"]
    _rewrite(mixed / "variants.py", 'PLANS_A[0].prepare', "lambda model, mesh: model")
    assert _codes(mixed / "main.py", *_MIXED_FORWARD) == []


def test_a_value_changed_in_another_file_is_seen_in_the_same_process(mixed):
    """The field's answer is cached per process, and dropped when a file it read changes."""
    _rewrite(mixed / "variants.py", ', Plan("compiled", compile_blocks)', "")
    assert _codes(mixed / "main.py", *_MIXED_FORWARD) == ["FSD101"]
    _rewrite(mixed / "variants.py", "[Plan(", '[Plan("compiled", compile_blocks), Plan(')
    assert _codes(mixed / "main.py", *_MIXED_FORWARD) == []


def test_a_method_of_a_known_project_class_is_no_field(mixed):
    """`plan` is declared a Plan, which has no field `shard`: the call is not followed even though
    another project class declares a field of that name with a sharding value."""
    (mixed / "other.py").write_text(
        "from dataclasses import dataclass\nfrom typing import Callable\nfrom steps import shard_all\n\n\n"
        "@dataclass\nclass Other:\n    shard: Callable\n\n\nOTHER = Other(shard=shard_all)\n")
    (mixed / "use.py").write_text(
        "from plans import Plan\nimport other\nfrom steps import shard_all\n\n\n"
        "def run(plan: Plan, model):\n    model = plan.shard(model, None)\n    model.forward(1)\n\n\n"
        "def run_other(o: other.Other, model):\n    model = o.shard(model, None)\n    model.forward(1)\n")
    found = lint_source((mixed / "use.py").read_bytes(), str(mixed / "use.py"), selected([], []))
    assert [(f.code, f.line) for f in found.findings] == [("FSD101", 13)]
