"""FSR6.. rank_decisions: decisions that would differ between ranks (FSR640, FSR641)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import DATA_IMPORTS, LOADER, MODEL, OPT, STEPS, TRAIN, TRAIN_LOADER

_NET = """\
import random
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 2)
    def forward(self, x):
        if random.random() < 0.5:
            x = self.a(x)
        return self.b(x)
model = Net()
"""  # lines 1-12


class RankLocalDecisionGatesCollective(Blocker):
    """A condition (an `if`, a `break`) that reads a value of one rank's own part of the data (its
    loss, a sum over its part of a split DataLoader) decides whether a collective runs: a checkpoint
    save, a forward of the sharded model, the training loop's next step.

    ## Why
    Each rank decides from its own value: some ranks enter the collective (or leave the loop) and
    the others do not, and the run hangs. A figure the rewrite combines over the ranks (a loop's
    sums, codemods/loop_sums.py) is the same on every rank and is not refused.

    ## What to do
    Decide from a value every rank shares: average it over the ranks first (dist.all_reduce, then
    divide by the world size), or broadcast rank 0's decision (dist.broadcast_object_list).
    """

    CODE = "FSR640"
    NAME = "rank-local-decision-gates-collective"
    STAGE = "rank_decisions"
    INVALID = (Invalid(TRAIN_LOADER + "    if loss.item() < 0.01:\n        break\n", line=10),)
    VALID = (
        # the loop left on a step count, the same on every rank
        Valid(
            DATA_IMPORTS + MODEL + OPT + LOADER + """\
for step, (x, y) in enumerate(loader):
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    if step >= 100:
        break
""",
        ),
        # a forward under a flag of enumerate's step index and a count not proven the same on every rank
        # (read from the environment): the index counts steps, the ranks' own batches do not reach it
        Valid(
            "import os\n" + DATA_IMPORTS + MODEL + OPT + LOADER + """\
def train(accum):
    for i, (x, y) in enumerate(loader):
        last = (i + 1) % accum == 0
        if not last:
            (model(x) - y).pow(2).mean().backward()
        else:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
train(int(os.environ.get("ACCUM", "2")))
""",
        ),
    )


class RandomControlFlowInForward(Blocker):
    """The forward of the sharded model decides its control flow (a loop's length, an `if`) from a
    random draw (`random.*`, `numpy.random.*`, `torch.rand*`) of a generator the script does not
    seed with a value every rank shares, directly or through a parameter the training loop binds
    under an `if` on such a draw (`if np.random.random() < 0.1: labels = None`).

    ## Why
    Each rank draws its own number: the ranks run different layers (or the same layer a different
    number of times), so the all-gathers and reduce-scatters fully_shard issues per layer no longer
    pair up between the ranks: a size mismatch error (gloo) or a hang (NCCL).

    ## What to do
    Seed that generator with the same value on every rank before training (`random.seed(0)`,
    `np.random.seed(0)`, `torch.manual_seed(0)`), or draw the number on rank 0 and broadcast it
    (dist.broadcast_object_list) before the forward.
    """

    CODE = "FSR641"
    NAME = "random-control-flow-in-forward"
    STAGE = "rank_decisions"
    INVALID = (Invalid(_NET + OPT + STEPS, line=9),)
    # the generator seeded alike on every rank before training
    VALID = (Valid(_NET + "random.seed(0)\n" + OPT + STEPS),)


_SPLIT_EVAL = """\
import os
rank = int(os.environ.get("RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
held_out = torch.randn(5, 4, 8)
for i in range(len(held_out)):
"""  # lines 7-11 after TRAINING's import and its 5 lines


class RankSplitForwardCount(Blocker):
    """A forward of the sharded model that each rank runs a number of times read from its rank: an
    evaluation split by `if i % world_size != rank: continue`, a loop over `range(rank, n,
    world_size)`, a forward under an `if` that reads the rank (a rank-0 test is rank_zero's).

    ## Why
    FSDP2 all-gathers the parameters in every forward, a collective each rank must join. Where the
    world size does not divide the work (5 items on 2 ranks) one rank runs one forward more than
    the others: it waits in its all-gather for ranks that never come (a hang).

    ## What to do
    Give every rank the same number of forwards: pad each rank's share to ceil(n / world_size)
    items (repeat an item and drop its result), or let every rank run all of them.
    """

    CODE = "FSR646"
    NAME = "rank-split-forward-count"
    STAGE = "rank_decisions"
    INVALID = (
        Invalid(TRAIN + _SPLIT_EVAL + "    if i % world_size != rank:\n        continue\n"
                "    print(model(held_out[i]).sum())\n", line=12),
        Invalid(TRAIN + _SPLIT_EVAL.replace("range(len(held_out))", "range(rank, len(held_out), world_size)")
                + "    print(model(held_out[i]).sum())\n", line=11),
    )
    VALID = (
        # every rank runs every item: the same count everywhere
        Valid(TRAIN + _SPLIT_EVAL + "    print(model(held_out[i]).sum())\n"),
        # the world size alone decides the count: the same on every rank
        Valid(TRAIN + _SPLIT_EVAL.replace("range(len(held_out))", "range(world_size)")
              + "    print(model(held_out[i]).sum())\n"),
    )
