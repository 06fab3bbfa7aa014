"""`fsdp2-retrofit check`: options and configuration; the run itself is check/run.py."""
from __future__ import annotations

from typing import List

import click

from fsdp2_retrofit.cli import EXIT_ERROR, _one_line


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


@click.command("check", help=CHECK_HELP, short_help="Lint for FSDP2 pitfalls (pre-commit).")
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
@click.option(
    "--no-cache", is_flag=True,
    help="Do not read or write cached results of the files checked, nor the summaries of the project's files "
    "outside the run (the cache `rewrite` uses, in check/; FSDP2_RETROFIT_NO_CACHE=1 also turns it off).",
)
@click.pass_context
def check_command(ctx: click.Context, paths, select, extend_select, ignore, fix, unsafe_fixes, diff, output_format,
                  exit_zero, statistics, exclude, force_exclude, stdin_filename, show_files, quiet, no_cache) -> None:
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
        cache=not no_cache,
    )
    if settings.output_format not in ("text", "json", "github", "sarif"):
        click.echo(f"error: unknown output-format {settings.output_format!r}", err=True)
        ctx.exit(EXIT_ERROR)
    ctx.exit(CheckRun(settings).main(list(paths) or ["."], show_files=show_files))
