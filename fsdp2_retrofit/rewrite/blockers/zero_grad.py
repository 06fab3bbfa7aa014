"""FSR9.. zero_grad: gradient clearing FSDP2 would make wrong (FSR950)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)


class ZeroGradBetweenForwardAndBackward(Blocker):
    """`model.zero_grad()` between the model's forward and backward() with no one optimizer to clear
    through (none, several, or one built over part of the model).

    ## Why
    After the forward FSDP2 keeps the root's and the last block's parameters gathered: the call
    clears the gathered tensors, not the sharded parameters holding the gradients, which add up
    every step; the rewrite clears through the one optimizer that trains the whole model, and here
    there is none.

    ## What to do
    Call `model.zero_grad()` before the forward, or clear through the optimizer
    (`optimizer.zero_grad()`).
    """

    CODE = "FSR950"
    NAME = "zero-grad-between-forward-and-backward"
    STAGE = "zero_grad"
    INVALID = (Invalid(
        """\

import torch
from torch import nn


def main():
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    dec = nn.Linear(4, 2)
    params = list(enc.parameters()) + list(dec.parameters())
    opt = torch.optim.Adam(params, lr=0.1)
    for step in range(3):
        loss = dec(enc(torch.randn(8, 4))).sum()
        enc.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
""",
        line=14,
    ),)
    # the gradients cleared before the forward
    VALID = (Valid(
        """\
import torch
from torch import nn


def main():
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    dec = nn.Linear(4, 2)
    params = list(enc.parameters()) + list(dec.parameters())
    opt = torch.optim.Adam(params, lr=0.1)
    for step in range(3):
        enc.zero_grad()
        dec.zero_grad()
        loss = dec(enc(torch.randn(8, 4))).sum()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
""",
    ),)
