"""Whether the rewrite splits the training batches between the ranks.

A loss summed over the batch needs its backward scaled by the world size only where
each rank's loss covers its own part of the global batch: FSDP2 averages the ranks'
gradients, so W rank sums over B/W rows each average to 1/W of the gradient of the sum
over B rows. Where every rank computes its loss on data the rewrite leaves whole (a
full-batch tensor, no DataLoader), the average of the ranks' gradients already is the
gradient of one rank's loss, the single run's: scaling it makes it W times too large.

The answer follows what the data and batch_draws stages split:

* ``True``: a training DataLoader (the data stage gives it a DistributedSampler, or it has
  one), a DataLoader of a sibling module the data stage distributes, a position counter
  the batch_draws stage strides, a random draw it splits (every rank seeds alike), or
  hand-sliced batches of counted loops it splits (every training loop one of them);
* ``False``: none of these, and no DataLoader and no batch draw at all: every rank
  computes its loss on the data it holds;
* ``None``: it cannot tell (a DataLoader no training loop is traced to, a batch draw it
  cannot split or one seeded per rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fsdp2_retrofit.analysis.batch_draws import hand_drawn_batches
from fsdp2_retrofit.analysis.sibling_loaders import sibling_loaders


@dataclass
class DataSplit:
    split: Optional[bool]
    why: str  # what the answer rests on, for the report


def training_data_split(facts) -> DataSplit:
    training = [l for l in facts.loaders if l.trains]
    if training:
        names = ", ".join(f"`{l.name}`" for l in training)
        return DataSplit(True, f"the training batches come from {names}, split between the ranks by a "
                               "DistributedSampler")
    elsewhere = sibling_loaders(facts.resolver, facts.classes) if facts.loops else []
    if elsewhere:
        return DataSplit(True, f"the training batches come from the DataLoader of {elsewhere[0].function}() "
                               "(a sibling module), split between the ranks")
    drawn = hand_drawn_batches(facts)
    if drawn.counters or (drawn.draws and not drawn.seeds):
        return DataSplit(True, "the training batches are drawn by the script and split between the ranks "
                               "(batch_draws)")
    sliced = [l for l in facts.loops if drawn.splits(l.node)]
    if sliced and not facts.loaders and len(sliced) == len(facts.loops):
        return DataSplit(True, "the training batches are sliced by the script in counted loops and split between "
                               "the ranks (batch_draws)")
    if not facts.loaders and not drawn.found and not sliced:
        return DataSplit(False, "no DataLoader and no batch draw the rewrite splits: every rank computes the "
                                "loss on the data it holds (the whole batch where it is the same tensor on "
                                "every rank)")
    return DataSplit(None, "whether each rank's loss covers its own part of the batch is not known (a "
                           "DataLoader no training loop is traced to, or batches drawn in a way the rewrite "
                           "does not split)")
