"""The `fsdp2-retrofit rewrite` command: exit codes, what it writes, and how it fails.

Most tests replace the pipeline with a small stand-in (`fake`), so they test the
command line alone: reading, writing, exit codes, messages. Tests marked
`pipeline` run the real rewrite end to end (CRLF and coding cookies kept, syntax
error lines, the console script on the example script).
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.cli import rewrite as rewrite_cli
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.report import Attention, Change, InputError, Refusal, RewriteResult

pytestmark = pytest.mark.smoke  # the smoke loop: README, "Running the tests"

EXAMPLE = Path(__file__).resolve().parents[1] / "fixtures/examples/train_single.py"
CONSOLE_SCRIPT = Path(sys.executable).with_name("fsdp2-retrofit")

SCRIPT = b'''\
import torch
import torch.nn as nn

model = nn.Linear(4, 2).to("cuda")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(8, 4, device="cuda")).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
torch.save(model.state_dict(), "model.pt")
'''

# What the stand-in pipeline appends; a script that has it is already converted.
MARK = b"# converted to FSDP2"


def fake_rewrite(source: bytes, path: str, options: RetrofitOptions) -> RewriteResult:
    """A stand-in pipeline: keeps newlines and encoding, refuses or fails on cue."""
    if b"SYNTAX ERROR" in source:
        raise InputError("invalid syntax", line=3)
    if b"REFUSE" in source:
        refusal = Refusal(2, "cannot shard the model", "it is built inside a loop", hint="pass --shard CLASS")
        return RewriteResult(path, source, source, [], [], [refusal])
    if MARK in source:
        return RewriteResult(path, source, source, [], [], [])
    newline = b"\r\n" if b"\r\n" in source else b"\n"
    changes = [Change(1, "launch", "start the process group", "torchrun runs one process per GPU", "all ranks on GPU 0")]
    attention = [Attention(11, "save", "torch.save(model[0])", "each rank holds a shard")]
    return RewriteResult(path, source, source + MARK + newline, changes, attention, [])


@pytest.fixture
def fake(monkeypatch):
    """Swap in the stand-in pipeline; yields the options each call received."""
    seen = []

    def rewrite(source, path, options):
        seen.append(options)
        return fake_rewrite(source, path, options)

    monkeypatch.setattr(rewrite_cli, "rewrite_source", rewrite)
    return seen


def rewrite(*args: str):
    return CliRunner().invoke(cli.main, ["rewrite", *map(str, args)])


def script(tmp_path: Path, data: bytes = SCRIPT, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def example_script(tmp_path: Path) -> Path:
    return script(tmp_path, EXAMPLE.read_bytes())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- help and version --------------------------------------------------------------------


def test_version():
    result = CliRunner().invoke(cli.main, ["--version"])
    assert result.exit_code == 0
    assert "0.1.0" in result.stdout


def test_help_teaches_what_exit_codes_and_an_example():
    result = CliRunner().invoke(cli.main, ["rewrite", "--help"])
    assert result.exit_code == 0
    text = result.stdout
    assert "fully_shard" in text
    assert "Exit codes" in text and "1  a file would change" in text
    assert "fsdp2-retrofit rewrite train.py --diff" in text


def test_no_arguments_shows_help():
    result = CliRunner().invoke(cli.main, ["rewrite"])
    assert "Usage:" in result.output
    assert result.exit_code in (0, 2)


# --- writing -----------------------------------------------------------------------------


def test_rewrites_in_place(tmp_path, fake):
    path = script(tmp_path)
    result = rewrite(path)
    assert result.exit_code == 0, result.output
    assert path.read_bytes() == SCRIPT + MARK + b"\n"
    assert f"rewrote {path}" in result.stderr


@pytest.mark.parametrize("file_mode", [0o640, 0o755, 0o600])
def test_in_place_keeps_file_mode(tmp_path, fake, file_mode):
    path = script(tmp_path)
    path.chmod(file_mode)
    assert rewrite(path).exit_code == 0
    assert mode(path) == file_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_nothing_to_change_exits_0_and_does_not_touch_the_file(tmp_path, fake):
    path = script(tmp_path, SCRIPT + MARK + b"\n")
    before = path.stat()
    result = rewrite(path)
    assert result.exit_code == 0
    assert "nothing to change" in result.stderr
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_output_leaves_input_untouched(tmp_path, fake):
    path = script(tmp_path)
    out = tmp_path / "train_fsdp2.py"
    result = rewrite(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert path.read_bytes() == SCRIPT
    assert out.read_bytes() == SCRIPT + MARK + b"\n"
    assert f"torchrun --nproc_per_node=<gpus> {out}" in result.stderr


def test_output_is_written_even_when_nothing_changes(tmp_path, fake):
    path = script(tmp_path, SCRIPT + MARK + b"\n")
    out = tmp_path / "out.py"
    assert rewrite(path, "-o", out).exit_code == 0
    assert out.read_bytes() == path.read_bytes()


def test_output_needs_exactly_one_path(tmp_path, fake):
    a, b = script(tmp_path, name="a.py"), script(tmp_path, name="b.py")
    result = rewrite(a, b, "-o", tmp_path / "out.py")
    assert result.exit_code == 2
    assert "exactly one PATH" in result.stderr
    assert not (tmp_path / "out.py").exists()
    assert fake == []


def test_shard_classes_reach_the_options(tmp_path, fake):
    rewrite(script(tmp_path), "--shard", "Block", "--shard", "mylib.Layer", "--quiet")
    assert fake == [RetrofitOptions(shard=("Block", "mylib.Layer"))]


def test_shard_naming_no_class_of_the_model_exits_2_and_leaves_the_file(tmp_path):
    path = example_script(tmp_path)
    before = path.read_bytes()
    result = rewrite(path, "--shard", "NoSuchClass")
    assert result.exit_code == 2 and path.read_bytes() == before
    first = result.output.splitlines()[0]
    assert first.startswith(f"{path}:") and "FSR630 --shard NoSuchClass" in first and "(its classes: " in first


def test_checkpoint_options_reach_the_options(tmp_path, fake):
    rewrite(script(tmp_path), "--export", "full", "--async-checkpoint", "--quiet")
    rewrite(script(tmp_path), "--quiet")
    assert fake == [RetrofitOptions(export="full", async_checkpoint=True), RetrofitOptions()]
    assert RetrofitOptions().export == "dcp"


def test_unknown_export_format_is_a_usage_error(tmp_path, fake):
    result = rewrite(script(tmp_path), "--export", "safetensors")
    assert result.exit_code == 2 and "safetensors" in result.output and fake == []


# --- diff and check ----------------------------------------------------------------------


def test_diff_prints_plain_unified_diff_and_writes_nothing(tmp_path, fake):
    path = script(tmp_path)
    result = rewrite(path, "--diff")
    assert result.exit_code == 0
    assert path.read_bytes() == SCRIPT
    assert f"--- {path}\n" in result.stdout and f"+++ {path}\n" in result.stdout  # absolute paths: no a/ b/
    assert "+" + MARK.decode() in result.stdout
    assert "\x1b[" not in result.stdout  # piped: no colour codes


def test_diff_with_output_names_the_output(tmp_path, fake):
    path = script(tmp_path)
    out = tmp_path / "out.py"
    result = rewrite(path, "--diff", "-o", out)
    assert f"+++ {out}\n" in result.stdout
    assert not out.exists()


def test_check_exits_1_when_a_change_is_due_and_writes_nothing(tmp_path, fake):
    path = script(tmp_path)
    result = rewrite(path, "--check")
    assert result.exit_code == 1
    assert f"would rewrite {path}" in result.stderr
    assert path.read_bytes() == SCRIPT
    assert result.stdout == ""


def test_check_exits_0_when_nothing_is_due(tmp_path, fake):
    path = script(tmp_path, SCRIPT + MARK + b"\n")
    assert rewrite(path, "--check").exit_code == 0


def test_check_after_rewrite_is_clean(tmp_path, fake):
    path = script(tmp_path)
    assert rewrite(path).exit_code == 0
    assert rewrite(path, "--check").exit_code == 0


def test_check_quiet_json_still_says_would_rewrite(tmp_path, fake):
    path = script(tmp_path)
    result = rewrite(path, "--check", "--report", "json")
    assert result.exit_code == 1
    assert result.stderr.strip() == f"would rewrite {path}"
    assert json.loads(result.stdout)[0]["changed"] is True
    assert rewrite(path, "--check", "--quiet").stderr == ""


def test_diff_and_check_show_and_exit_1(tmp_path, fake):
    path = script(tmp_path)
    result = rewrite(path, "--diff", "--check")
    assert result.exit_code == 1
    assert "+" + MARK.decode() in result.stdout
    assert path.read_bytes() == SCRIPT


# --- reports -----------------------------------------------------------------------------


def test_text_report_lists_changes_attention_and_launch(tmp_path, fake):
    path = script(tmp_path)
    result = rewrite(path)
    lines = result.stderr.splitlines()
    assert f"{path}:1 launch: start the process group" in lines  # one line per change, ruff's `file:line`
    assert "needs attention (1):" in lines
    assert f"{path}:11 save: torch.save(model[0])" in lines  # brackets are not markup
    assert "torchrun runs one process per GPU" not in result.stderr  # the why is behind --explain
    assert "each rank holds a shard" not in result.stderr
    assert any("--explain" in line for line in lines)
    assert f"torchrun --nproc_per_node=<gpus> {path}" in result.stderr
    assert result.stdout == ""


def test_explain_says_why_and_the_pitfall_under_each_line(tmp_path, fake):
    path = script(tmp_path)
    lines = rewrite(path, "--explain").stderr.splitlines()
    change = lines.index(f"{path}:1 launch: start the process group")
    assert lines[change + 1:change + 3] == ["    why: torchrun runs one process per GPU", "    pitfall: all ranks on GPU 0"]
    attention = lines.index(f"{path}:11 save: torch.save(model[0])")
    assert lines[attention + 1] == "    why: each rank holds a shard"
    assert not any("--explain" in line for line in lines)  # no hint to pass what was passed
    data = json.loads(rewrite(script(tmp_path, name="again.py"), "--explain", "--report", "json").stdout)
    assert data[0]["changes"][0]["why"] == "torchrun runs one process per GPU"  # JSON as ever


def test_further_refusals_are_one_line_each(tmp_path, monkeypatch):
    refusals = [Refusal(2, "first", "a"), Refusal(5, "cannot shard `blocks[0]`", "a long reason " * 12, "pass --shard X",
                                                    code="FSR101")]
    monkeypatch.setattr(rewrite_cli, "rewrite_source",
                        lambda source, path, options: RewriteResult(path, source, source, [], [], refusals))
    path = script(tmp_path)
    result = rewrite(path)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == f"{path}:2: first: a"
    assert f"{path}:5: FSR101 cannot shard `blocks[0]`: {'a long reason ' * 12}".rstrip() in [l.rstrip() for l in lines]
    assert "  hint: pass --shard X" in lines
    assert "…" not in result.stderr


@pytest.mark.pipeline
def test_the_bundled_example_report_fits_a_screen_and_cuts_no_code():
    """The README's first command: its report is one line per change, at most 50 lines on an
    80-column terminal, no cell cut with "…"; what the run will warn is said once."""
    example = "fixtures/rewrite/main_modulelist/input.py"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "fsdp2_retrofit", "rewrite", example, "--diff", "--no-cache"],
                          cwd=root, capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert sum(max(1, -(-len(line) // 80)) for line in lines) <= 50
    assert "…" not in proc.stderr
    changes = [line for line in lines if line.startswith(f"{example}:")]
    assert len(changes) == int(lines[0].rsplit("(", 1)[1].split()[0]) == 10
    assert f"{example}:63 forward_calls: `model.forward(...)` -> `model(...)`" in changes
    assert any("get_model_state_dict(...); `args.out` is now a checkpoint directory" in line for line in changes)
    notes = [line for line in lines if line.startswith("note: ")]
    assert len(notes) == 2 and "returned a view tensor" in notes[0] and "existing checkpoint" in notes[1]


@pytest.mark.pipeline
def test_the_run_time_warnings_are_explained_once_a_run(tmp_path):
    first, second = example_script(tmp_path), script(tmp_path, EXAMPLE.read_bytes(), "again.py")
    err = rewrite(first, second, "--diff", "--no-cache").stderr
    assert err.count("returned a view tensor") == 1 and err.count("existing checkpoint") == 1
    assert err.count("would rewrite") == 2


@pytest.mark.parametrize("flag", ["--diff", "--check"])
def test_a_run_that_writes_nothing_says_how_to_apply_before_launching(tmp_path, fake, flag):
    """The file on disk is still the single-GPU script: the last line must not tell the user to
    launch it as it is."""
    path = script(tmp_path)
    last = rewrite(path, flag).stderr.strip().splitlines()[-1]
    assert last.startswith(f"nothing written ({flag}): to write {path}, run the same command without {flag}; ")
    assert last.endswith(f"then launch with: torchrun --nproc_per_node=<gpus> {path}")
    assert "on several nodes" not in rewrite(path, flag).stderr
    out = tmp_path / "out.py"
    assert f"to write {out}," in rewrite(path, flag, "-o", out).stderr and not out.exists()
    written = rewrite(path).stderr.strip().splitlines()
    assert written[-2] == f"launch with: torchrun --nproc_per_node=<gpus> {path}"  # after a write: launch it


@pytest.fixture
def terminal(monkeypatch):
    """stderr as a terminal (rich forced to draw), progress due at once; yields what the display drew."""
    import io

    from rich.console import Console

    from fsdp2_retrofit.cli import progress

    drawn = io.StringIO()
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    monkeypatch.setattr(progress, "stderr_console", lambda: Console(file=drawn, force_terminal=True, width=400))
    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    return drawn


def slow(monkeypatch, seconds: float = 0.3, until=None):
    """The stand-in pipeline, taking `seconds` a file, or with `until`, as long as it takes
    `until(path)` to hold (10 s at most: a loaded machine can be slow to draw)."""
    import time

    def rewrite(source, path, options):
        deadline = time.monotonic() + (10.0 if until else seconds)
        while time.monotonic() < deadline and not (until and until(path)):
            time.sleep(0.01)
        return fake_rewrite(source, path, options)

    monkeypatch.setattr(rewrite_cli, "rewrite_source", rewrite)


def test_a_long_rewrite_shows_progress_on_a_terminal_and_erases_it(tmp_path, monkeypatch, terminal):
    slow(monkeypatch, until=lambda path: f"rewriting {path}" in terminal.getvalue())  # each file: until drawn
    paths = [script(tmp_path, name=f"train_{i}.py") for i in range(2)]
    result = rewrite(*paths, "--diff")
    assert result.exit_code == 0
    drawn = terminal.getvalue()
    assert f"rewriting {paths[0]}" in drawn and f"rewriting {paths[1]}" in drawn
    assert "0/2" in drawn and "1/2" in drawn  # the second file's display counts the first one
    assert "\x1b[2K" in drawn  # transient: the lines are erased when each file's work ends
    assert "rewriting" not in result.stdout and "\x1b[" not in result.stdout  # the diff stays clean
    assert "rewriting" not in result.stderr  # the report's own stream gets none of it


def test_no_progress_when_the_run_is_quick_piped_or_quiet(tmp_path, monkeypatch, terminal):
    from fsdp2_retrofit.cli import progress

    slow(monkeypatch, 0.05)
    path = script(tmp_path)
    monkeypatch.setattr(progress, "AFTER_S", 5.0)
    assert rewrite(path, "--diff").exit_code == 0 and terminal.getvalue() == ""  # under the threshold
    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    assert rewrite(path, "--diff", "-q").exit_code == 0 and terminal.getvalue() == ""  # --quiet
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: False)
    assert rewrite(path, "--diff").exit_code == 0 and terminal.getvalue() == ""  # stderr piped
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    assert rewrite(path, "--diff").exit_code == 0 and "rewriting" in terminal.getvalue()  # the knobs work


def test_json_report_on_stdout(tmp_path, fake):
    path = script(tmp_path)
    result = rewrite(path, "--report", "json")
    assert result.exit_code == 0
    [entry] = json.loads(result.stdout)
    assert entry["path"] == str(path)
    assert entry["changed"] is True
    assert entry["changes"][0]["code"] == "launch"
    assert entry["attention"][0]["line"] == 11
    assert result.stderr == ""


def test_json_report_moves_to_stderr_with_diff(tmp_path, fake):
    path = script(tmp_path)
    result = rewrite(path, "--report", "json", "--diff")
    assert result.stdout.startswith(f"--- {path}")
    assert json.loads(result.stderr)[0]["changed"] is True


def test_quiet_prints_no_report_but_still_errors(tmp_path, fake):
    good = script(tmp_path)
    result = rewrite(good, tmp_path / "missing.py", "--quiet")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"{tmp_path / 'missing.py'}: no such file or directory"]
    assert result.stdout == ""


# --- several paths -----------------------------------------------------------------------


def test_one_bad_file_does_not_stop_the_others(tmp_path, fake):
    a, b = script(tmp_path, name="a.py"), script(tmp_path, name="b.py")
    missing = tmp_path / "missing.py"
    result = rewrite(a, missing, b, "--quiet")
    assert result.exit_code == 2
    assert a.read_bytes() == b.read_bytes() == SCRIPT + MARK + b"\n"
    assert result.stderr.splitlines() == [f"{missing}: no such file or directory"]


@pytest.mark.parametrize(
    "contents, expected",
    [
        ([SCRIPT + MARK + b"\n", SCRIPT + MARK + b"\n"], 0),
        ([SCRIPT, SCRIPT + MARK + b"\n"], 1),
        ([SCRIPT, b"REFUSE\n"], 2),
        ([b"REFUSE\n", SCRIPT], 2),
    ],
)
def test_worst_exit_code_wins(tmp_path, fake, contents, expected):
    paths = [script(tmp_path, data, f"s{i}.py") for i, data in enumerate(contents)]
    assert rewrite(*paths, "--check", "--quiet").exit_code == expected


def test_summary_line_for_several_paths(tmp_path, fake):
    a, b = script(tmp_path, name="a.py"), script(tmp_path, SCRIPT + MARK + b"\n", "b.py")
    result = rewrite(a, b)
    assert result.stderr.splitlines()[-1] == "1 rewritten, 1 unchanged, 0 failed"


# --- errors and refusals: one line, exit 2, file intact ----------------------------------


def assert_one_line_error(result, path: Path, message: str, line: int = 0, before: bytes = None):
    assert result.exit_code == 2, result.output
    where = f"{path}:{line}" if line else str(path)
    assert result.stderr.splitlines() == [f"{where}: {message}"]
    if before is not None:
        assert path.read_bytes() == before


def test_refusal_prints_line_and_hint_and_keeps_the_file(tmp_path, fake):
    data = b"import torch\nREFUSE\n"
    path = script(tmp_path, data)
    result = rewrite(path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"{path}:2: cannot shard the model: it is built inside a loop",
        "  hint: pass --shard CLASS",
    ]
    assert path.read_bytes() == data


def test_refusal_with_output_writes_no_output(tmp_path, fake):
    path = script(tmp_path, b"REFUSE\n")
    out = tmp_path / "out.py"
    assert rewrite(path, "-o", out).exit_code == 2
    assert not out.exists()


def test_syntax_error_from_pipeline(tmp_path, fake):
    data = b"import torch\n\nSYNTAX ERROR\n"
    path = script(tmp_path, data)
    assert_one_line_error(rewrite(path), path, "invalid syntax", line=3, before=data)


def test_empty_file(tmp_path, fake):
    path = script(tmp_path, b"\n  \n")
    assert_one_line_error(rewrite(path), path, "empty file: nothing to retrofit", before=b"\n  \n")


def test_binary_file(tmp_path, fake):
    data = b"\x7fELF\x02\x01\x01\x00\x00"
    path = script(tmp_path, data, "train.pyc")
    assert_one_line_error(rewrite(path), path, "binary file (contains NUL bytes), not a Python script", 1, data)


def test_unknown_coding_cookie(tmp_path, fake):
    data = b"# coding: no-such-codec\nimport torch\n"
    path = script(tmp_path, data)
    assert_one_line_error(rewrite(path), path, "unknown encoding in coding cookie: no-such-codec", 1, data)


def test_bytes_that_do_not_decode(tmp_path, fake):
    data = b"import torch\n# caf\xe9\n"
    path = script(tmp_path, data)
    result = rewrite(path)
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{path}:2: cannot decode byte 0xe9 as utf-8")
    assert path.read_bytes() == data


def test_read_only_file_in_place(tmp_path, fake):
    path = script(tmp_path)
    path.chmod(0o444)
    result = rewrite(path)
    [line] = result.stderr.splitlines()
    assert result.exit_code == 2
    assert line.startswith(f"{path}: read-only file")
    assert path.read_bytes() == SCRIPT
    assert mode(path) == 0o444


def test_read_only_file_is_fine_to_check_or_copy(tmp_path, fake):
    path = script(tmp_path)
    path.chmod(0o444)
    assert rewrite(path, "--check", "--quiet").exit_code == 1
    assert rewrite(path, "-o", tmp_path / "out.py", "--quiet").exit_code == 0


def test_read_only_output(tmp_path, fake):
    path = script(tmp_path)
    out = script(tmp_path, b"keep me\n", "out.py")
    out.chmod(0o444)
    result = rewrite(path, "-o", out)
    [line] = result.stderr.splitlines()
    assert result.exit_code == 2
    assert line.startswith(f"{out}: read-only file")
    assert out.read_bytes() == b"keep me\n"


def test_directory(tmp_path, fake):
    (tmp_path / "scripts").mkdir()
    assert_one_line_error(rewrite(tmp_path / "scripts"), tmp_path / "scripts", "is a directory; rewrite takes script files")


def test_missing_path(tmp_path, fake):
    assert_one_line_error(rewrite(tmp_path / "nope.py"), tmp_path / "nope.py", "no such file or directory")


def test_internal_error_is_one_line_and_the_next_file_still_runs(tmp_path, monkeypatch):
    def broken(source, path, options):
        if path.endswith("a.py"):
            raise RuntimeError("stage exploded\nwith details")
        return fake_rewrite(source, path, options)

    monkeypatch.setattr(rewrite_cli, "rewrite_source", broken)
    monkeypatch.delenv("FSDP2_RETROFIT_TRACEBACK", raising=False)
    a, b = script(tmp_path, name="a.py"), script(tmp_path, name="b.py")
    result = rewrite(a, b, "--quiet")
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert line == f"{a}: internal error: RuntimeError: stage exploded (set FSDP2_RETROFIT_TRACEBACK=1 for the traceback)"
    assert a.read_bytes() == SCRIPT
    assert b.read_bytes() == SCRIPT + MARK + b"\n"


def test_crlf_and_latin1_pass_through_byte_for_byte(tmp_path, fake):
    crlf = script(tmp_path, SCRIPT.replace(b"\n", b"\r\n"), "crlf.py")
    latin = script(tmp_path, "# -*- coding: latin-1 -*-\n# café\n".encode("latin-1") + SCRIPT, "latin.py")
    assert rewrite(crlf, latin, "--quiet").exit_code == 0
    assert crlf.read_bytes() == SCRIPT.replace(b"\n", b"\r\n") + MARK + b"\r\n"
    assert latin.read_bytes().startswith(b"# -*- coding: latin-1 -*-\n# caf\xe9\n")


# --- the console script, in its own process ----------------------------------------------


def run_console(*args: str, cwd=None) -> subprocess.CompletedProcess:
    assert CONSOLE_SCRIPT.exists(), f"{CONSOLE_SCRIPT} missing: run `pip install -e .` in this venv"
    return subprocess.run([str(CONSOLE_SCRIPT), *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def test_console_script_runs_and_fails_cleanly(tmp_path):
    assert run_console("--version").stdout.strip() == "fsdp2-retrofit, version 0.1.0"
    proc = run_console("rewrite", str(tmp_path / "missing.py"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"{tmp_path / 'missing.py'}: no such file or directory"]


def test_rewrite_never_imports_torch(tmp_path):
    """Importing the CLI, and running a rewrite through the real pipeline, loads no torch."""
    path = script(tmp_path)
    code = (
        "import sys\n"
        "from fsdp2_retrofit import cli\n"
        "assert 'torch' not in sys.modules, 'cli imports torch'\n"
        f"cli.main(['rewrite', '--check', '--quiet', {str(path)!r}], standalone_mode=False)\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_rewrite_of_a_plain_script_loads_no_libcst_matchers(tmp_path):
    """libcst.matchers (loaded by libcst.codemod) costs more to import than libcst,
    click and rich together: a rewrite that removes no import never loads it."""
    path = script(tmp_path)
    code = (
        "import sys\n"
        "from fsdp2_retrofit import cli\n"
        f"cli.main(['rewrite', '--check', '--quiet', '--no-cache', {str(path)!r}], standalone_mode=False)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('libcst.matchers', 'libcst.codemod'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --- the real pipeline -------------------------------------------------------------------


@pytest.mark.pipeline
@pytest.mark.integration
def test_real_console_script_checks_the_example(tmp_path):
    path = example_script(tmp_path)
    proc = run_console("rewrite", "--check", "--quiet", str(path))
    assert proc.returncode == 1, proc.stderr
    assert path.read_bytes() == EXAMPLE.read_bytes()


@pytest.mark.pipeline
def test_real_rewrite_then_check_is_clean(tmp_path):
    path = example_script(tmp_path)
    result = rewrite(path)
    assert result.exit_code == 0, result.output
    assert path.read_bytes() != EXAMPLE.read_bytes()
    assert "torchrun --nproc_per_node=<gpus>" in result.stderr
    assert rewrite(path, "--check").exit_code == 0


@pytest.mark.pipeline
def test_real_crlf_script_is_rewritten_with_crlf_kept(tmp_path):
    data = EXAMPLE.read_bytes().replace(b"\n", b"\r\n")
    path = script(tmp_path, data)
    result = rewrite(path, "--quiet")
    assert result.exit_code == 0, result.output
    out = path.read_bytes()
    assert out != data
    assert out.count(b"\n") == out.count(b"\r\n")


@pytest.mark.pipeline
def test_real_latin1_cookie_is_kept(tmp_path):
    header = "# -*- coding: latin-1 -*-\n# entraîné sur un GPU\n".encode("latin-1")
    data = header + EXAMPLE.read_bytes()
    path = script(tmp_path, data)
    result = rewrite(path, "--quiet")
    assert result.exit_code == 0, result.output
    out = path.read_bytes()
    assert out != data
    assert out.startswith(header)
    out.decode("latin-1")


@pytest.mark.pipeline
def test_real_syntax_error_reports_its_line(tmp_path):
    data = b"import torch\n\nx = = 1\nmodel = torch.nn.Linear(2, 2)\n"
    path = script(tmp_path, data)
    result = rewrite(path)
    assert result.exit_code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{path}:3: ")
    assert path.read_bytes() == data


# --- the result cache ---------------------------------------------------------------


def test_cache_answers_a_second_run_and_misses_when_a_sibling_changes(tmp_path, monkeypatch):
    from fsdp2_retrofit.rewrite import cache
    from fsdp2_retrofit.options import RetrofitOptions

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    calls = []

    def counting(source, path, options):
        calls.append(path)
        return real(source, path, options)

    real = rewrite_cli.rewrite_source
    monkeypatch.setattr(rewrite_cli, "rewrite_source", counting)
    first = rewrite_cli.cached_rewrite(script.read_bytes(), str(script), RetrofitOptions(), use_cache=True)
    second = rewrite_cli.cached_rewrite(script.read_bytes(), str(script), RetrofitOptions(), use_cache=True)
    assert len(calls) == 1 and second.refusals == first.refusals and second.code == first.code
    (tmp_path / "model.py").write_text("X = 1\n")
    rewrite_cli.cached_rewrite(script.read_bytes(), str(script), RetrofitOptions(), use_cache=True)
    rewrite_cli.cached_rewrite(script.read_bytes(), str(script), RetrofitOptions(shard=("Block",)), use_cache=True)
    rewrite_cli.cached_rewrite(script.read_bytes(), str(script), RetrofitOptions(), use_cache=False)
    assert len(calls) == 4
    assert any(cache.cache_dir().iterdir())


def test_cache_key_changes_with_the_tools_own_source(tmp_path, monkeypatch):
    """A changed checkout of the same version must miss: the key holds a stamp of the
    size and mtime of every .py file of fsdp2_retrofit/ and codemods/."""
    import os

    from fsdp2_retrofit.options import RetrofitOptions
    from fsdp2_retrofit.rewrite import cache

    for name in ("fsdp2_retrofit/rewrite/stage.py", "codemods/shard.py", "fsdp2_retrofit/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("X = 1\n")
    (tmp_path / "fsdp2_retrofit/notes.txt").write_text("not code\n")
    first = cache.source_stamp(tmp_path)
    assert cache.source_stamp(tmp_path) == first
    (tmp_path / "fsdp2_retrofit/notes.txt").write_text("still not code\n")
    assert cache.source_stamp(tmp_path) == first
    stage = tmp_path / "codemods/shard.py"
    os.utime(stage, ns=(stage.stat().st_atime_ns, stage.stat().st_mtime_ns + 10**9))  # touched
    touched = cache.source_stamp(tmp_path)
    assert touched != first
    (tmp_path / "fsdp2_retrofit/rewrite/stage.py").write_text("X = 22\n")  # same mtime second, new size
    assert cache.source_stamp(tmp_path) not in (first, touched)
    (tmp_path / "fsdp2_retrofit/rewrite/new.py").write_text("")
    assert cache.source_stamp(tmp_path) != touched

    # the default root is this checkout, computed once a process, and it is in the key
    assert cache.source_stamp() == cache.source_stamp(Path(cache.__file__).resolve().parents[2])
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    key = cache._key(str(script), script.read_bytes(), RetrofitOptions())
    monkeypatch.setattr(cache, "_source_stamp", "another checkout")
    assert cache._key(str(script), script.read_bytes(), RetrofitOptions()) != key


PKG_MODELS = """from torch import nn


class Block(nn.Sequential):
    def __init__(self, width):
        super().__init__(nn.Linear(width, width), nn.Tanh())


class Net(nn.Module):
    def __init__(self, width=4, depth=3):
        super().__init__()
        self.layers = {layers}

    def forward(self, x):
        return self.layers[-1](self.layers[0](x))
"""
PKG_SCRIPT = """import torch

from pkg.models import Net


def main():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
"""


def test_cache_misses_when_a_module_in_a_package_the_analysis_read_changes(tmp_path, monkeypatch):
    """The blocks of Net live in pkg/models.py: its edit must reach the rewrite (not the cache)."""
    from fsdp2_retrofit.options import RetrofitOptions

    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    models = tmp_path / "pkg" / "models.py"
    models.write_text(PKG_MODELS.format(layers="nn.ModuleList([Block(width) for _ in range(depth)])"))
    script = tmp_path / "train.py"
    script.write_text(PKG_SCRIPT)
    calls = []
    real = rewrite_cli.rewrite_source

    def counting(source, path, options):
        calls.append(path)
        return real(source, path, options)

    monkeypatch.setattr(rewrite_cli, "rewrite_source", counting)
    rewrite_once = lambda: rewrite_cli.cached_rewrite(script.read_bytes(), str(script), RetrofitOptions(), use_cache=True)  # noqa: E731
    blocks = rewrite_once()
    assert b"fully_shard(block, mesh=mesh" in blocks.code and len(calls) == 1
    assert rewrite_once().code == blocks.code and len(calls) == 1  # unchanged: from the cache
    # a plain list instead of a ModuleList: its layers are not registered, the rewrite refuses
    models.write_text(PKG_MODELS.format(layers="[Block(width) for _ in range(depth)]"))
    plain = rewrite_once()
    assert len(calls) == 2 and plain.code == script.read_bytes()
    assert [r.code for r in plain.refusals] == ["FSR618"]
    assert rewrite_once().refusals == plain.refusals and len(calls) == 2
    assert str(models) in plain.inputs



def test_cache_misses_when_a_project_marker_folder_appears(tmp_path, monkeypatch):
    """`projects/demo/train.py` imports `pkg.models`, and `pkg/` sits at the project's root: the
    root is known only once a marker says so. A `.git` folder made after a cached rewrite must
    reach the rewrite, as a marker file does."""
    from fsdp2_retrofit.options import RetrofitOptions

    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "models.py").write_text(
        PKG_MODELS.format(layers="nn.ModuleList([Block(width) for _ in range(depth)])"))
    script = tmp_path / "projects" / "demo" / "train.py"
    script.parent.mkdir(parents=True)
    script.write_text(PKG_SCRIPT)
    calls = []
    real = rewrite_cli.rewrite_source

    def counting(source, path, options):
        calls.append(path)
        return real(source, path, options)

    monkeypatch.setattr(rewrite_cli, "rewrite_source", counting)
    rewrite_once = lambda: rewrite_cli.cached_rewrite(script.read_bytes(), str(script), RetrofitOptions(), use_cache=True)  # noqa: E731
    unknown = rewrite_once()
    assert b"fully_shard(block, mesh=mesh" not in unknown.code  # pkg/ not found: its blocks unknown
    assert rewrite_once().code == unknown.code and len(calls) == 1
    (tmp_path / ".git").mkdir()
    found = rewrite_once()
    assert len(calls) == 2 and b"fully_shard(block, mesh=mesh" in found.code
    assert rewrite_once().code == found.code and len(calls) == 2


def test_diff_headers_prefix_relative_paths_like_git():
    from fsdp2_retrofit.report import unified_diff

    text = unified_diff("train.py", "a = 1\n", "a = 2\n")
    assert text.startswith("--- a/train.py\n+++ b/train.py\n")


@pytest.mark.integration
def test_launch_commands_are_printed_and_emit_slurm_writes_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_bytes(SCRIPT)
    result = subprocess.run(
        [str(CONSOLE_SCRIPT), "rewrite", str(script), "--emit-slurm", str(tmp_path / "job.sbatch")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert f"launch with: torchrun --nproc_per_node=<gpus> {script}" in result.stderr
    assert "--rdzv_backend=c10d --rdzv_endpoint=<head-node>:29500" in result.stderr
    text = (tmp_path / "job.sbatch").read_text()
    assert text.startswith("#!/bin/bash\n") and "}\" torchrun \\\n" in text and f"    {script} \"$@\"\n" in text
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    # the GPU count is written once, in #SBATCH; torchrun reads what Slurm allocated; the node's
    # one task gets CPUs for every process, and srun is handed them (it does not inherit them)
    assert "#SBATCH --gpus-per-node=8\n" in text and text.count("8\n") == 1
    assert '--nproc_per_node="$gpus_per_node"' in text and 'gpus_per_node="${SLURM_GPUS_ON_NODE:?' in text
    assert "#SBATCH --cpus-per-task=64\n" in text and 'srun --cpus-per-task="${SLURM_CPUS_PER_TASK:?' in text
    both = CliRunner().invoke(cli.main, ["rewrite", str(script), str(script), "--emit-slurm", "x.sbatch"])
    assert both.exit_code == 2 and "--emit-slurm takes exactly one PATH" in both.output


@pytest.mark.e2e
def test_the_slurm_script_trains_under_a_stand_in_srun(tmp_path):
    """The sbatch script, run by bash with stand-ins for srun and scontrol on one
    2-process CPU node, trains the rewritten shared example to the end."""
    from fsdp2_retrofit.launch_commands import slurm_script

    out = tmp_path / "train_fsdp2.py"
    assert CliRunner().invoke(cli.main, ["rewrite", str(EXAMPLE), "-o", str(out), "-q"]).exit_code == 0
    job = tmp_path / "job.sbatch"
    job.write_text(slurm_script(str(out), nodes=1, gpus_per_node=2))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun's own options (up to the command) are dropped
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "torchrun").write_text(f'#!/bin/sh\nexec {sys.executable} -m torch.distributed.run "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**__import__("os").environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node1",
           "SLURM_NNODES": "1", "SLURM_JOB_ID": "42", "OMP_NUM_THREADS": "1", "SLURM_GPUS_ON_NODE": "2",
           "SLURM_CPUS_PER_TASK": "2"}
    # through verify's runner: gloo's abort at interpreter exit, after the script finished, is retried
    from fsdp2_retrofit.verify import run_script

    run_script(["bash", str(job), "--batch-size", "32", "--steps", "2", "--out", str(tmp_path / "ckpt")],
               tmp_path, env, 2, 300, "sbatch script under a stand-in srun", steps=0, instrument=False)
    assert (tmp_path / "ckpt" / ".metadata").is_file()
