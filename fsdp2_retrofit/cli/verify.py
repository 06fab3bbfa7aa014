"""`fsdp2-retrofit verify`: options; the engine is fsdp2_retrofit/verify."""
from __future__ import annotations

import sys
from pathlib import Path

import click


VERIFY_HELP = """\
Run SCRIPT and its FSDP2 retrofit, and check that they train the same.

WARNING: verify EXECUTES YOUR CODE: SCRIPT once in one process, and the
retrofit under `torchrun --nproc_per_node N` (CPU + gloo without CUDA, one GPU
per rank with it), both with SCRIPT-ARGS. Each run works in its own temporary
directory (what the script saves lands there; relative input paths resolve
there), with an instrumentation module on its PYTHONPATH; your files are never
edited.

Without --retrofitted, SCRIPT is retrofitted in memory with
--keep-global-batch, so the same arguments mean the same global batch. With
--retrofitted FILE, FILE is trusted to keep the global batch; if it keeps the
per-rank batch instead (the default rewrite), name its batch-size option with
--per-rank-arg and the single run gets that value times N.

Both runs record per optimizer step the loss (the sum of the losses
`backward()` is called on since the previous step: all micro-batches) and the
gradient norm, and stop after --steps optimizer steps. A shuffled DataLoader of
the single run visits samples in DistributedSampler's order (seed 0, at the
epochs the retrofit's samplers were set to); one the retrofit left unsplit
shuffles as in the original. Equivalent: each step read the
same number of samples in both runs (the global batch), every step's loss
(single vs mean over ranks) and gradient norm agree within rel 1e-4 / abs 1e-5,
and every element of the final weights within its band: --tolerance, or 2
spacings of its dtype at its magnitude (bfloat16 11.0 vs 11.0625 agrees), or,
after steps that all agree, the step bound of an optimizer that normalises its
step (Adam moves an element at most ~lr a step, so round-off in a gradient that
is zero in exact arithmetic, an attention key bias, becomes steps of up to lr).
The verdict says which rule decided, and names parameters by qualified name.
With --dtype float64 both runs are made in double precision where the scripts
let them: round-off ~1e-16, nothing for an optimizer to amplify.

A run that outlives --timeout is asked where each rank is (its stack) before
every process of it is killed; it is called a hang only when the stacks show
every rank waiting in torch.distributed.

With --to-end, both scripts go on after the steps: the loaders they trained on
yield nothing more, so each script reaches what it does after training (final
evaluation, generation, the last save) on the spot. A retrofit that fails or
hangs there (a collective on rank 0 only) is diverged; an original that fails
there is noted. Give the script small settings (one or two epochs) if its own
loop does not end with its loaders.

\b
Exit codes:
  0  equivalent within tolerance
  1  diverged (the first diverging step is named), or with --to-end the
     retrofit failed after training
  2  a script could not run (its error is shown), the runs read different
     global batches (not comparable), or bad input/options

\b
Examples:
  fsdp2-retrofit verify train.py -- --batch-size 64
  fsdp2-retrofit verify train_single.py --retrofitted train_fsdp2.py \\
      --per-rank-arg --batch-size -- --batch-size 32
"""


@click.command(
    "verify", help=VERIFY_HELP, no_args_is_help=True,
    short_help="Run a script and its retrofit; compare losses and weights (executes your code).",
    context_settings={"ignore_unknown_options": True},
)
@click.argument("script", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- SCRIPT-ARGS...]")
@click.option("--retrofitted", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="The distributed script to compare (default: SCRIPT retrofitted in memory with --keep-global-batch).")
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True, help="Ranks for torchrun.")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="Stop both runs after this many optimizer steps.")
@click.option("--to-end", is_flag=True,
              help="After the steps, run both scripts to their end and judge what the retrofit does after training.")
@click.option("--tolerance", type=click.FloatRange(min=0), default=1e-4, show_default=True,
              help="Largest allowed max |difference| of the final weights.")
@click.option("--dtype", type=click.Choice(["native", "float64"]), default="native", show_default=True,
              help="float64: make both runs in double precision where the scripts let them (default dtype float64, "
              "modules' inputs, parameters and buffers cast, .float() gives float64), so round-off is ~1e-16 and "
              "no optimizer turns it into steps; a parameter the script keeps in another dtype is named.")
@click.option("--per-rank-arg", "per_rank_args", multiple=True, metavar="NAME",
              help="A script option whose value is per rank in the distributed script (e.g. --batch-size): the "
              "single run gets it multiplied by --nproc (repeatable).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Also write the report as JSON to FILE.")
@click.option("--keep-runs", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Run in DIR (new, or without the single/, dist/, retrofitted/ and single-epochs/ folders of an "
              "earlier run) and keep the records, logs and in-memory retrofit there; other entries stay (inputs the "
              "script reads at ../data from its run folder).")
@click.option("--reuse-single", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Skip the single run: use the one recorded in DIR (a --keep-runs DIR/single) with the same "
              "script, arguments and steps.")
@click.option("--python", default=sys.executable, show_default="this interpreter", metavar="PATH",
              help="The Python (with torch) that runs both scripts.")
@click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds each run may take (then each rank's place is read and every process of the run killed).")
@click.option("--run-files", type=click.Path(file_okay=False, exists=True, path_type=Path), metavar="DIR",
              help="Put each entry of DIR into both runs' working directories (input files the script opens "
              "by a relative path): copied, each run its own, up to 64 MiB in all; linked above that.")
@click.pass_context
def verify_command(ctx: click.Context, script, script_args, retrofitted, nproc, steps, to_end, tolerance,
                   dtype, per_rank_args, json_path, keep_runs, reuse_single, python, timeout, run_files) -> None:
    from fsdp2_retrofit.verify import VerifySettings, verify

    settings = VerifySettings(
        script=script, script_args=tuple(script_args), retrofitted=retrofitted, nproc=nproc, steps=steps,
        tolerance=tolerance, per_rank_args=tuple(per_rank_args), json_path=json_path, keep_runs=keep_runs,
        reuse_single=reuse_single, python=python, timeout=timeout, run_files=run_files, to_end=to_end,
        dtype=dtype,
    )
    ctx.exit(verify(settings))
