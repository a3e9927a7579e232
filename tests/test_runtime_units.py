"""Runtime building blocks against independent oracles: HF Llama, nginx's WRR sequence, exact byte framing."""

from __future__ import annotations

import numpy as np
import pytest

from coral_dagster.catalog.models import get_model
from coral_dagster.errors import CoralError
from coral_dagster.runtime import wire
from coral_dagster.layer_split import parse_split, stage_ranges
from coral_dagster.runtime.config import Timing
from coral_dagster.runtime.engine import Step
from coral_dagster.runtime.generate import generate_tokens
from coral_dagster.runtime.security import CurveKeys, is_local
from coral_dagster.runtime.tiny import decoder_config
from coral_dagster.runtime.tokenizer import BOS, EOS, ByteTokenizer, finish_reason
from coral_dagster.routing import WeightedRoundRobin

torch = pytest.importorskip("torch")

from coral_dagster.runtime.torch_engine import (  # noqa: E402
    TorchEngine, embedding_weights, head_weights, layer_weights)

CFG = decoder_config("tiny-llama")
PROMPT = ByteTokenizer().encode("The quick brown fox")


@pytest.fixture(scope="module")
def full() -> TorchEngine:
    return TorchEngine(CFG, 0, CFG.n_layers)


def test_tiny_llama_keeps_llama_3_1_70b_shape_ratios():
    base = get_model("llama-3.1-70b")
    assert CFG.n_heads // CFG.n_kv_heads == base.n_heads // base.n_kv_heads == 8
    assert CFG.n_heads * CFG.head_dim == CFG.hidden
    assert CFG.intermediate / CFG.hidden == pytest.approx(base.intermediate / base.hidden)
    with pytest.raises(CoralError, match="tiny-llama"):
        decoder_config("tiny-gpt-oss-20b")


def test_decoder_matches_hugging_face_llama(full):
    """Same weights loaded into transformers' LlamaForCausalLM: same greedy tokens, logits within float error."""
    transformers = pytest.importorskip("transformers")
    hc = transformers.LlamaConfig(
        hidden_size=CFG.hidden, intermediate_size=CFG.intermediate, num_hidden_layers=CFG.n_layers,
        num_attention_heads=CFG.n_heads, num_key_value_heads=CFG.n_kv_heads, head_dim=CFG.head_dim,
        vocab_size=CFG.vocab, rope_theta=CFG.rope_theta, rms_norm_eps=CFG.norm_eps, tie_word_embeddings=False,
        max_position_embeddings=CFG.max_context, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS)
    model = transformers.LlamaForCausalLM(hc).eval()
    state = {"model.embed_tokens.weight": embedding_weights(CFG)}
    state["model.norm.weight"], state["lm_head.weight"] = head_weights(CFG)
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    for i in range(CFG.n_layers):
        w = layer_weights(CFG, i)
        state.update({f"model.layers.{i}.{hf}.weight": getattr(w, ours) for ours, hf in names.items()})
    model.load_state_dict(state, strict=True)
    ours, _ = generate_tokens(full, PROMPT, 20, ignore_eos=True)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([PROMPT]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert ours == theirs[0, len(PROMPT):].tolist()


def test_weights_do_not_depend_on_the_split():
    a, b = TorchEngine(CFG, 3, 8), TorchEngine(CFG, 0, CFG.n_layers)
    assert torch.equal(a.layers[0].wq, b.layers[3].wq) and torch.equal(a.layers[4].w_down, b.layers[7].w_down)


def _chain(engines: list[TorchEngine], steps: list[Step]) -> list[int]:
    for e in engines:
        outs = e.forward(steps)
        if e.is_last:
            return [o.token for o in outs]
        steps = [Step(s.rid, s.pos, hidden=o.hidden) for s, o in zip(steps, outs)]
    raise AssertionError("no last stage")


def test_pipeline_of_stages_and_batching_equal_the_single_engine(full):
    """Stages 3,5,4 with several requests batched give the tokens of one engine run request by request."""
    prompts = [ByteTokenizer().encode(p) for p in ("alpha", "a longer second prompt", "3")]
    expected = [generate_tokens(full, p, 12, ignore_eos=True, rid=f"ref{i}")[0] for i, p in enumerate(prompts)]
    stages = [TorchEngine(CFG, a, b) for a, b in stage_ranges((3, 5, 4))]
    steps = [Step(f"r{i}", 0, tokens=np.asarray(p)) for i, p in enumerate(prompts)]
    got: list[list[int]] = [[] for _ in prompts]
    for _ in range(12):
        tokens = _chain(stages, steps)
        for out, t in zip(got, tokens):
            out.append(t)
        steps = [Step(s.rid, s.pos + s.n_tokens, tokens=np.asarray([t])) for s, t in zip(steps, tokens)]
    assert got == expected


def test_kv_handoff_between_different_splits_continues_the_same_decode(full):
    """Prefill on stages 3,5,4, hand KV to decode stages 6,6 per overlapping layer range, decode on: same tokens."""
    expected, _ = generate_tokens(full, PROMPT, 10, ignore_eos=True)
    prefill = [TorchEngine(CFG, a, b) for a, b in stage_ranges((3, 5, 4))]
    decode = [TorchEngine(CFG, a, b) for a, b in stage_ranges((6, 6))]
    first = _chain(prefill, [Step("r", 0, tokens=np.asarray(PROMPT))])[0]
    for p in prefill:
        for d in decode:
            lo, hi = max(p.start, d.start), min(p.end, d.end)
            if lo < hi:
                assert d.cache_length("r") in (0, None)
                d.import_kv("r", lo, hi, [np.array(a) for a in p.export_kv("r", lo, hi)])
    assert all(d.cache_length("r") == len(PROMPT) for d in decode)
    got, step = [first], Step("r", len(PROMPT), tokens=np.asarray([first]))
    for _ in range(9):
        got.append(_chain(decode, [step])[0])
        step = Step("r", step.pos + 1, tokens=np.asarray([got[-1]]))
    assert got == expected


def test_partial_handoff_is_not_ready_and_wrong_positions_are_refused():
    d = TorchEngine(CFG, 0, 6)
    src = TorchEngine(CFG, 0, 6)
    src.forward([Step("r", 0, tokens=np.asarray(PROMPT))])
    d.import_kv("r", 0, 3, src.export_kv("r", 0, 3))
    assert d.cache_length("r") is None
    with pytest.raises(ValueError, match="position"):
        src.forward([Step("r", 0, tokens=np.asarray([1]))])
    with pytest.raises(CoralError, match="not inside"):
        d.import_kv("r", 4, 8, [])


def test_smooth_wrr_matches_nginx_sequence_and_proportions():
    """nginx's documented smooth WRR order for weights a=5, b=1, c=1 is a a b a c a a."""
    wrr = WeightedRoundRobin()
    assert [wrr.pick({"a": 5, "b": 1, "c": 1}) for _ in range(7)] == list("aabacaa")
    wrr = WeightedRoundRobin()
    weights = {"x": 3.0, "y": 2.0, "z": 1.0}
    picks = [wrr.pick(weights) for _ in range(600)]
    assert {k: picks.count(k) for k in weights} == {"x": 300, "y": 200, "z": 100}
    # A key that leaves is never picked; the rest keep their ratio.
    later = [wrr.pick({"x": 3.0, "z": 1.0}) for _ in range(400)]
    assert "y" not in later and later.count("x") == 300


def test_wire_round_trip_and_rejections():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([1, 2, 3], dtype=np.int64)
    frames = wire.pack({"kind": "forward", "rid": "r"}, [a, b])
    assert bytes(frames[1]) == a.tobytes()  # raw bytes, no serializer in between
    header, (a2, b2) = wire.unpack([bytes(f) for f in frames])
    assert header == {"kind": "forward", "rid": "r"} and np.array_equal(a, a2) and np.array_equal(b, b2)
    with pytest.raises(wire.WireError, match="bytes"):
        wire.unpack([frames[0], bytes(frames[1])[:-4], bytes(frames[2])])
    with pytest.raises(wire.WireError, match="JSON"):
        wire.unpack([b"\x80\x04\x95 pickle"])
    with pytest.raises(wire.WireError, match="dtype"):
        wire.pack({"kind": "x"}, [np.array(["text"], dtype=object)])
    bad = b'{"kind":"x","tensors":[["|O",[1]]]}'
    with pytest.raises(wire.WireError, match="description"):
        wire.unpack([bad, b"\x00" * 8])


def test_stop_rule_tokenizer_and_settings():
    assert finish_reason(EOS, 1, 5, ignore_eos=False) == "stop"
    assert finish_reason(EOS, 1, 5, ignore_eos=True) is None
    assert finish_reason(7, 5, 5, ignore_eos=False) == "length"
    tok = ByteTokenizer()
    assert tok.encode("hé") == [BOS, 104, 0xC3, 0xA9]
    assert tok.decode([104, 105, 300]) == "hi<|300|>"
    assert parse_split("3,5,4") == (3, 5, 4) and stage_ranges((3, 5, 4)) == [(0, 3), (3, 8), (8, 12)]
    with pytest.raises(CoralError, match="split"):
        parse_split("3,0")
    with pytest.raises(CoralError, match="heartbeat"):
        Timing(heartbeat_s=2.0, dead_after_s=1.0)


def test_curve_keys_and_loopback_rule():
    keys = CurveKeys.generate()
    again = CurveKeys.from_env(keys.env())
    assert again == keys and keys.public in keys.allowed
    assert CurveKeys.from_env({}) is None
    with pytest.raises(CoralError, match="CORAL_CURVE_SECRET_KEY"):
        CurveKeys.from_env({"CORAL_CURVE_SECRET_KEY": "not-a-key"})
    assert is_local("tcp://127.0.0.1:5555") and is_local("tcp://[::1]:1") and is_local("inproc://x")
    assert not is_local("tcp://0.0.0.0:5555") and not is_local("tcp://10.0.0.7:5555")


def test_make_engine_builds_per_step_engines_only():
    """vLLM streams whole requests (its head is built by `coral serve engine --engine vllm`); unknown kinds fail."""
    from coral_dagster.runtime.engine import make_engine

    with pytest.raises(CoralError, match="whole instance"):
        make_engine("vllm", "llama-3.1-70b", 0, 80)
    with pytest.raises(CoralError, match="unknown engine"):
        make_engine("tensorrt", "tiny-llama", 0, 12)
