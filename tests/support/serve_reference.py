"""The reference a served generation is checked against: `coral generate --greedy --json` in this process."""

from __future__ import annotations

import json

from click.testing import CliRunner

from coral_dagster.cli.serve import generate

PROMPTS = ["Hello, Coral!", "The quick brown fox", "zmq", "pipelines of mixed GPUs"]
MAX_TOKENS = 20


def reference(prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    """`coral generate --greedy --json`: the whole model in this one process."""
    result = CliRunner().invoke(generate, ["--model", "tiny-llama", "--prompt", prompt, "--greedy",
                                           "--max-tokens", str(max_tokens), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)
