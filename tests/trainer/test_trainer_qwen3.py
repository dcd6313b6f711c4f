"""HF Qwen3 <-> torchtitan Qwen3: same logprobs, lossless state-dict round trip, packed rows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from torchtitan_rl.assets.make_model import ensure_model
from torchtitan_rl.models.qwen3 import (
    PackedSDPAttention,
    Span,
    build_qwen3_from_hf,
    document_spans,
    hf_state_dict_from_torchtitan,
    load_hf_state_dict,
    model_attention_masks,
    torchtitan_qwen3_config,
    torchtitan_state_dict_from_hf,
)


@pytest.fixture(scope="module")
def tiny_dir():
    return ensure_model("tiny").resolve()


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return build_qwen3_from_hf(tiny_dir)


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def test_trainer_qwen3_logprobs_equal_transformers_float32(tiny_dir, tiny_model):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    tokens = torch.randint(3, 1024, (3, 33), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(33).expand(3, 33)
    with torch.no_grad():
        expected = _token_logprobs(hf_model(tokens).logits, tokens)
        got = _token_logprobs(
            tiny_model(tokens, positions, model_attention_masks(tiny_model, positions)), tokens
        )
    diff = (expected - got).abs()
    print(f"transformers vs torchtitan float32 logprobs: max|diff|={diff.max():.3g}")
    assert diff.max().item() <= 1e-6


def test_trainer_qwen3_state_dict_round_trip_is_lossless_and_drops_tied_head(tiny_dir, tiny_model):
    config = tiny_model.config
    assert config.enable_weight_tying
    hf_sd = hf_state_dict_from_torchtitan(tiny_model.state_dict(), config)
    reference = load_hf_state_dict(tiny_dir)
    assert "lm_head.weight" not in hf_sd
    assert set(hf_sd) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(hf_sd[name], tensor), name
    back = torchtitan_state_dict_from_hf(hf_sd, config)
    assert "lm_head.weight" not in hf_sd  # the input dict is left alone
    assert back["lm_head.weight"] is back["tok_embeddings.weight"]
    assert set(back) == set(tiny_model.state_dict())


def test_trainer_qwen3_packed_row_equals_one_sample_per_row(tiny_model):
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(3, 1024, (n,), generator=gen) for n in (9, 5, 12)]
    row = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    with torch.no_grad():
        packed = tiny_model(row, positions, model_attention_masks(tiny_model, positions))[0]
        start = 0
        for sample in samples:
            alone = tiny_model(sample[None])[0]
            torch.testing.assert_close(
                packed[start : start + len(sample)], alone, rtol=0, atol=1e-5
            )
            start += len(sample)


def test_trainer_qwen3_document_spans_find_samples_and_merge_single_tokens():
    spans = document_spans(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], [0, 0, 1, 2, 3, 0, 0, 0]]))
    assert spans.rows == (
        (Span(0, 3, False), Span(3, 5, False), Span(5, 8, True)),
        (Span(0, 1, True), Span(1, 5, False), Span(5, 8, True)),
    )
    with pytest.raises(ValueError, match="position 0"):
        document_spans(torch.tensor([[1, 0, 1]]))


def _block_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """Dense reference [B, 1, L, L]: query i sees key j iff j <= i and both lie in one sample."""
    doc_ids = torch.cumsum((positions == 0).to(torch.int32), dim=1)
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def test_trainer_qwen3_per_sample_attention_equals_dense_block_causal_mask():
    """Outputs and q/k/v gradients of the per-sample path against SDPA with the dense mask, with
    grouped-query heads (4 query heads on 2 kv heads) and one-token samples and padding runs."""
    gen = torch.Generator().manual_seed(2)
    lengths = [[7, 1, 5, 1, 1, 1], [3, 9, 4]]  # each row: 16 tokens
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    q = torch.randn(2, 16, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 16, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 16, 2, 8, generator=gen, requires_grad=True)
    grad_out = torch.randn(2, 16, 4, 8, generator=gen)
    attention = PackedSDPAttention(PackedSDPAttention.Config())

    def run(compute):
        out = compute()
        (grad_q, grad_k, grad_v) = torch.autograd.grad(out, (q, k, v), grad_out)
        return out, grad_q, grad_k, grad_v

    got = run(lambda: attention(q, k, v, attention_masks=document_spans(positions),
                                enable_gqa=True))
    expected = run(lambda: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=_block_causal_mask(positions), enable_gqa=True).transpose(1, 2))
    for name, a, b in zip(("out", "grad_q", "grad_k", "grad_v"), got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


def test_trainer_qwen3_all_padding_rows_give_zero_qk_gradients():
    """FSDP reduce-scatters only parameters with a gradient: a padding-only microbatch must still
    give q/k (hence wq/wk) one, zero, like a microbatch with samples does."""
    q = torch.randn(1, 6, 4, 8, requires_grad=True)
    k = torch.randn(1, 6, 2, 8, requires_grad=True)
    v = torch.randn(1, 6, 2, 8, requires_grad=True)
    attention = PackedSDPAttention(PackedSDPAttention.Config())
    out = attention(q, k, v, attention_masks=document_spans(torch.zeros(1, 6, dtype=torch.long)),
                    enable_gqa=True)
    assert torch.equal(out, v.repeat_interleave(2, dim=2))
    grad_q, grad_k = torch.autograd.grad(out.sum(), (q, k))
    assert torch.equal(grad_q, torch.zeros_like(q)) and torch.equal(grad_k, torch.zeros_like(k))


def test_trainer_qwen3_config_rejects_unsupported_keys(tiny_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    hf = json.loads((bad / "config.json").read_text())
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    (bad / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="rope_type"):
        torchtitan_qwen3_config(bad)
    with pytest.raises(FileNotFoundError, match="config.json"):
        torchtitan_qwen3_config(tmp_path)
