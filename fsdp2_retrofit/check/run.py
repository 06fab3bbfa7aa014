"""One `fsdp2-retrofit check` invocation: select rules, find files, lint, fix, render, exit code."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import click

from fsdp2_retrofit import files
from fsdp2_retrofit.check import formats
from .checker import CheckJob, FileResult, lint_one, run
from fsdp2_retrofit.report import InputError, unified_diff

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
PROGRESS_MIN_FILES = 50


@dataclass
class CheckSettings:
    select: List[str] = field(default_factory=list)
    extend_select: List[str] = field(default_factory=list)
    ignore: List[str] = field(default_factory=list)
    fix: bool = False  # compute fixes
    write: bool = False  # write them to the files
    diff: bool = False
    unsafe_fixes: bool = False
    output_format: str = "text"
    exit_zero: bool = False
    statistics: bool = False
    exclude: Tuple[str, ...] = ()
    force_exclude: bool = False
    stdin_filename: Optional[str] = None
    quiet: bool = False
    cache: bool = True  # --no-cache: no result (results_cache) nor importer summary (importers) read or written


class CheckRun:
    def __init__(self, settings: CheckSettings):
        self.s = settings
        self.errors = 0

    def main(self, paths: Sequence[str], show_files: bool = False) -> int:
        from .rules import selected, unknown_codes

        bad = unknown_codes(self.s.select + self.s.extend_select + self.s.ignore)
        if bad:
            click.echo(f"error: unknown rule code or prefix {bad[0]!r} (see `fsdp2-retrofit rules`)", err=True)
            return EXIT_ERROR
        rules = tuple(selected(self.s.select, self.s.ignore, self.s.extend_select))
        self.rules = rules
        job = CheckJob(rules, fix=self.s.fix, unsafe_fixes=self.s.unsafe_fixes, exclude=self.s.exclude,
                       cache=self.s.cache)

        if list(paths) == ["-"]:
            return self._stdin(job)
        targets: List[str] = []
        for path, error in files.discover(paths, self.s.exclude, self.s.force_exclude):
            if error:
                self._error(path, InputError(error))
            else:
                targets.append(path)
        if not targets and not self.errors:
            return self._nothing_checked(paths)
        if show_files:
            for t in targets:
                click.echo(t)
            return EXIT_ERROR if self.errors else EXIT_OK
        results = self._run(job, targets)
        return self._finish(results)

    def _nothing_checked(self, paths: Sequence[str]) -> int:
        """No file to check: say so. Directories with no Python file left (all
        git-ignored, excluded, or none at all) are an error, like a typo in a path;
        files named on the command line and dropped by --force-exclude are what a
        pre-commit hook sends for an excluded file: a warning, exit 0."""
        import os

        if paths and all(os.path.isfile(p) for p in paths):
            click.echo("warning: every file given is excluded (--force-exclude): nothing checked", err=True)
            return EXIT_OK
        where = ", ".join(paths)
        click.echo(
            f"error: no Python file to check under {where} (none there, or all git-ignored or excluded)", err=True
        )
        return EXIT_ERROR

    def _run(self, job: CheckJob, targets: List[str]) -> List[FileResult]:
        if len(targets) >= PROGRESS_MIN_FILES and sys.stderr.isatty():
            from rich.progress import Progress

            with Progress(transient=True, console=_stderr_console()) as progress:
                task = progress.add_task("checking", total=len(targets))
                return run(job, targets, on_result=lambda _: progress.advance(task))
        return run(job, targets)

    def _stdin(self, job: CheckJob) -> int:
        name = self.s.stdin_filename or "-"
        data = sys.stdin.buffer.read()
        result = lint_one(job, name, data)
        if self.s.write and result.error is None:
            # ruff's convention: the fixed source goes to stdout, findings to stderr
            sys.stdout.buffer.write(result.fixed if result.fixed is not None else data)
            sys.stdout.flush()
            return self._finish([result], out_err=True)
        return self._finish([result])

    def _finish(self, results: List[FileResult], out_err: bool = False) -> int:
        findings = []
        fixed = bare = 0
        would_change = False
        for r in results:
            if r.error is not None:
                self._error(r.path, r.error)
                continue
            findings.extend(r.findings)
            bare += r.bare_noqa
            if r.fixed is None:
                continue
            if self.s.diff:
                would_change = True
                original, fixed_text = r.original.decode("utf-8", "replace"), r.fixed.decode("utf-8", "replace")
                # what remains was found in the fixed text: report it at the lines of the file on disk
                findings[len(findings) - len(r.findings):] = formats.on_original_lines(r.findings, original, fixed_text, r.initial)
                # a machine-read format keeps stdout to itself: the diff goes to stderr
                click.echo(unified_diff(r.path, original, fixed_text), nl=False, err=out_err or self.s.output_format != "text")
            elif self.s.write and r.path != (self.s.stdin_filename or "-"):
                try:
                    _check_writable(r.path)
                    files.atomic_write(r.path, r.fixed)
                except InputError as exc:
                    self._error(r.path, exc)
                    continue
            if not self.s.diff:
                fixed += r.applied
        self._render(findings, fixed, bare, err=out_err)
        if self.errors:
            return EXIT_ERROR
        if self.s.exit_zero:
            return EXIT_OK
        return EXIT_FINDINGS if findings or would_change else EXIT_OK

    def _render(self, findings, fixed: int, bare: int, err: bool) -> None:
        fmt = self.s.output_format
        echo = lambda text: click.echo(text, err=err)  # noqa: E731
        if self.s.statistics:
            for line in formats.statistics(findings, bare, self.s.unsafe_fixes):
                echo(line)
            return
        if fmt == "json":
            echo(formats.to_json(findings))
        elif fmt == "sarif":
            echo(formats.sarif(findings, self.rules))
        elif fmt == "github":
            for line in formats.github(findings):
                echo(line)
        else:
            for line in formats.text_lines(findings, self.s.unsafe_fixes):
                echo(line)
            if not self.s.quiet and not self.s.diff and (findings or fixed or not self.errors):
                for line in formats.summary(findings, fixed, self.s.unsafe_fixes, fixing=self.s.write):
                    echo(line)

    def _error(self, path: str, exc: InputError) -> None:
        self.errors += 1
        where = f"{path}:{exc.line}:{exc.col}" if exc.line and exc.col else f"{path}:{exc.line}" if exc.line else path
        click.echo(f"{where}: error: {exc.message}", err=True)


def _check_writable(path: str) -> None:
    """files.check_writable, with the remedy `check` offers (it has no -o)."""
    try:
        files.check_writable(path)
    except InputError as exc:
        if exc.message.startswith("read-only file"):
            raise InputError("read-only file: not fixing it (make it writable; --diff shows the fixes)") from None
        raise


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)
