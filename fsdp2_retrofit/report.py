"""Change / Refusal records, and how they are shown (one line per record, JSON, unified diff)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Iterable, List, Optional, Sequence, Set


@dataclass(frozen=True)
class Change:
    """One edit a stage made: where, what, why, and the pitfall it avoids."""

    line: int
    code: str  # the stage that made it, e.g. "shard"
    what: str
    why: str
    pitfall: str = ""
    path: str = ""  # the file it is in (set for every record of a result)


@dataclass(frozen=True)
class Attention:
    """Something the rewrite could not fix but the user must look at.

    `differs` marks the items that say the output will not train exactly like the
    original (every rank on the same data, per-rank BatchNorm statistics on CPU, ...):
    what to check is named, the run may still be what the user wants."""

    line: int
    code: str
    what: str
    why: str
    differs: bool = False
    path: str = ""


@dataclass(frozen=True)
class Refusal:
    """A construct that cannot be converted safely: the whole file is left alone."""

    line: int
    what: str
    why: str
    hint: str = ""
    code: str = ""  # its kind in the refusal catalogue (`fsdp2-retrofit rules FSR101`)
    path: str = ""


class RefusedError(Exception):
    """Raised by a stage to refuse the whole file."""

    def __init__(self, refusal: Refusal):
        super().__init__(f"{refusal.line}: {refusal.what}")
        self.refusal = refusal


@dataclass
class RewriteResult:
    """What rewriting one source gave: the new bytes and the reasons."""

    path: str
    original: bytes
    code: bytes
    changes: List[Change]
    attention: List[Attention]
    refusals: List[Refusal]
    # the other files the analysis looked for (found or not): the result depends on them
    inputs: List[str] = field(default_factory=list)
    # the project's other files this rewrite edits (a DataLoader helper's module), one result each
    siblings: List["RewriteResult"] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Every record names its file."""
        for records in (self.changes, self.attention, self.refusals):
            records[:] = [r if r.path else replace(r, path=self.path) for r in records]

    @property
    def changed(self) -> bool:
        """This file changes (the script's result: the script itself; see `files`)."""
        return not self.refusals and self.code != self.original

    @property
    def files(self) -> List["RewriteResult"]:
        """The script's result, then each other file's: what a run writes, shows and counts."""
        return [self] + list(self.siblings)

    @property
    def changed_files(self) -> List["RewriteResult"]:
        return [] if self.refusals else [r for r in self.files if r.code != r.original]


def to_json(results: Sequence[RewriteResult]) -> str:
    """The machine-readable report of one or more rewrites."""
    return json.dumps(
        [
            {
                "path": r.path,
                "changed": r.changed,
                "changes": [asdict(c) for c in r.changes],
                "attention": [asdict(a) for a in r.attention],
                "refusals": [asdict(x) for x in r.refusals],
            }
            for result in results
            for r in result.files
        ],
        indent=2,
    )


def unified_diff(path: str, before: str, after: str, out_path: Optional[str] = None) -> str:
    """A plain unified diff of one file, git-style headers."""
    import difflib  # only for --diff: kept off check's and rewrite's start-up

    lines = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile=_diff_name("a", path),
        tofile=_diff_name("b", out_path or path),
    )
    return "".join(_ensure_newline(lines))


def _diff_name(side: str, path: str) -> str:
    """git's `a/x.py` for relative paths; absolute paths as they are."""
    return path if path.startswith("/") else f"{side}/{path}"


def _ensure_newline(lines: Iterable[str]) -> Iterable[str]:
    for line in lines:
        yield line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"


class InputError(Exception):
    """The input cannot be read or parsed: reported as `path:line: message`, exit 2 (`check`
    adds the column of a syntax error, `path:line:col:`, as ruff does)."""

    def __init__(self, message: str, line: int = 0, col: int = 0):
        super().__init__(message)
        self.message = message
        self.line = line
        self.col = col


# Rendering for the terminal. rich is imported inside the functions: `--help`,
# `--version`, `--quiet` and `--report json` never pay for it.



def launch_command(target: str) -> str:
    """The command that runs a rewritten script on every GPU of one machine."""
    from fsdp2_retrofit.launch_commands import single_node

    return single_node(target)


def render_text(result: RewriteResult, console, *, target: Optional[str] = None,
                targets: Optional[Dict[str, str]] = None, unwritten: str = "", explain: bool = False,
                said: Optional[Set[str]] = None) -> None:
    """The human report of one rewrite, on `console` (a rich Console).

    One line per record, `path:line stage: what`, as ruff and black print theirs: never
    wrapped into cells nor cut, so code in it stays whole and `grep` finds it. `explain`
    adds each change's why and pitfall, and each attention item's why, indented below it.
    `target` is where the result goes (default: in place), `targets` where each other file
    of the project it edits goes (default: in place); `unwritten` is the flag (`--diff`,
    `--check`) that kept them from being written, empty when they were written; `said` holds
    the notes a run printed already (each is printed once a run, then added). A refused
    file's first refusal is the error line the CLI prints, so only the further ones are
    listed here.
    """
    from rich.text import Text

    target = target or result.path
    if result.refusals:
        if len(result.refusals) > 1:
            console.print(Text(f"{result.path}: further refusals (file left unchanged)", style="bold red"),
                          soft_wrap=True)
            for r in result.refusals[1:]:
                code = f"{r.code} " if r.code else ""
                _line(console, r.path, r.line, Text(f"{code}{r.what}: {r.why}"))
                if r.hint:
                    console.print(Text(f"  hint: {r.hint}", style="italic"), soft_wrap=True)
        return

    targets = targets or {}
    applied = not unwritten
    shown = [(result, target)] + [(s, targets.get(s.path, s.path)) for s in result.siblings if s.code != s.original]
    for unit, dest in shown:
        _render_file(unit, console, dest, applied, explain)
    attention = [a for unit, _ in shown for a in unit.attention]
    if attention:
        console.print(Text(f"needs attention ({len(attention)}):", style="bold yellow"), soft_wrap=True)
        for a in attention:
            what = Text("training differs: ", style="bold red") + Text(a.what) if a.differs else Text(a.what)
            _line(console, a.path, a.line, what, a.code)
            if explain:
                _explained(console, "why", a.why)
    # a thin entry into a package: the entry stays, the modules it reaches change; it is still what is launched
    changed = bool(result.changed_files)
    if changed:
        said = set() if said is None else said
        for note in [n for n in run_time_warnings([unit for unit, _ in shown]) if n not in said]:
            said.add(note)
            console.print(Text(f"note: {note}", style="dim"), soft_wrap=True)
    if not explain and (attention or any(unit.changes for unit, _ in shown)):
        console.print(Text("add --explain for why each change was made and what each attention item asks of you",
                           style="dim"), soft_wrap=True)

    if changed and unwritten:
        # the file on disk is still the single-GPU script: launching it now would not be the rewrite
        what = target if result.changed else f"the modules {target} reaches"
        console.print(Text.assemble(
            f"nothing written ({unwritten}): to write {what}, run the same command without {unwritten}; "
            "then launch with: ", (launch_command(target), "bold")), soft_wrap=True)
    elif changed:
        from fsdp2_retrofit.launch_commands import multi_node

        console.print(Text.assemble("launch with: ", (launch_command(target), "bold")), soft_wrap=True)
        console.print(Text.assemble("  on several nodes, on each: ", multi_node(target)), soft_wrap=True)


# What a rewritten script's run prints on every rank that is no fault, and the text in the
# output that makes it print it: said once, under the report, so nobody chases it.
_RUN_TIME_WARNINGS = (
    (("fully_shard(",),
     "each rank may warn 'FSDP2-wrapped module (...) returned a view tensor' where a forward returns a view "
     "(`x.view(...)`, a slice): harmless unless the caller changes that output in place (`out += y`)"),
    (("dcp.save(", "dcp.async_save("),
     "each rank warns 'Detected an existing checkpoint in ..., overwriting' when a DCP save writes a directory "
     "an earlier save or run wrote: expected for a checkpoint saved again at the same path"),
)


def run_time_warnings(units: Sequence[RewriteResult]) -> List[str]:
    """The notes on the warnings the rewritten files will print when they run."""
    text = b"\n".join(u.code for u in units)
    return [note for needles, note in _RUN_TIME_WARNINGS if any(n.encode() in text for n in needles)]


def _line(console, path: str, line: int, what, code: str = "") -> None:
    """One record: `path:line stage: what`, in one line however long (the terminal wraps it)."""
    from rich.text import Text

    where = Text(f"{path}:{line}" if line else path, style="cyan")
    console.print(Text.assemble(where, (f" {code}" if code else "", "magenta"), ": ", what), soft_wrap=True)


def _explained(console, label: str, text: str) -> None:
    from rich.text import Text

    if text:
        console.print(Text(f"    {label}: {text}", style="italic" if label == "pitfall" else ""), soft_wrap=True)


def _render_file(result: RewriteResult, console, target: str, applied: bool, explain: bool) -> None:
    """The heading and change lines of one file of a rewrite."""
    from rich.text import Text

    dest = "" if target == result.path else f" -> {target}"
    if result.changed:
        verb = "rewrote" if applied else "would rewrite"
        count = _count(len(result.changes), "change")
        console.print(Text(f"{verb} {result.path}{dest} ({count})", style="bold green"), soft_wrap=True)
    else:
        console.print(Text(f"{result.path}: nothing to change{dest}", style="bold"), soft_wrap=True)
    for c in result.changes:
        _line(console, c.path, c.line, Text(c.what), c.code)
        if explain:
            _explained(console, "why", c.why)
            _explained(console, "pitfall", c.pitfall)


def render_diff(diff: str, console) -> None:
    """Print a unified diff: coloured on a terminal, as plain text when piped."""
    if not diff:
        return
    if console.is_terminal:
        from rich.syntax import Syntax

        console.print(Syntax(diff, "diff", theme="ansi_dark", background_color="default", word_wrap=True))
    else:
        console.file.write(diff)
        console.file.flush()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
