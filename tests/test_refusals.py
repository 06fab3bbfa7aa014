"""The refusal catalogue: every refusal names a code that exists, every code is used,
and the CLI shows it."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.rewrite.refusals import CATALOGUE, STAGES, all_refusals, refusal_by_code

ROOT = Path(__file__).resolve().parent.parent
# where refusals are raised (codemods) or prepared for a stage to raise (analysis)
# or found by a blocker family's checks for its stage to raise (rewrite/blockers/, `Blocked(...)`)
SOURCES = (sorted((ROOT / "codemods").glob("*.py")) + sorted((ROOT / "fsdp2_retrofit" / "analysis").glob("*.py"))
           + sorted((ROOT / "fsdp2_retrofit" / "rewrite" / "blockers").glob("*.py")))
CODE = re.compile(r"FSR\d{3}")
# refusals prepared by the analysis and raised as they come: (file, first argument)
PASSED_ON = {("migrate_fsdp1.py", "problem.code"), ("shard.py", "kind")}


def _calls(name_pattern: str):
    """(file name, call node) of every call to a function or method matching the pattern."""
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if re.fullmatch(name_pattern, name):
                    yield path.name, node


def _code_literals():
    found = {}
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        defined = {id(n.value) for n in ast.walk(tree)  # a blocker's own `CODE = "FSR601"`: its catalogue entry
                   if isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["CODE"]}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and CODE.fullmatch(node.value)
                    and id(node) not in defined):
                found.setdefault(node.value, []).append(f"{path.name}:{node.lineno}")
    return found


def test_the_sources_are_found():
    assert any(p.name == "shard.py" for p in SOURCES) and any(p.name == "fsdp1.py" for p in SOURCES)


def test_every_refuse_call_names_a_code_of_the_catalogue():
    calls = list(_calls("refuse|_refuse|Problem|Blocked"))
    assert len(calls) > 50
    for file, call in calls:
        first = call.args[0] if call.args else None
        where = f"{file}:{call.lineno}"
        if isinstance(first, ast.Constant):
            assert first.value in CATALOGUE, f"{where}: {first.value!r} is not in the refusal catalogue"
        else:
            text = ast.unparse(first) if first is not None else ""
            # `_refuse(code, ...)` hands its own parameter on to Problem
            assert (file, text) in PASSED_ON or (file == "fsdp1.py" and text == "code"), (
                f"{where}: refusal without a literal code ({text or 'no arguments'})"
            )


def test_every_code_in_the_sources_is_catalogued_and_every_entry_is_used():
    found = _code_literals()
    unknown = sorted(set(found) - set(CATALOGUE))
    assert not unknown, {c: found[c] for c in unknown}
    unused = sorted(set(CATALOGUE) - set(found))
    assert not unused, f"catalogue entries no refusal uses: {unused}"


def test_codes_follow_their_stage():
    codes = [r.code for r in all_refusals()]
    assert codes == sorted(codes) and len(set(codes)) == len(codes)
    assert len({r.name for r in all_refusals()}) == len(codes)
    raised_in = {}
    for file, call in _calls("refuse|_refuse|Problem|Blocked"):
        if call.args and isinstance(call.args[0], ast.Constant):
            raised_in.setdefault(call.args[0].value, set()).add(file)
    for rule in all_refusals():
        assert re.fullmatch(r"FSR[1-9]\d\d", rule.code) and rule.code[3] in STAGES
        for text in (rule.summary, rule.why, rule.fix):
            assert text and "\n" not in text
        for file in raised_in.get(rule.code, ()):
            # a stage's codes are raised by its codemod (or the analysis feeding it)
            assert file in (f"{rule.stage}.py", "fsdp1.py", "facts.py", "library_models.py"), (rule.code, file)


def test_refuse_rejects_an_unknown_code():
    from libcst.codemod import CodemodContext

    from fsdp2_retrofit.rewrite.stage import RetrofitStage

    with pytest.raises(ValueError, match="FSR999"):
        RetrofitStage(CodemodContext()).refuse("FSR999", 1, "what", "why")


NO_OPTIMIZER = "import torch\nimport torch.nn as nn\n\nmodel = nn.Linear(2, 2)\nmodel(torch.ones(2)).sum().backward()\n"


def test_cli_refusal_line_and_json_carry_the_code(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "train.py"
    path.write_text(NO_OPTIMIZER)
    result = CliRunner().invoke(cli.main, ["rewrite", str(path)])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[0].startswith(f"{path}:4: FSR612 no optimizer trains a model")
    report = CliRunner().invoke(cli.main, ["rewrite", "--report", "json", str(path)])
    assert [r["code"] for r in json.loads(report.stdout)[0]["refusals"]] == ["FSR612"]
    assert path.read_text() == NO_OPTIMIZER


def test_rules_lists_lint_rules_and_refusals_and_explains_one():
    listing = CliRunner().invoke(cli.main, ["rules"]).output
    assert "FSD101" in listing
    for rule in all_refusals():
        assert f"{rule.code}  " in listing and rule.name in listing
    doc = CliRunner().invoke(cli.main, ["rules", "fsr612"])
    assert doc.exit_code == 0
    rule = refusal_by_code("FSR612")
    assert doc.output == rule.doc()
    assert doc.output.startswith("# FSR612 shard-no-optimizer") and "## What to do" in doc.output
    assert CliRunner().invoke(cli.main, ["rules", "FSR000"]).exit_code == 2


def test_rules_shows_a_case_with_its_project_modules_and_its_options_as_flags():
    """A code whose first case needs modules beside the script or an option still gets an example: each
    file in its own block under its name, the options as the flags a user types."""
    doc = CliRunner().invoke(cli.main, ["rules", "FSR970"]).output
    example = doc.split("## Example", 1)[1]
    assert example.startswith(" (refused at engine.py:3)") and "train.py:\n```python" in example
    assert "engine.py:\n```python\ndef train(model, loader, opt):" in example
    shown = [refusal_by_code(c) for c in ("FSR302", "FSR303", "FSR404", "FSR905")]
    assert any("rewritten with --" in r.doc() for r in shown), [r.code for r in shown]
    # every code has an example `rules` can show, or its cases all guard a stage run alone / are too long
    for rule in all_refusals():
        assert rule.example is not None or all(c.stage or len(c.source.splitlines()) > 30 for c in rule.examples)
