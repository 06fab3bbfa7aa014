"""A DataLoader built by a function of a sibling module (`train_loader = make_loader(...)`,
`from loaders import make_loader`): the rewrite gives it its DistributedSampler in that module
(the program linked into one analysis, taken apart file by file: rewrite/link.py) when no other
script beside them names the function; otherwise it says which function and line build the
loader that gets no sampler (attention, `differs`), and why it is left."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from textwrap import dedent

from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.rewrite.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]

LOADERS = dedent("""\
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    def make_loader(n, batch_size, shuffle):
        data = TensorDataset(torch.randn(n, 8), torch.randint(0, 2, (n,)))
        return DataLoader(data, batch_size=batch_size, shuffle=shuffle)
    """)

SCRIPT = dedent("""\
    import torch
    import torch.nn as nn
    from loaders import make_loader


    def train(model, optimizer, loader):
        for epoch in range(2):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()


    def main():
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        {bind} = make_loader(64, 8, True)
        train(model, optimizer, {bind})


    main()
    """)

SAMPLED = (
    "    sampler = DistributedSampler(data, shuffle=shuffle)\n"
    "    # The per-rank batch stays as written: the global batch is now world_size x larger.\n"
    "    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)\n"
    "    return loader\n"
)


def _project(tmp_path: Path, bind: str = "train_loader") -> Path:
    (tmp_path / "loaders.py").write_text(LOADERS)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(bind=bind))
    return script


def _rewrite(script: Path):
    return rewrite_source(script.read_bytes(), str(script))


def test_the_loader_gets_its_sampler_in_the_sibling_module(tmp_path):
    out = _rewrite(_project(tmp_path))
    assert not out.refusals, out.refusals
    assert [Path(s.path).name for s in out.siblings] == ["loaders.py"]
    edited = out.siblings[0]
    assert edited.original == LOADERS.encode()
    text = edited.code.decode()
    assert SAMPLED in text
    assert "from torch.utils.data.distributed import DistributedSampler\n" in text
    assert [(c.line, c.code, Path(c.path).name) for c in edited.changes] == [
        (7, "returns", "loaders.py"), (7, "data", "loaders.py")]
    assert not any("make_loader() of loaders.py" in a.what for a in out.attention)


def test_its_epoch_is_set_in_the_function_it_is_handed_to(tmp_path):
    """The script binds the loader and hands it to train(), whose epoch loop passes over its
    parameter: set_epoch goes there, on the parameter."""
    out = _rewrite(_project(tmp_path))
    assert "    for epoch in range(2):\n        loader.sampler.set_epoch(epoch)\n" in out.code.decode()


def test_renamed_locals_give_the_same_outcome(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _rewrite(_project(tmp_path / "a", "train_loader"))
    second = _rewrite(_project(tmp_path / "b", "batches"))
    assert [s.code for s in first.siblings] == [s.code for s in second.siblings] != []
    assert first.code == second.code.replace(b"batches", b"train_loader")


def test_another_script_naming_the_function_keeps_the_module_as_it_is(tmp_path):
    script = _project(tmp_path)
    (tmp_path / "evaluate.py").write_text("from loaders import make_loader\nprint(len(make_loader(8, 8, False)))\n")
    out = _rewrite(script)
    assert out.siblings == []
    items = [a for a in out.attention if a.differs and "make_loader() of loaders.py (its line 7)" in a.what]
    assert len(items) == 1, out.attention
    assert "evaluate.py names make_loader() too" in items[0].what
    assert items[0].line == SCRIPT.splitlines().index("    {bind} = make_loader(64, 8, True)") + 1


def test_sampler_none_there_is_no_sampler_and_a_sampler_of_its_own_is_refused_there(tmp_path):
    """`sampler=None` is the DataLoader's default: the loader gets its DistributedSampler (it was refused
    FSR901, "trains through `None`"); a sampler of its own there is refused at its line in loaders.py."""
    (tmp_path / "a").mkdir()
    script = _project(tmp_path / "a")
    (tmp_path / "a" / "loaders.py").write_text(LOADERS.replace("shuffle=shuffle)", "sampler=None)"))
    out = _rewrite(script)
    assert not out.refusals, out.refusals
    assert "DistributedSampler(data, shuffle=False)" in out.siblings[0].code.decode()
    (tmp_path / "b").mkdir()
    script = _project(tmp_path / "b")
    (tmp_path / "b" / "loaders.py").write_text(
        LOADERS.replace("shuffle=shuffle)", "sampler=torch.utils.data.WeightedRandomSampler([1.0] * n, n))"))
    out = _rewrite(script)
    assert [(r.code, r.line, Path(r.path).name) for r in out.refusals] == [("FSR901", 7, "loaders.py")]
    assert out.siblings == [] and out.code == out.original


def test_without_the_sibling_file_it_is_no_dataloader(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(bind="loader"))
    out = rewrite_source(script.read_bytes(), str(script))
    assert any("no DataLoader" in a.what and a.differs for a in out.attention), out.attention
    assert out.siblings == []


def test_installed_packages_and_folders_above_the_project_are_not_editable(tmp_path):
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / "src").mkdir()
    work = Workspace(str(project / "src" / "train.py"))
    assert work.not_editable(str(project / "src" / "loaders.py")) == ""
    assert work.not_editable(str(project / "lib" / "loaders.py")) == ""
    assert work.not_editable(str(project / ".venv" / "lib" / "site-packages" / "x.py")) == "an installed package"
    assert work.not_editable(str(tmp_path / "elsewhere.py")).startswith("outside the project")


# -- the command line: every file shown, written, counted ------------------------------------


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "FSDP2_RETROFIT_CACHE_DIR": str(cwd / ".cache")}
    return subprocess.run([sys.executable, "-m", "fsdp2_retrofit", "rewrite", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_diff_shows_every_file_and_writes_none(tmp_path):
    _project(tmp_path)
    done = _cli("train.py", "--diff", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--- a/train.py" in done.stdout and "--- a/loaders.py" in done.stdout
    assert all("+" + line in done.stdout for line in SAMPLED.splitlines(keepends=True))
    assert (tmp_path / "loaders.py").read_text() == LOADERS


def test_check_counts_every_file(tmp_path):
    _project(tmp_path)
    done = _cli("train.py", "--check", "--report", "json", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert [(r["path"], r["changed"]) for r in report] == [("train.py", True), ("loaders.py", True)]
    assert all(c["path"] == "loaders.py" for c in report[1]["changes"])
    assert (tmp_path / "loaders.py").read_text() == LOADERS


def test_in_place_writes_both_and_a_second_run_changes_nothing(tmp_path):
    _project(tmp_path)
    done = _cli("train.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert SAMPLED in (tmp_path / "loaders.py").read_text()
    assert "rewrote loaders.py (2 changes)" in done.stderr
    again = _cli("train.py", "--check", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert not list(tmp_path.glob(".*.tmp")) and not (tmp_path / ".fsdp2-retrofit-pending.json").exists()


def test_output_folder_gets_the_set_and_the_project_is_untouched(tmp_path):
    (tmp_path / "proj").mkdir()
    script = _project(tmp_path / "proj")
    done = _cli(str(script), "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["loaders.py", "train.py"]
    assert SAMPLED in (tmp_path / "out" / "loaders.py").read_text()
    assert (tmp_path / "proj" / "loaders.py").read_text() == LOADERS


def test_output_file_for_a_set_of_files_is_an_error(tmp_path):
    _project(tmp_path)
    (tmp_path / "out.py").write_text("")
    done = _cli("train.py", "-o", "out.py", cwd=tmp_path)
    assert done.returncode == 2
    assert "this rewrite changes 2 files (train.py, loaders.py); give -o a folder" in done.stderr
    assert (tmp_path / "loaders.py").read_text() == LOADERS


def test_the_cache_answers_with_every_file_and_misses_when_the_module_changes(tmp_path):
    _project(tmp_path)
    first = _cli("train.py", "--diff", cwd=tmp_path)
    assert list((tmp_path / ".cache").glob("*")), "nothing was cached"
    again = _cli("train.py", "--diff", cwd=tmp_path)
    assert again.stdout == first.stdout and "--- a/loaders.py" in again.stdout
    (tmp_path / "loaders.py").write_text(LOADERS.replace("batch_size=batch_size, shuffle", "batch_size=batch_size,  shuffle"))
    changed = _cli("train.py", "--diff", cwd=tmp_path)
    assert "-    return DataLoader(data, batch_size=batch_size,  shuffle=shuffle)" in changed.stdout


def test_verify_runs_the_retrofit_with_the_modules_it_edits(tmp_path):
    from fsdp2_retrofit.verify import retrofit_in_memory

    script = _project(tmp_path)
    target = retrofit_in_memory(script, tmp_path / "retrofit")
    edited = (tmp_path / "retrofit" / "loaders.py").read_text()  # verify keeps the global batch
    assert "    loader = DataLoader(data, batch_size=batch_size // dist.get_world_size(), sampler=sampler)\n" in edited
    assert target == tmp_path / "retrofit" / "train.py"


SHARED = dedent("""\
    import torch
    import torch.nn as nn
    from loaders import make_loader


    def main():
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_loader = make_loader(64, 8, True)
        val_loader = make_loader(32, 8, False)
        for epoch in range(2):
            for x, y in train_loader:
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            with torch.no_grad():
                print(sum(nn.functional.cross_entropy(model(x), y).item() for x, y in val_loader))


    main()
    """)


def test_a_helper_shared_with_a_validation_loader_samples_only_for_training(tmp_path):
    (tmp_path / "loaders.py").write_text(LOADERS)
    script = tmp_path / "train.py"
    script.write_text(SHARED)
    out = _rewrite(script)
    assert not out.refusals, out.refusals
    text = out.siblings[0].code.decode()
    assert "def make_loader(n, batch_size, shuffle, distributed=False):\n" in text
    assert ("    loader = DataLoader(data, batch_size=batch_size, shuffle=None if distributed else shuffle, "
            "sampler=DistributedSampler(data, shuffle=shuffle) if distributed else None)\n    return loader\n") in text
    new = out.code.decode()
    assert "    train_loader = make_loader(64, 8, True, distributed=True)\n" in new
    assert "    val_loader = make_loader(32, 8, False)\n" in new
    assert "    for epoch in range(2):\n        train_loader.sampler.set_epoch(epoch)\n" in new
    compile(text, "loaders.py", "exec")


def test_a_helper_taking_kwargs_is_left_when_it_also_builds_a_validation_loader(tmp_path):
    (tmp_path / "loaders.py").write_text(LOADERS.replace("shuffle):", "shuffle, **kwargs):"))
    script = tmp_path / "train.py"
    script.write_text(SHARED)
    out = _rewrite(script)
    assert not any("DistributedSampler" in s.code.decode() for s in out.siblings)
    assert any("make_loader() takes **kwargs: no parameter can be added" in a.what and a.differs
               for a in out.attention), out.attention


def test_output_naming_a_new_script_for_a_set_of_files_is_an_error_too(tmp_path):
    _project(tmp_path)
    done = _cli("train.py", "-o", "train_fsdp2.py", cwd=tmp_path)
    assert done.returncode == 2
    assert "give -o a folder" in done.stderr
    assert not (tmp_path / "train_fsdp2.py").exists()
