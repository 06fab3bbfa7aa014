"""Every rule's VALID cases yield nothing; every INVALID case yields exactly its own
finding on its line, and its fix (safe or unsafe) gives exactly the documented code."""
from __future__ import annotations

import pytest

from fsdp2_retrofit.check.lint import lint_source
from fsdp2_retrofit.check.rules import all_rules

pytestmark = pytest.mark.smoke  # the smoke loop: README, "Running the tests"

RULES = all_rules()
VALID = [(r, i, c) for r in RULES for i, c in enumerate(r.VALID)]
INVALID = [(r, i, c) for r in RULES for i, c in enumerate(r.INVALID)]


def _id(item):
    rule, i, _ = item
    return f"{rule.CODE}-{i}"


def test_catalogue_is_complete():
    codes = [r.CODE for r in RULES]
    assert codes == [f"FSD1{n:02d}" for n in range(1, 27)] + ["FSD401"]
    assert [r.CODE for r in RULES if not r.DEFAULT] == ["FSD401"]  # 4xx: off unless selected
    for rule in RULES:
        doc = rule.__doc__ or ""
        for heading in ("## What it does", "## Why is this bad?", "## Example", "## Use instead", "## Fix safety"):
            assert heading in doc, (rule.CODE, heading)
        assert rule.NAME and rule.MESSAGE and rule.VALID and rule.INVALID


@pytest.mark.parametrize("rule", RULES, ids=[r.CODE for r in RULES])
def test_declared_fix_safety_is_what_the_cases_show(rule):
    """`rules` marks unsafe fixes from FIX_SAFETY: it must be what the fixes are."""
    seen = set()
    for case in rule.INVALID:
        for f in lint_source(case.code.encode(), case.path, [rule]).findings:
            if f.fix is not None:
                seen.add("safe" if f.fix.safe else "unsafe")
    if seen:
        assert {"safe": {"safe"}, "unsafe": {"unsafe"}, "mixed": {"safe", "unsafe"}}[rule.FIX_SAFETY] == seen


@pytest.mark.parametrize("item", VALID, ids=[_id(v) for v in VALID])
def test_valid_cases_yield_nothing(item):
    rule, _, case = item
    findings = lint_source(case.code.encode(), case.path, RULES).findings
    assert [f for f in findings if f.code == rule.CODE] == []


@pytest.mark.parametrize("item", INVALID, ids=[_id(v) for v in INVALID])
def test_invalid_cases_yield_one_finding_on_their_line(item):
    rule, _, case = item
    findings = [f for f in lint_source(case.code.encode(), case.path, RULES).findings if f.code == rule.CODE]
    assert [(f.code, f.line) for f in findings] == [(rule.CODE, case.line)]
    fixed = lint_source(case.code.encode(), case.path, [rule], fix=True, unsafe_fixes=True)
    if case.fixed is None:
        assert findings[0].fix is None
        assert fixed.fixed is None
    else:
        assert findings[0].fix is not None
        assert (fixed.fixed or b"").decode() == case.fixed
        assert fixed.findings == []


def test_fsdp1_in_a_test_module_or_a_copy_of_torch_is_a_note_not_an_error():
    """FSD111 leaves the files whose subject FSDP1 is to FSD401 (off by default)."""
    code = b"from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\nmodel = FSDP(model)\n"
    for path in ("tests/test_fsdp1.py", "pkg/fsdp1_test.py", "third_party/torch/distributed/fsdp/api.py"):
        codes = [f.code for f in lint_source(code, path, RULES).findings]
        assert codes == ["FSD401"], path
    assert [f.code for f in lint_source(code, "train.py", RULES).findings] == ["FSD111"]
    from fsdp2_retrofit.check.rules import selected

    assert "FSD401" not in [r.CODE for r in selected([], [])]
    assert "FSD401" in [r.CODE for r in selected([], [], ["FSD4"])]
