"""FSR6.. shared_downloads: downloads every rank would run at once (FSR637)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class DownloadBeforeProcessGroup(Blocker):
    """A dataset built with `download=True` where no rank test can go: before the process group starts
    (module level, a function called before init_process_group).

    ## Why
    Every rank finds the files missing and downloads into the same folder at once (a truncated
    archive, a rank reading a file still being written). Rank 0 can download first, the others
    waiting at a barrier, only once the process group runs.

    ## What to do
    Build the dataset after the process group starts, in the function that starts it, or download it
    before the run and pass download=False.
    """

    CODE = "FSR637"
    NAME = "download-before-process-group"
    STAGE = "shared_downloads"
    INVALID = (Invalid(
        """\
import torch
import torch.nn as nn
from torchvision import datasets

TRAIN = datasets.MNIST("data", download=True)


def main(download=True):
    torch.manual_seed(0)
    pass

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = model(torch.randn(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


main()
""",
        line=5,
    ),)
    # the dataset built in the function that trains: rank 0 downloads first
    VALID = (Valid(
        """\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def main():
    torch.manual_seed(0)
    train = datasets.MNIST("data", download=True, transform=transforms.ToTensor())
    loader = DataLoader(train, batch_size=8, shuffle=True)
    model = nn.Linear(784, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x.flatten(1)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
""",
    ),)
