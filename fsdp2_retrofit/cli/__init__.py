"""The `fsdp2-retrofit` command line. Thin: parse arguments, call the pipeline, render.

Nothing here imports torch, and libcst/rich load only when a command needs them,
so `--help` and `--version` start at once.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import click

from fsdp2_retrofit import __version__, files
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.report import InputError, RewriteResult, render_diff, render_text, to_json, unified_diff

EXIT_OK = 0
EXIT_WOULD_CHANGE = 1
EXIT_ERROR = 2

_TRACEBACK_ENV = "FSDP2_RETROFIT_TRACEBACK"


def rewrite_source(source: bytes, path: str, options: RetrofitOptions) -> RewriteResult:
    """The pipeline, imported on first use (it pulls in libcst and every stage)."""
    from fsdp2_retrofit.rewrite.pipeline import rewrite_source as run

    return run(source, path, options)


def cached_rewrite(source: bytes, path: str, options: RetrofitOptions, use_cache: bool) -> RewriteResult:
    """A result from the cache when the script and its folder are unchanged, else the pipeline."""
    from fsdp2_retrofit.rewrite import cache

    result = cache.lookup(path, source, options) if use_cache else None
    if result is None:
        result = rewrite_source(source, path, options)
        if use_cache:
            cache.store(result, options)
    return result


@click.group(no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]})
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


REWRITE_HELP = """\
Rewrite training scripts into FSDP2, in place.

Each PATH is a single-device PyTorch training script. The rewrite adds the
distributed set-up (process group, device per rank), shards the model with
fully_shard (repeated blocks first, then the root), builds the optimizer from
the sharded parameters, gives the DataLoader a DistributedSampler, and makes
saving and logging safe on many ranks, keeping your names, comments and
formatting.
A report lists every change with the reason for it. A script that cannot be
converted safely is refused and left untouched. Run the result with
`torchrun --nproc_per_node=<gpus> SCRIPT`.

\b
Exit codes:
  0  done, or nothing to change
  1  a file would change (--check)
  2  error: unreadable or invalid input, bad options, a refused file

\b
Examples:
  fsdp2-retrofit rewrite train.py --diff
  fsdp2-retrofit rewrite train.py -o train_fsdp2.py
  fsdp2-retrofit rewrite train.py --check --shard TransformerBlock
"""


@main.command("rewrite", help=REWRITE_HELP, no_args_is_help=True, short_help="Rewrite scripts into FSDP2.")
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option("-o", "--output", "out", metavar="OUT", help="Write the result to OUT and leave PATH untouched (one PATH only).")
@click.option("--diff", is_flag=True, help="Print a unified diff instead of writing.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if a file would change.")
@click.option(
    "--shard", "shard", multiple=True, metavar="CLASS",
    help="Make each instance of CLASS its own FSDP2 unit (repeatable); replaces repeated-block detection.",
)
@click.option(
    "--report", "report_format", type=click.Choice(["text", "json"]), default="text", show_default=True,
    help="Report format: a table per file on stderr, or JSON on stdout (stderr with --diff).",
)
@click.option(
    "--keep-global-batch", is_flag=True,
    help="Divide each training DataLoader's batch size by the world size (checked at run time), so the same "
    "arguments train on the same global batch as the single-GPU run. Default: the per-rank batch stays as written.",
)
@click.option(
    "--accumulation-sync", type=click.Choice(["last", "every"]), default="last", show_default=True,
    help="With gradient accumulation: reduce gradients once, on the last micro-batch (set_requires_gradient_sync; "
    "unsharded gradients held meanwhile), or on every micro-batch (less memory, more communication).",
)
@click.option(
    "--mixed-precision", type=click.Choice(["none", "auto", "bf16", "fp16"]), default="none", show_default=True,
    help="Give every fully_shard a MixedPrecisionPolicy: parameters in bf16/fp16, gradients reduced in float32. "
    "auto takes the dtype of the script's autocast.",
)
@click.option(
    "--cpu-offload", is_flag=True,
    help="Keep parameter, gradient and optimizer-state shards in CPU memory (CPUOffloadPolicy; process group "
    "cpu:gloo,cuda:nccl).",
)
@click.option(
    "--hsdp", type=click.IntRange(min=1), default=None, metavar="REPLICAS",
    help="Hybrid sharding: a 2-D (replicate, shard) mesh with REPLICAS groups; each group shards the model, "
    "groups hold replicas (e.g. one group per node).",
)
@click.option(
    "--reshard-after-forward", type=click.Choice(["default", "always", "never"]), default="default",
    show_default=True,
    help="Whether a unit frees its gathered parameters after forward. default: every block but the last "
    "(backward needs it first; the root keeps its own, as FSDP2 does); always: every unit (least memory); "
    "never: none (no all-gather in backward, most memory).",
)
@click.option(
    "--frozen-models", type=click.Choice(["shard", "replicate"]), default="shard", show_default=True,
    help="Models the script freezes and never trains (a distillation teacher): shard them like the trained "
    "ones (1/N of the memory, an all-gather per unit in their forward) or keep a full copy on every rank.",
)
@click.option(
    "--no-reduce-logs", is_flag=True,
    help="Print rank 0's own loss. Default: a logged `loss.item()` is averaged over the ranks first (an "
    "all_reduce on every rank), so the log reads like the single-GPU run's.",
)
@click.option(
    "--torch-version", default="", metavar="X.Y", callback=lambda ctx, param, value: _torch_version(value),
    help="The torch the output must run on (>= 2.4). Before 2.6 FSDP2 is imported from "
    "torch.distributed._composable.fsdp. Default: 2.6 and newer (torch.distributed.fsdp).",
)
@click.option(
    "--emit-slurm", "emit_slurm", metavar="FILE",
    help="Also write an sbatch script to FILE that runs the result with `srun torchrun` (one PATH only; edit "
    "its --nodes and --gpus-per-node).",
)
@click.option(
    "--export", "export", type=click.Choice(["dcp", "full"]), default="dcp", show_default=True,
    help="Model-only saves: a DCP checkpoint directory, or one torch.save file of the full state dict (rank 0 writes).",
)
@click.option(
    "--async-checkpoint", is_flag=True,
    help="dcp.async_save (waiting on the previous save first); the process group gets a CPU backend too.",
)
@click.option(
    "--meta-init", is_flag=True,
    help="Trade exact initialisation for memory: build the model on the meta device, shard it, then allocate "
    "only this rank's shards (to_empty) and re-run its initialisation (reset_parameters, its own init, buffers). "
    "The initial weights are new random draws, not the single-GPU run's. Refused when the initialisation cannot "
    "be re-created safely.",
)
@click.option("-q", "--quiet", is_flag=True, help="No report; errors are still printed.")
@click.option(
    "--no-cache", is_flag=True,
    help="Do not read or write the result cache (~/.cache/fsdp2-retrofit; FSDP2_RETROFIT_CACHE_DIR moves it).",
)
@click.pass_context
def rewrite_command(
    ctx: click.Context,
    paths: Tuple[str, ...],
    out: Optional[str],
    diff: bool,
    check: bool,
    shard: Tuple[str, ...],
    keep_global_batch: bool,
    accumulation_sync: str,
    mixed_precision: str,
    cpu_offload: bool,
    hsdp: Optional[int],
    reshard_after_forward: str,
    frozen_models: str,
    no_reduce_logs: bool,
    torch_version: str,
    emit_slurm: Optional[str],
    meta_init: bool,
    report_format: str,
    export: str,
    async_checkpoint: bool,
    quiet: bool,
    no_cache: bool,
) -> None:
    if out is not None and len(paths) != 1:
        raise click.UsageError("-o/--output takes exactly one PATH")
    if emit_slurm is not None and len(paths) != 1:
        raise click.UsageError("--emit-slurm takes exactly one PATH")
    run = _Run(
        options=RetrofitOptions(
            shard=tuple(shard),
            keep_global_batch=keep_global_batch,
            accumulation_sync=accumulation_sync,
            mixed_precision=mixed_precision,
            cpu_offload=cpu_offload,
            hsdp=hsdp or 0,
            reshard_after_forward=reshard_after_forward,
            frozen_models=frozen_models,
            reduce_logs=not no_reduce_logs,
            torch_version=torch_version,
            export=export,
            async_checkpoint=async_checkpoint,
            meta_init=meta_init,
        ),
        out=out,
        diff=diff,
        check=check,
        quiet=quiet,
        report_format=report_format,
        use_cache=not no_cache,
    )
    for path in paths:
        run.process(path)
    if emit_slurm is not None and run.exit_code != EXIT_ERROR:
        from fsdp2_retrofit.rewrite.launch_commands import slurm_script

        try:
            files.atomic_write(emit_slurm, slurm_script(out or paths[0]).encode())
        except InputError as exc:
            run._fail(emit_slurm, exc)
        else:
            if not quiet:
                click.echo(f"wrote {emit_slurm}: sbatch {emit_slurm}", err=True)
    if not quiet and report_format == "json":
        click.echo(to_json(run.results), err=diff)
    if run.text_report and len(paths) > 1:
        run.summary()
    ctx.exit(run.exit_code)


def _torch_version(value: str) -> str:
    if not value:
        return ""
    import re

    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.\d+)?", value.strip())
    if m is None:
        raise click.BadParameter(f"{value!r} is not a version like 2.5")
    if (int(m.group(1)), int(m.group(2))) < (2, 4):
        raise click.BadParameter(f"FSDP2 (fully_shard) needs torch 2.4 or newer, not {value}")
    return f"{m.group(1)}.{m.group(2)}"


@dataclass
class _Run:
    """One `rewrite` invocation: processes paths, remembers results and the worst exit code."""

    options: RetrofitOptions
    out: Optional[str]
    diff: bool
    check: bool
    quiet: bool
    report_format: str
    use_cache: bool = True

    def __post_init__(self) -> None:
        self.results: List[RewriteResult] = []
        self.exit_code = EXIT_OK
        self.counts = {"changed": 0, "unchanged": 0, "failed": 0}
        self._stderr = None
        self._stdout = None

    @property
    def text_report(self) -> bool:
        return not self.quiet and self.report_format == "text"

    @property
    def writes(self) -> bool:
        return not (self.diff or self.check)

    def process(self, path: str) -> None:
        target = self.out or path
        try:
            source = files.read_source(path)
            result = cached_rewrite(source.data, path, self.options, self.use_cache)
        except InputError as exc:
            return self._fail(path, exc)
        except Exception as exc:  # a bug in a stage: report it, carry on with the next file
            if os.environ.get(_TRACEBACK_ENV):
                raise
            detail = _one_line(str(exc))
            message = f"internal error: {type(exc).__name__}: {detail} (set {_TRACEBACK_ENV}=1 for the traceback)"
            return self._fail(path, InputError(message))

        self.results.append(result)
        if result.refusals:
            first = result.refusals[0]
            code = f"{first.code} " if first.code else ""
            self._error(path, first.line, f"{code}{first.what}: {first.why}", first.hint)
            self.counts["failed"] += 1
            self._bump(EXIT_ERROR)
            if self.text_report:
                self._render(result, target, applied=False)
            return

        if self.diff and result.changed:
            text = unified_diff(path, source.decode(), source.decode(result.code), self.out)
            render_diff(text, self.stdout)
        if self.writes and (result.changed or self.out is not None):
            try:
                files.check_writable(target)
                files.atomic_write(target, result.code)
            except InputError as exc:
                self.results.pop()
                return self._fail(target, exc)
        if self.check and result.changed:
            self._bump(EXIT_WOULD_CHANGE)
            if not self.quiet and not self.text_report:  # the text report's heading says it
                click.echo(f"would rewrite {path}", err=True)
        self.counts["changed" if result.changed else "unchanged"] += 1
        if self.text_report:
            self._render(result, target, applied=self.writes)

    def summary(self) -> None:
        verb = "rewritten" if self.writes else "would change"
        c = self.counts
        click.echo(f"{c['changed']} {verb}, {c['unchanged']} unchanged, {c['failed']} failed", err=True)

    @property
    def stderr(self):
        if self._stderr is None:
            from rich.console import Console

            self._stderr = Console(stderr=True, highlight=False)
        return self._stderr

    @property
    def stdout(self):
        if self._stdout is None:
            from rich.console import Console

            self._stdout = Console(highlight=False)
        return self._stdout

    def _render(self, result: RewriteResult, target: str, applied: bool) -> None:
        render_text(result, self.stderr, target=target, applied=applied)

    def _fail(self, path: str, exc: InputError) -> None:
        self._error(path, exc.line, exc.message)
        self.counts["failed"] += 1
        self._bump(EXIT_ERROR)

    def _error(self, path: str, line: int, message: str, hint: str = "") -> None:
        where = f"{path}:{line}" if line else path
        click.echo(f"{where}: {_one_line(message)}", err=True)
        if hint:
            click.echo(f"  hint: {_one_line(hint)}", err=True)

    def _bump(self, code: int) -> None:
        self.exit_code = max(self.exit_code, code)


CHECK_HELP = """\
Lint PATHS for FSDP2 pitfalls (the pre-commit check).

Finds what breaks or silently corrupts FSDP2 training: `.forward(...)` on a
sharded module (FSD101), `torch.save` of sharded state (FSD102), an optimizer
built before sharding, a collective inside a rank-0 branch, and the rest of the
catalogue (`fsdp2-retrofit rules`). Rules fire only where a module is known to
be sharded, so ordinary single-GPU code is never flagged. Directories are
walked (git-ignored and excluded paths skipped); `-` reads standard input.

\b
Suppress one line with `# noqa: FSD101`, a whole file with a comment line
`# fsdp2-retrofit: noqa: FSD101` (or without codes: every rule). Options also
come from [tool.fsdp2-retrofit] in the nearest pyproject.toml (select, ignore,
extend-select, exclude, extend-exclude, unsafe-fixes, output-format); the
command line wins.

\b
Exit codes:
  0  no findings (or --exit-zero)
  1  findings remain
  2  error: unreadable file, syntax error, bad options, no Python file
     to check (all git-ignored or excluded, an empty directory)

\b
Examples:
  fsdp2-retrofit check train.py
  fsdp2-retrofit check src/ --select FSD101,FSD102 --output-format github
  fsdp2-retrofit check train.py --fix --diff
"""


def _codes(values) -> List[str]:
    out: List[str] = []
    for value in values or ():
        out.extend(c.strip().upper() for c in value.split(",") if c.strip())
    return out


@main.command("check", help=CHECK_HELP, short_help="Lint for FSDP2 pitfalls (pre-commit).")
@click.argument("paths", nargs=-1, metavar="[PATH...|-]")
@click.option("--select", multiple=True, metavar="CODES", help="Only these codes or prefixes (comma-separated; ALL for every rule).")
@click.option("--extend-select", multiple=True, metavar="CODES", help="Add these codes or prefixes to the selection.")
@click.option("--ignore", multiple=True, metavar="CODES", help="Skip these codes or prefixes.")
@click.option("--fix", is_flag=True, help="Apply the safe fixes and write the files.")
@click.option("--unsafe-fixes/--no-unsafe-fixes", default=None, help="Also apply (or show as fixable) the unsafe fixes.")
@click.option("--diff", is_flag=True, help="Print the fixes as a unified diff; write nothing.")
@click.option(
    "--output-format", type=click.Choice(["text", "json", "github", "sarif"]), default=None,
    help="text (path:line:col: CODE message), json, github (workflow annotations), sarif (2.1.0).  [default: text]",
)
@click.option("--exit-zero", is_flag=True, help="Exit 0 even when findings remain.")
@click.option("--statistics", is_flag=True, help="Print a count per rule instead of each finding.")
@click.option("--exclude", multiple=True, metavar="PATTERN", help="Also skip paths matching these glob patterns.")
@click.option("--force-exclude", is_flag=True, help="Apply exclusions to files named on the command line too (for pre-commit).")
@click.option("--stdin-filename", metavar="PATH", help="The name to report for `-` (standard input).")
@click.option("--show-files", is_flag=True, help="List the files that would be checked, and stop.")
@click.option("-q", "--quiet", is_flag=True, help="Only the findings: no summary line.")
@click.pass_context
def check_command(ctx: click.Context, paths, select, extend_select, ignore, fix, unsafe_fixes, diff, output_format,
                  exit_zero, statistics, exclude, force_exclude, stdin_filename, show_files, quiet) -> None:
    from fsdp2_retrofit.check.run import CheckRun, CheckSettings
    from fsdp2_retrofit.options import ConfigError, load_config

    try:
        _, config = load_config(".")
    except ConfigError as exc:
        click.echo(f"error: {_one_line(str(exc))}", err=True)
        ctx.exit(EXIT_ERROR)
    settings = CheckSettings(
        # ruff's layering: a --select on the command line replaces the configured selection
        # (its ignores included); otherwise command-line codes add to the configured ones
        select=_codes(select) or _codes(config.get("select")),
        extend_select=_codes(extend_select) + ([] if select else _codes(config.get("extend-select"))),
        ignore=_codes(ignore) + ([] if select else _codes(config.get("ignore"))),
        fix=fix or diff,
        write=fix and not diff,
        diff=diff,
        unsafe_fixes=bool(config.get("unsafe-fixes", False)) if unsafe_fixes is None else unsafe_fixes,
        output_format=output_format or config.get("output-format", "text"),
        exit_zero=exit_zero,
        statistics=statistics,
        exclude=tuple(exclude) + tuple(config.get("exclude", ())) + tuple(config.get("extend-exclude", ())),
        force_exclude=force_exclude,
        stdin_filename=stdin_filename,
        quiet=quiet,
    )
    if settings.output_format not in ("text", "json", "github", "sarif"):
        click.echo(f"error: unknown output-format {settings.output_format!r}", err=True)
        ctx.exit(EXIT_ERROR)
    ctx.exit(CheckRun(settings).main(list(paths) or ["."], show_files=show_files))


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
the single run visits samples in DistributedSampler's order (seed 0).
Equivalent: every step's loss (single vs mean over ranks) and gradient norm
agree within rel 1e-4 / abs 1e-5, and the final weights within --tolerance.

\b
Exit codes:
  0  equivalent within tolerance
  1  diverged (the first diverging step is named)
  2  a script could not run (its error is shown), or bad input/options

\b
Examples:
  fsdp2-retrofit verify train.py -- --batch-size 64
  fsdp2-retrofit verify train_single.py --retrofitted train_fsdp2.py \\
      --per-rank-arg --batch-size -- --batch-size 32
"""


@main.command(
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
@click.option("--tolerance", type=click.FloatRange(min=0), default=1e-4, show_default=True,
              help="Largest allowed max |difference| of the final weights.")
@click.option("--per-rank-arg", "per_rank_args", multiple=True, metavar="NAME",
              help="A script option whose value is per rank in the distributed script (e.g. --batch-size): the "
              "single run gets it multiplied by --nproc (repeatable).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Also write the report as JSON to FILE.")
@click.option("--keep-runs", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Run in DIR (new or empty) and keep the records, logs and in-memory retrofit there.")
@click.option("--reuse-single", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Skip the single run: use the one recorded in DIR (a --keep-runs DIR/single) with the same "
              "script, arguments and steps.")
@click.option("--python", default=sys.executable, show_default="this interpreter", metavar="PATH",
              help="The Python (with torch) that runs both scripts.")
@click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds each run may take (then it is killed: a deadlock).")
@click.option("--run-files", type=click.Path(file_okay=False, exists=True, path_type=Path), metavar="DIR",
              help="Link each entry of DIR into both runs' working directories (input files the script opens "
              "by a relative path).")
@click.pass_context
def verify_command(ctx: click.Context, script, script_args, retrofitted, nproc, steps, tolerance, per_rank_args,
                   json_path, keep_runs, reuse_single, python, timeout, run_files) -> None:
    from fsdp2_retrofit.verify import VerifySettings, verify

    settings = VerifySettings(
        script=script, script_args=tuple(script_args), retrofitted=retrofitted, nproc=nproc, steps=steps,
        tolerance=tolerance, per_rank_args=tuple(per_rank_args), json_path=json_path, keep_runs=keep_runs,
        reuse_single=reuse_single, python=python, timeout=timeout, run_files=run_files,
    )
    ctx.exit(verify(settings))


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


@main.command("convert", help=CONVERT_HELP, no_args_is_help=True,
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


RULES_HELP = """\
List the lint rules and the rewrite's refusals, or explain one.

\b
  fsdp2-retrofit rules           the catalogues: lint rules (code, name, fix,
                                 summary), then what `rewrite` refuses (code,
                                 stage, name, summary)
  fsdp2-retrofit rules FSD101    why it matters, an example, the fix, and the
                                 flagged / not flagged cases the tests run
  fsdp2-retrofit rules FSR101    what is refused, why, and what to do
"""


@main.command("rules", help=RULES_HELP, short_help="The lint rules and refusal codes; one code's documentation.")
@click.argument("code", required=False, metavar="[CODE]")
@click.pass_context
def rules_command(ctx: click.Context, code: Optional[str]) -> None:
    from fsdp2_retrofit.check.rules import all_rules, rule_by_code
    from fsdp2_retrofit.rewrite.refusals import all_refusals, refusal_by_code

    if code is None:
        rules = all_rules()
        width = max(len(r.NAME) for r in rules)
        fix_width = max(len(r.fix_label()) for r in rules)
        for r in rules:
            click.echo(f"{r.CODE}  {r.NAME:<{width}}  {r.fix_label():<{fix_width}}  {r.summary()}")
        click.echo(
            "\nFixes: safe ones are applied by --fix; unsafe ones only with --unsafe-fixes too (they may change "
            "behaviour); *: some cases only. `fsdp2-retrofit rules CODE` explains one."
        )
        refusals = all_refusals()
        width = max(len(r.name) for r in refusals)
        stage_width = max(len(r.stage) for r in refusals)
        click.echo("\nrewrite refuses (the file is left unchanged, exit 2):")
        for r in refusals:
            click.echo(f"{r.code}  {r.stage:<{stage_width}}  {r.name:<{width}}  {r.summary}")
        return
    refusal = refusal_by_code(code)
    if refusal is not None:
        click.echo(refusal.doc(), nl=False)
        return
    rule = rule_by_code(code)
    if rule is None:
        click.echo(f"error: no rule {code!r} (see `fsdp2-retrofit rules`)", err=True)
        ctx.exit(EXIT_ERROR)
    click.echo(_rule_doc(rule))


def _rule_doc(rule) -> str:
    import inspect
    import textwrap

    doc = inspect.cleandoc(rule.__doc__ or "")
    lines = [f"# {rule.CODE} {rule.NAME}", "", f"Message: {rule.MESSAGE}", "", doc, "", "## Flagged"]
    for case in rule.INVALID:
        lines.append(f"(line {case.line})")
        lines.append(textwrap.indent(case.code.rstrip(), "    "))
        if case.fixed is not None:
            lines.append("fixed to:")
            lines.append(textwrap.indent(case.fixed.rstrip(), "    "))
        lines.append("")
    lines.append("## Not flagged")
    for case in rule.VALID:
        lines.append(textwrap.indent(case.code.rstrip(), "    "))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _one_line(message: str) -> str:
    """An error is one line: the first non-blank line of a longer message."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0] if lines else message.strip()

