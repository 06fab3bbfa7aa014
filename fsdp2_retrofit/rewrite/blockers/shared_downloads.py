"""FSR6.. shared_downloads: downloads every rank would run at once (FSR637)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import TRAINING, indented


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
        "import torch\nfrom torchvision import datasets\n" + 'DATA = datasets.MNIST("data", download=True)\n'
        + "def main():\n" + indented(TRAINING) + "main()\n",
        line=3,
    ),)
    # the dataset built in the function that trains: rank 0 downloads first
    VALID = (Valid(
        """\
import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
def main():
    data = datasets.MNIST("data", download=True, transform=transforms.ToTensor())
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model = torch.nn.Linear(784, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        torch.nn.functional.cross_entropy(model(x.flatten(1)), y).backward()
        opt.step()
main()
""",
    ),)
    # the dataset built in the function that trains: rank 0 downloads first
