"""Chat tools as vLLM's server serves them: `tools` and `tool_choice` read into a plan, `required` and named calls
guaranteed by a JSON-schema grammar (vLLM's own schemas), `auto` calls found by the served model's tool-call parser
(vLLM's `--tool-call-parser`, chosen per model in the catalog), and the calls of earlier assistant turns written back
into the conversation in that parser's format.

Parsers, as vLLM's `vllm/tool_parsers` read them: `hermes` (`<tool_call>{"name": …, "arguments": …}</tool_call>`
blocks after any content), `llama3_json` (Llama 3.1's JSON calls, `{"name": …, "parameters": …}`, optionally after
`<|python_tag|>`, several separated by `;`; no content beside them) and `pythonic` (Llama 3.2's and Llama 4's Python
list of keyword calls, `[get_weather(city='Paris'), …]`, the whole output). Calls to a function the request did not
offer are dropped (vLLM passes them on).
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coral_dagster.errors import CoralError, UnknownNameError
from coral_dagster.runtime.structured import StructuredError

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
# The parser of a model whose catalog entry names none: the format Coral's byte-level chat template writes back.
DEFAULT_PARSER = "hermes"

Call = tuple[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output becomes tool calls: `mode` is "required" (a JSON list of calls), "named" (the
    arguments of `name`), or "auto" (calls the model may write, read by `parser`); `grammar` the structured output
    that guarantees the first two."""

    mode: str
    names: tuple[str, ...]
    name: str | None = None
    grammar: tuple[str, str] | None = None
    parser: str = DEFAULT_PARSER


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


def plan(body: dict[str, Any], parser: str = DEFAULT_PARSER) -> ToolPlan | None:
    """The tool plan of a chat body for a model served with `parser`, or None (no tools, or `tool_choice: "none"`)."""
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
        return ToolPlan("auto", names, parser=parser)
    compact = {"whitespace_flexible": False}
    if choice == "required":
        # vLLM's schema for `required`: a list of {name, parameters} objects, one shape per tool.
        item = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                             "parameters": p},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for n, p in functions.items()]}
        limit = {} if body.get("parallel_tool_calls", True) else {"maxItems": 1}
        schema = {"type": "array", "minItems": 1, **limit, "items": item, "x-guidance": compact}
        return ToolPlan("required", names, grammar=("json_schema", json.dumps(schema)), parser=parser)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name not in functions:
        raise _bad("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                                  f"{{\"name\": one of {', '.join(names)}}}}}")
    schema = {**functions[name], "x-guidance": compact}
    return ToolPlan("named", names, name=name, grammar=("json_schema", json.dumps(schema)), parser=parser)


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
    found, content = PARSERS[tp.parser].extract(text)
    offered = [call(name, arguments) for name, arguments in found if name in tp.names]
    return (offered, content) if offered else ([], text)


def _hermes(text: str) -> tuple[list[Call], str]:
    found = []
    for block in _HERMES.findall(text):
        try:
            data = json.loads(block)
        except (ValueError, RecursionError):
            continue
        if isinstance(data, dict) and isinstance(data.get("name"), str):
            found.append((data["name"], data.get("arguments", {})))
    return (found, text[:text.find("<tool_call>")].strip()) if found else ([], text)


def _llama3_json(text: str) -> tuple[list[Call], str]:
    """Every JSON object in the output is a call (`parameters` or `arguments`); one that is not leaves it all
    content, as vLLM's `Llama3JsonToolParser` does."""
    found: list[Call] = []
    decoder, end = json.JSONDecoder(), -1
    for match in re.finditer(r"\{", text):
        if match.start() <= end:
            continue
        try:
            data, end = decoder.raw_decode(text, match.start())
            found.append((data["name"], data["arguments"] if "arguments" in data else data["parameters"]))
        except (ValueError, KeyError, TypeError, RecursionError):
            return [], text
    return found, ""


# The JSON literals vLLM's pythonic parser also reads as Python names.
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """A keyword argument's value as vLLM's `get_parameter_value` reads it: constants, containers (tuples and sets
    as lists), signed numbers and JSON's true, false and null."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(v) for v in node.elts]
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"{ast.dump(node)} is not a JSON value")


def _pythonic(text: str) -> tuple[list[Call], str]:
    """The whole output a Python list of keyword-only calls (what vLLM's `TOOL_CALL_REGEX` admits, checked on the
    parsed tree rather than by that backtracking pattern)."""
    if not text.startswith("["):
        return [], text
    try:
        tree = ast.parse(text)
    except (SyntaxError, RecursionError, MemoryError):
        return [], text
    listed = getattr(tree.body[0], "value", None) if tree.body else None
    if not isinstance(listed, ast.List):
        return [], text
    found: list[Call] = []
    for e in listed.elts:
        if not (isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and not e.args
                and all(k.arg for k in e.keywords)):
            return [], text
        try:
            found.append((e.func.id, {str(k.arg): _literal(k.value) for k in e.keywords}))
        except (ValueError, RecursionError):
            return [], text
    return found, ""


def _hermes_text(found: list[Call]) -> str:
    return "\n".join("<tool_call>" + json.dumps({"name": n, "arguments": a}) + "</tool_call>" for n, a in found)


def _llama3_json_text(found: list[Call]) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in found)


def _pythonic_text(found: list[Call]) -> str:
    def one(name: str, arguments: Any) -> str:
        pairs = arguments.items() if isinstance(arguments, dict) else ()
        return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in pairs) + ")"
    return "[" + ", ".join(one(n, a) for n, a in found) + "]"


def _held(text: str, marker: str) -> int:
    """Where `marker` begins in `text`, or where an end of `text` that may yet become it begins (else its length)."""
    at = text.find(marker)
    if at >= 0:
        return at
    return next((len(text) - k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                 if marker.startswith(text[-k:])), len(text))


def _hermes_start(text: str) -> int:
    return _held(text, "<tool_call>")


def _llama3_json_start(text: str) -> int:
    # Any JSON object may be a call (as `_llama3_json` reads the whole output); Llama's `<|python_tag|>` opens them.
    brace = text.find("{")
    return min(_held(text, "<|python_tag|>"), brace if brace >= 0 else len(text))


def _pythonic_start(text: str) -> int:
    return 0 if text[:1] in ("", "[") else len(text)


@dataclass(frozen=True)
class ToolParser:
    """One tool-call format: `extract` finds the calls (name, arguments) in an output and the content beside them
    (none found: all of it); `text` writes calls back as the model would have said them; `start` says how much of an
    unfinished output is content for sure (no call can begin before it), what a stream sends on at once."""

    extract: Callable[[str], tuple[list[Call], str]]
    text: Callable[[list[Call]], str]
    start: Callable[[str], int]


PARSERS = {"hermes": ToolParser(_hermes, _hermes_text, _hermes_start),
           "llama3_json": ToolParser(_llama3_json, _llama3_json_text, _llama3_json_start),
           "pythonic": ToolParser(_pythonic, _pythonic_text, _pythonic_start)}


def parser_for(model: str) -> str:
    """The tool-call parser `model` is served with: its catalog entry's `tool_call_parser` (a tiny model's base
    entry's), else `DEFAULT_PARSER`."""
    from coral_dagster.catalog.models import get_model
    from coral_dagster.runtime.tiny import TINY_ALIASES, TINY_PREFIX

    key = model.lower()
    base = TINY_ALIASES.get(key) or key.removeprefix(TINY_PREFIX)
    try:
        parser = get_model(base).tool_call_parser or DEFAULT_PARSER
    except UnknownNameError:
        return DEFAULT_PARSER
    if parser not in PARSERS:
        raise CoralError(f"the catalog serves {model} with tool-call parser {parser!r}, which Coral does not have.",
                         f"set its tool_call_parser to one of {', '.join(PARSERS)} (data/catalog/models.yaml)")
    return parser


def rendered(message: dict[str, Any], content: str, parser: str = DEFAULT_PARSER) -> str:
    """An assistant turn's text with its `tool_calls` written back in `parser`'s format (what the model would have
    said), so a conversation continues after `role: tool` answers."""
    found: list[Call] = []
    for c in message.get("tool_calls") or []:
        function = c.get("function", {}) if isinstance(c, dict) else {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            arguments = function.get("arguments")
        found.append((str(function.get("name")), arguments))
    blocks = PARSERS[parser].text(found)
    return "\n".join([content, blocks]) if content else blocks
