"""check's per-file results cache (check/results_cache.py): a warm run answers unparsed, with the
cold run's output byte for byte; whatever a file's findings depend on (its bytes, the rules,
what the run's other files hand it, the project modules its analysis reads) is a miss."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.check import lint

TRAIN = """\
from torch.distributed.fsdp import fully_shard
from trainer import Trainer


def main(model, mesh, x):
    fully_shard(model, mesh=mesh)
    t = Trainer(model)
    t.step(x)
    torch.save(model.state_dict(), "m.pt")  # noqa
"""

TRAINER = """\
class Trainer:
    def __init__(self, model):
        self.model = model

    def step(self, x):
        return self.model.forward(x)
"""

PARALLEL = """\
from torch.distributed.fsdp import fully_shard


def shard_model(model):
    fully_shard(model)
    return model
"""

BY_SHARDER = """\
import torch
from parallel import shard_model


def main(model, x):
    model = shard_model(model)
    y = model.forward(x)
    torch.save(model.state_dict(), "m.pt")
"""


def _project(root: Path, files: dict) -> Path:
    (root / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def _run(root: Path, *args: str):
    """The CliRunner result of `check ARGS` in root."""
    old = os.getcwd()
    os.chdir(root)
    try:
        return CliRunner().invoke(cli.main, ["check", *args])
    finally:
        os.chdir(old)


def _found(root: Path, *args: str) -> dict:
    """{path: [(line, code)]} of `check ARGS --output-format json` in root."""
    out = _run(root, "--output-format", "json", *args)
    assert out.exit_code in (0, 1), out.output
    found: dict = {}
    for f in json.loads(out.stdout):
        found.setdefault(os.path.normpath(f["filename"]), []).append((f["location"]["row"], f["code"]))
    return found


def _entries() -> list:
    return sorted((Path(os.environ["FSDP2_RETROFIT_CACHE_DIR"]) / "check" / "results").glob("*.json"))


@pytest.fixture
def parses(monkeypatch):
    """The paths lint_source is asked to lint (a parse each), in order."""
    asked = []
    real = lint.lint_source
    monkeypatch.setattr(lint, "lint_source", lambda data, path, *a, **k: asked.append(path) or real(data, path, *a, **k))
    return asked


def _never_parsed(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("parsed on a warm run")

    monkeypatch.setattr(lint, "lint_source", fail)
    monkeypatch.setattr(lint, "handed_out", fail)
    monkeypatch.setattr(lint, "applicable", fail)


@pytest.mark.parametrize("args", [
    ["--output-format", "text"], ["--output-format", "json"], ["--output-format", "github"],
    ["--output-format", "sarif"], ["--statistics"], ["--output-format", "text", "--unsafe-fixes"],
])
@pytest.mark.parametrize("paths", [["."], ["trainer.py"]])
def test_a_warm_run_parses_nothing_and_prints_the_cold_runs_bytes(tmp_path, monkeypatch, args, paths):
    _project(tmp_path, {"train.py": TRAIN + "    t.model.forward(x)\n", "trainer.py": TRAINER,
                        "broken.py": "def f(:\n", "plain.py": "x = 1\n"})
    if paths == ["."]:
        paths = ["train.py", "trainer.py", "broken.py", "plain.py"]
    cold = _run(tmp_path, *args, *paths)
    assert cold.exit_code == (2 if "broken.py" in paths else 1), cold.output
    assert _entries()
    _never_parsed(monkeypatch)
    warm = _run(tmp_path, *args, *paths)
    assert (warm.exit_code, warm.stdout, warm.stderr) == (cold.exit_code, cold.stdout, cold.stderr)
    assert "FSD101" in cold.stdout


def test_a_changed_file_is_linted_again(tmp_path, parses):
    _project(tmp_path, {"train.py": TRAIN, "trainer.py": TRAINER})
    assert _found(tmp_path, ".") == {"trainer.py": [(6, "FSD101")]}
    del parses[:]
    (tmp_path / "trainer.py").write_text(TRAINER + "\n    def evaluate(self, x):\n        return self.model.forward(x)\n")
    assert _found(tmp_path, ".") == {"trainer.py": [(6, "FSD101"), (9, "FSD101")]}
    # train.py too: its analysis reads trainer.py, the module it imports
    assert sorted(set(parses)) == ["train.py", "trainer.py"]
    del parses[:]
    (tmp_path / "other.py").write_text("x = 1\n")
    assert _found(tmp_path, ".") == {"trainer.py": [(6, "FSD101"), (9, "FSD101")]}
    assert parses == []  # other.py is not even parsed (the prefilter), the others answered from the cache


def test_another_rule_selection_is_a_miss(tmp_path, parses):
    _project(tmp_path, {"train.py": TRAIN + "    model.forward(x)\n", "trainer.py": TRAINER})
    assert _found(tmp_path, ".") == {"train.py": [(10, "FSD101")], "trainer.py": [(6, "FSD101")]}
    del parses[:]
    assert _found(tmp_path, "--select", "FSD102", ".") == {}  # FSD102's one is under a noqa
    assert parses
    assert _found(tmp_path, "--ignore", "FSD101", "--extend-select", "FSD102", ".") == {}
    del parses[:]
    assert _found(tmp_path, ".") == {"train.py": [(10, "FSD101")], "trainer.py": [(6, "FSD101")]}
    assert parses == []  # each selection keeps its own entries


@pytest.mark.parametrize("paths", [["."], ["trainer.py"]])
def test_the_receiver_follows_the_file_that_shards_what_it_is_handed(tmp_path, paths):
    """train.py shards the model it hands Trainer: trainer.py's entry is a miss when train.py
    stops sharding it (in the run, or outside it: check/importers.py), and again when it starts."""
    _project(tmp_path, {"train.py": TRAIN, "trainer.py": TRAINER})
    assert _found(tmp_path, *paths) == {"trainer.py": [(6, "FSD101")]}
    (tmp_path / "train.py").write_text(TRAIN.replace("    fully_shard(model, mesh=mesh)\n", ""))
    assert _found(tmp_path, *paths) == {}
    (tmp_path / "train.py").write_text(TRAIN)
    assert _found(tmp_path, *paths) == {"trainer.py": [(6, "FSD101")]}
    (tmp_path / "train.py").write_text(TRAIN.replace("Trainer(model)", "Trainer(None)"))
    assert _found(tmp_path, *paths) == {}


def test_a_changed_module_its_analysis_reads_is_a_miss(tmp_path):
    """train.py is the same; parallel.py, whose shard_model shards what train.py forwards, stops sharding."""
    _project(tmp_path, {"train.py": BY_SHARDER, "parallel.py": PARALLEL})
    assert _found(tmp_path, "train.py") == {"train.py": [(7, "FSD101"), (8, "FSD102")]}
    (tmp_path / "parallel.py").write_text(PARALLEL.replace("    fully_shard(model)\n", "    model.cuda()\n"))
    assert _found(tmp_path, "train.py") == {}
    (tmp_path / "parallel.py").write_text(PARALLEL)
    assert _found(tmp_path, "train.py") == {"train.py": [(7, "FSD101"), (8, "FSD102")]}


@pytest.mark.parametrize("garbage", [
    "{not json", "[]", "", "null", '{"stamp": 1}',
    "findings:[[1]]", "findings:[[1,2,3,4,5,6,7,8,9]]", "handed:[[1]]", "reads:[]", "stamp:another version",
])
def test_a_corrupt_or_foreign_entry_is_a_miss(tmp_path, parses, garbage):
    _project(tmp_path, {"train.py": TRAIN, "trainer.py": TRAINER})
    assert _found(tmp_path, ".") == {"trainer.py": [(6, "FSD101")]}
    for entry in _entries():
        if ":" in garbage and not garbage.startswith("{"):
            field, _, value = garbage.partition(":")
            data = json.loads(entry.read_text())
            data[field] = json.loads(value) if value[:1] in "[{" else value
            entry.write_text(json.dumps(data))
        else:
            entry.write_text(garbage)
    del parses[:]
    assert _found(tmp_path, ".") == {"trainer.py": [(6, "FSD101")]}
    assert sorted(set(parses)) == ["train.py", "trainer.py"]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_no_cache_reads_and_writes_nothing(tmp_path, monkeypatch, parses, how):
    _project(tmp_path, {"train.py": TRAIN, "trainer.py": TRAINER})
    assert _found(tmp_path, ".") == {"trainer.py": [(6, "FSD101")]}
    written = _entries()
    assert written
    for entry in written:
        entry.unlink()
    if how == "env":
        monkeypatch.setenv("FSDP2_RETROFIT_NO_CACHE", "1")
    del parses[:]
    assert _found(tmp_path, ".", *(["--no-cache"] if how == "flag" else [])) == {"trainer.py": [(6, "FSD101")]}
    assert parses and not _entries()


def test_fixing_reads_and_writes_no_result(tmp_path, parses):
    _project(tmp_path, {"train.py": TRAIN + "    model.forward(x)\n", "trainer.py": TRAINER})
    diff = _run(tmp_path, "--diff", ".")
    assert diff.exit_code == 1 and "+    model(x)" in diff.stdout
    assert not _entries()
    assert _found(tmp_path, ".")  # now kept
    del parses[:]
    fixed = _run(tmp_path, "--fix", ".")
    assert fixed.exit_code in (0, 1) and parses  # linted, not answered from the cache
    assert "    model(x)\n" in (tmp_path / "train.py").read_text()
    assert "self.model(x)" in (tmp_path / "trainer.py").read_text()
    assert _found(tmp_path, ".") == _found(tmp_path, "--no-cache", ".") == {}  # the fixed bytes: a miss


def test_no_worker_is_started_when_every_file_hits(tmp_path, monkeypatch):
    import concurrent.futures

    from fsdp2_retrofit.check import checker
    from fsdp2_retrofit.check.rules import selected

    _project(tmp_path, {f"m{i}.py": TRAIN + "    model.forward(x)\n" for i in range(checker.PARALLEL_MIN_FILES)})
    paths = [str(p) for p in sorted(tmp_path.glob("m*.py"))]
    job = checker.CheckJob(tuple(selected([], [])))
    cold = checker.run(job, paths, workers=1)

    def fail(*args, **kwargs):
        raise AssertionError("a process pool for files that all hit the cache")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", fail)
    _never_parsed(monkeypatch)
    warm = checker.run(job, paths, workers=2)
    assert [(r.path, r.findings, r.handed, r.bare_noqa) for r in warm] == [
        (r.path, r.findings, r.handed, r.bare_noqa) for r in cold]
    assert all(r.findings for r in warm)


@pytest.mark.parametrize("appears", ["module", "package", "shadow"])
def test_a_module_that_appears_where_an_import_was_looked_for_is_a_miss(tmp_path, appears, new_process):
    """train.py's `from parallel import shard_model` resolved to nothing (or to a module that does
    not shard), then parallel.py is created (a package's __init__.py; one beside train.py that
    shadows the project root's): the entry made without it is stale."""
    sharding = {"train.py": [(7, "FSD101"), (8, "FSD102")]}
    if appears == "module":
        _project(tmp_path, {"train.py": BY_SHARDER})
        new = {"parallel.py": PARALLEL}
    elif appears == "package":  # parallel/ without __init__.py: nothing to import shard_model from
        _project(tmp_path, {"train.py": BY_SHARDER})
        (tmp_path / "parallel").mkdir()
        new = {"parallel/__init__.py": PARALLEL}
    else:  # app/train.py imports the root's parallel.py, which does not shard; app/parallel.py does
        _project(tmp_path, {"parallel.py": PARALLEL.replace("    fully_shard(model)\n", "    model.cuda()\n")})
        (tmp_path / "app").mkdir()
        (tmp_path / "app" / "train.py").write_text(BY_SHARDER)
        sharding = {os.path.join("app", "train.py"): [(7, "FSD101"), (8, "FSD102")]}
        new = {"app/parallel.py": PARALLEL}
    checked = next(iter(sharding))
    assert _found(tmp_path, checked) == {}
    for name, text in new.items():
        (tmp_path / name).write_text(text)
    new_process()
    assert _found(tmp_path, checked) == sharding


def test_a_project_marker_that_appears_above_is_a_miss(tmp_path, new_process):
    """apps/train.py's `from lingua.parallel import shard_model` resolves from the project's root:
    with no marker there is none (nothing found); a pyproject.toml created above makes it one."""
    (tmp_path / "lingua").mkdir()
    (tmp_path / "lingua" / "parallel.py").write_text(PARALLEL)
    (tmp_path / "apps").mkdir()
    (tmp_path / "apps" / "train.py").write_text(BY_SHARDER.replace("from parallel", "from lingua.parallel"))
    checked = os.path.join("apps", "train.py")
    assert _found(tmp_path, checked) == {}
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    new_process()
    assert _found(tmp_path, checked) == {checked: [(7, "FSD101"), (8, "FSD102")]}
