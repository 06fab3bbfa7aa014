import pytest


@pytest.fixture(autouse=True)
def _private_result_cache(tmp_path_factory, monkeypatch):
    """Each test gets its own empty result cache: no test answers from another's."""
    monkeypatch.setenv("FSDP2_RETROFIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
