"""A training loop inside a trainer class handed the model (FSR605): in the script, or
in a sibling module, where the refusal names that file and the line of its backward()."""
from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

from fsdp2_retrofit.rewrite.pipeline import rewrite_source

TRAINER = dedent("""\
    import torch
    from torch.utils.data import DataLoader


    class Trainer:
        def __init__(self, model, dataset, optimizer=None):
            self.model = model
            self.dataset = dataset
            self.optimizer = optimizer

        def run(self):
            model = self.model
            optimizer = self.optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3)
            for x, y in DataLoader(self.dataset, batch_size=32, shuffle=True):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    """)
BACKWARD_LINE = TRAINER.splitlines().index("            loss.backward()") + 1

NET = dedent("""\
    import torch
    import torch.nn as nn
    {imports}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            for block in self.blocks:
                x = torch.tanh(block(x))
            return self.head(x)

    {classes}
    def main():
        dataset = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
        model = Net()
        {optimizer}
        Trainer({args}).run()
        torch.save(model.state_dict(), "model.pt")


    main()
    """)


def _script(sibling: bool, optimizer: bool, trainer_class: str = "Trainer") -> str:
    return NET.format(
        imports=f"from trainer import {trainer_class}\n" if sibling else "from torch.utils.data import DataLoader\n",
        classes="" if sibling else TRAINER.split("\n\n\n", 1)[1] + "\n",
        optimizer="optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)" if optimizer else "",
        args="model, dataset, optimizer" if optimizer else "model, dataset",
    ).replace("Trainer(", f"{trainer_class}(")


def _rewrite(tmp_path: Path, text: str):
    script = tmp_path / "train.py"
    script.write_text(text)
    return rewrite_source(text.encode(), str(script))


@pytest.mark.parametrize("optimizer", [False, True], ids=["optimizer-in-trainer", "optimizer-in-main"])
def test_sibling_trainer_is_refused_naming_its_file_and_backward_line(tmp_path, optimizer):
    (tmp_path / "trainer.py").write_text(TRAINER)
    text = _script(sibling=True, optimizer=optimizer)
    result = _rewrite(tmp_path, text)
    assert [r.code for r in result.refusals] == ["FSR605"], result.refusals
    refusal = result.refusals[0]
    assert refusal.line == text.splitlines().index("    Trainer(model, dataset" + (", optimizer" if optimizer else "")
                                                   + ").run()") + 1
    assert f"Trainer (trainer.py:{BACKWARD_LINE})" in refusal.what
    assert result.code == text.encode()  # nothing half-converted: the loop in trainer.py would keep its sampler


@pytest.mark.parametrize("optimizer", [False, True], ids=["optimizer-in-trainer", "optimizer-in-main"])
def test_trainer_class_in_the_script_is_refused(tmp_path, optimizer):
    text = _script(sibling=False, optimizer=optimizer)
    result = _rewrite(tmp_path, text)
    assert [r.code for r in result.refusals] == ["FSR605"], result.refusals
    assert "class Trainer," in result.refusals[0].what


def test_a_sibling_class_without_backward_is_not_a_trainer(tmp_path):
    (tmp_path / "trainer.py").write_text(TRAINER.replace("loss.backward()", "print(loss.item())")
                                         + "\n\nclass Logger:\n    def __init__(self, model):\n        self.model = model\n")
    text = _script(sibling=True, optimizer=True, trainer_class="Logger").replace("Logger(model, dataset, optimizer).run()",
                                                                                 "Logger(model)")
    text = text.replace("        torch.save(", "        for x, y in torch.utils.data.DataLoader(dataset, batch_size=8):\n"
                        "            loss = torch.nn.functional.cross_entropy(model(x), y)\n"
                        "            optimizer.zero_grad()\n            loss.backward()\n            optimizer.step()\n"
                        "        torch.save(")
    result = _rewrite(tmp_path, text)
    assert not result.refusals, result.refusals
    assert "fully_shard(" in result.code.decode()


@pytest.mark.parametrize("marker", ["setup.py", "pyproject.toml", None])
def test_a_trainer_of_the_projects_own_package_is_found_from_a_subfolder(tmp_path, marker):
    """`projects/demo/train.py` importing `from pkg.trainer import Trainer`, where `pkg/` sits
    at the project's root (installed with `pip install -e .`): found when a marker file says
    where the root is."""
    if marker:
        (tmp_path / marker).write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "trainer.py").write_text(TRAINER)
    folder = tmp_path / "projects" / "demo"
    folder.mkdir(parents=True)
    text = _script(sibling=True, optimizer=False).replace("from trainer import", "from pkg.trainer import")
    result = _rewrite(folder, text)
    if marker is None:  # no root known: the trainer is not found, nor the optimizer it builds
        assert [r.code for r in result.refusals] != ["FSR605"], result.refusals
        return
    assert [r.code for r in result.refusals] == ["FSR605"], result.refusals
    assert f"Trainer (pkg/trainer.py:{BACKWARD_LINE})" in result.refusals[0].what
