"""The pre-commit hooks through the real `pre-commit try-repo`, and the flake8 plugin
through real flake8: a file with a pitfall fails, a clean one passes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

PITFALL = """\
import torch
from torch.distributed.fsdp import fully_shard

model = Net()
fully_shard(model)
logits = model.forward(x)
"""
CLEAN = PITFALL.replace("model.forward(x)", "model(x)")


def _tool(name: str) -> str:
    found = BIN / name
    if found.exists():
        return str(found)
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: the test extra installs it")
    return path


@pytest.fixture(scope="module")
def user_repo(tmp_path_factory):
    """A user's git repository with one file that has a pitfall and one that is clean."""
    repo = tmp_path_factory.mktemp("user_repo")
    (repo / "bad.py").write_text(PITFALL)
    (repo / "good.py").write_text(CLEAN)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e"}
    for cmd in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env)
    return repo


@pytest.fixture(scope="module")
def pre_commit_home(tmp_path_factory):
    return tmp_path_factory.mktemp("pre_commit_home")


def _try_repo(repo: Path, home: Path, hook: str, *files: str):
    env = {**os.environ, "PRE_COMMIT_HOME": str(home), "PRE_COMMIT_COLOR": "never"}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        [_tool("pre-commit"), "try-repo", str(ROOT), hook, "--files", *files],
        cwd=repo, env=env, capture_output=True, text=True, timeout=900,
    )


@pytest.mark.integration
@pytest.mark.xdist_group("pre_commit")  # one hook environment (pre_commit_home) for both
def test_pre_commit_hook_fails_on_a_pitfall_and_passes_clean_code(user_repo, pre_commit_home):
    bad = _try_repo(user_repo, pre_commit_home, "fsdp2-check", "bad.py")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "bad.py:6:10: FSD101" in bad.stdout, bad.stdout
    good = _try_repo(user_repo, pre_commit_home, "fsdp2-check", "good.py")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "Passed" in good.stdout


@pytest.mark.integration
@pytest.mark.xdist_group("pre_commit")  # one hook environment (pre_commit_home) for both
def test_pre_commit_fix_hook_fixes_the_file(user_repo, pre_commit_home, tmp_path):
    work = tmp_path / "repo"
    shutil.copytree(user_repo, work)
    result = _try_repo(work, pre_commit_home, "fsdp2-check-fix", "bad.py")
    assert result.returncode == 1, result.stdout + result.stderr  # a fixer that changed a file fails the hook
    assert (work / "bad.py").read_text() == CLEAN
    again = _try_repo(work, pre_commit_home, "fsdp2-check-fix", "bad.py")
    assert again.returncode == 0, again.stdout + again.stderr


@pytest.mark.integration
def test_flake8_plugin_reports_fsd_codes(tmp_path):
    (tmp_path / "bad.py").write_text(PITFALL)
    (tmp_path / "good.py").write_text(CLEAN)
    bad = subprocess.run([_tool("flake8"), "--select", "FSD", "bad.py"], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout.splitlines() == [
        "bad.py:6:10: FSD101 `model.forward(...)` bypasses FSDP2's hooks on sharded `model`; call `model(...)`"
    ]
    good = subprocess.run([_tool("flake8"), "--select", "FSD", "good.py"], cwd=tmp_path, capture_output=True, text=True)
    assert (good.returncode, good.stdout) == (0, "")
    noqa = subprocess.run([_tool("flake8"), "--select", "FSD", "-"], input=PITFALL.replace(
        "model.forward(x)", "model.forward(x)  # noqa: FSD101"), cwd=tmp_path, capture_output=True, text=True)
    assert (noqa.returncode, noqa.stdout) == (0, "")


# --- the hook file and the README's pre-commit snippet -----------------------------------


def _readme_pre_commit_config() -> dict:
    import re

    import yaml

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**pre-commit**"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    return yaml.safe_load(block)


def test_the_hook_file_names_the_rule_catalogue_of_the_registry():
    import re

    import yaml

    from fsdp2_retrofit.check.rules import all_rules

    codes = sorted(r.CODE for r in all_rules() if r.DEFAULT)  # the 4xx notes are off unless selected
    numbers = [int(c[3:]) for c in codes]
    assert numbers == list(range(numbers[0], numbers[-1] + 1))  # so a range names every rule
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    ranges = [m for h in hooks for m in re.findall(r"(FSD\d{3})\s*[-–]\s*(FSD\d{3})", h["description"])]
    assert ranges == [(codes[0], codes[-1])]
    readme = (ROOT / "README.md").read_text()  # the introduction names the same range
    assert f"the {codes[0]}–{codes[-1]} catalogue" in " ".join(readme[:readme.index("## Set-up")].split())


def test_the_readme_pre_commit_snippet_uses_real_hooks_options_and_no_missing_tag():
    from fsdp2_retrofit.cli.check import check_command
    import yaml

    [repo] = _readme_pre_commit_config()["repos"]
    hooks = {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}
    assert [h["id"] for h in repo["hooks"]] == ["fsdp2-check"] and "fsdp2-check" in hooks
    assert not str(repo["rev"]).startswith("v")  # no release tag exists: a branch for autoupdate --freeze to pin
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**pre-commit**"):readme.index("**flake8 / editors**")]
    # the commented-out fixing hook: its id and each flag it passes are real
    assert "# - id: fsdp2-check-fix" in section and "fsdp2-check-fix" in hooks
    args = [a.strip() for a in section.split("#   args: [", 1)[1].split("]", 1)[0].split(",")]
    flags = {o for p in check_command.params for o in p.opts + p.secondary_opts}
    assert args == ["--unsafe-fixes"] and set(args) <= flags
    for said in ("pre-commit autoupdate --freeze", "pre-commit try-repo", "git ls-remote"):
        assert said in " ".join(section.split())


@pytest.mark.integration
def test_autoupdate_freeze_pins_the_readme_snippet_to_a_commit_sha(tmp_path):
    """The README's way to pin: on a copy of this repository with no tag, `pre-commit autoupdate
    --freeze` turns the snippet's `rev:` into the full SHA of the newest commit."""
    import yaml

    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e", "PRE_COMMIT_HOME": str(tmp_path / "home"), "PRE_COMMIT_COLOR": "never"}
    tool = tmp_path / "tool"
    tool.mkdir()
    shutil.copy(ROOT / ".pre-commit-hooks.yaml", tool)
    shutil.copy(ROOT / "pyproject.toml", tool)
    for cmd in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "tool"]):
        subprocess.run(cmd, cwd=tool, check=True, env=env)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tool, check=True, capture_output=True, text=True).stdout.strip()
    user = tmp_path / "user"
    user.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=user, check=True, env=env)
    config = _readme_pre_commit_config()
    config["repos"][0]["repo"] = str(tool)
    (user / ".pre-commit-config.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([_tool("pre-commit"), "autoupdate", "--freeze"], cwd=user, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert yaml.safe_load((user / ".pre-commit-config.yaml").read_text())["repos"][0]["rev"] == sha
