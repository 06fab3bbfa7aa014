"""How `check` findings are shown: text, JSON, GitHub annotations, SARIF 2.1.0, statistics."""
from __future__ import annotations

import json
from collections import Counter
from typing import Iterable, List, Sequence

from fsdp2_retrofit import __version__

DOCS_URL = "https://github.com/fsdp2-retrofit/fsdp2-retrofit#rules"


def marker(finding, unsafe_fixes: bool) -> str:
    """`[*] ` when --fix (with --unsafe-fixes where needed) would fix it."""
    safe = finding.fix_safe
    return "[*] " if safe or (safe is False and unsafe_fixes) else ""


def text_lines(findings: Iterable, unsafe_fixes: bool) -> List[str]:
    return [f"{f.path}:{f.line}:{f.col}: {f.code} {marker(f, unsafe_fixes)}{f.message}" for f in findings]


def summary(findings: Sequence, fixed: int, unsafe_fixes: bool, fixing: bool) -> List[str]:
    """ruff's closing lines: what was found, fixed, and could be fixed."""
    remaining = len(findings)
    if remaining == 0 and fixed == 0:
        return ["All checks passed!"]
    noun = "error" if remaining + fixed == 1 else "errors"
    out = [f"Found {remaining + fixed} {noun} ({fixed} fixed, {remaining} remaining)." if fixed
           else f"Found {remaining} {noun}."]
    if not fixing:
        fixable = sum(1 for f in findings if f.fix_safe or (f.fix_safe is False and unsafe_fixes))
        hidden = sum(1 for f in findings if f.fix_safe is False and not unsafe_fixes)
        if fixable:
            out.append(f"[*] {fixable} fixable with the `--fix` option.")
        if hidden:
            out.append(f"({hidden} hidden fix{'es' if hidden != 1 else ''} can be enabled with the `--unsafe-fixes` option.)")
    return out


def on_original_lines(findings: Sequence, original: str, fixed: str, initial: Sequence = ()) -> list:
    """Findings located in `fixed` moved to the lines of `original` (the file on
    disk, for --diff): the finding of `original` (`initial`) with the same code at
    the line it maps to, when there is one (its message names lines on disk too);
    else the finding moved: a line the fixes did not touch keeps its column, one
    inside a changed block goes to that block's first line in the original."""
    import difflib

    from dataclasses import replace

    mapping = {}
    last = len(original.splitlines()) or 1
    matcher = difflib.SequenceMatcher(None, original.splitlines(), fixed.splitlines(), autojunk=False)
    for tag, i1, _, j1, j2 in matcher.get_opcodes():
        for j in range(j1, j2):
            mapping[j + 1] = (i1 + (j - j1) + 1, True) if tag == "equal" else (min(i1 + 1, last), False)

    def move(row: int):
        return mapping.get(row, (min(row, last), False))

    out = []
    for f in findings:
        line, same = move(f.line)
        twin = next((g for g in initial if g.code == f.code and g.line == line and (not same or g.col == f.col)), None)
        if twin is not None:
            out.append(twin)
            continue
        end_line, end_same = move(f.end_line)
        record = f.fix_record
        if record is not None:
            record = {**record, "edits": [
                {**e, "location": {**e["location"], "row": move(e["location"]["row"])[0]},
                 "end_location": {**e["end_location"], "row": move(e["end_location"]["row"])[0]}}
                for e in record["edits"]
            ]}
        out.append(replace(
            f, line=line, col=f.col if same else 1, end_line=max(end_line, line),
            end_col=f.end_col if end_same else 1, fix_record=record,
        ))
    return out


def statistics(findings: Sequence, bare_noqa: int, unsafe_fixes: bool) -> List[str]:
    counts = Counter(f.code for f in findings)
    names = {f.code: f.name for f in findings}
    fixable = {f.code for f in findings if marker(f, unsafe_fixes)}
    lines = [
        f"{n:>5}\t{code}\t{'[*]' if code in fixable else '[ ]'} {names[code]}" for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    if bare_noqa:
        lines.append(f"{bare_noqa:>5}\tnoqa\t[ ] bare `# noqa` (suppresses every code on its line; name the codes)")
    return lines


def to_json(findings: Iterable) -> str:
    return json.dumps(
        [
            {
                "code": f.code,
                "name": f.name,
                "message": f.message,
                "filename": f.path,
                "location": {"row": f.line, "column": f.col},
                "end_location": {"row": f.end_line, "column": f.end_col},
                "fix": f.fix_record,
                "url": f"{DOCS_URL}-{f.code.lower()}",
            }
            for f in findings
        ],
        indent=2,
    )


def github(findings: Iterable) -> List[str]:
    """GitHub Actions workflow commands: one annotation per finding."""
    out = []
    for f in findings:
        props = (
            f"title=fsdp2-retrofit ({f.code}),file={_escape_property(f.path)},line={f.line},col={f.col},"
            f"endLine={f.end_line},endColumn={f.end_col}"
        )
        out.append(f"::error {props}::{_escape_data(f'{f.path}:{f.line}:{f.col}: {f.code} {f.message}')}")
    return out


def _escape_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(s: str) -> str:
    return _escape_data(s).replace(":", "%3A").replace(",", "%2C")


def sarif(findings: Sequence, rules: Sequence) -> str:
    """A SARIF 2.1.0 log with one run: the rules that were selected and the results."""
    import os
    from pathlib import Path

    rule_ids = [r.CODE for r in rules]
    driver = {
        "name": "fsdp2-retrofit",
        "informationUri": DOCS_URL,
        "version": __version__,
        "rules": [
            {
                "id": r.CODE,
                "name": r.NAME,
                "shortDescription": {"text": r.summary()},
                "fullDescription": {"text": (r.__doc__ or "").strip()},
                "help": {"text": (r.__doc__ or "").strip(), "markdown": (r.__doc__ or "").strip()},
                "helpUri": f"{DOCS_URL}-{r.CODE.lower()}",
                "defaultConfiguration": {"level": "error"},
            }
            for r in rules
        ],
    }
    results = []
    for f in findings:
        uri = Path(os.path.abspath(f.path)).as_uri() if f.path != "-" else "stdin"
        result = {
            "ruleId": f.code,
            "ruleIndex": rule_ids.index(f.code) if f.code in rule_ids else 0,
            "level": "error",
            "message": {"text": f.message},
            "locations": [
                {
                    "physicalLocation": {
                        "artifactLocation": {"uri": uri},
                        "region": {
                            "startLine": f.line,
                            "startColumn": f.col,
                            "endLine": f.end_line,
                            "endColumn": f.end_col,
                        },
                    }
                }
            ],
        }
        results.append(result)
    log = {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{"tool": {"driver": driver}, "results": results}],
    }
    return json.dumps(log, indent=2)
