"""Test-wide settings: deterministic hypothesis runs under CI; subprocess tests run last."""

import os

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
