"""Every blocker's INVALID cases are refused with its code at their line, its VALID cases
convert, and every code of the refusal catalogue has at least one INVALID case."""
from __future__ import annotations

from pathlib import Path

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.rewrite.blockers import FAMILIES, Blocker, all_blockers, family_blockers
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.rewrite.refusals import CATALOGUE

BLOCKERS = all_blockers()
INVALID = [(b, i, c) for b in BLOCKERS for i, c in enumerate(b.INVALID)]
VALID = [(b, i, c) for b in BLOCKERS for i, c in enumerate(b.VALID)]


def _id(item) -> str:
    blocker, index, _ = item
    return f"{blocker.CODE}-{index}"


def _rewrite(tmp_path: Path, case):
    """The rewrite of the case's entry, `train.py`, beside its project's other modules."""
    for rel, text in case.files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    entry = tmp_path / "train.py"
    entry.write_text(case.source)
    options = RetrofitOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in case.options.items()})
    if getattr(case, "stage", ""):
        return entry, _stage_alone(case.stage, case.source, str(entry), options)
    return entry, rewrite_source(case.source.encode(), str(entry), options)


def _stage_alone(name: str, source: str, path: str, options: RetrofitOptions):
    """The stage called `name` run on its own, as libcst's codemod tool runs it: its refusal (or None)."""
    import libcst as cst
    from types import SimpleNamespace

    from codemods.retrofit import GROUPS
    from fsdp2_retrofit.report import RefusedError
    from fsdp2_retrofit.rewrite.context import RewriteContext

    stage = next(s for group in GROUPS for s in group if s.CODE == name)
    try:
        stage(RewriteContext(filename=path), options).transform_module(cst.parse_module(source))
    except RefusedError as refused:
        return SimpleNamespace(refusals=[refused.refusal], code=source, original=source)
    return SimpleNamespace(refusals=[], code=None, original=source)


def test_every_code_has_an_invalid_case():
    missing = [b.CODE for b in BLOCKERS if not b.INVALID]
    assert not missing, f"blockers without an INVALID case: {missing}"
    assert sorted(CATALOGUE) == [b.CODE for b in BLOCKERS]


def test_families_are_one_file_each_in_code_order():
    import importlib

    seen = set()
    for name in FAMILIES:
        module = importlib.import_module(f"fsdp2_retrofit.rewrite.blockers.{name}")
        blockers = family_blockers(module)
        assert blockers, f"family {name} defines no blocker"
        assert module.__doc__, f"family {name} has no docstring"
        for blocker in blockers:
            assert blocker.__module__ == module.__name__, f"{blocker.CODE} is imported into {name}, not defined there"
            assert blocker.CODE not in seen
            seen.add(blocker.CODE)
            assert blocker.rule().stage.endswith(name) or name in blocker.rule().stage, (blocker.CODE, name)


def test_a_docstring_without_its_sections_is_an_error():
    class Broken(Blocker):
        """Only a summary."""

        CODE = "FSR999"
        NAME = "broken"

    with pytest.raises(TypeError, match="## Why"):
        Broken.rule()


@pytest.mark.parametrize("item", INVALID, ids=[_id(i) for i in INVALID])
def test_invalid_case_is_refused_with_its_code_at_its_line(tmp_path, item):
    blocker, _, case = item
    entry, result = _rewrite(tmp_path, case)
    assert result.refusals, f"{blocker.CODE}: converted, expected a refusal"
    refusal = result.refusals[0]
    where = Path(refusal.path or entry).resolve()
    assert (refusal.code, refusal.line) == (blocker.CODE, case.line), refusal
    assert where == (tmp_path / (case.path or "train.py")).resolve(), refusal
    assert result.code == result.original


@pytest.mark.parametrize("item", VALID, ids=[_id(i) for i in VALID])
def test_valid_case_converts(tmp_path, item):
    blocker, _, case = item
    _, result = _rewrite(tmp_path, case)
    assert not result.refusals, result.refusals[0]
    assert result.code != result.original
