"""A file checked without the files that import it (pre-commit passes only the changed files, in
parallel batches) is judged as `check .` judges it: the project's files outside the run that hand
it a sharded module are found and read (check/importers.py), through a summary cache by content."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli

TRAIN = """\
from torch.distributed.fsdp import fully_shard
from trainer import Trainer


def main(model, mesh, x):
    fully_shard(model, mesh=mesh)
    t = Trainer(model)
    t.step(x)
"""

TRAINER = """\
class Trainer:
    def __init__(self, model):
        self._model = model

    def step(self, x):
        return self._model.forward(x)
"""

# the probe: the forward through a local alias of the attribute
TRAINER_ALIAS = TRAINER.replace("        return self._model.forward(x)\n", "        net = self._model\n        return net.forward(x)\n")

PKG_TRAIN = TRAIN.replace("from trainer import Trainer", "from .trainer import Trainer")

HELPERS = """\
def evaluate(net, x):
    return net.forward(x)
"""

BY_FUNCTION = """\
from torch.distributed.fsdp import fully_shard
import helpers


def main(model, x):
    fully_shard(model)
    helpers.evaluate(model, x)
"""

PARALLEL = """\
from torch.distributed.fsdp import fully_shard


def shard_model(model):
    fully_shard(model)
    return model
"""

BY_SHARDER = """\
from parallel import shard_model
from trainer import Trainer


def main(model, x):
    model = shard_model(model)
    Trainer(model).step(x)
"""

LAYOUTS = {
    "probe": ({"train.py": TRAIN, "trainer.py": TRAINER}, "trainer.py"),
    "probe-alias": ({"train.py": TRAIN, "trainer.py": TRAINER_ALIAS}, "trainer.py"),
    "package": ({"pkg/__init__.py": "", "pkg/train.py": PKG_TRAIN, "pkg/trainer.py": TRAINER}, "pkg/trainer.py"),
    "function": ({"train.py": BY_FUNCTION, "helpers.py": HELPERS}, "helpers.py"),
    "sharder": ({"train.py": BY_SHARDER, "parallel.py": PARALLEL, "trainer.py": TRAINER}, "trainer.py"),
}


def _project(root: Path, files: dict) -> Path:
    (root / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _check(root: Path, *args: str):
    """(exit code, {path relative to root: [(line, code)]}) of `check ARGS --output-format json` in root."""
    old = os.getcwd()
    os.chdir(root)
    try:
        out = CliRunner().invoke(cli.main, ["check", "--output-format", "json", *args])
    finally:
        os.chdir(old)
    assert out.exit_code in (0, 1), out.output
    found: dict = {}
    for f in json.loads(out.stdout):
        found.setdefault(os.path.normpath(f["filename"]), []).append((f["location"]["row"], f["code"]))
    return out.exit_code, found


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_file_checked_alone_is_judged_as_the_whole_tree_judges_it(tmp_path, layout):
    files, receiver = LAYOUTS[layout]
    _project(tmp_path, files)
    _, tree = _check(tmp_path, ".")
    _, alone = _check(tmp_path, receiver)
    assert alone.get(receiver, []) == tree.get(receiver, [])
    if layout != "probe-alias":  # the alias is not followed yet, in the tree either
        assert tree[receiver] and tree[receiver][0][1] == "FSD101"


@pytest.mark.parametrize("layout", ["probe", "package", "sharder"])
def test_pre_commit_batches_together_find_what_the_tree_finds(tmp_path, layout):
    """`pre-commit run --all-files` splits the files among processes: each half is checked alone."""
    files, _ = LAYOUTS[layout]
    _project(tmp_path, files)
    names = sorted(files)
    _, tree = _check(tmp_path, ".")
    batches: dict = {}
    for half in (names[: len(names) // 2], names[len(names) // 2:]):
        batches.update(_check(tmp_path, *half)[1])
    assert batches == tree and tree


def test_without_its_importers_nothing_is_found(tmp_path):
    """The file alone is told only by its importers: with them gone, nothing."""
    _project(tmp_path, {"trainer.py": TRAINER, "other.py": "import trainer\n"})
    assert _check(tmp_path, "trainer.py") == (0, {})


def test_a_changed_importer_is_read_again(tmp_path):
    _project(tmp_path, LAYOUTS["probe"][0])
    assert _check(tmp_path, "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}
    (tmp_path / "train.py").write_text(TRAIN.replace("    fully_shard(model, mesh=mesh)\n", ""))
    assert _check(tmp_path, "trainer.py") == (0, {})
    (tmp_path / "train.py").write_text(TRAIN)
    assert _check(tmp_path, "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}


def test_a_changed_module_the_importer_reads_is_read_again(tmp_path):
    """train.py is the same; parallel.py, whose shard_model makes its model sharded, stops sharding."""
    _project(tmp_path, LAYOUTS["sharder"][0])
    assert _check(tmp_path, "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}
    (tmp_path / "parallel.py").write_text(PARALLEL.replace("    fully_shard(model)\n", "    model.cuda()\n"))
    assert _check(tmp_path, "trainer.py") == (0, {})


def test_a_warm_run_reads_the_summaries_and_does_not_analyse_the_importer_again(tmp_path, monkeypatch):
    from fsdp2_retrofit.check import lint

    _project(tmp_path, LAYOUTS["probe"][0])
    assert _check(tmp_path, "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}
    assert list((Path(os.environ["FSDP2_RETROFIT_CACHE_DIR"]) / "check").glob("*.json"))

    def fail(*args, **kwargs):
        raise AssertionError("analysed again")

    monkeypatch.setattr(lint, "handed_out", fail)
    assert _check(tmp_path, "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}


@pytest.mark.parametrize("garbage", ["{not json", "[]", '{"reads": {}, "handed": [[1]]}', ""])
def test_a_corrupt_cache_entry_is_computed_again(tmp_path, garbage):
    _project(tmp_path, LAYOUTS["probe"][0])
    _check(tmp_path, "trainer.py")
    entries = list((Path(os.environ["FSDP2_RETROFIT_CACHE_DIR"]) / "check").glob("*.json"))
    assert entries
    for entry in entries:
        entry.write_text(garbage)
    assert _check(tmp_path, "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}


def test_an_unwritable_cache_is_no_error(tmp_path, monkeypatch):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(blocker))
    (tmp_path / "p").mkdir()
    _project(tmp_path / "p", LAYOUTS["probe"][0])
    assert _check(tmp_path / "p", "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}


@pytest.mark.parametrize("how", ["flag", "env"])
def test_no_cache_reads_and_writes_nothing(tmp_path, monkeypatch, how):
    _project(tmp_path, LAYOUTS["probe"][0])
    if how == "env":
        monkeypatch.setenv("FSDP2_RETROFIT_NO_CACHE", "1")
    assert _check(tmp_path, "trainer.py", *(["--no-cache"] if how == "flag" else []))[1] == {
        "trainer.py": [(6, "FSD101")]}
    assert not (Path(os.environ["FSDP2_RETROFIT_CACHE_DIR"]) / "check").exists()


def test_an_excluded_importer_is_not_read(tmp_path):
    """What `check .` would skip (--exclude) tells nothing, as in the tree."""
    _project(tmp_path, LAYOUTS["probe"][0])
    assert _check(tmp_path, "--exclude", "train.py", ".") == (0, {})
    assert _check(tmp_path, "--exclude", "train.py", "trainer.py") == (0, {})


def test_outside_a_project_only_the_folder_and_its_packages_are_read(tmp_path):
    """No pyproject.toml/.git: the script's own folder (where `from trainer import` resolves)."""
    for name, text in LAYOUTS["probe"][0].items():
        (tmp_path / name).write_text(text)
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "deep" / "er" / "x.py").write_text("raise SystemExit\n")  # never a package: not read
    from fsdp2_retrofit.check.importers import project_files, project_of

    assert project_of(str(tmp_path / "trainer.py")) == (str(tmp_path), False)
    assert sorted(Path(p).name for p in project_files(str(tmp_path), False, ())) == ["train.py", "trainer.py"]
    assert _check(tmp_path, "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}


def test_a_file_of_the_run_is_never_read_again_as_an_importer(tmp_path, monkeypatch):
    """train.py is fixed in the run (--diff): what it hands is the run's, not its bytes on disk read again."""
    from fsdp2_retrofit.check import lint

    _project(tmp_path, {"train.py": TRAIN + "    model.forward(x)\n", "trainer.py": TRAINER, "other.py": "x = 1\n"})
    asked = []
    real = lint.handed_out
    monkeypatch.setattr(lint, "handed_out", lambda data, path, rules: asked.append(path) or real(data, path, rules))
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        out = CliRunner().invoke(cli.main, ["check", "--diff", "train.py", "trainer.py"])
    finally:
        os.chdir(old)
    assert out.exit_code == 1, out.output
    assert asked == []


def _summaries() -> list:
    return sorted((Path(os.environ["FSDP2_RETROFIT_CACHE_DIR"]) / "check").glob("*.json"))


def test_an_edited_importer_replaces_its_summary(tmp_path):
    """One summary per file and rule selection: an edit replaces it (none piles up)."""
    _project(tmp_path, LAYOUTS["probe"][0])
    _check(tmp_path, "trainer.py")
    entries = _summaries()
    assert len(entries) == 1
    for n in range(3):
        (tmp_path / "train.py").write_text(TRAIN + f"\n# edit {n}\n")
        assert _check(tmp_path, "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}
    assert _summaries() == entries
    _check(tmp_path, "--select", "FSD101", "trainer.py")
    assert len(_summaries()) == 2  # another selection: an entry of its own


def test_a_summary_is_stale_once_a_module_its_importer_looked_for_appears(tmp_path, new_process):
    """train.py imports shard_model from parallel.py, which is not there yet: it hands nothing
    sharded; once parallel.py (which shards) is created, its summary is a miss."""
    train = "from torch.distributed.fsdp import fully_shard  # noqa: F401\n" + BY_SHARDER
    _project(tmp_path, {"train.py": train, "trainer.py": TRAINER})
    assert _check(tmp_path, "trainer.py") == (0, {})
    (tmp_path / "parallel.py").write_text(PARALLEL)
    new_process()
    assert _check(tmp_path, "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}


def test_a_project_marker_that_appears_above_makes_importers_of_its_files(tmp_path, new_process):
    """Without a marker, pkg/trainer.py's project is the folder above its package (only its files
    and packages are read: app/train.py is not); a pyproject.toml there makes it the project's
    root, and app/train.py (which imports pkg.trainer from that root) an importer."""
    files = {"pkg/__init__.py": "", "pkg/trainer.py": TRAINER,
             "app/train.py": TRAIN.replace("from trainer import", "from pkg.trainer import")}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    checked = os.path.join("pkg", "trainer.py")
    assert _check(tmp_path, checked) == (0, {})
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    new_process()
    assert _check(tmp_path, checked)[1] == {checked: [(6, "FSD101")]}
    assert _check(tmp_path, ".")[1] == {checked: [(6, "FSD101")]}


@pytest.mark.parametrize("field, value", [("stamp", "another tool"), ("data", "other bytes"), ("reads", [])])
def test_a_foreign_summary_is_computed_again(tmp_path, monkeypatch, field, value):
    from fsdp2_retrofit.check import lint

    _project(tmp_path, LAYOUTS["probe"][0])
    _check(tmp_path, "trainer.py")
    for entry in _summaries():
        found = json.loads(entry.read_text())
        found[field] = value
        found["handed"] = []  # what a hit would hand: nothing
        entry.write_text(json.dumps(found))
    asked = []
    real = lint.handed_out
    monkeypatch.setattr(lint, "handed_out", lambda *a, **k: asked.append(a[1]) or real(*a, **k))
    assert _check(tmp_path, "trainer.py")[1] == {"trainer.py": [(6, "FSD101")]}
    assert asked
