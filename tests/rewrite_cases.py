"""The rewrite fixtures, and each one's rewrite computed once per test session.

A full rewrite of a fixture takes seconds; the golden comparison, the report and
line checks and anything else that needs the same result ask ``rewrite_case``,
which runs the pipeline once per (case, file) and hands every later caller the
same ``RewriteResult``. Treat it as read-only: it is shared.

Each test still makes its own assertions on that result, so each can fail on
its own. Under pytest-xdist every worker keeps its own cache; the golden tests
group each case's tests on one worker (``xdist_group``) so it is rewritten once.
"""
from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.pipeline import rewrite_source

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rewrite"
CASES = sorted(p for p in FIXTURES.iterdir() if (p / "input.py").is_file())


def case_params(sample: int = 1) -> list:
    """CASES as parameters named by the case, each case its own xdist group, so that
    ``--dist loadgroup`` runs every test of one case on the worker that rewrote it. With
    `sample` N, only every N-th case stays in the fast loop: the others are marked
    `integration` (a property repeated over every fixture; the full run has them all)."""
    return [
        pytest.param(case, id=case.name, marks=[pytest.mark.xdist_group(case.name)]
                     + ([] if i % sample == 0 else [pytest.mark.integration]))
        for i, case in enumerate(CASES)
    ]


def sampled(items: list, sample: int) -> list:
    """`items` as parameters, every `sample`-th in the fast loop, the others marked `integration`."""
    return [pytest.param(item, marks=[] if i % sample == 0 else [pytest.mark.integration]) for i, item in enumerate(items)]


def case_config(case: Path) -> dict:
    if tomllib is None:
        pytest.skip("reading case.toml needs Python 3.11 (tomllib)")
    return tomllib.loads((case / "case.toml").read_text())


def case_options(case: Path) -> RetrofitOptions:
    raw = case_config(case).get("options", {})
    return RetrofitOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def rewrite_case(case: Path, name: str = "input.py"):
    """The rewrite of ``case/name`` with the case's options (cached for the session)."""
    return _rewrite(case.resolve(), name)


@functools.lru_cache(maxsize=None)
def _rewrite(case: Path, name: str):
    path = project_copy(case, name) / "input.py" if edits_siblings(case) else case / name
    return rewrite_source(path.read_bytes(), str(path), case_options(case))


def script_path(case: Path) -> Path:
    """Where a case's input.py is rewritten: in the case's folder, or for a case that edits
    modules beside it, in a copy of its project (the goldens beside it name its functions too)."""
    return project_copy(case, "input.py") / "input.py" if edits_siblings(case) else case / "input.py"


def edits_siblings(case: Path) -> bool:
    """A case whose rewrite also edits modules beside the script: their goldens are in
    `expected/`, at their paths below the case."""
    return (case / "expected").is_dir()


_KEPT_OUT = ("input.py", "expected.py", "reference.py")


def project_copy(case: Path, name: str, into: Path = None) -> Path:
    """The project of a case that edits siblings, alone in a folder: its modules, and `name`
    as input.py; for "expected.py" the modules are the goldens of `expected/` (what the
    rewrite's output runs with). Copied once per (case, name) unless `into` is given (the
    script and the modules the rewrite reads are all the folder holds, as in a user's project)."""
    if into is None:
        into = Path(tempfile.mkdtemp(prefix=f"{case.name}-")) / "project"
    for path in sorted(case.rglob("*.py")):
        rel = path.relative_to(case)
        if rel.parts[0] == "expected" or rel.as_posix() in _KEPT_OUT:
            continue
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, into / rel)
    if name == "expected.py":
        for path in sorted((case / "expected").rglob("*.py")):
            target = into / path.relative_to(case / "expected")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    shutil.copyfile(case / name, into / "input.py")
    return into


def sibling_goldens(case: Path) -> dict:
    """{path below the case: golden bytes} of the modules beside the script the rewrite edits."""
    if not edits_siblings(case):
        return {}
    return {p.relative_to(case / "expected").as_posix(): p.read_bytes() for p in sorted((case / "expected").rglob("*.py"))}
