"""FSR6.. loop_sums: sums over the loader the split would change (FSR639)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import DATA_IMPORTS, EPOCH, LOADER, MODEL, OPT, indented

_EPOCHS = DATA_IMPORTS + MODEL + OPT + LOADER + "for epoch in range(3):\n" + indented(EPOCH)  # lines 1-10
_COUNT = """\
        seen = 0
        for x, y in loader:
            seen += y.size(0)
        print(seen)
"""


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
    INVALID = (Invalid(_EPOCHS + "    if loss.item() > 0.1:\n" + _COUNT, line=13),)
    # the loop under a condition every rank decides alike (the epoch)
    VALID = (Valid(_EPOCHS + "    if epoch % 2 == 0:\n" + _COUNT),)
    # the loop under a condition every rank decides alike (the epoch)
