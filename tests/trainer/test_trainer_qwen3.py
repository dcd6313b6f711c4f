"""HF Qwen3 <-> torchtitan Qwen3: same logprobs, lossless state-dict round trip, packed rows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from torchtitan_rl.assets.make_model import ensure_model
from torchtitan_rl.models.qwen3 import (
    block_causal_mask,
    build_qwen3_from_hf,
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


def test_trainer_qwen3_block_causal_mask_never_crosses_samples():
    mask = block_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


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
