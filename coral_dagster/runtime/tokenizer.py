"""A byte-level tokenizer (one token per UTF-8 byte plus specials), its chat template and the shared stop rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BOS = 256
EOS = 257
N_BYTES = 256


@dataclass(frozen=True)
class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; 256 is BOS, 257 EOS, the rest of the vocabulary renders as `<|id|>`."""

    vocab: int = 512

    def encode(self, text: str) -> list[int]:
        """BOS, then the UTF-8 bytes of `text`."""
        return [BOS, *text.encode("utf-8")]

    def decode_token(self, token: int) -> str:
        """One token's text; bytes render as Latin-1 so that per-token pieces concatenate to the whole text."""
        if token < N_BYTES:
            return chr(token)
        if token in (BOS, EOS):
            return ""
        return f"<|{token}|>"

    def decode(self, tokens: list[int]) -> str:
        return "".join(self.decode_token(t) for t in tokens)


# The chat template every model served through the byte tokenizer uses (and the tiny models' exported
# tokenizer_config.json holds): a role tag line, the content, a newline; the prompt ends with the assistant's tag.
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def apply_chat_template(messages: list[dict[str, Any]], template: str = CHAT_TEMPLATE) -> str:
    """The prompt text of a conversation, rendered as Hugging Face renders chat templates (sandboxed Jinja,
    `add_generation_prompt=True`); BOS comes from `encode`, so the template does not add it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def finish_reason(token: int, n_generated: int, max_tokens: int, ignore_eos: bool) -> str | None:
    """Why generation ends after sampling `token` as the `n_generated`-th output, or None to continue.

    "stop": the token is EOS (it is not part of the output); "length": `max_tokens` outputs reached.
    """
    if token == EOS and not ignore_eos:
        return "stop"
    if n_generated >= max_tokens:
        return "length"
    return None
