"""The `fsdp2-retrofit` command line. Thin: parse arguments, call the pipeline, render.

One module per command (rewrite.py, check.py, verify.py, convert.py, rules.py),
imported only when that command runs (or `--help` lists them all), so the
pre-commit path `check` builds only its own options. Nothing here imports
torch, and libcst/rich load only when a command needs them, so `--help` and
`--version` start at once.
"""
from __future__ import annotations

import importlib
from typing import List, Optional

import click

from fsdp2_retrofit import __version__

EXIT_OK = 0
EXIT_WOULD_CHANGE = 1
EXIT_ERROR = 2

_TRACEBACK_ENV = "FSDP2_RETROFIT_TRACEBACK"

# command name -> the attribute of fsdp2_retrofit.cli.<name> that is its click command
_COMMANDS = {
    "check": "check_command",
    "convert": "convert_command",
    "rewrite": "rewrite_command",
    "rules": "rules_command",
    "verify": "verify_command",
}


class _LazyGroup(click.Group):
    """A group whose sub-commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> List[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        attr = _COMMANDS.get(cmd_name)
        if attr is None:
            return None
        return getattr(importlib.import_module(f"{__name__}.{cmd_name}"), attr)


@click.group(cls=_LazyGroup, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="fsdp2-retrofit")
def main() -> None:
    """Rewrite single-GPU PyTorch training scripts into torchrun-ready FSDP2,
    and lint FSDP2 code for its pitfalls.

    \b
    Start with:
      fsdp2-retrofit rewrite train.py --diff
      fsdp2-retrofit check train_fsdp2.py
      fsdp2-retrofit convert ckpt.pt ckpt_single.pt
    """


def _one_line(message: str) -> str:
    """An error is one line: the first non-blank line of a longer message."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0] if lines else message.strip()
