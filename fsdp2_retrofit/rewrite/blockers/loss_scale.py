"""FSR9.. loss_scale: losses the gradient averaging over ranks would scale wrongly (FSR960)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import DATA_IMPORTS, LOADER, MODEL, OPT

_LOSS = DATA_IMPORTS + MODEL + OPT + LOADER + """\
for x, y in loader:
    out = model(x)
    loss = torch.nn.functional.mse_loss(out, y) + 0.5 * torch.{reduce}(out.pow(2))
    loss.backward()
    opt.step()
"""


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
    INVALID = (Invalid(_LOSS.format(reduce="sum"), line=8),)
    # every term averaged over the batch
    VALID = (Valid(_LOSS.format(reduce="mean")),)
    # every term averaged over the batch
