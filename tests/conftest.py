import pytest

from tests import ranks


@pytest.fixture(scope="session")
def on_ranks():
    """``on_ranks(n, fn, *args)`` runs ``fn`` on ``n`` pooled gloo ranks."""
    return ranks.run


def pytest_sessionfinish(session, exitstatus):
    ranks._close_all()
