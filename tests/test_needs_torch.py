"""`verify` and `convert` import torch; without it in the Python they use, the first thing
they say is that, and how to install it (exit 2), not a traceback from deep inside a run."""
from __future__ import annotations

import subprocess
import sys
import venv

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli

pytestmark = pytest.mark.smoke  # the smoke loop: README, "Running the tests"


@pytest.fixture(scope="module")
def python_without_torch(tmp_path_factory):
    """A fresh virtual environment: the bare interpreter a newcomer may point --python at."""
    root = tmp_path_factory.mktemp("bare-venv")
    venv.EnvBuilder(with_pip=False).create(root)
    python = str(root / "bin" / "python")
    if subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("the base interpreter has torch of its own")
    return python


def invoke(*args):
    return CliRunner().invoke(cli.main, list(map(str, args)))


def test_verify_with_a_python_without_torch_says_so_first(tmp_path, python_without_torch):
    missing = tmp_path / "no-such-script.py"  # not looked at yet: torch is said first
    result = invoke("verify", missing, "--python", python_without_torch, "--json", tmp_path / "r.json")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: verify needs torch in {python_without_torch}: pip install torch"
    assert lines[1].strip().startswith(f"{python_without_torch} -m pip install torch")
    assert "sitecustomize" not in result.output and "Traceback" not in result.output
    assert '"exit_code": 2' in (tmp_path / "r.json").read_text()


def test_verify_with_no_such_python(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    result = invoke("verify", script, "--python", tmp_path / "nope" / "python")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: verify cannot run {tmp_path / 'nope' / 'python'}: ")


def test_convert_without_torch_says_so_before_looking_at_the_paths(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, find_spec finds nothing
    result = invoke("convert", tmp_path / "missing_dir", tmp_path / "out.pt")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: convert needs torch in {sys.executable}: pip install torch"
    assert "pip install torch" in lines[1]
    assert not (tmp_path / "out.pt").exists()


def test_check_needs_no_torch(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    path = tmp_path / "train.py"
    path.write_text("import torch\n")
    assert invoke("check", path).exit_code == 0
