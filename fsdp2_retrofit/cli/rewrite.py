"""`fsdp2-retrofit rewrite`: the command, and one run of it over its paths."""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import click

from fsdp2_retrofit import files
from fsdp2_retrofit.cli import _TRACEBACK_ENV, EXIT_ERROR, EXIT_OK, EXIT_WOULD_CHANGE, _one_line
from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.report import InputError, RewriteResult, render_diff, render_text, to_json, unified_diff


def rewrite_source(source: bytes, path: str, options: RetrofitOptions) -> RewriteResult:
    """The pipeline, imported on first use (it pulls in libcst and every stage)."""
    from fsdp2_retrofit.pipeline import rewrite_source as run

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


REWRITE_HELP = """\
Rewrite training scripts into FSDP2, in place.

Each PATH is a single-device PyTorch training script. The rewrite adds the
distributed set-up (process group, device per rank), shards the model with
fully_shard (repeated blocks first, then the root), builds the optimizer from
the sharded parameters, gives the DataLoader a DistributedSampler, and makes
saving and logging safe on many ranks, keeping your names, comments and
formatting.
A report lists every change, one line each (--explain: with the reason for it). A script that cannot be
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


@click.command("rewrite", help=REWRITE_HELP, no_args_is_help=True, short_help="Rewrite scripts into FSDP2.")
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option(
    "-o", "--output", "out", metavar="OUT",
    help="Write the result to OUT and leave PATH untouched (one PATH only). When the rewrite also changes other "
    "files of the project, or OUT is a folder, every changed file goes into the folder OUT at its path below the "
    "folder the files share.",
)
@click.option("--diff", is_flag=True, help="Print a unified diff instead of writing.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if a file would change.")
@click.option(
    "--shard", "shard", multiple=True, metavar="CLASS",
    help="Make each instance of CLASS its own FSDP2 unit (repeatable); replaces repeated-block detection.",
)
@click.option(
    "--report", "report_format", type=click.Choice(["text", "json"]), default="text", show_default=True,
    help="Report format: one line per change on stderr, or JSON on stdout (stderr with --diff).",
)
@click.option(
    "--explain", is_flag=True,
    help="In the text report, say under each change why it was made and the pitfall it avoids, and under each "
    "attention item why it needs you.",
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
    "--accumulation-params", type=click.Choice(["hold", "reshard"]), default="hold", show_default=True,
    help="With gradient accumulation: keep the gathered parameters between the micro-batches of one optimizer "
    "step (set_reshard_after_backward; no all-gather before the next forward, unsharded parameters held "
    "meanwhile), or free them after every backward (reshard: less memory, more all-gathers).",
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
    accumulation_params: str,
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
    explain: bool,
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
            accumulation_params=accumulation_params,
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
        explain=explain,
        use_cache=not no_cache,
    )
    from fsdp2_retrofit.cli import progress

    # a run longer than progress.AFTER_S shows a transient display on a terminal's stderr
    run.progress = progress.DelayedProgress(len(paths), enabled=not quiet and progress.stderr_is_terminal())
    for path in paths:
        run.process(path)
    if emit_slurm is not None and run.exit_code != EXIT_ERROR:
        from fsdp2_retrofit.launch_commands import slurm_script

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
    explain: bool = False
    use_cache: bool = True

    def __post_init__(self) -> None:
        self.results: List[RewriteResult] = []
        self.exit_code = EXIT_OK
        self.counts = {"changed": 0, "unchanged": 0, "failed": 0}
        self._stderr = None
        self._stdout = None
        self.progress = None  # cli.progress.DelayedProgress, set by the command
        self.said: set = set()  # the report's notes printed so far: each once a run

    @property
    def text_report(self) -> bool:
        return not self.quiet and self.report_format == "text"

    @property
    def writes(self) -> bool:
        return not (self.diff or self.check)

    def process(self, path: str) -> None:
        if self.writes:
            for line in files.finish_interrupted(os.path.dirname(os.path.abspath(path))):
                click.echo(line, err=True)
        try:
            with self.progress.working(path) if self.progress is not None else nullcontext():
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
            self._error(first.path or path, first.line, f"{code}{first.what}: {first.why}", first.hint)
            self.counts["failed"] += 1
            self._bump(EXIT_ERROR)
            if self.text_report:
                self._render(result, {}, applied=False)
            return

        changed = result.changed_files
        try:
            targets = self._targets(result, changed)
        except InputError as exc:
            self.results.pop()
            return self._fail(path, exc)
        if self.diff:
            for unit in changed:
                text = files.decode(unit.original)
                diff = unified_diff(unit.path, text, files.decode(unit.code, like=unit.original),
                                    targets[unit.path] if self.out else None)
                render_diff(diff, self.stdout)
        if self.writes and (changed or self.out is not None):
            edited = {id(u) for u in changed}
            writes = [(targets[u.path], u.code) for u in result.files
                      if id(u) in edited or (u is result and self.out is not None)]
            try:
                for target, _ in writes:
                    files.check_writable(target)
                    if self.out is not None and targets[result.path] != self.out:  # into the folder OUT
                        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
                files.write_all(writes)
            except (InputError, OSError) as exc:
                self.results.pop()
                failed = exc if isinstance(exc, InputError) else InputError(f"cannot write: {exc.strerror}")
                return self._fail(target if len(writes) == 1 else (self.out or path), failed)
        if self.check and changed:
            self._bump(EXIT_WOULD_CHANGE)
            if not self.quiet and not self.text_report:  # the text report's heading says it
                for unit in changed:
                    click.echo(f"would rewrite {unit.path}", err=True)
        self.counts["changed"] += len(changed)
        self.counts["unchanged"] += 0 if changed else 1
        if self.text_report:
            self._render(result, targets, applied=self.writes)

    def _targets(self, result: RewriteResult, changed: List[RewriteResult]) -> Dict[str, str]:
        """Where each file of the result goes: in place, or with -o the script's OUT, or for a
        rewrite that changes several files (or an OUT that is a folder) each file at its path
        below the folder the files share, inside OUT."""
        if self.out is None:
            return {u.path: u.path for u in result.files}
        several = [u for u in changed if u is not result]
        folder = os.path.isdir(self.out) or self.out.endswith(("/", os.sep))
        if not several and not folder:
            return {result.path: self.out}
        if not folder and (os.path.exists(self.out) or self.out.endswith((".py", ".pyw"))):
            names = ", ".join(u.path for u in changed)
            raise InputError(f"-o {self.out}: this rewrite changes {len(changed)} files ({names}); give -o a folder")
        from fsdp2_retrofit.rewrite.workspace import project_relative

        _, below = project_relative([u.path for u in result.files])
        return {u.path: os.path.join(self.out, rel) for u, rel in zip(result.files, below)}

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

    def _render(self, result: RewriteResult, targets: Dict[str, str], applied: bool) -> None:
        unwritten = "" if applied else "--diff" if self.diff else "--check"
        render_text(result, self.stderr, target=targets.get(result.path), targets=targets, unwritten=unwritten,
                    explain=self.explain, said=self.said)

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
