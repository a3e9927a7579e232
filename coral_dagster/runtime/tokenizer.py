"""A byte-level tokenizer (one token per UTF-8 byte plus specials) and the shared stop rule."""

from __future__ import annotations

from dataclasses import dataclass

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


def finish_reason(token: int, n_generated: int, max_tokens: int, ignore_eos: bool) -> str | None:
    """Why generation ends after sampling `token` as the `n_generated`-th output, or None to continue.

    "stop": the token is EOS (it is not part of the output); "length": `max_tokens` outputs reached.
    """
    if token == EOS and not ignore_eos:
        return "stop"
    if n_generated >= max_tokens:
        return "length"
    return None
