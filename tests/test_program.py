"""The program: the entry and the project modules it reaches, converted as one (rewrite/link.py).

The same training, restructured as a project, converts to the same training: main_modulelist
is also written as a course-style project (project_course: model_builder, data_setup, engine,
utils, a module-level entry), a Solver class that owns the run (project_solver), a thin entry
into a package (project_thin_entry) and a Trainer whose run() builds the optimizer
(project_trainer_method_optimizer). Each has its golden and its own execution test
(test_golden, test_execution); the e2e test below runs each converted project and the
converted single file under torchrun and finds the same weights. The fast tests pin the
coverage rule: a training step the entry reaches in another module is converted where it
lives, or refused at that step (FSR970), never left behind a "converted".
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from textwrap import dedent

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source
from rewrite_cases import FIXTURES, edits_siblings, project_copy

PROJECTS = ["project_course", "project_solver", "project_thin_entry", "project_trainer_method_optimizer"]

ENGINE = '''
import torch


def train(model, loader, optimizer, epochs):
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        print(epoch, loss.item())
'''

ENTRY = '''
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import engine

model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
engine.train(model, loader, optimizer, 2)
torch.save(model.state_dict(), "model.pt")
'''


def _project(tmp_path: Path, files: dict) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(dedent(text).lstrip())
    return tmp_path / "train.py"


def _rewrite(entry: Path):
    return rewrite_source(entry.read_bytes(), str(entry), RetrofitOptions())


def _by_file(result) -> dict:
    return {Path(f.path).name: f.code.decode() for f in result.files}


def test_a_loop_in_a_sibling_module_gets_its_sampler_and_the_entry_its_shards(tmp_path):
    result = _rewrite(_project(tmp_path, {"engine.py": ENGINE, "train.py": ENTRY}))
    assert not result.refusals, result.refusals
    files = _by_file(result)
    assert "fully_shard(model, mesh=mesh)" in files["train.py"]
    assert "DistributedSampler" in files["train.py"]
    assert "loader.sampler.set_epoch(epoch)" in files["engine.py"]
    assert "import torch.distributed as dist" in files["engine.py"]  # the imports its new code reads
    assert "engine.train(model, loader, optimizer, 2)" in files["train.py"]  # read through the module again
    assert {Path(c.path).name for f in result.files for c in f.changes} == {"train.py", "engine.py"}


def test_an_aliased_module_and_a_from_import_convert_the_same(tmp_path):
    aliased = _rewrite(_project(tmp_path / "a", {"engine.py": ENGINE, "train.py": ENTRY.replace(
        "import engine\n", "import engine as eng\n").replace("engine.train(", "eng.train(")}))
    named = _rewrite(_project(tmp_path / "b", {"engine.py": ENGINE, "train.py": ENTRY.replace(
        "import engine\n", "from engine import train\n").replace("engine.train(", "train(")}))
    assert not aliased.refusals and not named.refusals
    assert _by_file(aliased)["engine.py"] == _by_file(named)["engine.py"]
    assert "eng.train(model, loader, optimizer, 2)" in _by_file(aliased)["train.py"]
    assert _by_file(aliased)["train.py"].replace("eng.train(", "train(").replace(
        "import engine as eng", "from engine import train") == _by_file(named)["train.py"]


def test_a_step_in_a_module_that_cannot_be_linked_is_refused_at_that_step(tmp_path):
    # the module handed around as a value: the linked text cannot read it as its names
    entry = ENTRY.replace("engine.train(model", "getattr(engine, 'train')(model")
    result = _rewrite(_project(tmp_path, {"engine.py": ENGINE, "train.py": entry}))
    assert [r.code for r in result.refusals] == ["FSR970"]
    refusal = result.refusals[0]
    assert Path(refusal.path).name == "engine.py" and refusal.line == 9  # loss.backward()
    assert "the module `engine` is used as a value" in refusal.why
    assert result.code == result.original and not result.siblings


def test_a_name_imported_under_another_name_is_read_as_itself_and_written_back(tmp_path):
    # minGPT's `from mingpt.utils import CfgNode as CN`; here `from engine import train as fit`
    entry = ENTRY.replace("import engine\n", "from engine import train as fit\n").replace("engine.train(", "fit(")
    result = _rewrite(_project(tmp_path, {"engine.py": ENGINE, "train.py": entry}))
    assert not result.refusals, result.refusals
    files = _by_file(result)
    assert "from engine import train as fit\n" in files["train.py"] and "fit(model, loader, optimizer, 2)" in files["train.py"]
    assert "loader.sampler.set_epoch(epoch)" in files["engine.py"]


def test_names_two_modules_bind_to_different_things_are_renamed_apart_and_back(tmp_path):
    # `loader` at the top level of both files; `F` two different imports (the corpus's Image_Segmentation)
    engine = ENGINE.replace("import torch\n", "import torch\nimport torch.nn.functional as F\n").replace(
        "torch.nn.functional.mse_loss(", "F.mse_loss(") + "\nloader = None\n"
    entry = ENTRY.replace("import torch.nn as nn\n", "import torch.nn as nn\nfrom torchvision.transforms import functional as F\n")
    result = _rewrite(_project(tmp_path, {"engine.py": engine, "train.py": entry}))
    assert not result.refusals, result.refusals
    files = _by_file(result)
    assert "loader.sampler.set_epoch(epoch)" in files["engine.py"]
    assert "F.mse_loss(model(x), y)" in files["engine.py"] and "loader = None" in files["engine.py"]
    assert "__engine" not in files["engine.py"] + files["train.py"]  # no name of the linked text is left
    assert "from torchvision.transforms import functional as F\n" in files["train.py"]
    assert "import torch.nn.functional as F\n" not in files["train.py"]


def test_without_the_program_the_same_entry_would_have_been_converted(tmp_path):
    # what the coverage rule guards against: the entry alone shards and splits its loader, while the
    # loop that reads it is in engine.py; the linked program is what reaches the loop
    entry = _project(tmp_path, {"engine.py": ENGINE, "train.py": ENTRY})
    from fsdp2_retrofit.pipeline import _rewrite_module, parse

    alone = _rewrite_module(entry.read_bytes(), str(entry), RetrofitOptions(), parse(entry.read_bytes()))
    assert not alone.refusals and not alone.siblings  # "converted", engine.py never seen
    assert "set_epoch" not in alone.code.decode()


def test_a_project_import_under_the_main_guard_is_linked_and_put_back(tmp_path):
    entry = ENTRY.replace("import engine\n", "").replace(
        "engine.train(model, loader, optimizer, 2)\n",
        'if __name__ == "__main__":\n    from engine import train\n\n    train(model, loader, optimizer, 2)\n')
    result = _rewrite(_project(tmp_path, {"engine.py": ENGINE, "train.py": entry}))
    assert not result.refusals, result.refusals
    files = _by_file(result)
    assert '    from engine import train\n\n    train(model, loader, optimizer, 2)' in files["train.py"]
    assert "__fsdp2_link__" not in files["train.py"] + files["engine.py"]
    assert "loader.sampler.set_epoch(epoch)" in files["engine.py"]


def test_a_nested_import_of_a_module_and_a_library_in_one_statement_is_refused_at_the_step(tmp_path):
    entry = ENTRY.replace("import engine\n", "").replace(
        "engine.train(model, loader, optimizer, 2)\n",
        'if __name__ == "__main__":\n    import os, engine\n\n    engine.train(model, loader, optimizer, 2)\n')
    result = _rewrite(_project(tmp_path, {"engine.py": ENGINE, "train.py": entry}))
    assert [(r.code, Path(r.path).name) for r in result.refusals] == [("FSR970", "engine.py")]
    assert "a project module and a library in one statement" in result.refusals[0].why


def test_a_root_the_entry_adds_to_sys_path_and_a_star_import_of_a_package_module(tmp_path):
    # apps/run/train.py: sys.path.append("../../lib"); from proj.sub.engine import *  (lib/proj/sub/engine.py)
    (tmp_path / "pyproject.toml").write_text("")  # the project's root, above apps/ and lib/
    entry = "import sys\n\nsys.path.append('../../lib')\n" + ENTRY.replace(
        "import engine\n", "from proj.sub.engine import *\n").replace("engine.train(", "train(")
    files = {"lib/proj/__init__.py": "", "lib/proj/sub/__init__.py": "", "lib/proj/sub/engine.py": ENGINE,
             "apps/run/train.py": entry}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(dedent(text).lstrip())
    result = _rewrite(tmp_path / "apps/run/train.py")
    assert not result.refusals, result.refusals
    [engine] = result.siblings
    assert Path(engine.path).resolve() == (tmp_path / "lib/proj/sub/engine.py").resolve()
    assert "loader.sampler.set_epoch(epoch)" in engine.code.decode()
    assert "from proj.sub.engine import *" in result.code.decode()


def test_an_import_of_a_folder_without_init_is_found_from_the_entry_s_folder(tmp_path):
    # loaders/data.py (no __init__.py beside it) imports `from base import make_loader`: Python finds base/
    # in the entry's folder (sys.path[0]), so does the program; the entry changes nothing but its own
    files = {
        "base/__init__.py": "from .loaders import *\n",
        "base/loaders.py": "import torch\n\n\ndef make_loader(data):\n"
                           "    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)\n",
        "loaders/data.py": "import torch\nfrom base import make_loader\n\n\ndef get_loader():\n"
                           "    return make_loader(torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1)))\n",
        "engine.py": ENGINE,
        "train.py": ENTRY.replace("import engine\n", "import engine\nfrom loaders.data import get_loader\n").replace(
            "loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)",
            "loader = get_loader()"),
    }
    result = _rewrite(_project(tmp_path, files))
    assert not result.refusals, result.refusals
    edited = {Path(f.path).resolve().relative_to(tmp_path.resolve()).as_posix(): f.code.decode() for f in result.siblings}
    assert "DistributedSampler(data, shuffle=True)" in edited["base/loaders.py"]
    assert "loader.sampler.set_epoch(epoch)" in edited["engine.py"]


def test_a_module_the_program_cannot_read_is_said(tmp_path):
    # helpers.py does not parse: whatever loop it holds is unseen, and the report says so at the entry
    entry = ENTRY.replace("import engine\n", "import helpers\n").replace(
        "engine.train(model, loader, optimizer, 2)\n",
        "for x, y in loader:\n    optimizer.zero_grad()\n    torch.nn.functional.mse_loss(model(x), y).backward()\n"
        "    optimizer.step()\n")
    result = _rewrite(_project(tmp_path, {"helpers.py": "def broken(:\n", "train.py": entry}))
    assert not result.refusals, result.refusals
    [said] = [a for a in result.attention if a.code == "program"]
    assert said.differs and "helpers.py does not parse" in said.what


def test_a_save_helper_handed_the_state_is_refused_at_its_save(tmp_path):
    entry = _project(tmp_path, {"train.py": ENTRY.replace("import engine\n", "").replace(
        "engine.train(model, loader, optimizer, 2)\n", "").replace(
        'torch.save(model.state_dict(), "model.pt")',
        'def save_checkpoint(state, filename):\n    torch.save(state, filename)\n\n\n'
        'save_checkpoint({"epoch": 2, "state_dict": model.state_dict()}, "ckpt.pt")')})
    result = _rewrite(entry)
    assert [(r.code, r.line) for r in result.refusals] == [("FSR708", 10)]  # the torch.save in the helper


def test_a_program_whose_steps_are_all_in_the_entry_is_rewritten_as_before(tmp_path):
    utils = 'def describe(n):\n    return f"{n} steps"\n'
    entry = ENTRY.replace("import engine\n", "import utils\n").replace(
        "engine.train(model, loader, optimizer, 2)\n",
        "for x, y in loader:\n    optimizer.zero_grad()\n    torch.nn.functional.mse_loss(model(x), y).backward()\n"
        "    optimizer.step()\nprint(utils.describe(4))\n")
    result = _rewrite(_project(tmp_path, {"utils.py": utils, "train.py": entry}))
    assert not result.refusals and not result.siblings
    assert "utils.describe(4)" in result.code.decode()


# --- the same training, restructured ----------------------------------------------------


@pytest.mark.e2e
@pytest.mark.xdist_group("program_restructured")
def test_each_project_converts_to_the_training_of_the_single_file(tmp_path):
    from fsdp2_retrofit.verify import compare_saved, launch_distributed

    args = ["--batch-size", "32", "--steps", "6"]
    single_file = tmp_path / "single_file"
    launch_distributed(FIXTURES / "main_modulelist" / "expected.py", ["--out", str(single_file / "out.pt"), *args],
                       single_file, nproc=2, timeout=180)
    for name in PROJECTS:
        case = FIXTURES / name
        assert edits_siblings(case), name  # every restructured shape edits a module beside the entry
        folder = tmp_path / name
        entry = project_copy(case, "expected.py", into=folder / "project") / "input.py"
        launch_distributed(entry, ["--out", str(folder / "out.pt"), *args], folder, nproc=2, timeout=180)
        same = compare_saved(single_file / "out.pt", folder / "out.pt", (), 1e-6)
        print(f"\n{name}: saved weights vs the converted single file: {same.max_abs_diff}")
        assert same.ok, f"{name}: {same.problem}"


def test_a_module_with_other_newlines_links_and_keeps_them(tmp_path):
    """engine.py written with CRLF beside an LF entry: linked (each statement goes back into its own
    module and renders with that module's newline), converted, and written back with CRLF only; a model
    module with CRLF that needs no edit is left as it was (it was FSR970, 'another newline style')."""
    entry = _project(tmp_path, {"train.py": ENTRY})
    (tmp_path / "engine.py").write_bytes(dedent(ENGINE).lstrip().replace("\n", "\r\n").encode())
    out = _rewrite(entry)
    assert not out.refusals, out.refusals
    engine = next(f for f in out.files if Path(f.path).name == "engine.py").code
    assert b"dist.all_reduce" in engine or b"rank" in engine, engine.decode()
    assert engine.count(b"\r\n") == engine.count(b"\n"), "a bare LF in the CRLF module"
    assert b"\r\n" not in out.code


def test_a_sentence_names_another_file_as_seen_from_the_entry_s_folder(tmp_path):
    """A refusal of the linked program that names a line of another module says `pkg/net.py:3`, however the
    entry was given (an absolute path put the whole path in every sentence)."""
    from types import SimpleNamespace

    from fsdp2_retrofit.report import Refusal
    from fsdp2_retrofit.rewrite.link import _mapped

    entry, other = str(tmp_path / "train.py"), str(tmp_path / "pkg" / "net.py")
    linked = SimpleNamespace(where=lambda n: (entry, n) if n < 10 else (other, n - 9), unmangle={},
                             program=SimpleNamespace(entry=entry), shown={entry: entry, other: other})
    got = _mapped(linked, Refusal(3, "`model` (trained at line 12) is bound here", "why", "hint", "FSR611"))
    assert (got.what, got.line, got.path) == ("`model` (trained at pkg/net.py:3) is bound here", 3, entry)


def test_a_loader_helper_another_script_calls_is_split_when_the_step_is_elsewhere_too(tmp_path):
    """A program whose loop is in engine.py and whose loader comes from data.py, which predict.py beside them
    also calls: the program converts (the loop could not be left unsplit), the helper gets its sampler.
    Where the program is linked for that helper only (the loop in the entry), the script alone is rewritten
    instead and the helper reported (tests/test_sibling_loaders.py)."""
    data = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\ndef loader(bs):\n"
            "    ds = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))\n"
            "    return DataLoader(ds, batch_size=bs, shuffle=True)\n")
    entry = ("import torch\nimport torch.nn as nn\n\nimport data\nimport engine\n\nmodel = nn.Linear(4, 1)\n"
             "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\nengine.train(model, data.loader(8), optimizer, 2)\n")
    script = _project(tmp_path, {"train.py": entry, "engine.py": ENGINE, "data.py": data,
                                 "predict.py": "from data import loader\nprint(len(loader(4)))\n"})
    out = _rewrite(script)
    assert not out.refusals, out.refusals
    assert "DistributedSampler(ds, shuffle=True)" in _by_file(out)["data.py"]


def test_a_model_from_an_unreadable_builder_is_refused_at_its_binding_across_modules(tmp_path):
    """engine.run(model) trains what the entry binds with a builder the analysis cannot read: refused at that
    binding in the entry, naming the optimizer's line in engine.py (it was refused at engine.py's optimizer
    as 'not built in this function (a parameter...)', where the value was not lost)."""
    engine = ("import torch\n\n\ndef run(model):\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "    for _ in range(3):\n        loss = model(torch.randn(8, 4)).pow(2).mean()\n"
              "        opt.zero_grad()\n        loss.backward()\n        opt.step()\n")
    entry = "import torch\nfrom mylib import get_model\n\nimport engine\n\nmodel = get_model('small')\nengine.run(model)\n"
    out = _rewrite(_project(tmp_path, {"train.py": entry, "engine.py": engine}))
    assert [(r.code, Path(r.path).name, r.line) for r in out.refusals] == [("FSR611", "train.py", 6)]
    assert "the optimizer at engine.py:5 trains" in out.refusals[0].what


def test_a_function_local_import_does_not_stand_for_the_module_s_import(tmp_path):
    """dist_utils.setup() gains `torch.cuda.set_device(...)` before its init_process_group; the module
    imports torch only inside another function (`describe()`): the module gets its own `import torch`
    (a function's local import serves that function; the set_device raised NameError on a GPU)."""
    utils = '''
    import torch.distributed as dist


    def setup():
        dist.init_process_group("gloo")


    def describe():
        import torch
        return torch.__version__
    '''
    entry = """
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    import dist_utils
    import engine


    def main():
        dist_utils.setup()
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
        engine.train(model, loader, optimizer, 2)


    if __name__ == "__main__":
        main()
    """
    result = _rewrite(_project(tmp_path, {"engine.py": ENGINE, "dist_utils.py": utils, "train.py": entry}))
    assert not result.refusals, result.refusals
    files = _by_file(result)
    assert "torch.cuda.set_device(" in files["dist_utils.py"]
    assert "\nimport torch\n" in "\n" + files["dist_utils.py"].split("def setup")[0]
    compile(files["dist_utils.py"], "dist_utils.py", "exec")
