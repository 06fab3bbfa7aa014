"""Renaming a script's local names never changes what the rewrite does (issue 27).

Every fixture input is alpha-renamed (tests/alpha_rename.py: each local name of each
scope gets a prefix of its own, so a helper's `train_loader` and its caller's are no
longer spelled alike) and rewritten with the fixture's options. The outcome must be the
same as for the input itself: the same refusal codes at the same lines, or the same
output once the prefixes are taken off again, with the same changes and attention items
(stage code, line, `differs`). Since the output is the same program, the fixture's own
execution test (parity with the original) covers the renamed script too.
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from alpha_rename import alpha_rename, unrename
from fsdp2_retrofit.pipeline import rewrite_source
from rewrite_cases import CASES, case_options, case_params, rewrite_case, sampled, script_path


def _fresh(text: str) -> str:
    return re.sub(r"\b([A-Za-z]\w*?)_\d+\b", r"\1", text)


def _outcome(result) -> tuple:
    return (
        [(r.code, r.line) for r in result.refusals],
        sorted((c.line, c.code) for c in result.changes),
        sorted((a.line, a.code, a.differs) for a in result.attention),
        [(Path(s.path).name, s.code) for s in result.siblings],
    )


@pytest.mark.parametrize("case", case_params(sample=4))  # every fixture in the full run
def test_renamed_locals_rewrite_the_same(case):
    original = rewrite_case(case)
    source = (case / "input.py").read_text(encoding="utf-8")
    renamed_source = alpha_rename(source)
    assert renamed_source != source or "def " not in source, "the renamer renamed nothing"
    renamed = rewrite_source(renamed_source.encode("utf-8"), str(script_path(case)), case_options(case))
    assert _outcome(renamed) == _outcome(original)
    # a name the rewrite adds takes a numbered spelling (`rank_1`) where the user's own name is
    # taken; with the user's names prefixed it is not: the numbers are not compared
    got = _fresh(unrename(renamed.code.decode("utf-8")))
    want = _fresh(original.code.decode("utf-8"))
    assert got == want, "\n".join(difflib.unified_diff(want.splitlines(), got.splitlines(), "original", "renamed",
                                                       lineterm=""))


def test_the_renamer_separates_scopes():
    source = (
        "def build():\n    loader = make()\n    return loader\n\n"
        "def main():\n    loader = build()\n    for x in loader:\n        step(x, loader=loader)\n"
    )
    renamed = alpha_rename(source)
    helper, caller = renamed.split("def main")
    assert "loader" in helper and "loader" in caller
    helper_names = {w for w in helper.replace("(", " ").replace(")", " ").split() if w.endswith("_loader")}
    caller_names = {w for w in caller.replace("(", " ").replace(")", " ").replace(":", " ").split()
                    if w.endswith("_loader")}
    assert helper_names and caller_names and not helper_names & caller_names
    assert "loader=" in renamed  # a keyword of a callee that is not the script's keeps its spelling
    assert unrename(renamed) == source


CHECK_FILES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "check").glob("*.py"))


@pytest.mark.parametrize("path", sampled(CHECK_FILES + [c / "expected.py" for c in CASES], 4),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_renamed_locals_check_the_same(path):
    """`check` finds the same rule codes at the same lines in a file whose locals are renamed
    (the check fixtures with their planted defects, and every rewrite golden)."""
    from fsdp2_retrofit.check.lint import lint_source
    from fsdp2_retrofit.check.rules import all_rules

    source = path.read_text(encoding="utf-8")
    findings = lint_source(source.encode("utf-8"), str(path), all_rules()).findings
    renamed = lint_source(alpha_rename(source).encode("utf-8"), str(path), all_rules()).findings
    assert sorted((f.code, f.line) for f in renamed) == sorted((f.code, f.line) for f in findings)
