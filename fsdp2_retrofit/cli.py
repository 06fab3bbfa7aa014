"""The `fsdp2-retrofit` command line. Thin: parse arguments, call the pipeline, render.

Nothing here imports torch, and libcst/rich load only when a command needs them,
so `--help` and `--version` start at once.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import click

from . import __version__, files
from .options import RetrofitOptions
from .report import InputError, RewriteResult, render_diff, render_text, to_json, unified_diff

EXIT_OK = 0
EXIT_WOULD_CHANGE = 1
EXIT_ERROR = 2

_TRACEBACK_ENV = "FSDP2_RETROFIT_TRACEBACK"


def rewrite_source(source: bytes, path: str, options: RetrofitOptions) -> RewriteResult:
    """The pipeline, imported on first use (it pulls in libcst and every stage)."""
    from .pipeline import rewrite_source as run

    return run(source, path, options)


def cached_rewrite(source: bytes, path: str, options: RetrofitOptions, use_cache: bool) -> RewriteResult:
    """A result from the cache when the script and its folder are unchanged, else the pipeline."""
    from . import cache

    result = cache.lookup(path, source, options) if use_cache else None
    if result is None:
        result = rewrite_source(source, path, options)
        if use_cache:
            cache.store(result, options)
    return result


@click.group(no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="fsdp2-retrofit")
def main() -> None:
    """Rewrite single-GPU PyTorch training scripts into torchrun-ready FSDP2.

    \b
    Start with:
      fsdp2-retrofit rewrite train.py --diff
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
    "--export", "export", type=click.Choice(["dcp", "full"]), default="dcp", show_default=True,
    help="Model-only saves: a DCP checkpoint directory, or one torch.save file of the full state dict (rank 0 writes).",
)
@click.option(
    "--async-checkpoint", is_flag=True,
    help="dcp.async_save (waiting on the previous save first); the process group gets a CPU backend too.",
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
    report_format: str,
    export: str,
    async_checkpoint: bool,
    quiet: bool,
    no_cache: bool,
) -> None:
    if out is not None and len(paths) != 1:
        raise click.UsageError("-o/--output takes exactly one PATH")
    run = _Run(
        options=RetrofitOptions(shard=tuple(shard), export=export, async_checkpoint=async_checkpoint),
        out=out,
        diff=diff,
        check=check,
        quiet=quiet,
        report_format=report_format,
        use_cache=not no_cache,
    )
    for path in paths:
        run.process(path)
    if not quiet and report_format == "json":
        click.echo(to_json(run.results), err=diff)
    if run.text_report and len(paths) > 1:
        run.summary()
    ctx.exit(run.exit_code)


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
            self._error(path, first.line, f"{first.what}: {first.why}", first.hint)
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


def _one_line(message: str) -> str:
    """An error is one line: the first non-blank line of a longer message."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0] if lines else message.strip()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
