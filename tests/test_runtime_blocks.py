"""Models chosen at run time (issue 15 item 4): which modules the generated run-time
discovery makes FSDP2 units, and where the rewrite reads blocks statically instead.

The discovery statements are taken from the goldens and run on the fixtures' real
model classes with `fully_shard` replaced by a recorder (no process group needed):
the parity tests show the outputs train like the originals, these show which units
they train with.
"""
from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source
from rewrite_cases import FIXTURES, rewrite_case

torch = pytest.importorskip("torch", reason="runs the generated discovery on torch modules")


def _discovery(case: str) -> str:
    """The statements of the golden from the discovery to the root's fully_shard."""
    lines = (FIXTURES / case / "expected.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("blocks = []"))
    end = next(i for i, line in enumerate(lines) if line.strip() == "fully_shard(model, mesh=mesh)")
    return textwrap.dedent("\n".join(lines[start : end + 1]))


def _units(case: str, model) -> list:
    sharded = []
    namespace = {
        "model": model, "mesh": None, "torch": torch, "nn": torch.nn,
        "collections": __import__("collections"),
        "fully_shard": lambda module, **kwargs: sharded.append((module, kwargs.get("reshard_after_forward", True))),
    }
    exec(_discovery(case), namespace)
    return sharded


def _module(case: str, name: str):
    spec = importlib.util.spec_from_file_location(f"_{case}_{name}", FIXTURES / case / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nested_blocks_are_units_innermost_first_and_tied_ones_stay_in_the_root():
    models = _module("model_table_sibling", "models")
    model = models.MODEL_FACTORIES["staged"](4)
    stage0, stage1 = model.stages
    units = [m for m, _ in _units("model_table_sibling", model)]
    # stage1 and its second block hold the weight `model.tied` reuses: both stay in the root unit
    assert units == [stage1.blocks[0], stage0.blocks[1], stage0.blocks[0], stage0, model]


def test_a_model_without_repeated_blocks_is_the_root_alone():
    models = _module("model_table_sibling", "models")
    model = models.MODEL_FACTORIES["wide"](4)  # Sequential(Linear, ReLU, Linear): children of different classes
    assert [m for m, _ in _units("model_table_sibling", model)] == [model]
    mlp = _module("model_choice_if_elif", "input").MLP(16, 4)
    assert [m for m, _ in _units("model_choice_if_elif", mlp)] == [mlp]


def test_each_branch_gets_its_own_blocks():
    net = _module("model_choice_if_elif", "input").ResidualNet(16, 4)
    units = _units("model_choice_if_elif", net)
    assert [m for m, _ in units] == [*reversed(net.blocks), net]
    # the last block keeps its gathered parameters after forward (backward needs it first)
    assert [keep for _, keep in units[:3]] == [False, True, True]


def _rewrite(tmp_path: Path, text: str, **files: str):
    for name, body in files.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(text))
    return rewrite_source(path.read_bytes(), str(path), RetrofitOptions())


TRAIN = """\
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    class A(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(2)])

    class B(nn.Module):
        def __init__(self, wide=False):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

    def main(kind):
        loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
        {build}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for (x,) in loader:
            model(x).sum().backward()
            optimizer.step()
    """


def test_branches_with_the_same_blocks_keep_the_static_loop(tmp_path: Path):
    build = "if kind == 'a':\n            model = A()\n        else:\n            model = B()"
    result = _rewrite(tmp_path, TRAIN.replace("{build}", build))
    assert not result.refusals, result.refusals
    assert "for index, block in enumerate(model.blocks):" in result.code.decode()
    assert "model.modules()" not in result.code.decode()


def test_a_table_whose_value_cannot_be_read_is_not_a_model(tmp_path: Path):
    """A value that is neither a class, a lambda nor a function building one: nothing is guessed."""
    build = "model = MODELS[kind]()"
    text = textwrap.dedent(TRAIN.replace("{build}", build)) + "\nMODELS = {'a': A, 'b': getattr(nn, 'Linear')}\n"
    result = _rewrite(tmp_path, text)
    assert [r.code for r in result.refusals] == ["FSR611"]


def test_a_table_of_a_sibling_module_is_read(tmp_path: Path):
    sibling = """\
        import torch.nn as nn

        class Small(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

        def make_small():
            return Small().float()

        ZOO = {"small": make_small}
        """
    text = TRAIN.replace("{build}", "model = ZOO[kind]()").replace(
        "from torch.utils.data import", "from zoo import ZOO\n    from torch.utils.data import")
    result = _rewrite(tmp_path, text, zoo=sibling)
    assert not result.refusals, result.refusals
    assert "for container in model.modules():" in result.code.decode()
    assert any("chosen at run time" in c.what for c in result.changes)


def test_the_report_says_the_blocks_are_found_at_run_time():
    found = [c.what for c in rewrite_case(FIXTURES / "model_choice_if_elif").changes]
    assert any("one of ResidualNet, MLP, chosen at run time" in what for what in found), found


ZOO_PACKAGE = {
    "__init__": "from .small import *\nfrom .deep import *\n",
    "small": """\
        import torch.nn as nn

        class Small(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

        def _private():
            return 3
        """,
    "deep": """\
        import torch.nn as nn

        class Deep(nn.Module):
            def __init__(self, depth=3):
                super().__init__()
                self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(depth)])

        def deep2():
            return Deep(depth=2)
        """,
}


def _zoo(tmp_path: Path) -> None:
    (tmp_path / "zoo").mkdir()
    for name, body in ZOO_PACKAGE.items():
        (tmp_path / "zoo" / f"{name}.py").write_text(textwrap.dedent(body))


@pytest.mark.parametrize("build", ["model = zoo.__dict__[kind]()", "model = getattr(zoo, kind)()"])
def test_a_model_picked_by_name_from_a_package_of_the_project(tmp_path: Path, build: str):
    _zoo(tmp_path)
    text = TRAIN.replace("{build}", build).replace("import torch\n", "import torch\n    import zoo\n", 1)
    result = _rewrite(tmp_path, text)
    assert not result.refusals, result.refusals
    assert "for container in model.modules():" in result.code.decode()
    assert any("one of Small, Deep, chosen at run time" in c.what for c in result.changes), result.changes


def test_a_namespace_outside_the_project_is_not_a_model(tmp_path: Path):
    """`json.__dict__[kind]()`: no module of the project, nothing is guessed."""
    text = TRAIN.replace("{build}", "model = json.__dict__[kind]()").replace("import torch\n", "import json\n    import torch\n", 1)
    result = _rewrite(tmp_path, text)
    assert [r.code for r in result.refusals] == ["FSR611"], result.refusals
