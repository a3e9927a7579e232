"""Fixtures the test files share, built once per test session: the small scenario's library in a DuckDB file, the
vLLM CPU node environment and the OpenAI clients environment (each built in the background while the other tests
run; the tests that need one run last)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from support.scenario_docs import build_small, copy_small

NODE_ENV_FIXTURES = {"vllm_node_env", "node_env"}
BUILD = pytest.StashKey[subprocess.Popen]()
CLIENTS_BUILD = pytest.StashKey[subprocess.Popen]()


def _needs_node_env(item: pytest.Item) -> bool:
    return bool(NODE_ENV_FIXTURES & set(getattr(item, "fixturenames", ())))


def _needs_clients_env(item: pytest.Item) -> bool:
    return "clients_env" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests first, so that with `-n 2` the long ones do not end the run on one worker while the other idles;
    tests that need the vLLM node environment or the clients environment last (they build meanwhile); otherwise in
    their collected order."""
    items.sort(key=lambda item: (_needs_node_env(item) or _needs_clients_env(item),
                                 item.get_closest_marker("slow") is None))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the node environment and the clients environment as soon as a selected test needs one."""
    from support import clients_env, node_env

    if session.config.option.collectonly:
        return
    for needs, start, key in ((_needs_node_env, node_env.start_background_build, BUILD),
                              (_needs_clients_env, clients_env.start_background_build, CLIENTS_BUILD)):
        if any(needs(item) for item in session.items):
            proc = start()
            if proc is not None:
                session.config.stash[key] = proc


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A build still running when the session ends (interrupted, or its tests deselected by -x) is stopped."""
    for key in (BUILD, CLIENTS_BUILD):
        proc = session.config.stash.get(key, None)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def small_library(tmp_path_factory) -> tuple[Path, Path]:
    """tests/support/scenario_docs.py's SMALL scenario file and a DuckDB file holding its template library, built
    once by `coral templates build`; read-only for tests (take `small_store` to write)."""
    return build_small(tmp_path_factory.mktemp("small-library"))


@pytest.fixture
def small_store(small_library, tmp_path) -> tuple[Path, Path]:
    """A copy of `small_library`'s scenario file and DuckDB file in this test's own folder, free to write."""
    return copy_small(small_library, tmp_path)


def _built(request, key: pytest.StashKey[subprocess.Popen], build, what: str) -> dict[str, str]:
    """The environment `build()` returns, once the background build under `key` (if any) has ended."""
    proc = request.config.stash.get(key, None)
    if proc is not None:
        _, err = proc.communicate()
        if proc.returncode:
            pytest.fail(f"building the {what} failed ({proc.returncode}):\n{err[-4000:]}")
    try:
        return build()
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def vllm_node_env(request) -> dict[str, str]:
    """The vLLM CPU node environment built by sky_tasks/setup_node.sh (cached per machine: about 3 min the first
    time on 2 cores, then reused); only slow tests take it."""
    from support.node_env import build_node_env

    return _built(request, BUILD, build_node_env, "node environment")


@pytest.fixture(scope="session")
def node_env(vllm_node_env) -> dict[str, str]:
    """The node environment, as the vLLM test modules name it."""
    return vllm_node_env


@pytest.fixture(scope="session")
def clients_env(request) -> dict[str, str]:
    """The OpenAI clients environment (guidellm, aiperf, LiteLLM; tests/support/clients_env.py), cached per machine:
    about 1.5 min the first time on 2 cores, then reused; only slow tests take it."""
    from support.clients_env import build_clients_env

    return _built(request, CLIENTS_BUILD, build_clients_env, "clients environment")


@pytest.fixture(scope="session")
def hf(tmp_path_factory):
    """Hugging Face transformers' `LlamaForCausalLM` on the tiny model's exported weights: the oracle the torch
    engine's answers are checked against."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from coral_dagster.runtime.hf_export import export_tiny
    from support.openai_stack import MODEL

    path = export_tiny(MODEL, tmp_path_factory.mktemp("hf"))
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
