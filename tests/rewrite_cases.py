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


def case_params() -> list:
    """CASES as parameters named by the case, each case its own xdist group, so that
    ``--dist loadgroup`` runs every test of one case on the worker that rewrote it."""
    return [pytest.param(case, id=case.name, marks=pytest.mark.xdist_group(case.name)) for case in CASES]


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
