"""FSR6.. shared_names: module-level names the ranks would share (FSR635, FSR636)."""
from __future__ import annotations

from . import Blocker, Invalid, Valid  # noqa: F401  (the cases use them)
from ._scripts import TRAINING, indented

_MAIN = "def main():\n" + indented(TRAINING)  # 6 lines


class SharedNameBeforeProcessGroup(Blocker):
    """A path every rank uses is named from the clock or a uuid before the process group starts (at
    module level, in a function called before init_process_group, or read before it).

    ## Why
    Each rank reads its own clock and gets another name: each would write into a path of its own (a
    collective DCP save split over folders, logs scattered). Rank 0's value can be broadcast only
    once the process group runs.

    ## What to do
    Name the run after the process group starts, in the function that starts it, or pass the name in
    as an argument.
    """

    CODE = "FSR635"
    NAME = "shared-name-before-process-group"
    STAGE = "shared_names"
    INVALID = (Invalid(
        "import time\nimport torch\n" + 'RUN = "runs/" + time.strftime("%H%M%S")\n' + _MAIN
        + '    torch.save(model.state_dict(), RUN + "/m.pt")\nmain()\n',
        line=3,
    ),)


class SharedNameUnnamed(Blocker):
    """A path every rank uses is made from the clock or a uuid without a name to hand over: inline in
    the call, stored in `self.attr`, a function's result used in place.

    ## Why
    Each rank reads its own clock and gets another name; the rewrite broadcasts rank 0's value by
    binding a plain name (or `obj.attr`) again right after it is made, and here there is none.

    ## What to do
    Bind the value to a name first (`run_dir = ...`) in the function that uses it.
    """

    CODE = "FSR636"
    NAME = "shared-name-unnamed"
    STAGE = "shared_names"
    INVALID = (Invalid(
        "import time\nimport torch\n" + _MAIN
        + '    torch.save(model.state_dict(), f"ckpt-{time.time()}.pt")\nmain()\n',
        line=9,
    ),)
    # the name bound first, in the function that saves: rank 0's value is broadcast
    VALID = (Valid(
        "import time\nimport torch\n" + _MAIN + """\
    path = f"ckpt-{time.time()}.pt"
    torch.save(model.state_dict(), path)
main()
""",
    ),)
    # the name bound first, in the function that saves: rank 0's value is broadcast
