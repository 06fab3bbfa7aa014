"""device_placement: in a script that names no device, every tensor that meets the model's outputs
is placed on the rank's device (on a GPU fully_shard moves only the forward's own inputs); a literal
GPU 0 becomes the rank's device. These tests read the placement of each such tensor from the code,
so they fail without a GPU; the fixtures cpu_only_accuracy_numpy and literal_device_zero run the
results on 2 ranks (tests/test_execution.py) and on one GPU (benchmarks/gpu/run.py)."""
from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import libcst as cst
import pytest

from fsdp2_retrofit.analysis import analyse
from fsdp2_retrofit.analysis.device_placement import device_free, unplaced
from fsdp2_retrofit.pipeline import rewrite_source
from fsdp2_retrofit.syntax.names import code

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "rewrite"


def _rewrite(text: str):
    result = rewrite_source(dedent(text).encode(), "train.py")
    assert not result.refusals, result.refusals
    return result


def _facts(text: str):
    return analyse(cst.parse_module(text), "train.py")


def test_each_tensor_meeting_the_outputs_of_the_fixture_is_found():
    """In the fixture's input (after the launch preamble, where the stage plans): the labels of the
    loop, the two factory targets, and both `.numpy()` calls (of the prediction, of the moved labels)."""
    result = _rewrite((FIXTURES / "cpu_only_accuracy_numpy" / "input.py").read_text())
    found = sorted((c.line, c.what) for c in result.changes if c.code == "device_placement")
    assert [line for line, _ in found] == [53, 53, 55, 57, 62, 63], found
    whats = " | ".join(w for _, w in found)
    for fragment in ("`labels` moved to `device` at the loop's head", "torch.zeros(labels.shape[0], 1)",
                     "torch.ones(labels.shape[0], 1)", "`.cpu()` before `.numpy()`"):
        assert fragment in whats, whats
    assert not [a for a in result.attention if a.code == "device_placement"]


def test_the_golden_output_leaves_no_tensor_off_the_device():
    expected = (FIXTURES / "cpu_only_accuracy_numpy" / "expected.py").read_text()
    assert unplaced(_facts(expected)) == []


@pytest.mark.parametrize("undo, left", [
    ("        labels = labels.to(device)\n", "loop"),
    (", device=device)\n        is_even[", ")\n        is_even["),
    ("argmax(dim=1).detach().cpu().numpy()", "numpy"),
])
def test_an_output_missing_one_placement_is_caught(undo: str, left: str):
    """Each placement undone in the golden output is found again: the check can fail."""
    expected = (FIXTURES / "cpu_only_accuracy_numpy" / "expected.py").read_text()
    if left.startswith(")"):
        broken, kind = expected.replace(undo, left, 1), "factory"
    elif left == "numpy":
        broken, kind = expected.replace(undo, "argmax(dim=1).detach().numpy()"), "numpy"
    else:
        broken, kind = expected.replace(undo, ""), "loop"
    assert broken != expected
    missing = unplaced(_facts(broken))
    assert [p.kind for p in missing] == [kind], [(p.kind, code(p.node)[:40]) for p in missing]


def test_scripts_that_place_their_tensors_are_left_alone():
    script = """\
        import torch
        import torch.nn as nn

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = nn.Linear(4, 2).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = torch.randn(8, 4).to(device), torch.randint(0, 2, (8,)).to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        """
    result = _rewrite(script)
    assert not [c for c in result.changes if c.code == "device_placement"]
    assert not device_free(_facts(dedent(script)).resolver)


def test_a_dict_batch_a_parameter_and_a_comprehension():
    """A dict batch moves key by key at the loop's head; a step helper's parameter is followed into
    its caller (the loop target there); an evaluation's comprehension moves the label where it is read."""
    out = _rewrite("""\
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        from torch.utils.data import DataLoader

        def step(model, optimizer, x, y):
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        def main():
            data = [{"x": torch.randn(4), "y": torch.randn(1)} for _ in range(16)]
            pairs = [(torch.randn(4), torch.randn(1)) for _ in range(16)]
            model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            records = DataLoader(data, batch_size=4)
            for batch in records:
                loss = F.mse_loss(model(batch["x"]), batch["y"])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            loader = DataLoader(pairs, batch_size=4)
            for x, y in loader:
                step(model, optimizer, x, y)
            err = sum((model(x) - y).abs().sum().item() for x, y in loader)
            print(err)

        main()
        """).code.decode()
    assert "batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}" in out
    assert "        y = y.to(device)\n        step(model, optimizer, x, y)" in out
    assert "(model(x) - y.to(device))" in out
    assert out.count('device = torch.device("cuda" if torch.cuda.is_available() else "cpu")') == 1


def test_what_cannot_be_followed_is_reported():
    result = _rewrite("""\
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        def targets_for(x):
            return x.sum(dim=1, keepdim=True)

        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(8, 4)
            y = targets_for(x)
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        """)
    notes = [a for a in result.attention if a.code == "device_placement"]
    assert len(notes) == 1 and notes[0].line == 13 and "`y`" in notes[0].what, notes
    assert "targets_for" in notes[0].why


@pytest.mark.parametrize("before, after", [
    ('device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")',
     'device = torch.device("cuda" if torch.cuda.is_available() else "cpu")'),
    ('device = 0 if torch.cuda.is_available() else "cpu"',
     'device = local_rank if torch.cuda.is_available() else "cpu"'),
    ('device = torch.device("cuda", 0) if torch.cuda.is_available() else "cpu"',
     'device = torch.device("cuda") if torch.cuda.is_available() else "cpu"'),
])
def test_a_literal_gpu_0_becomes_the_ranks_device(before: str, after: str):
    script = f"""\
        import torch
        import torch.nn as nn

        def main():
            {before}
            model = nn.Linear(4, 2).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                x, y = torch.randn(8, 4).to(device), torch.randint(0, 2, (8,)).to(device)
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

        main()
        """
    result = _rewrite(script)
    out = result.code.decode()
    assert after in out, out
    assert [c.line for c in result.changes if c.code == "device_placement"] == [5]


def test_a_cuda_0_call_and_a_module_level_index():
    out = _rewrite("""\
        import torch
        import torch.nn as nn

        GPU = 0

        def main():
            model = nn.Linear(4, 2)
            if torch.cuda.is_available():
                model = model.cuda(0)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                x = torch.randn(8, 4)
                if torch.cuda.is_available():
                    x = x.to(GPU)
                loss = model(x).sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

        main()
        """).code.decode()
    assert "model = model.cuda()\n" in out
    assert 'GPU = int(os.environ.get("LOCAL_RANK", 0))' in out


def test_the_inputs_of_an_unsharded_wrapper_around_the_model_are_moved():
    """`objective = Objective(net)` is not sharded (only `net` is): fully_shard's pre-forward runs when
    the objective's forward calls `net`, so only what it hands `net` moves; `target` meets the output
    inside the objective's forward on the CPU. Both of the wrapper's inputs move at the loop's head."""
    out = _rewrite("""\
        import torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, TensorDataset

        class Objective(nn.Module):
            def __init__(self, net):
                super().__init__()
                self.net = net

            def forward(self, x, target):
                return ((self.net(x) - target) ** 2).mean()

        net = nn.Linear(4, 4)
        objective = Objective(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 4)), batch_size=4)
        for x, target in loader:
            loss = objective(x, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        """)
    text = out.code.decode()
    assert "x, target = x.to(device), target.to(device)" in text, text
    plain = out.code.decode().replace("x, target = x.to(device), target.to(device)", "")
    assert {p.kind for p in unplaced(_facts(plain))} == {"loop"}


def test_the_tensors_a_loss_module_is_built_with_are_placed():
    """`nn.CrossEntropyLoss(weight=torch.tensor([...]))` keeps its weight where it was made; the
    loss meets the outputs inside its forward (on a GPU: a device mismatch at the first step). The
    factory gets the device, a name bound to arithmetic of one is followed, `self.criterion` of a
    Trainer is read where `__init__` stores it, and a weight the rewrite cannot follow is reported."""
    out = _rewrite("""\
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        criterion = nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 4.0]), reduction="mean")
        for step in range(3):
            x = torch.randn(8, 4)
            y = torch.randint(0, 3, (8,))
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        """).code.decode()
    assert 'criterion = nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 4.0], device=device), reduction="mean")' \
        in out
    result = _rewrite("""\
        import torch
        import torch.nn as nn

        class Trainer:
            def __init__(self, model):
                self.model = model
                self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                scale = torch.full((1,), 3.0) * 2
                self.criterion = nn.BCEWithLogitsLoss(pos_weight=scale)

            def fit(self, steps):
                for step in range(steps):
                    x = torch.randn(8, 4)
                    y = (torch.randn(8, 1) > 0).float()
                    loss = self.criterion(self.model(x), y)
                    self.optimizer.zero_grad()
                    loss.backward()
                    self.optimizer.step()

        Trainer(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))).fit(3)
        """)
    out = result.code.decode()
    assert "scale = torch.full((1,), 3.0, device=device) * 2" in out, out
    assert "y = (torch.randn(8, 1).to(device) > 0).float()" in out, out
    assert not [a for a in result.attention if a.code == "device_placement"], result.attention
    result = _rewrite("""\
        import torch
        import torch.nn as nn

        def class_weights():
            return torch.tensor([0.2, 1.0, 4.0])

        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        weights = class_weights()
        criterion = nn.CrossEntropyLoss(weight=weights)
        for step in range(3):
            loss = criterion(model(torch.randn(8, 4)), torch.zeros(8, dtype=torch.long))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        """)
    notes = [a for a in result.attention if a.code == "device_placement"]
    assert [(n.line, "`weights`" in n.what) for n in notes] == [(12, True)], notes
    assert "class_weights" in notes[0].why
