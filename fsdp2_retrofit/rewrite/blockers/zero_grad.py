"""FSR9.. zero_grad: gradient clearing FSDP2 would make wrong (FSR950)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)

_ENC_DEC = """\
import torch
enc = torch.nn.Linear(8, 8)
dec = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(list(enc.parameters()) + list(dec.parameters()), lr=0.1)
for step in range(10):
"""  # lines 1-5


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
        _ENC_DEC + """\
    loss = dec(enc(torch.randn(4, 8))).sum()
    enc.zero_grad()
    loss.backward()
    opt.step()
""",
        line=7,
    ),)
    # the gradients cleared before the forward
    VALID = (Valid(
        _ENC_DEC + """\
    enc.zero_grad()
    dec.zero_grad()
    loss = dec(enc(torch.randn(4, 8))).sum()
    loss.backward()
    opt.step()
""",
    ),)
    # the gradients cleared before the forward
