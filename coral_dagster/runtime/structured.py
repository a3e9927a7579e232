"""Structured outputs: the grammar a request asks for (`response_format`, vLLM's `structured_outputs` and `guided_*`)
read and checked by the front door, and the llguidance matchers the torch engine's last stage masks each draw with.

The front door compiles the grammar once (llguidance's own check), so a schema it cannot serve is a 400 naming the
field there and never reaches an instance. JSON is generated compact (no free whitespace), as vLLM's guidance
backend does by default, so a small model cannot spin in indentation.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from coral_dagster.runtime.limits import RequestError
from coral_dagster.runtime.tokenizer import BOS, EOS, N_BYTES

# The grammar kinds a request may carry: (kind, text) with text a JSON schema, a regex or a JSON list of choices.
KINDS = ("json_schema", "regex", "choice")
# Any JSON object (OpenAI's JSON mode).
JSON_OBJECT = json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": False}})
FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")


class StructuredError(RequestError):
    """A malformed structured-output request; `param` names the field."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(problem, f"see structured outputs in docs/openai-api.md for {param}'s shape")
        self.param = param


def _fail(param: str, problem: str) -> StructuredError:
    return StructuredError(param, problem)


def _schema(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _fail(param, f"{param}: the JSON schema is not JSON") from None
    if not isinstance(value, dict):
        raise _fail(param, f"{param}: a JSON schema must be an object")
    return json.dumps({**value, "x-guidance": {"whitespace_flexible": False}})


def _choice(value: Any, param: str) -> tuple[str, str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise _fail(param, f"{param}: choices must be a non-empty list of non-empty strings")
    return "choice", json.dumps(value)


def _regex(value: Any, param: str) -> tuple[str, str]:
    if not isinstance(value, str) or not value:
        raise _fail(param, f"{param}: a regex must be a non-empty string")
    return "regex", value


def read(body: dict[str, Any]) -> tuple[str, str] | None:
    """The one grammar `body` asks for, or None; a StructuredError naming the field for a malformed, doubled or
    uncompilable one."""
    asked = [f for f in FIELDS if body.get(f) is not None]
    spec = _read(body)
    if spec is not None:
        check(spec, asked[0])
    return spec


def check(spec: tuple[str, str], param: str) -> None:
    """A StructuredError naming `param` when llguidance cannot compile `spec`."""
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(_grammar(*spec))
    if problem:
        raise _fail(param, f"{param}: the grammar engine cannot compile it: {problem.strip()[:500]}")


def _read(body: dict[str, Any]) -> tuple[str, str] | None:
    asked = [f for f in FIELDS if body.get(f) is not None
             and not (f == "response_format" and isinstance(body[f], dict) and body[f].get("type") == "text")]
    if len(asked) > 1:
        raise _fail(asked[1], f"ask for one structured output, not {' and '.join(asked)}")
    if not asked:
        return None
    name = asked[0]
    value = body[name]
    if name == "guided_json":
        return "json_schema", _schema(value, name)
    if name == "guided_regex":
        return _regex(value, name)
    if name == "guided_choice":
        return _choice(value, name)
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return "json_schema", JSON_OBJECT
        if kind == "json_schema" and isinstance(value.get("json_schema"), dict) \
                and value["json_schema"].get("schema") is not None:
            return "json_schema", _schema(value["json_schema"]["schema"], name)
        raise _fail(name, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                          "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
    if not isinstance(value, dict) or len([k for k in ("json", "regex", "choice", "json_object") if k in value]) != 1:
        raise _fail(name, "structured_outputs must name exactly one of json, regex, choice, json_object")
    if "json" in value:
        return "json_schema", _schema(value["json"], name)
    if "regex" in value:
        return _regex(value["regex"], name)
    if "choice" in value:
        return _choice(value["choice"], name)
    return "json_schema", JSON_OBJECT


class _ByteVocab:
    """The byte tokenizer as llguidance's `TokenizerWrapper` reads one: each token's bytes, BOS/EOS specials."""

    eos_token_id = EOS
    bos_token_id = BOS

    def __init__(self, vocab: int) -> None:
        self.tokens = [bytes([i]) for i in range(N_BYTES)] + [f"<|{i}|>".encode() for i in range(N_BYTES, vocab)]
        self.special_token_ids = list(range(N_BYTES, vocab))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@lru_cache(maxsize=4)
def _tokenizer(vocab: int) -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(vocab)), slices=[])


@lru_cache(maxsize=64)
def _grammar(kind: str, text: str) -> str:
    import llguidance

    return llguidance.grammar_from(kind, text)  # type: ignore[arg-type]


class Guides:
    """One llguidance matcher per request on the last stage: which tokens may come next, advanced by each draw."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._matchers: dict[str, Any] = {}

    def allowed(self, rid: str, spec: tuple[str, str]) -> Any:
        """A bool tensor over the vocabulary: the tokens the grammar allows next (EOS once it is complete)."""
        import llguidance
        import numpy as np
        import torch

        matcher = self._matchers.get(rid)
        if matcher is None:
            if spec[0] not in KINDS:
                raise ValueError(f"request {rid}: unknown structured output kind {spec[0]!r}")
            matcher = llguidance.LLMatcher(_tokenizer(self.vocab), _grammar(*spec))
            if matcher.is_error():
                raise ValueError(f"request {rid}: the structured output cannot be compiled: {matcher.get_error()}")
            self._matchers[rid] = matcher
        words = np.full((self.vocab + 31) // 32, -1, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.size * words.itemsize)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:self.vocab].astype(bool)
        if not bits.any():
            # The grammar is complete and the request ignores EOS: only EOS may follow (it is left out of the text).
            bits[EOS] = True
        return torch.from_numpy(bits)

    def advance(self, rid: str, token: int) -> None:
        matcher = self._matchers.get(rid)
        if matcher is not None and not matcher.is_stopped():
            matcher.consume_token(token)

    def free(self, rid: str) -> None:
        self._matchers.pop(rid, None)
