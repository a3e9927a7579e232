"""A tiny decoder's weights as a Hugging Face Llama directory, so vLLM loads exactly what the torch engine runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

from coral_dagster.runtime.tiny import DecoderConfig, decoder_config
from coral_dagster.runtime.tokenizer import BOS, CHAT_TEMPLATE, EOS, N_BYTES, ByteTokenizer

MODELS_ENV = "CORAL_MODELS_DIR"


def hf_config(cfg: DecoderConfig) -> dict:
    """`config.json` of a `LlamaForCausalLM` with `cfg`'s shape (untied head, no biases, plain RoPE)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.hidden, "intermediate_size": cfg.intermediate, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_context, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": BOS, "eos_token_id": EOS, "torch_dtype": cfg.dtype, "dtype": cfg.dtype,
    }


def tokenizer_config(cfg: DecoderConfig) -> dict:
    """`tokenizer_config.json`: the byte tokenizer's specials, context and chat template (vLLM and
    transformers read `chat_template` from here)."""
    names = ByteTokenizer()
    return {"chat_template": CHAT_TEMPLATE, "bos_token": f"<|{BOS}|>", "eos_token": f"<|{EOS}|>",
            "model_max_length": cfg.max_context, "vocab_size": names.vocab, "add_bos_token": True}


def byte_level_chars() -> list[str]:
    """GPT-2's byte-to-character table, which the `ByteLevel` pre-tokenizer and decoder of Hugging Face `tokenizers`
    use: printable Latin-1 bytes stand for themselves, the other bytes for characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(N_BYTES, 2 * N_BYTES))
    return [chr(b) if b in printable else chr(next(others)) for b in range(N_BYTES)]


def tokenizer_json(cfg: DecoderConfig) -> dict:
    """`tokenizer.json` (Hugging Face `tokenizers`' format) encoding and decoding as `ByteTokenizer`: a byte-level
    BPE with no merges whose byte tokens are ids 0..255 and whose other ids are entries `<|id|>` that no text
    encodes to but that decode to that text; BOS and EOS are also special tokens (BOS added before each text)."""
    vocab = {ch: b for b, ch in enumerate(byte_level_chars())}
    vocab.update({f"<|{t}|>": t for t in range(N_BYTES, cfg.vocab)})
    special = [{"id": t, "content": f"<|{t}|>", "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for t in (BOS, EOS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    bos = f"<|{BOS}|>"
    first, second = ({"Sequence": {"id": seq, "type_id": i}} for i, seq in enumerate("AB"))
    prepend_bos = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, first],
                   "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, first, second],
                   "special_tokens": {bos: {"id": bos, "ids": [BOS], "tokens": [bos]}}}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special, "normalizer": None,
        "pre_tokenizer": byte_level, "decoder": byte_level, "post_processor": prepend_bos,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def hf_state_dict(cfg: DecoderConfig) -> dict:
    """Every tensor under the names `LlamaForCausalLM` uses, from the torch engine's seeded weights."""
    from coral_dagster.runtime.torch_engine import embedding_weights, head_weights, layer_weights

    names = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    out = {"model.embed_tokens.weight": embedding_weights(cfg)}
    for i in range(cfg.n_layers):
        w = layer_weights(cfg, i)
        out.update({f"model.layers.{i}.{hf}.weight": getattr(w, ours) for ours, hf in names.items()})
    out["model.norm.weight"], out["lm_head.weight"] = head_weights(cfg)
    return {k: v.contiguous() for k, v in out.items()}


def models_dir() -> Path:
    """Where exported models are kept: $CORAL_MODELS_DIR, else ~/.cache/coral/models."""
    return Path(os.environ.get(MODELS_ENV) or Path.home() / ".cache" / "coral" / "models")


def export_tiny(name: str, root: Path | None = None) -> Path:
    """Write (once) the tiny decoder `name` as a Hugging Face directory in float32; returns the directory."""
    from safetensors.torch import save_file

    cfg = decoder_config(name)
    out = (root or models_dir()) / f"{cfg.name}-seed{cfg.seed}"
    config = json.dumps(hf_config(cfg), indent=2, sort_keys=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg), indent=2, sort_keys=True))
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(cfg), indent=1))
    if (out / "model.safetensors").is_file() and (out / "config.json").read_text() == config:
        return out
    tmp = out / "model.safetensors.tmp"
    save_file(hf_state_dict(cfg), str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}))
    (out / "config.json").write_text(config)
    return out
