"""`fsdp2-retrofit convert`: options; the conversion is fsdp2_retrofit/convert.py."""
from __future__ import annotations

import os

import click

from fsdp2_retrofit.cli import _TRACEBACK_ENV, EXIT_ERROR, _one_line


CONVERT_HELP = """\
Convert a checkpoint between DCP and torch.save (offline, one process).

The rewritten scripts save sharded state as DCP checkpoint directories (one
file of shards per rank and a .metadata). SRC a directory: DST becomes one
torch.save file with the full tensors, for single-GPU code (evaluation, the
original script). SRC a file: DST becomes a DCP directory that the FSDP2
script's dcp.load reads on any number of ranks (a warm start from a
single-GPU run).

\b
What else changes, each said in a note line:
  - an optimizer state of the FSDP2 run (keyed by parameter name) is numbered
    in its param_groups' order, as optimizer.state_dict() writes it, so the
    single-GPU optimizer.load_state_dict takes it;
  - a pickled module (torch.save(model, ...)) becomes its state_dict();
  - an optimizer state keyed by number (a single-GPU run's) is copied as it
    is: the FSDP2 script loads optimizer state by parameter name, so resume
    only the other entries from it.

Needs torch >= 2.6. A file is read with torch.load(weights_only=True)
(argparse.Namespace allowed); --trust-pickle unpickles anything, running
code from the file: only for files you trust.

\b
Exit codes:
  0  converted
  2  error: SRC missing, unreadable or not a checkpoint, DST exists
     (without --force), torch missing or too old

\b
Examples:
  fsdp2-retrofit convert ckpt.pt ckpt_single.pt     # DCP dir -> one file
  fsdp2-retrofit convert single_gpu.pt warm_start   # one file -> DCP dir
  fsdp2-retrofit convert out/best.pt best_eval.pt --force
"""


@click.command("convert", help=CONVERT_HELP, no_args_is_help=True,
              short_help="A DCP checkpoint directory to one torch.save file, and back.")
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--force", is_flag=True, help="Replace DST if it exists (only once the new one is complete).")
@click.option("--trust-pickle", is_flag=True,
              help="Read a torch.save SRC with weights_only=False (runs code from the file; trusted files only).")
@click.option("-q", "--quiet", is_flag=True, help="Print only errors.")
@click.pass_context
def convert_command(ctx: click.Context, src: str, dst: str, force: bool, trust_pickle: bool, quiet: bool) -> None:
    from fsdp2_retrofit.convert import ConvertError, convert
    from fsdp2_retrofit.torch_env import install_hint, missing_torch

    missing = missing_torch("convert")  # said first: no other answer helps without it
    if missing:
        click.echo(f"error: {missing}", err=True)
        click.echo(install_hint(), err=True)
        ctx.exit(EXIT_ERROR)
    try:
        done = convert(src, dst, force=force, trust_pickle=trust_pickle)
    except ConvertError as exc:
        click.echo(f"error: {_one_line(str(exc))}", err=True)
        ctx.exit(EXIT_ERROR)
    except Exception as exc:  # a bug, or torch failing in a way not foreseen: one line
        if os.environ.get(_TRACEBACK_ENV):
            raise
        click.echo(f"error: {src}: {type(exc).__name__}: {_one_line(str(exc))} (set {_TRACEBACK_ENV}=1 for the "
                   "traceback)", err=True)
        ctx.exit(EXIT_ERROR)
    if quiet:
        return
    what = "one torch.save file" if done.direction == "dcp->file" else "a DCP checkpoint directory"
    click.echo(f"wrote {dst}: {what} of {', '.join(done.entries) or 'nothing'}", err=True)
    for note in done.notes:
        click.echo(f"  note: {note}", err=True)
