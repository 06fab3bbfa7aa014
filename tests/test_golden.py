"""Golden outputs: every fixture rewrites to exactly its expected.py, and a second
rewrite of expected.py changes nothing (idempotence). Each file is rewritten once
a session (tests/rewrite_cases.py); every test below makes its own assertions on it.

When a golden file must change, regenerate it with `python tests/test_golden.py
CASE` and read the diff it prints before committing it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fsdp2_retrofit.report import unified_diff
from rewrite_cases import FIXTURES, case_config, case_params, rewrite_case, sibling_goldens

pytestmark = pytest.mark.smoke  # the smoke loop: README, "Running the tests"


@pytest.mark.parametrize("case", case_params())
def test_fixture_rewrites_to_expected(case: Path):
    result = rewrite_case(case)
    assert not result.refusals, result.refusals
    expected = (case / "expected.py").read_bytes()
    if result.code != expected:
        diff = unified_diff("expected.py", expected.decode(), result.code.decode(), "got.py")
        pytest.fail(f"{case.name}: the rewrite differs from expected.py:\n{diff}")
    folder = Path(result.path).parent
    edited = {Path(s.path).resolve().relative_to(folder.resolve()).as_posix(): s.code for s in result.siblings}
    goldens = sibling_goldens(case)
    assert sorted(edited) == sorted(goldens), f"{case.name}: edits {sorted(edited)}, goldens in expected/ {sorted(goldens)}"
    for rel, code in edited.items():
        if code != goldens[rel]:
            diff = unified_diff(f"expected/{rel}", goldens[rel].decode(), code.decode(), f"got/{rel}")
            pytest.fail(f"{case.name}: the rewrite of {rel} differs from expected/{rel}:\n{diff}")


@pytest.mark.parametrize("case", case_params())
def test_rewrite_of_expected_changes_nothing(case: Path):
    result = rewrite_case(case, "expected.py")
    assert not result.refusals, result.refusals
    assert result.code == (case / "expected.py").read_bytes()
    assert result.changes == []
    assert result.siblings == []


@pytest.mark.parametrize("case", case_params())
def test_report_names_what_needs_attention(case: Path):
    expected = case_config(case).get("report", {}).get("attention", [])
    found = [a.what for file in rewrite_case(case).files for a in file.attention]  # the script's and its modules'
    for fragment in expected:
        assert any(fragment in what for what in found), f"{fragment!r} not in {found}"


@pytest.mark.parametrize("case", case_params())
def test_every_change_points_at_a_line_of_the_input(case: Path):
    result = rewrite_case(case)
    folder = Path(result.path).parent.resolve()
    assert any(file.changes for file in result.files)
    for file in result.files:  # the script's changes, and those of each project module it edits (a thin entry: none)
        lines = Path(file.path).resolve().read_text().splitlines()
        assert Path(file.path).resolve().parent.is_relative_to(folder)
        for change in file.changes:
            assert 1 <= change.line <= len(lines), change
            assert Path(change.path).resolve() == Path(file.path).resolve(), change


if __name__ == "__main__":
    # Regenerate golden files for the named cases and show what changed.
    for name in sys.argv[1:]:
        case = FIXTURES / name
        result = rewrite_case(case)
        new = result.code
        old = (case / "expected.py").read_bytes() if (case / "expected.py").exists() else b""
        print(unified_diff(f"{name}/expected.py", old.decode(), new.decode()) or f"{name}: unchanged")
        (case / "expected.py").write_bytes(new)
        for sibling in result.siblings:
            rel = Path(sibling.path).resolve().relative_to(Path(result.path).parent.resolve())
            golden = case / "expected" / rel
            old = golden.read_bytes() if golden.exists() else b""
            print(unified_diff(f"{name}/expected/{rel}", old.decode(), sibling.code.decode()) or f"{rel}: unchanged")
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_bytes(sibling.code)
