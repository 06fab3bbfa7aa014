"""The recall benchmark's tables stay true (benchmarks/check_recall.py): each planted
mutation applies exactly once to its golden and still compiles, the goldens give no
finding that is not a documented defect of the golden, and every planted defect with an
expected rule is caught by it (a rule that stops catching one fails here, not only in the
benchmark's report). Static: nothing is run, torch is not imported."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("check_recall", ROOT / "benchmarks" / "check_recall.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_recall", module)
    spec.loader.exec_module(module)
    return module


recall = _load()
MUTATIONS = recall.MUTATIONS


def test_table_is_large_and_ids_unique():
    assert len(MUTATIONS) >= 30
    keys = [m.id for m in MUTATIONS]  # KNOWN_MISSES names rows by id
    assert len(set(keys)) == len(keys)
    codes = {r.CODE for r in recall.default_rules()}
    for m in MUTATIONS:
        assert m.expect is None or m.expect in codes, (m.id, m.expect)
        assert m.defect


@pytest.mark.parametrize("m", MUTATIONS, ids=[f"{m.fixture}:{m.id}" for m in MUTATIONS])
def test_mutation_applies_once_and_compiles(m):
    text = recall.golden(m.fixture).read_text()
    assert text.count(m.old) == 1
    mutated = recall.mutate(m)
    assert mutated != text
    compile(mutated, str(recall.golden(m.fixture)), "exec", dont_inherit=True)


@pytest.mark.parametrize("m", [m for m in MUTATIONS if m.expect], ids=[f"{m.fixture}:{m.id}" for m in MUTATIONS if m.expect])
def test_planted_defect_is_caught_by_its_rule_unless_a_known_miss(m):
    codes = {f.code for f in recall.findings(recall.mutate(m), str(recall.golden(m.fixture)))}
    if m.id in recall.KNOWN_MISSES:
        assert m.expect not in codes, "caught now: remove it from KNOWN_MISSES"
    else:
        assert m.expect in codes, sorted(codes)


def test_known_misses_name_rows_of_the_table():
    assert recall.KNOWN_MISSES <= {m.id for m in MUTATIONS}


def test_mutate_refuses_an_edit_that_does_not_apply_once():
    bad = recall.Mutation("x", "x", MUTATIONS[0].fixture, "this text is not in any golden", "", None)
    with pytest.raises(ValueError):
        recall.mutate(bad)


def test_goldens_have_no_unexplained_findings():
    from test_check import KNOWN_FALSE_POSITIVES

    found = recall.run_goldens()
    # a known false positive is counted as one in the table; any other finding must be a documented defect
    unexplained = [(name, f.code, f.line) for name, fs in found for f in fs
                   if (name, f.code) not in set(recall.GOLDEN_DEFECTS) | KNOWN_FALSE_POSITIVES]
    assert unexplained == []
    # a documented defect of a golden that is no longer reported is stale: remove it from the table
    reported = {(name, f.code) for name, fs in found for f in fs}
    assert set(recall.GOLDEN_DEFECTS) <= reported


def test_known_golden_defects_agree_with_test_check():
    from test_check import KNOWN_GOLDEN_DEFECTS

    assert set(recall.GOLDEN_DEFECTS) == KNOWN_GOLDEN_DEFECTS
