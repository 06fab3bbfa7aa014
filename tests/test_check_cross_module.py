"""`check` follows a sharding helper into the project module it is imported from
(analysis.project_sharders): a call of a function of another module that shards its
parameter, or returns a sharded module, makes the caller's module sharded for every rule."""
from __future__ import annotations

import os
from pathlib import Path

from click.testing import CliRunner

from fsdp2_retrofit import cli
from fsdp2_retrofit.check.lint import applicable, lint_source
from fsdp2_retrofit.check.rules import all_rules

PARALLEL = """\
from torch.distributed.fsdp import fully_shard


def shard_model(model, mesh):
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def to_device(model, device):
    return model.to(device)
"""

STATEMENT = """\
import torch
from parallel import shard_model


def main(mesh, x, path):
    model = Transformer()
    shard_model(model, mesh)
    out = model.forward(x)
    torch.save(model.state_dict(), path)
"""


def _project(tmp_path: Path, files: dict) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _codes(path: Path):
    result = lint_source(path.read_bytes(), str(path), all_rules())
    assert result.error is None, result.error
    return [(f.line, f.code) for f in result.findings]


def test_a_helper_of_another_module_called_as_a_statement_shards_its_argument(tmp_path):
    _project(tmp_path, {"parallel.py": PARALLEL, "train.py": STATEMENT})
    assert _codes(tmp_path / "train.py") == [(8, "FSD101"), (9, "FSD102")]


def test_a_comment_or_docstring_naming_fully_shard_still_reads_the_helper(tmp_path):
    """Whether a file shards is read from its code: text that mentions the API (a docstring, a
    comment) neither makes it shard nor stops the lookup of the module that does (issue 45)."""
    train = '"""The model is sharded with fully_shard in parallel.py."""\n' + STATEMENT.replace(
        "    shard_model(model, mesh)\n", "    shard_model(model, mesh)  # fully_shard per block, then the root\n")
    _project(tmp_path, {"parallel.py": PARALLEL, "train.py": train})
    assert _codes(tmp_path / "train.py") == [(9, "FSD101"), (10, "FSD102")]


def test_the_value_a_helper_returns_sharded_is_sharded(tmp_path):
    train = STATEMENT.replace("    model = Transformer()\n    shard_model(model, mesh)\n",
                              "    model = shard_model(Transformer(), mesh)\n")
    _project(tmp_path, {"parallel.py": PARALLEL, "train.py": train})
    assert _codes(tmp_path / "train.py") == [(7, "FSD101"), (8, "FSD102")]


def test_a_function_of_the_same_module_that_does_not_shard_changes_nothing(tmp_path):
    train = STATEMENT.replace("from parallel import shard_model", "from parallel import to_device").replace(
        "shard_model(model, mesh)", "model = to_device(model, mesh)")
    _project(tmp_path, {"parallel.py": PARALLEL, "train.py": train})
    assert _codes(tmp_path / "train.py") == []


def test_import_module_and_alias_spellings(tmp_path):
    for spelling, call in (("import parallel", "parallel.shard_model"), ("import parallel as par", "par.shard_model"),
                           ("from parallel import shard_model as shard", "shard")):
        train = STATEMENT.replace("from parallel import shard_model", spelling).replace(
            "shard_model(model, mesh)", f"{call}(model, mesh)")
        _project(tmp_path, {"parallel.py": PARALLEL, "train.py": train})
        assert _codes(tmp_path / "train.py") == [(8, "FSD101"), (9, "FSD102")], spelling


def test_relative_import_in_a_package_and_through_a_package_init(tmp_path):
    train = STATEMENT.replace("from parallel import shard_model", "from .dist.parallel import shard_model")
    _project(tmp_path, {"pkg/__init__.py": "", "pkg/dist/__init__.py": "", "pkg/dist/parallel.py": PARALLEL,
                        "pkg/train.py": train})
    assert _codes(tmp_path / "pkg" / "train.py") == [(8, "FSD101"), (9, "FSD102")]
    # re-exported by the package's __init__.py
    train = STATEMENT.replace("from parallel import shard_model", "from .dist import shard_model")
    _project(tmp_path, {"pkg/dist/__init__.py": "from .parallel import shard_model\n", "pkg/train.py": train})
    assert _codes(tmp_path / "pkg" / "train.py") == [(8, "FSD101"), (9, "FSD102")]


def test_star_import_honours_all(tmp_path):
    train = STATEMENT.replace("from parallel import shard_model", "from parallel import *")
    _project(tmp_path, {"parallel.py": PARALLEL, "train.py": train})
    assert _codes(tmp_path / "train.py") == [(8, "FSD101"), (9, "FSD102")]
    _project(tmp_path, {"parallel.py": '__all__ = ["to_device"]\n' + PARALLEL})
    assert _codes(tmp_path / "train.py") == []


def test_through_another_project_function_two_modules_away(tmp_path):
    helper = "from fsdp_utils import apply_fsdp\n\n\ndef setup(model, mesh):\n    apply_fsdp(model.encoder, mesh)\n" \
             "    apply_fsdp(model, mesh)\n    return model\n"
    utils = "from torch.distributed.fsdp import fully_shard\n\n\ndef apply_fsdp(module, mesh):\n" \
            "    fully_shard(module, mesh=mesh)\n"
    train = STATEMENT.replace("from parallel import shard_model", "from helper import setup").replace(
        "shard_model(model, mesh)", "setup(model, mesh)")
    _project(tmp_path, {"helper.py": helper, "fsdp_utils.py": utils, "train.py": train})
    assert _codes(tmp_path / "train.py") == [(8, "FSD101"), (9, "FSD102")]


def test_self_attribute_set_from_a_helper_is_sharded_in_the_other_methods(tmp_path):
    train = """\
import torch
from parallel import shard_model


class Trainer:
    def __init__(self, mesh):
        self.model = self._build(mesh)

    def _build(self, mesh):
        model = Transformer()
        shard_model(model, mesh)
        return model

    def step(self, x):
        return self.model.forward(x)

    def save(self, path):
        torch.save(self.model.state_dict(), path)
"""
    _project(tmp_path, {"parallel.py": PARALLEL, "train.py": train})
    assert _codes(tmp_path / "train.py") == [(15, "FSD101"), (18, "FSD102")]


def test_a_helper_that_shards_only_the_blocks_leaves_the_roots_forward_alone(tmp_path):
    blocks = PARALLEL.replace("    fully_shard(model, mesh=mesh)\n", "")
    train = STATEMENT.replace("    torch.save(model.state_dict(), path)\n", "    h = model.layers[0].forward(x)\n")
    _project(tmp_path, {"parallel.py": blocks, "train.py": train})
    assert _codes(tmp_path / "train.py") == [(9, "FSD101")]


def test_the_helper_module_is_read_again_when_it_changes(tmp_path):
    _project(tmp_path, {"parallel.py": PARALLEL, "train.py": STATEMENT})
    assert _codes(tmp_path / "train.py") == [(8, "FSD101"), (9, "FSD102")]
    unsharded = PARALLEL.replace("fully_shard(block, mesh=mesh)", "pass").replace("    fully_shard(model, mesh=mesh)\n", "")
    path = tmp_path / "parallel.py"
    path.write_text(unsharded)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert _codes(tmp_path / "train.py") == []


def test_the_prefilter_passes_a_file_only_when_an_imported_project_module_shards(tmp_path):
    _project(tmp_path, {"parallel.py": PARALLEL, "train.py": STATEMENT, "plain.py": "def f(m):\n    return m\n"})
    train = tmp_path / "train.py"
    assert applicable(train.read_bytes(), all_rules(), str(train))
    assert not applicable(train.read_bytes(), all_rules())  # no path: nothing to follow
    other = tmp_path / "other.py"
    other.write_text(STATEMENT.replace("from parallel import shard_model", "from plain import f as shard_model"))
    assert not [r for r in applicable(other.read_bytes(), all_rules(), str(other)) if r.NEEDS_SHARDING]


def test_command_line(tmp_path):
    _project(tmp_path, {"parallel.py": PARALLEL, "train.py": STATEMENT})
    result = CliRunner().invoke(cli.main, ["check", str(tmp_path / "train.py")], catch_exceptions=False)
    assert result.exit_code == 1
    assert result.output.splitlines()[0].startswith(f"{tmp_path / 'train.py'}:8:11: FSD101")


# -- the other way: a file hands a sharded module to another module's class or function ---------

TRAINER = """\
import torch


class Trainer:
    def __init__(self, model, loader, optimizer):
        self.model = model
        self.loader = loader
        self.optimizer = optimizer

    def train(self):
        for x, y in self.loader:
            loss = torch.nn.functional.cross_entropy(self.model.forward(x), y)
            loss.backward()
            self.optimizer.step()
        torch.save(self.model.state_dict(), "ckpt.pt")


def evaluate(net, x):
    return net.forward(x)
"""

HANDS_OVER = """\
import torch
from torch.distributed.fsdp import fully_shard
from trainer import Trainer, evaluate


def main(loader, x):
    {model} = Transformer()
    fully_shard({model})
    optimizer = torch.optim.AdamW({model}.parameters())
    Trainer({model}, loader, optimizer).train()
    evaluate(x=x, net={model})
"""


def _run_codes(tmp_path: Path, *names: str):
    from fsdp2_retrofit.check.checker import CheckJob, run

    results = run(CheckJob(tuple(all_rules())), [str(tmp_path / n) for n in names], workers=1)
    return {Path(r.path).name: [(f.line, f.code) for f in r.findings] for r in results}


def test_a_sharded_module_handed_to_another_modules_class_and_function_is_sharded_there(tmp_path):
    _project(tmp_path, {"trainer.py": TRAINER, "train.py": HANDS_OVER.format(model="model")})
    found = _run_codes(tmp_path, "train.py", "trainer.py")
    assert found["trainer.py"] == [(12, "FSD101"), (15, "FSD102"), (19, "FSD101")]
    assert found["train.py"] == []


def test_renamed_locals_hand_over_the_same(tmp_path):
    _project(tmp_path, {"trainer.py": TRAINER, "train.py": HANDS_OVER.format(model="net_2")})
    assert _run_codes(tmp_path, "trainer.py", "train.py")["trainer.py"] == [(12, "FSD101"), (15, "FSD102"), (19, "FSD101")]


def test_without_the_file_that_shards_in_the_run_the_module_is_told_by_the_file_on_disk(tmp_path):
    """pre-commit passes only trainer.py: train.py, which imports it, is read from disk (check/importers.py)."""
    _project(tmp_path, {"trainer.py": TRAINER, "train.py": HANDS_OVER.format(model="model")})
    assert _run_codes(tmp_path, "trainer.py") == {"trainer.py": [(12, "FSD101"), (15, "FSD102"), (19, "FSD101")]}
    from fsdp2_retrofit.check.checker import CheckJob, run

    alone = run(CheckJob(tuple(all_rules()), importers=False), [str(tmp_path / "trainer.py")], workers=1)
    assert [r.findings for r in alone] == [[]]


def test_an_unsharded_module_handed_over_tells_nothing(tmp_path):
    unsharded = HANDS_OVER.format(model="model").replace("    fully_shard(model)\n", "")
    _project(tmp_path, {"trainer.py": TRAINER, "train.py": unsharded})
    assert _run_codes(tmp_path, "train.py", "trainer.py")["trainer.py"] == []


def test_the_command_line_reports_the_receiving_file(tmp_path):
    _project(tmp_path, {"trainer.py": TRAINER, "train.py": HANDS_OVER.format(model="model")})
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        out = CliRunner().invoke(cli.main, ["check", "."])
    finally:
        os.chdir(old)
    assert out.exit_code == 1, out.output
    assert "trainer.py:12:" in out.output and "FSD101" in out.output


def test_a_package_beside_the_scripts_outermost_package_is_the_projects(tmp_path):
    """`apps/lm/train.py` of package `apps.lm` runs as `python -m apps.lm.train` from the folder above
    `apps/`: `from core.parallel import ...` is `core/` there, with no root marker (lingua's layout).
    An installed package's neighbours (site-packages) are libraries, never read."""
    train = STATEMENT.replace("from parallel import shard_model", "from core.parallel import shard_model")
    files = {"apps/__init__.py": "", "apps/lm/__init__.py": "", "apps/lm/train.py": train,
             "core/__init__.py": "", "core/parallel.py": PARALLEL}
    _project(tmp_path / "lingua", files)
    assert _codes(tmp_path / "lingua" / "apps" / "lm" / "train.py") == [(8, "FSD101"), (9, "FSD102")]
    _project(tmp_path / "site-packages", files)
    assert _codes(tmp_path / "site-packages" / "apps" / "lm" / "train.py") == []
    # a script outside any package is not given one
    _project(tmp_path / "loose", {"scripts/train.py": train, "core/__init__.py": "", "core/parallel.py": PARALLEL})
    assert _codes(tmp_path / "loose" / "scripts" / "train.py") == []
