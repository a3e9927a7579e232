"""Fixtures the test files share, built once per test session: the small scenario's library in a DuckDB file and
the vLLM CPU node environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.scenario_docs import build_small, copy_small


@pytest.fixture(scope="session")
def small_library(tmp_path_factory) -> tuple[Path, Path]:
    """tests/support/scenario_docs.py's SMALL scenario file and a DuckDB file holding its template library, built
    once by `coral templates build`; read-only for tests (take `small_store` to write)."""
    return build_small(tmp_path_factory.mktemp("small-library"))


@pytest.fixture
def small_store(small_library, tmp_path) -> tuple[Path, Path]:
    """A copy of `small_library`'s scenario file and DuckDB file in this test's own folder, free to write."""
    return copy_small(small_library, tmp_path)


@pytest.fixture(scope="session")
def vllm_node_env() -> dict[str, str]:
    """The vLLM CPU node environment built by sky_tasks/setup_node.sh (cached per machine: ~14 min the first time
    on 2 cores, then reused); only slow tests take it."""
    from support.node_env import build_node_env

    try:
        return build_node_env()
    except RuntimeError as exc:
        pytest.fail(str(exc))
