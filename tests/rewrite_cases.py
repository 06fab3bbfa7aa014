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
from pathlib import Path

import pytest

from fsdp2_retrofit.options import RetrofitOptions
from fsdp2_retrofit.rewrite.pipeline import rewrite_source

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
    path = case / name
    return rewrite_source(path.read_bytes(), str(path), case_options(case))
