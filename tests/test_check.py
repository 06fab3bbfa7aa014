"""`fsdp2-retrofit check`: the pitfall fixtures, the cross-check against every rewrite
fixture, and the command line (formats, exit codes, noqa, selection, fixes, config)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.check.lint import lint_source
from fsdp2_retrofit.check.rules import all_rules

pytestmark = pytest.mark.smoke  # the smoke loop: README, "Running the tests"

ROOT = Path(__file__).resolve().parent.parent
CHECK_FIXTURES = sorted((ROOT / "fixtures" / "check").glob("*.py"))
REWRITE_FIXTURES = sorted((ROOT / "fixtures" / "rewrite").glob("*/*.py"))
EXAMPLES = ROOT / "fixtures" / "examples"  # the example pair (single-GPU script, hand-written FSDP2 twin)
EXPECT = re.compile(r"#\s*expect:\s*(FSD\d{3})")
# Findings on rewrite goldens that are real defects of the golden, not false positives:
# (fixture, code) pairs a golden is allowed to be flagged for, when the rewrite has a known
# defect there. The same table, with the reason, is GOLDEN_DEFECTS in
# benchmarks/check_recall.py (tests/test_check_recall.py keeps the two equal). The five
# FSD121 findings of old (no set_epoch for passes counted by a `while`) were fixed in the
# rewrite; param_numpy_logging keeps a `.numpy()` of parameters no stage can fix, and the
# rewrite's report names it (tests/test_output_check.py).
KNOWN_GOLDEN_DEFECTS: set = {("param_numpy_logging", "FSD117"), ("batch_size_shaped_tensors", "FSD120")}
# a false positive, counted as one in benchmarks/check_recall.py: the fixture sums its loss over one
# full-batch tensor every rank holds whole, so the backward is rightly unscaled (parity 0.0); FSD119
# does not follow where the data comes from
KNOWN_FALSE_POSITIVES: set = {("sum_loss_full_batch", "FSD119")}

BAD = """\
import torch
from torch.distributed.fsdp import fully_shard

model = Net()
fully_shard(model)
out = model.forward(x)
torch.save(model.state_dict(), "model.pt")
"""


def _lint(path: Path):
    return lint_source(path.read_bytes(), str(path), all_rules()).findings


def _invoke(args, **kwargs):
    return CliRunner().invoke(cli.main, ["check", *args], catch_exceptions=False, **kwargs)


# -- what the rules find -------------------------------------------------------


@pytest.mark.parametrize("path", CHECK_FIXTURES, ids=lambda p: p.name)
def test_check_fixture_findings_are_exactly_the_marked_lines(path):
    expected = sorted(
        (i, m.group(1)) for i, line in enumerate(path.read_text().splitlines(), 1) for m in [EXPECT.search(line)] if m
    )
    found = sorted((f.line, f.code) for f in _lint(path))
    assert found == expected


def test_pitfall_fixtures_cover_every_rule():
    codes = {m.group(1) for p in CHECK_FIXTURES for m in EXPECT.finditer(p.read_text())}
    assert codes == {r.CODE for r in all_rules()}


@pytest.mark.parametrize(
    "path", REWRITE_FIXTURES + sorted(EXAMPLES.glob("*.py")), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_rewrite_fixtures_inputs_and_outputs_have_no_findings(path):
    if path.name == "input.py" and path.parent.name.startswith("fsdp1_"):
        # an FSDP1 input is the FSDP1 API the rewrite removes: check finds that and only that
        assert {f.code for f in _lint(path)} == {"FSD111"}
        return
    if path.parent.name.startswith("fsdp1_") and path.name not in ("expected.py", "reference.py"):
        # a module of an FSDP1 project (its save helper): FSDP1 API, or nothing
        assert {f.code for f in _lint(path)} <= {"FSD111"}
        return
    known = {code for name, code in KNOWN_GOLDEN_DEFECTS | KNOWN_FALSE_POSITIVES
             if path.name == "expected.py" and path.parent.name == name}
    assert [f for f in _lint(path) if f.code not in known] == []


# Each mutation puts one pitfall back into the correct FSDP2 example: the cross-check
# above would pass for a linter that never looks, this shows it looks.
MUTATIONS = [
    ("F.cross_entropy(model(inputs), targets)", "F.cross_entropy(model.forward(inputs), targets)", "FSD101"),
    ("dcp.save(get_model_state_dict(model), checkpoint_id=args.out)", "torch.save(model.state_dict(), args.out)", "FSD102"),
    ("torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
     "gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); print(gn.item())", "FSD107"),
    ("loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)",
     "loader = DataLoader(dataset, batch_size=args.batch_size)", "FSD108"),
]


@pytest.mark.parametrize("before,after,code", MUTATIONS, ids=[m[2] for m in MUTATIONS])
def test_a_pitfall_put_back_into_the_fsdp2_example_is_found(tmp_path, before, after, code):
    text = (EXAMPLES / "train_fsdp2.py").read_text()
    assert before in text
    path = tmp_path / "train.py"
    path.write_text(text.replace(before, after))
    line = next(i for i, l in enumerate(path.read_text().splitlines(), 1) if after.split(";")[0] in l)
    assert [(f.code, f.line) for f in _lint(path)] == [(code, line)]


# -- the command line ----------------------------------------------------------


def test_text_output_and_exit_code(tmp_path):
    (tmp_path / "bad.py").write_text(BAD)
    result = _invoke([str(tmp_path / "bad.py")])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == f"{tmp_path / 'bad.py'}:6:7: FSD101 [*] `model.forward(...)` bypasses FSDP2's hooks on sharded `model`; call `model(...)`"
    assert lines[1].startswith(f"{tmp_path / 'bad.py'}:7:1: FSD102 `torch.save` of the state dict")
    assert lines[2:] == [
        "Found 2 errors.",
        "[*] 1 fixable with the `--fix` option.",
        "(1 hidden fix can be enabled with the `--unsafe-fixes` option.)",
    ]


def test_an_empty_file_is_clean_for_check_and_an_error_for_rewrite(tmp_path):
    """Deliberately different (README, the exit codes of both): `check` lints whatever files it
    is given, and an empty `__init__.py` is ordinary in a package, so it has no finding (exit
    0, like ruff); `rewrite` is asked to convert one training script, and a file with none
    in it (empty, or with no model) is an error (exit 2), so a wrong path is not mistaken for
    a converted script."""
    (tmp_path / "__init__.py").write_text("")
    result = _invoke([str(tmp_path / "__init__.py")])
    assert (result.exit_code, result.output) == (0, "All checks passed!\n")
    rewrite = CliRunner().invoke(cli.main, ["rewrite", str(tmp_path / "__init__.py"), "--no-cache"])
    assert rewrite.exit_code == 2
    assert rewrite.stderr == f"{tmp_path / '__init__.py'}: empty file: nothing to retrofit\n"


def test_clean_files_exit_0_and_a_run_that_checks_no_file_says_so_and_exits_2(tmp_path):
    (tmp_path / "good.py").write_text(BAD.replace("model.forward(x)", "model(x)").replace(
        'torch.save(model.state_dict(), "model.pt")', ""))
    result = _invoke([str(tmp_path / "good.py")])
    assert (result.exit_code, result.output) == (0, "All checks passed!\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _invoke([str(empty)])
    assert result.exit_code == 2
    assert result.output == f"error: no Python file to check under {empty} (none there, or all git-ignored or excluded)\n"
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text(BAD)
    (repo / ".gitignore").write_text("*.py\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    result = _invoke([str(repo)])
    assert result.exit_code == 2 and "no Python file to check" in result.output
    assert _invoke([str(tmp_path / "good.py"), "--exclude", "good.py"]).exit_code == 0  # named: still checked
    excluded = _invoke([str(tmp_path), "--exclude", "*.py"])
    assert excluded.exit_code == 2 and "no Python file to check" in excluded.output


def test_directories_are_walked_skipping_gitignored_and_excluded(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / ".venv" / "lib").mkdir(parents=True)
    (repo / "build").mkdir()
    for rel in ("pkg/train.py", "ignored.py", ".venv/lib/x.py", "build/y.py", "pkg/skipme.py"):
        (repo / rel).write_text(BAD)
    (repo / ".gitignore").write_text("ignored.py\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    result = _invoke([str(repo), "--show-files", "--exclude", "skip*.py"])
    assert result.output.splitlines() == [str(repo / "pkg" / "train.py")]
    # named explicitly, an excluded file is checked, unless --force-exclude (pre-commit)
    assert _invoke([str(repo / "build" / "y.py")]).exit_code == 1
    # pre-commit names an excluded file: nothing to check is then a warning, not a failed hook
    forced = _invoke([str(repo / "build" / "y.py"), "--force-exclude"])
    assert forced.exit_code == 0 and "warning: every file given is excluded" in forced.output


def test_noqa_on_the_line_and_for_the_file(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(BAD.replace("model.forward(x)", "model.forward(x)  # noqa: FSD101"))
    assert [l.split(": ")[1].split()[0] for l in _invoke([str(path), "-q"]).output.splitlines()] == ["FSD102"]
    path.write_text(BAD.replace("model.forward(x)", "model.forward(x)  # noqa"))
    result = _invoke([str(path), "--statistics"])
    assert result.output.splitlines() == [
        "    1\tFSD102\t[ ] torch-save-dtensor",
        "    1\tnoqa\t[ ] bare `# noqa` (suppresses every code on its line; name the codes)",
    ]
    path.write_text("# fsdp2-retrofit: noqa: FSD102\n" + BAD)
    assert "FSD102" not in _invoke([str(path)]).output
    path.write_text("# fsdp2-retrofit: noqa\n" + BAD)
    assert _invoke([str(path)]).exit_code == 0


def test_select_and_ignore_by_code_and_prefix(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(BAD)

    def codes(*args):
        return sorted({l.split(": ")[1].split()[0] for l in _invoke([str(path), "-q", *args]).output.splitlines()})

    assert codes() == ["FSD101", "FSD102"]
    assert codes("--select", "FSD102") == ["FSD102"]
    assert codes("--ignore", "FSD101") == ["FSD102"]
    assert codes("--select", "FSD10", "--ignore", "FSD102") == ["FSD101"]
    assert codes("--select", "FSD101", "--ignore", "FSD1") == ["FSD101"]  # the more specific code wins
    result = _invoke([str(path), "--select", "FSD999"])
    assert result.exit_code == 2 and "unknown rule code or prefix 'FSD999'" in result.output


def test_fix_writes_safe_fixes_and_diff_writes_nothing(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(BAD)
    diff = _invoke([str(path), "--diff"])
    assert diff.exit_code == 1
    assert "-out = model.forward(x)\n+out = model(x)\n" in diff.output
    assert path.read_text() == BAD
    fixed = _invoke([str(path), "--fix"])
    assert fixed.exit_code == 1  # FSD102's fix is unsafe: it remains
    assert path.read_text() == BAD.replace("model.forward(x)", "model(x)")
    assert "Found 2 errors (1 fixed, 1 remaining)." in fixed.output
    unsafe = _invoke([str(path), "--fix", "--unsafe-fixes"])
    assert unsafe.exit_code == 0, unsafe.output
    text = path.read_text()
    assert 'dcp.save(model.state_dict(), checkpoint_id="model.pt")' in text
    assert "import torch.distributed.checkpoint as dcp\n" in text
    compile(text, str(path), "exec")



def test_nested_fixes_are_applied_in_rounds_and_each_counted_once():
    """The outer call's fix holds the inner one: it waits for the next round (its
    replacement is built from the original inner call, which would undo the inner fix)."""
    source = BAD.replace("out = model.forward(x)", "out = model.forward(model.forward(x))")
    result = lint_source(source.encode(), "case.py", all_rules(), fix=True)
    assert result.fixed.decode() == source.replace("model.forward(model.forward(x))", "model(model(x))")
    assert result.applied == 2
    assert [f.code for f in result.findings] == ["FSD102"]  # unsafe: left


def test_an_insertion_keyed_on_no_statement_of_a_block_is_not_applied():
    """A statement inserted before/after a small statement of `a = f(); g()` or the body
    of a one-line `if c: g()` has no line of its own to go to: that fix is skipped, the
    others are applied."""
    from types import SimpleNamespace

    import libcst as cst

    from fsdp2_retrofit.check.lint import apply_fixes
    from fsdp2_retrofit.check.rules import Edit, Fix
    from fsdp2_retrofit.syntax.names import Resolver

    source = "a = f(); g()\nif c: g()\nh()\n"
    resolver = Resolver(cst.parse_module(source))
    line, branch, last = resolver.module.body
    new = [cst.parse_statement("x = 1\n")]
    fixes = [
        Fix("in a line", [Edit(line.body[1], new, kind="before")]),
        Fix("in a suite", [Edit(branch.body.body[0], new, kind="after")]),
        Fix("a line", [Edit(last, new, kind="after")]),
    ]
    fixed, count = apply_fixes(resolver, [SimpleNamespace(fix=fix) for fix in fixes])
    assert (fixed.decode(), count) == (source + "x = 1\n", 1)


SHIFTED = """\
import torch
from torch.distributed.fsdp import fully_shard

model = Net()
opt = torch.optim.AdamW(model.parameters())
fully_shard(model)
out = model.forward(x)
torch.save(model.state_dict(), "model.pt")
"""


def _runner():
    return CliRunner(mix_stderr=False) if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else CliRunner()


def test_diff_reports_what_remains_at_the_lines_on_disk(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SHIFTED)
    # the unsafe fix of line 8 adds an import line: the optimizer (FSD103, no fix) moves to line 6 of the fixed text
    result = _invoke([str(path), "--diff", "--unsafe-fixes"])
    assert result.exit_code == 1
    assert "+import torch.distributed.checkpoint as dcp\n" in result.output
    remaining = [l for l in result.output.splitlines() if l.startswith(str(path))]
    assert remaining == [
        f"{path}:5:7: FSD103 optimizer `opt` is built from `model`'s parameters before `fully_shard` (line 6): "
        "it keeps the unsharded tensors"
    ]
    assert path.read_text() == SHIFTED


def test_on_original_lines_moves_a_finding_that_has_no_twin():
    from fsdp2_retrofit.check import formats
    from fsdp2_retrofit.check.rules import Finding

    original, fixed = "a\nb\nc\n", "a\nnew\nb\nc2\n"
    moved = formats.on_original_lines(
        [Finding("FSD101", "n", "m", "p", 3, 5, 3, 9), Finding("FSD101", "n", "m", "p", 4, 2, 4, 3)], original, fixed
    )
    assert [(f.line, f.col, f.end_line, f.end_col) for f in moved] == [(2, 5, 2, 9), (3, 1, 3, 1)]


def test_diff_with_json_keeps_the_diff_off_stdout(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SHIFTED)
    result = _runner().invoke(cli.main, ["check", str(path), "--diff", "--unsafe-fixes", "--output-format", "json"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert [(d["code"], d["location"]) for d in data] == [("FSD103", {"row": 5, "column": 7})]
    if hasattr(result, "stderr_bytes") and result.stderr_bytes is not None:
        assert "+import torch.distributed.checkpoint as dcp" in result.stderr


def test_fix_of_a_read_only_file_names_only_options_check_has(tmp_path, monkeypatch):
    from fsdp2_retrofit import files

    path = tmp_path / "bad.py"
    path.write_text(BAD)
    monkeypatch.setattr(files, "_write_bit", lambda st: 0)  # read-only even for root
    result = _invoke([str(path), "--fix"])
    assert path.read_text() == BAD
    assert result.exit_code == 2
    assert "read-only file: not fixing it" in result.output and "-o OUT" not in result.output


def test_stdin_reads_and_fix_prints_the_fixed_source():
    result = _invoke(["-", "--stdin-filename", "train.py"], input=BAD)
    assert result.exit_code == 1
    assert result.output.startswith("train.py:6:7: FSD101")
    runner = CliRunner(mix_stderr=False) if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else CliRunner()
    fixed = runner.invoke(cli.main, ["check", "-", "--fix", "--select", "FSD101"], input=BAD)
    assert fixed.exit_code == 0
    assert fixed.stdout.startswith(BAD.replace("model.forward(x)", "model(x)"))


def test_json_github_and_sarif_formats(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(BAD)
    data = json.loads(_invoke([str(path), "--output-format", "json"]).output)
    assert [(d["code"], d["location"], d["end_location"]) for d in data] == [
        ("FSD101", {"row": 6, "column": 7}, {"row": 6, "column": 23}),
        ("FSD102", {"row": 7, "column": 1}, {"row": 7, "column": 43}),
    ]
    assert data[0]["fix"]["applicability"] == "safe"
    assert data[0]["fix"]["edits"] == [
        {"content": "model(x)", "location": {"row": 6, "column": 7}, "end_location": {"row": 6, "column": 23}}
    ]
    gh = _invoke([str(path), "--output-format", "github"]).output.splitlines()
    assert gh[0] == (
        f"::error title=fsdp2-retrofit (FSD101),file={path},line=6,col=7,endLine=6,endColumn=23::"
        f"{path}:6:7: FSD101 `model.forward(...)` bypasses FSDP2's hooks on sharded `model`; call `model(...)`"
    )
    log = json.loads(_invoke([str(path), "--output-format", "sarif"]).output)
    assert log["version"] == "2.1.0" and log["$schema"].endswith("sarif-2.1.0.json")
    run = log["runs"][0]
    assert [r["id"] for r in run["tool"]["driver"]["rules"]] == [r.CODE for r in all_rules() if r.DEFAULT]
    first = run["results"][0]
    assert first["ruleId"] == "FSD101"
    assert first["locations"][0]["physicalLocation"]["region"] == {
        "startLine": 6, "startColumn": 7, "endLine": 6, "endColumn": 23}
    assert first["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == path.as_uri()


def test_errors_exit_2_with_file_and_line_and_leave_the_file_alone(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("from torch.distributed.fsdp import fully_shard\ndef f(:\n")
    before = broken.read_bytes()
    result = _invoke([str(broken), "--fix"])
    assert result.exit_code == 2
    assert result.output.startswith(f"{broken}:2:7: error: syntax error: invalid syntax")
    assert broken.read_bytes() == before
    missing = _invoke([str(tmp_path / "nope.py")])
    assert missing.exit_code == 2 and "nope.py: error: no such file or directory" in missing.output


@pytest.mark.parametrize("workers", [1, 2])
def test_a_syntax_error_is_an_error_also_in_a_file_the_prefilter_skips(tmp_path, monkeypatch, workers):
    """No FSDP text: no rule can fire, libcst never parses it, but the file cannot run: exit 2 at
    line:col (as ruff reports it), next to a clean file and a file with findings."""
    from fsdp2_retrofit.check import checker

    monkeypatch.setattr(checker, "PARALLEL_MIN_FILES", 1 if workers > 1 else 10**6)
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "clean.py").write_text("x = 1\n")
    broken = tmp_path / "broken.py"
    broken.write_text("import os\n\nif os.sep:\n    print(os.sep\n")
    result = _invoke([str(tmp_path)])
    assert result.exit_code == 2
    assert f"{broken}:4:10: error: syntax error: '(' was never closed" in result.output.splitlines()
    assert "FSD101" in result.output and "clean.py" not in result.output
    broken.write_text("import os\n")
    assert _invoke([str(tmp_path)]).exit_code == 1  # the findings of bad.py remain


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="needs a Python older than the syntax (3.12 f-strings)")
@pytest.mark.parametrize("fsdp", [False, True], ids=["no FSDP text", "with FSDP text"])
def test_syntax_of_a_newer_python_is_not_an_error(tmp_path, fsdp):
    """A project on Python 3.12 checked by a hook running 3.11: a nested-quote f-string does not
    compile here, but libcst parses it. It is not an error, and the rules still run on the file."""
    head = BAD if fsdp else "import os\n"
    newer = tmp_path / "newer.py"
    newer.write_text(head + 'print(f"{os.path.join("a", "b")}")\n')
    with pytest.raises(SyntaxError):
        compile(newer.read_bytes(), str(newer), "exec")
    result = _invoke([str(newer)])
    assert "syntax error" not in result.output
    assert result.exit_code == (1 if fsdp else 0), result.output
    if fsdp:
        assert "FSD101" in result.output


def test_stdin_with_a_syntax_error_and_no_fsdp_text_exits_2():
    result = CliRunner().invoke(cli.main, ["check", "-", "--stdin-filename", "x.py"], input="def f(:\n")
    assert result.exit_code == 2 and result.output.startswith("x.py:1:7: error: syntax error")


@pytest.mark.parametrize("text", [
    b"# caf\xe9\nimport torch\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(m).forward(x)\n",
    b"import os\nname = 'caf\xe9'\n",  # no FSDP text: the prefilter skips it
    b"import os\n# caf\xe9 (Python's compile() accepts this comment; python itself refuses the file)\n",
], ids=["fsdp_text", "no_fsdp_text", "comment_only"])
def test_bytes_that_do_not_decode_get_the_message_rewrite_gives(tmp_path, text):
    path = tmp_path / "latin.py"
    path.write_bytes(text)
    result = _invoke([str(path)])
    assert result.exit_code == 2
    line = result.output.strip()
    rewrite = CliRunner().invoke(cli.main, ["rewrite", str(path), "--diff"])
    assert rewrite.exit_code == 2
    message = rewrite.output.strip().split(": ", 1)[1]  # `path:line: message`
    assert message.startswith("cannot decode byte 0xe9 as utf-8")
    number = text[:text.index(b"\xe9")].count(b"\n") + 1
    assert line == f"{path}:{number}: error: {message}"
    assert "internal error" not in line


def test_options_come_from_pyproject_and_the_command_line_wins(tmp_path, monkeypatch):
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "pyproject.toml").write_text('[tool.fsdp2-retrofit]\nignore = ["FSD102"]\n')
    monkeypatch.chdir(tmp_path)
    assert "FSD102" not in _invoke(["bad.py"]).output
    assert "FSD102" in _invoke(["bad.py", "--select", "FSD102"]).output
    (tmp_path / "pyproject.toml").write_text('[tool.fsdp2-retrofit]\nselct = ["FSD102"]\n')
    result = _invoke(["bad.py"])
    assert result.exit_code == 2 and "unknown option `selct`" in result.output


def test_exit_zero_keeps_findings_but_exits_0(tmp_path):
    (tmp_path / "bad.py").write_text(BAD)
    result = _invoke([str(tmp_path / "bad.py"), "--exit-zero"])
    assert result.exit_code == 0 and "FSD101" in result.output


def test_rules_command_lists_and_explains():
    listing = CliRunner().invoke(cli.main, ["rules"]).output
    assert [l.split()[0] for l in listing.splitlines()[:len(all_rules())]] == [r.CODE for r in all_rules()]
    doc = CliRunner().invoke(cli.main, ["rules", "FSD101"])
    assert doc.exit_code == 0
    for part in ("# FSD101 forward-call", "## Why is this bad?", "## Flagged", "## Not flagged", "model.forward(x)"):
        assert part in doc.output
    assert CliRunner().invoke(cli.main, ["rules", "FSD000"]).exit_code == 2
    columns = {l.split()[0]: l.split()[2] for l in listing.splitlines()[:len(all_rules())] if len(l.split()) > 3}
    assert columns["FSD101"] == "safe" and columns["FSD106"] == "unsafe" and columns["FSD102"] == "unsafe*"
    assert "--unsafe-fixes" in listing


def test_check_never_imports_torch(tmp_path):
    (tmp_path / "bad.py").write_text(BAD)
    code = (
        "import sys; from fsdp2_retrofit.cli import main\n"
        "try:\n    main(['check', sys.argv[1], '-q'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bad.py")], capture_output=True, text=True)
    assert out.stdout.splitlines()[-1] == "ok", out.stderr


def test_many_files_run_in_worker_processes_with_the_same_result(tmp_path):
    from fsdp2_retrofit.check import checker

    paths = []
    for i in range(checker.PARALLEL_MIN_FILES + 2):
        p = tmp_path / f"f{i:02d}.py"
        p.write_text(BAD if i % 2 else BAD.replace("model.forward(x)", "model(x)"))
        paths.append(str(p))
    job = checker.CheckJob(tuple(all_rules()))
    serial = checker.run(job, paths, workers=1)
    parallel = checker.run(job, paths, workers=2)
    assert [(r.path, [(f.code, f.line) for f in r.findings]) for r in parallel] == [
        (r.path, [(f.code, f.line) for f in r.findings]) for r in serial
    ]
    assert sum(len(r.findings) for r in serial) == 9 * 2 + 9  # FSD101 + FSD102 in odd files, FSD102 in even
