import pytest


@pytest.fixture(autouse=True)
def _private_result_cache(tmp_path_factory, monkeypatch):
    """Each test gets its own empty result cache: no test answers from another's."""
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A run that failed (verify's VerifyError) shows the stderr it kept: a failure seen only on a
    loaded machine or in CI then says why (a port, a timeout, a traceback), not just "exit code 1"."""
    outcome = yield
    excinfo = call.excinfo
    detail = getattr(excinfo.value, "detail", "") if excinfo is not None else ""
    if detail and type(excinfo.value).__name__ == "VerifyError":
        outcome.get_result().sections.append(("VerifyError detail", detail))
