"""The suite's parallel run keeps tests that share a costly fixture on one worker.

Under ``--dist loadgroup`` xdist groups a test by the ``@group`` it appends to the test's id on
each worker, from the ``xdist_group`` marks present when its own collection hook runs: a mark
added after it groups nothing, and each worker then starts its own vLLM and llama.cpp servers.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def shared_by_the_module() -> object:
    return object()


def test_a_test_sharing_a_module_fixture_is_grouped_with_its_module(
    request: pytest.FixtureRequest, shared_by_the_module: object
) -> None:
    mark = request.node.get_closest_marker("xdist_group")
    assert mark is not None and mark.args == (__name__,)
    if os.environ.get("PYTEST_XDIST_WORKER") and request.config.getvalue("loadgroup"):
        assert request.node.nodeid.endswith(f"@{__name__}"), request.node.nodeid


def test_a_test_of_no_shared_fixture_is_free_to_run_anywhere(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("xdist_group") is None
    assert "@" not in request.node.nodeid
