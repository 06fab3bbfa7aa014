"""FSR9.. loss_scale: losses the gradient averaging over ranks would scale wrongly (FSR960)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class LossMixedReduction(Blocker):
    """A loss that reaches backward() adds a term summed over the batch (`reduction="sum"`,
    `size_average=False`, `torch.sum(...)`) to a term averaged over it.

    ## Why
    FSDP2 averages gradients over the ranks: an averaged term then has the gradient of the
    single-process run at the same global batch, a summed term 1/world_size of it (the rewrite
    scales the backward of a loss whose every term is a sum by the world size); no one scale makes
    both right.

    ## What to do
    Reduce every term the same way (divide the summed term by the batch size, or sum the averaged
    one), or scale the summed term by dist.get_world_size() yourself.
    """

    CODE = "FSR960"
    NAME = "loss-mixed-reduction"
    STAGE = "loss_scale"
    INVALID = (Invalid(
        """\
from torch.utils.data import DataLoader, TensorDataset
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


def main():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler()
    loader = DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=8)
    for (x,) in loader:
        out = model(x)
        recon = F.mse_loss(out, x)
        kl = 0.5 * torch.sum(out.pow(2))
        loss = recon + kl
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
""",
        line=25,
    ),)
    # every term averaged over the batch
    VALID = (Valid(
        """\
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


def main():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=8)
    for (x,) in loader:
        out = model(x)
        recon = F.mse_loss(out, x)
        kl = 0.5 * torch.mean(out.pow(2))
        loss = recon + kl
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
""",
    ),)
