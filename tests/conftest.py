import sys
from pathlib import Path

import pytest

# Where the environment asks for no byte code (PYTHONDONTWRITEBYTECODE, set on the team's
# machines), every test process compiled every module it imports again and pytest rewrote
# every test module's asserts again: about 9 s of each process's 11 s collection. The test
# run keeps its byte code under .pytest_cache/pycache instead, out of the source tree.
if sys.dont_write_bytecode:
    sys.pycache_prefix = str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "pycache")
    sys.dont_write_bytecode = False


@pytest.fixture(autouse=True)
def _private_result_cache(tmp_path_factory, monkeypatch):
    """Each test gets its own empty result cache: no test answers from another's."""
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def new_process():
    """A function that makes this process forget what it learnt of the file system (where imports
    resolve, which project a file is in): each `check` run is a process of its own."""
    def forget():
        from fsdp2_retrofit.analysis import project_imports

        for memo in (project_imports._LOCATED, project_imports._ROOTS, project_imports._PACKAGE_BASES,
                     project_imports._IMPORTED, project_imports._PROJECTS):
            memo.clear()

    return forget


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A run that failed (verify's VerifyError) shows the stderr it kept: a failure seen only on a
    loaded machine or in CI then says why (a port, a timeout, a traceback), not just "exit code 1"."""
    outcome = yield
    excinfo = call.excinfo
    detail = getattr(excinfo.value, "detail", "") if excinfo is not None else ""
    if detail and type(excinfo.value).__name__ == "VerifyError":
        outcome.get_result().sections.append(("VerifyError detail", detail))
