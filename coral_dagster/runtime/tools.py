"""Chat tools as vLLM's server serves them: `tools` and `tool_choice` read into a plan, `required` and named calls
guaranteed by a JSON-schema grammar (vLLM's own schemas), `auto` calls found by the Hermes parser (vLLM's
`--tool-call-parser hermes`: `<tool_call>{"name": …, "arguments": …}</tool_call>`), and the calls of earlier
assistant turns rendered back into the conversation in that same form."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from coral_dagster.runtime.structured import StructuredError

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output becomes tool calls: `mode` is "required" (a JSON list of calls), "named" (the
    arguments of `name`), or "auto" (Hermes blocks the model may write); `grammar` the structured output that
    guarantees the first two."""

    mode: str
    names: tuple[str, ...]
    name: str | None = None
    grammar: tuple[str, str] | None = None


def _bad(param: str, problem: str) -> StructuredError:
    return StructuredError(param, problem)


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise _bad("tools", "tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name or name in out:
            raise _bad("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}} with "
                                "a name no other tool has")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise _bad("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = parameters
    return out


def plan(body: dict[str, Any]) -> ToolPlan | None:
    """The tool plan of a chat body, or None (no tools, or `tool_choice: "none"`)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "tool_choice needs tools")
        return None
    functions = _functions(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    names = tuple(functions)
    if choice == "auto":
        return ToolPlan("auto", names)
    compact = {"whitespace_flexible": False}
    if choice == "required":
        # vLLM's schema for `required`: a list of {name, parameters} objects, one shape per tool.
        item = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                             "parameters": p},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for n, p in functions.items()]}
        limit = {} if body.get("parallel_tool_calls", True) else {"maxItems": 1}
        schema = {"type": "array", "minItems": 1, **limit, "items": item, "x-guidance": compact}
        return ToolPlan("required", names, grammar=("json_schema", json.dumps(schema)))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name not in functions:
        raise _bad("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                                  f"{{\"name\": one of {', '.join(names)}}}}}")
    schema = {**functions[name], "x-guidance": compact}
    return ToolPlan("named", names, name=name, grammar=("json_schema", json.dumps(schema)))


def call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape (arguments as a JSON string), with a fresh id as vLLM makes them."""
    return {"id": f"chatcmpl-tool-{secrets.token_hex(16)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def calls(tp: ToolPlan, text: str) -> tuple[list[dict[str, Any]], str]:
    """The calls in a choice's finished output and the content left beside them; none (and all the text as
    content) when the output holds no complete call, e.g. one cut by max_tokens."""
    try:
        if tp.mode == "named":
            return [call(tp.name or "", json.loads(text))], ""
        if tp.mode == "required":
            return [call(c["name"], c["parameters"]) for c in json.loads(text)], ""
    except (ValueError, TypeError, KeyError):
        return [], text
    found = []
    for block in _HERMES.findall(text):
        try:
            data = json.loads(block)
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("name") in tp.names:
            found.append(call(data["name"], data.get("arguments", {})))
    if not found:
        return [], text
    return found, text[:text.find("<tool_call>")].strip()


def rendered(message: dict[str, Any], content: str) -> str:
    """An assistant turn's text with its `tool_calls` written back as Hermes blocks (what the model would have
    said), so a conversation continues after `role: tool` answers."""
    blocks = []
    for c in message.get("tool_calls") or []:
        function = c.get("function", {}) if isinstance(c, dict) else {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            arguments = function.get("arguments")
        blocks.append("<tool_call>" + json.dumps({"name": function.get("name"), "arguments": arguments})
                      + "</tool_call>")
    return "\n".join([content, *blocks]) if content else "\n".join(blocks)
