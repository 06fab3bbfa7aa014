"""FSR6.. loop_sums: sums over the loader the split would change (FSR639)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class LoopSumsUnderRankLocalCondition(Blocker):
    """Figures summed in a loop over a split DataLoader (an evaluation's loss and correct count) and
    read after it, where the loop runs under a condition not known to be the same on every rank.

    ## Why
    After the retrofit each rank sums over its own part of the data; the sums are combined over the
    ranks after the loop (a collective every rank must join). Under a condition each rank decides
    for itself, the ranks that enter would wait for the others: a hang.

    ## What to do
    Make the condition one every rank decides alike (a step or epoch count, an argument), or combine
    the sums yourself (all_reduce) where every rank runs.
    """

    CODE = "FSR639"
    NAME = "loop-sums-under-rank-local-condition"
    STAGE = "loop_sums"
    INVALID = (Invalid(
        """\
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def run_epoch(model, loader, optimizer=None):
    total_loss, correct = 0.0, 0
    for x, y in loader:
        out = model(x)
        loss = F.cross_entropy(out, y)
        if optimizer is not None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        total_loss += loss.item() * y.size(0)
        correct += (out.argmax(1) == y).sum().item()
    return total_loss / len(loader.dataset), correct / len(loader.dataset)


def test(model, loader):
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
    return correct / len(loader.dataset)


def main():
    torch.manual_seed(0)
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    train_loader = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True)
    test_loader = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    best = 0.0
    for epoch in range(3):
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if loss.item() > 0.1:
            seen = 0
            for xb, yb in train_loader:
                seen += yb.size(0)
            print(seen)


if __name__ == "__main__":
    main()
""",
        line=45,
    ),)
    # the loop under a condition every rank decides alike (the epoch)
    VALID = (Valid(
        """\
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    train_loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        for xb, yb in train_loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if epoch % 2 == 0:
            seen = 0
            for xb, yb in train_loader:
                seen += yb.size(0)
            print(seen)


if __name__ == "__main__":
    main()
""",
    ),)
