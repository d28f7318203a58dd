"""Test-wide settings: deterministic hypothesis runs under CI; subprocess tests run last."""

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# The torchvision stub goes on sys.path only in the zennit subprocess: collecting it here (its
# doctests) would put it on this process's path, and transformers breaks when it can import it.
collect_ignore = ["zennit_stub"]

# Tests that start other Python processes (the examples, torchrun jobs) take the longest and
# fail for reasons of their own: they run after everything else, so a failure elsewhere shows early.
_SUBPROCESS_TESTS = ("tests/test_examples.py", "tests/data/test_data_processes.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def starts_processes(item: pytest.Item) -> bool:
        return item.nodeid.startswith(_SUBPROCESS_TESTS)

    items.sort(key=starts_processes)  # stable: the order within each group is kept


@pytest.fixture
def pools_of_any_size() -> Iterator[None]:
    """Max pooling on a channels-last copy (NOTE [shadow max pooling]) at every input size, not only where it is the
    faster: so that tests of its numbers run on small inputs."""
    with pytest.MonkeyPatch.context() as patch:  # (its own: a test's ``monkeypatch.undo()`` leaves it in place)
        patch.setattr("tdhook_fn._pool_layout._FEWEST_ELEMENTS", 0)
        yield
