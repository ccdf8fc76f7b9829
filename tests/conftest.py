import pytest

from tests import ranks


# sharded.launch kills a rank still running GRACE (15) s after another rank failed and
# reports it as killed. Tests that require every rank to end on its own with the cause
# (test_faults, test_catalogue's FATAL cases, test_runners) test that the failure
# reaches the other ranks, not how fast a loaded 2-core CI machine runs: they get 120 s.
PATIENT_GRACE = 120.0


@pytest.fixture(scope="session", autouse=True)
def patient_grace():
    import importlib

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(importlib.import_module("sharded.launch"), "GRACE", PATIENT_GRACE)
        yield


@pytest.fixture(scope="session")
def on_ranks():
    """``on_ranks(n, fn, *args)`` runs ``fn`` on ``n`` pooled gloo ranks."""
    return ranks.run


def pytest_sessionfinish(session, exitstatus):
    ranks._close_all()
