"""The README's two set-up commands exist, and CI runs exactly the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for block in re.findall(r"```(?:sh|bash)\n(.*?)```", section, re.S)
            for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_readme_has_exactly_two_setup_commands():
    cmds = _setup_commands()
    assert len(cmds) == 2, cmds
    main, tests = cmds
    assert "coral run" in main and "pytest" in tests
    for cmd in cmds:
        assert cmd.startswith("python3 -m venv .venv")


def test_ci_runs_the_readme_test_command():
    """CI's last step is the README's test command; before it CI may only install the browser the UI test uses and
    HAProxy, the endpoint the takeover test puts in front of the coordinator pair."""
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert ci[-1] == _setup_commands()[1]
    assert all("apt-get install" in line and "chromium" in line and "haproxy" in line for line in ci[:-1])
