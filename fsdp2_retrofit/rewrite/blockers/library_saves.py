"""FSR7.. library_saves: library save calls of sharded models (FSR702, FSR703)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)

_HF = """\
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("gpt2")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for batch in range(3):
    model(batch).sum().backward()
    opt.step()
"""  # lines 1-7


class LibrarySaveOwnStateDict(Blocker):
    """save_pretrained is given its own state_dict.

    ## Why
    Which state it writes is for the script to say; a sharded model's state dict holds one rank's
    shards.

    ## What to do
    Pass a full state dict gathered on every rank (get_model_state_dict with full_state_dict=True).
    """

    CODE = "FSR702"
    NAME = "library-save-own-state-dict"
    STAGE = "library_saves"
    INVALID = (Invalid(_HF + 'model.save_pretrained("out", state_dict=model.state_dict())\n', line=8),)


class LibrarySaveRankGated(Blocker):
    """save_pretrained of a sharded model under a rank test.

    ## Why
    Gathering the full state dict is a collective every rank must join (deadlock).

    ## What to do
    Call save_pretrained outside the rank test; the rewrite gates the write itself.
    """

    CODE = "FSR703"
    NAME = "library-save-rank-gated"
    STAGE = "library_saves"
    INVALID = (Invalid(_HF + 'if rank == 0:\n    model.save_pretrained("out")\n', line=9),)
    # save_pretrained on every rank: the rewrite gathers the state and gates the write
    VALID = (Valid(_HF + 'model.save_pretrained("out")\n'),)
    # save_pretrained on every rank: the rewrite gathers the state and gates the write
