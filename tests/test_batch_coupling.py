"""batch_coupling: a loss term that reads the other samples of its batch is flagged at its line (the
execution tests of batch_coupled_contrastive and batch_coupled_relativistic show the runs differ);
per-sample terms and the final reductions of a loss are not."""
from __future__ import annotations

from textwrap import dedent

import pytest

from fsdp2_retrofit.pipeline import rewrite_source

SCRIPT = dedent("""\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 4)), batch_size=8)
    for x, y in loader:
        out = model(x)
        other = model(y)
        LOSS
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    """)


def _flags(loss: str, script: str = SCRIPT):
    result = rewrite_source(script.replace("LOSS\n", dedent(loss).replace("\n", "\n    ").rstrip(" ")).encode(),
                            "train.py")
    assert not result.refusals, result.refusals
    return [(a.line, a.what) for a in result.attention if a.code == "batch_coupling"]


@pytest.mark.parametrize("loss", [
    "loss = F.cross_entropy(out @ other.T, torch.arange(out.size(0)))\n",
    "sim = torch.mm(F.normalize(out, dim=1), F.normalize(other, dim=1).t())\nloss = sim.mean()\n",
    "e = out.detach() * 2\nloss = torch.matmul(e, other.transpose(1, 0)).sum() / 64\n",
    "loss = torch.einsum('nc,mc->nm', out, other).mean()\n",
    "loss = F.cosine_similarity(out.unsqueeze(1), other.unsqueeze(0), dim=-1).mean()\n",
    "loss = torch.cdist(out, other).mean()\n",
    "loss = F.softplus(out - other.mean(0, keepdim=True)).mean()\n",
    "centred = out - torch.mean(out, dim=0)\nloss = centred.pow(2).mean()\n",
    "loss = ((x + 0.5 * x.std() * torch.rand(x.size())) - out).pow(2).mean()\n",
    "loss = (out / other.sum(dim=0)).mean()\n",
], ids=["matmul-T", "mm-t", "matmul-transpose", "einsum", "cosine-unsqueeze", "cdist", "relativistic",
        "centred", "dragan-std", "normalised-over-batch"])
def test_a_coupling_is_flagged_at_its_line(loss: str):
    flags = _flags(loss)
    first = dedent(loss).splitlines()
    coupled = 12 + next(i for i, line in enumerate(first)
                        if any(k in line for k in ("@", "mm(", "matmul", "einsum", "cosine", "cdist", "mean(0",
                                                   "dim=0", "std()")))
    assert [line for line, _ in flags] == [coupled], flags


@pytest.mark.parametrize("loss", [
    "loss = F.mse_loss(out, y)\n",
    "loss = (out - y).pow(2).sum(1).mean()\n",  # a per-sample sum, then the batch mean
    "loss = out.mean() - other.mean() + 0.1 * out.pow(2).mean()\n",  # means added: a mean of per-sample terms
    "g = out.norm(2, dim=1)\nloss = ((g - 1) ** 2).mean()\n",  # a per-sample norm
    "loss = (out - out.mean(1, keepdim=True)).pow(2).mean()\n",  # a statistic over the features, not the batch
    "w = model[0].weight\nloss = F.mse_loss(out, y) + 1e-4 * (w @ w.T).mean()\n",  # weights, not a batch
], ids=["mse", "per-sample-sum", "sum-of-means", "per-sample-norm", "feature-statistic", "weights"])
def test_per_sample_terms_are_not_flagged(loss: str):
    assert _flags(loss) == []


def test_not_flagged_where_the_data_is_not_split():
    """Every rank computes the loss over the same whole batch: nothing changes with the ranks."""
    script = SCRIPT.replace("loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 4)), batch_size=8)\n",
                            "loader = [(torch.randn(8, 4), torch.randn(8, 4))] * 4\n")
    assert _flags("loss = F.cross_entropy(out @ other.T, torch.arange(out.size(0)))\n", script) == []


LOSSES = dedent("""\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class PairLoss(nn.Module):
        def __init__(self, temperature=0.1):
            super().__init__()
            self.temperature = temperature

        def forward(self, features, labels):
            features = F.normalize(features, dim=1)
            logits = torch.div(torch.matmul(features, features.T), self.temperature)
            return F.cross_entropy(logits, labels)
    """)


@pytest.mark.parametrize("where", ["sibling", "script"])
def test_a_coupling_inside_a_criterion_class_is_flagged_at_its_call(tmp_path, where: str):
    """`criterion(out, y)` of a loss class (a sibling module's, as SupContrast's SupConLoss, or the script's
    own): the flow does not follow the call into its forward; the class's code is read with the batch
    tensors it is handed, and the call is flagged with the line inside."""
    loss = "criterion = PairLoss(0.2)\nloss = criterion(out, torch.arange(out.size(0)))\n"
    script = SCRIPT.replace("LOSS\n", dedent(loss).replace("\n", "\n    ").rstrip(" "))
    if where == "sibling":
        (tmp_path / "losses.py").write_text(LOSSES)
        script = script.replace("import torch\n", "import torch\nfrom losses import PairLoss\n", 1)
    else:
        script = script.replace("model = nn.Sequential", LOSSES.split("\n\n\n", 1)[1] + "\n\nmodel = nn.Sequential", 1)
    path = tmp_path / "train.py"
    path.write_text(script)
    result = rewrite_source(path.read_bytes(), str(path))
    assert not result.refusals, result.refusals
    flags = [(a.line, a.what) for a in result.attention if a.code == "batch_coupling"]
    call_line = next(i for i, line in enumerate(script.splitlines(), 1) if "loss = criterion(" in line)
    assert [line for line, _ in flags] == [call_line], flags
    assert "runs PairLoss.forward, where (" + ("losses.py:13" if where == "sibling" else "line ") in flags[0][1]
    assert "is a batch-by-batch matrix" in flags[0][1]


@pytest.mark.parametrize("loss, flagged", [
    ("loss = F.cross_entropy(out, y.argmax(1), weight=torch.tensor([1.0, 2.0, 1.0, 3.0]))\n", True),
    ("crit = nn.CrossEntropyLoss(weight=class_w)\nloss = crit(out, y.argmax(1))\n", True),
    ("loss = F.nll_loss(out.log_softmax(1), y.argmax(1), weight=class_w, reduction='mean')\n", True),
    ("loss = F.cross_entropy(out, y.argmax(1))\n", False),  # an unweighted mean of per-sample terms
    ("loss = F.cross_entropy(out, y.argmax(1), weight=None)\n", False),
    ("loss = F.cross_entropy(out, y.argmax(1), weight=class_w, reduction='none').mean()\n", False),
], ids=["functional", "module", "nll-mean", "unweighted", "weight-none", "per-sample"])
def test_a_class_weighted_mean_is_flagged_at_its_line(loss: str, flagged: bool):
    """Its mean divides by the total class weight of the batch's targets: each rank by its own part's."""
    found = _flags("class_w = torch.tensor([1.0, 2.0, 1.0, 3.0])\n" + loss)
    assert bool(found) == flagged, found
    if flagged:
        assert "averages over the total class weight of the batch's targets" in found[0][1]
        assert "each rank divides by its own part's total" in found[0][1]
