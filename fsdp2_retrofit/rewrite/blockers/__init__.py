"""The refusal catalogue as blocker classes: one family a file, like `check`'s rules.

A blocker is a construct `rewrite` refuses to convert, with a stable code (`FSR` + three
digits, the first digit the stage that refuses, in pipeline order: 1 migrate_spawn,
2 migrate_ddp, 3 migrate_fsdp1, 4 launch, 5 meta_init (--meta-init), 6 shard and the
stages that run beside it, 7 checkpoint and library_saves, 8 resume, 9 data, zero_grad
(FSR95x), loss_scale (FSR96x), 97x the program). A refusal leaves every file unchanged
(exit 2) and names the construct at its own file and line. Codes are never reused.

Each blocker is a `Blocker` subclass whose docstring is its catalogue entry (what is
refused; `## Why`; `## What to do`), with `CODE`, `NAME` and `INVALID` / `VALID` cases:
an `Invalid` script is refused with this code at its `line`; a `Valid` one, the same
construct written the way the rewrite can follow, converts. The cases are both the
documentation (`fsdp2-retrofit rules FSR101`) and the tests (tests/test_blockers.py).
A family whose checks read only the stage's analysis also holds them (`find`), so the
stage keeps its edits and the refusals live here.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple, Type

STAGES = {
    "1": "migrate_spawn",
    "2": "migrate_ddp",
    "3": "migrate_fsdp1",
    "4": "launch",
    "5": "meta_init",
    "6": "shard",
    "7": "checkpoint",
    "8": "resume",
    "9": "data",
}


@dataclass(frozen=True)
class Invalid:
    """A script the rewrite refuses with the blocker's code, at `line` of `path` (the entry
    when empty). `files` are the project's other modules ({relative path: source});
    `options` are RetrofitOptions fields. `stage`: the refusal guards a stage run on its own
    (`python -m libcst.tool codemod shard.ShardModelCommand train.py`), and the case runs only it."""

    source: str
    line: int
    files: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, object] = field(default_factory=dict)
    path: str = ""
    stage: str = ""


@dataclass(frozen=True)
class Valid:
    """The construct written so the rewrite can follow it: the script converts."""

    source: str
    files: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class RefusalRule:
    """One kind of refusal: what is refused, why, and what to do (read from a blocker's docstring)."""

    code: str
    name: str
    summary: str  # what is refused, one line
    why: str
    fix: str
    stage_name: str = ""  # where it is not the code's stage (library_saves among the 7xx)
    examples: Tuple[Invalid, ...] = field(default=(), compare=False)  # the INVALID cases; `rules` shows one
    converting: Tuple[Valid, ...] = field(default=(), compare=False)  # the VALID cases

    @property
    def example(self) -> Optional[Invalid]:
        """The first INVALID case `rules` can show (_shown)."""
        return next((c for c in self.examples if _shown(c)), None)

    @property
    def converts(self) -> Optional[Valid]:
        """The first VALID case `rules` can show."""
        return next((c for c in self.converting if _shown(c)), None)

    @property
    def stage(self) -> str:
        return self.stage_name or STAGES[self.code[3]]

    def doc(self) -> str:
        """The documentation `fsdp2-retrofit rules CODE` shows, in ruff's shape: the catalogue entry,
        then its first INVALID case (where it fits a screen and is one file) and VALID case."""
        parts = [
            f"# {self.code} {self.name}", "",
            f"Refused by the {self.stage} stage: the file is left unchanged (exit 2).", "",
            "## What is refused", self.summary, "",
            "## Why", self.why, "",
            "## What to do", self.fix,
        ]
        example, converts = self.example, self.converts
        if example is not None:
            where = (f"{example.path or 'train.py'}:{example.line}" if example.path or example.files
                     else f"line {example.line}")
            parts += ["", f"## Example (refused at {where})", *_case_text(example)]
        if converts is not None:
            parts += ["", "## Converts", *_case_text(converts)]
        return "\n".join(parts) + "\n"


def _shown(case) -> bool:
    """A case `rules` prints: a script (with the project modules beside it) of at most 40 lines in all, not
    one that guards a stage run on its own."""
    return (not getattr(case, "stage", "")
            and case.source.count("\n") + sum(t.count("\n") for t in case.files.values()) <= 40)


def _case_text(case) -> List[str]:
    """The lines `rules` prints for a case: the options it is rewritten with as command-line flags, then
    the script (`train.py`, where the case has modules beside it) and each module, as code blocks."""
    lines = []
    if case.options:
        lines += [f"rewritten with {' '.join(_flag(k, v) for k, v in case.options.items())}", ""]
    files = {"train.py": case.source, **case.files} if case.files else {"": case.source}
    for name, text in files.items():
        if not text.strip():
            lines.append(f"{name}: (empty)")
            continue
        lines += ([f"{name}:"] if name else []) + ["```python", text.rstrip("\n"), "```"]
    return lines


def _flag(option: str, value) -> str:
    """`--keep-global-batch`, `--hsdp 2`: the command-line form of a RetrofitOptions field."""
    flag = "--" + option.replace("_", "-")
    if value is True:
        return flag
    values = value if isinstance(value, (list, tuple)) else [value]
    return " ".join(f"{flag} {v}" for v in values)


class Blocker:
    """A construct the rewrite refuses; subclasses are the catalogue."""

    CODE = ""
    NAME = ""
    STAGE = ""  # where it is not the code's stage (library_saves among the 7xx)
    INVALID: Tuple[Invalid, ...] = ()
    VALID: Tuple[Valid, ...] = ()

    @classmethod
    def rule(cls) -> RefusalRule:
        summary, why, fix = _sections(cls)
        return RefusalRule(cls.CODE, cls.NAME, summary, why, fix, cls.STAGE, tuple(cls.INVALID), tuple(cls.VALID))


def _sections(cls: Type[Blocker]) -> Tuple[str, str, str]:
    """(what is refused, why, what to do) of a blocker's docstring, each as one line."""
    parts: Dict[str, List[str]] = {"": [], "## Why": [], "## What to do": []}
    current = ""
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        if line.strip() in parts:
            current = line.strip()
        elif line.strip():
            parts[current].append(line.strip())
    summary, why, fix = (" ".join(parts[k]) for k in ("", "## Why", "## What to do"))
    if not (summary and why and fix):
        raise TypeError(f"{cls.__name__}: the docstring needs what is refused, ## Why and ## What to do")
    return summary, why, fix


def family_blockers(module) -> List[Type[Blocker]]:
    """The blockers a family module defines, in code order."""
    found = [v for v in vars(module).values()
             if isinstance(v, type) and issubclass(v, Blocker) and v is not Blocker and v.CODE]
    return sorted(found, key=lambda b: b.CODE)


def all_blockers() -> List[Type[Blocker]]:
    """Every blocker of every family, in code order."""
    return sorted((b for m in _family_modules() for b in family_blockers(m)), key=lambda b: b.CODE)


FAMILIES = (
    "spawn", "ddp", "fsdp1", "launch", "meta_init", "shard", "shared_names", "shared_downloads", "loop_sums",
    "rank_decisions", "checkpoint", "library_saves", "checkpoint_files", "resume", "data", "zero_grad",
    "loss_scale", "program",
)


def _family_modules() -> list:
    import importlib
    return [importlib.import_module(f"{__name__}.{name}") for name in FAMILIES]


@dataclass(frozen=True)
class Blocked:
    """A refusal a family's checks found, for its stage to raise: `at` is the node (or line) it
    names, or a tuple of them, the first with a line in the file being rewritten winning (a node
    of a class read from a sibling module has none there: the statement building the model does)."""

    code: str
    at: object
    what: str
    why: str
    fix: str = ""
