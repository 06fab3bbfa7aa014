"""The rewritten script is checked for the run-time crashes no stage can fix (FSD117):
each finding is an attention item at the user's line, and the crash it announces is
real (the output run under torchrun with the branch taken)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from textwrap import dedent

import pytest

from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.verify import VerifyError, launch_distributed
from rewrite_cases import FIXTURES, rewrite_case

CASE = FIXTURES / "param_numpy_logging"


def _numpy_line(path: Path) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if ".numpy()" in line)


def test_the_report_names_the_line_of_the_numpy_call():
    result = rewrite_case(CASE)
    flagged = [a for a in result.attention if a.what.startswith("FSD117")]
    assert [a.line for a in flagged] == [_numpy_line(CASE / "input.py")]
    assert flagged[0].differs and flagged[0].code == "check"
    assert ".numpy()" in (CASE / "expected.py").read_text()  # left as written: only a person can place the gather


@pytest.mark.parametrize("read", [
    "value.shape",  # plain numbers
    "value.detach().norm().item()",
    "value.full_tensor().cpu().numpy()",  # already gathered (a collective on every rank)
])
def test_reads_that_survive_sharding_are_not_flagged(read):
    script = (CASE / "input.py").read_text().replace("value.detach().cpu().numpy()", read)
    result = rewrite_source(script.encode(), "train.py")
    assert not result.refusals
    assert not [a for a in result.attention if a.code == "check"], result.attention


def test_output_without_numpy_or_tolist_is_not_analysed(monkeypatch):
    import libcst as cst

    from fsdp2_retrofit.check import lint
    from fsdp2_retrofit.output_check import crashes_in_output
    from fsdp2_retrofit.syntax.names import Origins

    built = []
    original = lint.LintContext.__init__
    monkeypatch.setattr(lint.LintContext, "__init__", lambda self, *a, **k: built.append(1) or original(self, *a, **k))
    for text, analysed in [
        ("from torch.distributed.fsdp import fully_shard\nfully_shard(model)\nw = model.head.weight.tolist()\n", True),
        ("from torch.distributed.fsdp import fully_shard\nfully_shard(model)\nopt = SGD(model.parameters())\n", False),
    ]:
        built.clear()
        module = cst.parse_module(text)
        found = crashes_in_output(module, text.encode(), "train.py", Origins(module, text))
        assert bool(built) is analysed and bool(found) is analysed, (text, found)


def test_a_rewrite_without_numpy_tolist_or_a_save_does_not_load_check():
    """The gate comes before the imports: a fresh interpreter rewriting a script that
    can hit neither FSD117 nor FSD102 (main_modulelist without its save) never loads check's
    modules (start-up cost of every rewrite); with its save, FSD102 runs on the output."""
    source = (FIXTURES / "main_modulelist" / "input.py").read_text(encoding="utf-8")
    unsaved = source.replace("    torch.save(model.state_dict(), args.out)\n", "")
    assert unsaved != source
    for text, loaded in ((unsaved, False), (source, True)):
        code = (
            "import sys\nfrom fsdp2_retrofit.pipeline import rewrite_source\n"
            f"rewrite_source({text.encode()!r}, 'train.py')\n"
            "print(sorted(m for m in sys.modules if m.startswith('fsdp2_retrofit.check')))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert (out.strip() != "[]") is loaded, out


@pytest.mark.e2e
def test_the_flagged_line_does_crash_under_fsdp2(tmp_path: Path):
    """What the attention item says happens: with the branch taken, the output dies at
    the `.numpy()` (the parity run, where it is not taken, is test_execution's)."""
    with pytest.raises(VerifyError) as failure:
        launch_distributed(CASE / "expected.py", ["--batch-size", "32", "--log-every", "2"], tmp_path / "dist")
    assert "numpy" in failure.value.detail.lower() or "DTensor" in failure.value.detail, failure.value.detail


# --- the rewrite's output passes its own check, or the report says what check finds -----------------

import re  # noqa: E402

from fsdp2_retrofit.check.lint import lint_source  # noqa: E402
from fsdp2_retrofit.check.rules import all_rules  # noqa: E402
from rewrite_cases import case_params, project_copy, edits_siblings  # noqa: E402

_CODE = re.compile(r"^(FSD\d{3}):")


def reported_codes(result) -> set:
    """The check codes the rewrite's report names in its attention items, in every file it edits."""
    return {m.group(1) for file in result.files for a in file.attention for m in [_CODE.match(a.what)] if m}


def own_check_findings(case: Path) -> list:
    """(file, code, line) for what `check` finds in the case's goldens, each read where it runs: the
    script beside the modules it imports; for a multi-file case, in a copy of its project holding the
    edited modules' goldens (expected/), each of those checked too."""
    if not edits_siblings(case):
        checked = [(case / "expected.py", case / "input.py")]
    else:
        folder = project_copy(case, "expected.py")
        checked = [(folder / "input.py", folder / "input.py")]
        checked += [(folder / p.relative_to(case / "expected"),) * 2 for p in sorted((case / "expected").rglob("*.py"))]
    found = []
    for path, name in checked:
        for f in lint_source(path.read_bytes(), str(name), all_rules()).findings:
            found.append((name.name, f.code, f.line))
    return found


@pytest.mark.parametrize("case", case_params())
def test_every_check_finding_on_a_golden_output_is_in_its_report(case: Path):
    """The output passes the tool's own check, or each finding is an attention item of the report
    (issue 29 item 6): a user who runs check after the rewrite learns nothing the report did not say."""
    findings = own_check_findings(case)
    missing = [f for f in findings if f[1] not in reported_codes(rewrite_case(case))]
    assert not missing, f"check finds what the report does not say: {missing}"


def test_the_own_check_test_can_fail():
    """A golden with a finding (param_numpy_logging's FSD117) against a report without it."""
    findings = own_check_findings(CASE)
    assert [code for _, code, _ in findings] == ["FSD117"]

    class Empty:
        files = []

    assert "FSD117" not in reported_codes(Empty())


def test_a_save_no_stage_converted_is_reported_by_fsd102_on_the_output(monkeypatch):
    """The safety net under the checkpoint stage: were it to miss a save (simulated: the stage does
    nothing), FSD102 on the output reports `torch.save` of the sharded state at the user's line."""
    from codemods.checkpoint import ConvertSavesCommand

    source = (FIXTURES / "main_modulelist" / "input.py").read_bytes()
    line = next(i for i, text in enumerate(source.decode().splitlines(), 1) if "torch.save(" in text)
    assert not [a for a in rewrite_source(source, "train.py").attention if a.code == "check"]
    monkeypatch.setattr(ConvertSavesCommand, "edit", lambda self, tree, facts, editor: None)
    found = [a for a in rewrite_source(source, "train.py").attention if a.code == "check"]
    assert [(a.line, a.differs) for a in found] == [(line, True)], found
    assert found[0].what.startswith("FSD102: `torch.save` of")
