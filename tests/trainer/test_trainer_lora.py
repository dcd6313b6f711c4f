"""LoRA on the trainer (trainer/lora.py): only the adapters train, the merged weights compute what
the adapted model computes, and the config names its mistakes (torchtitan on the tiny model)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.trainer.trainer_testlib import random_batch
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.trainer.lora import LoRA

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir():
    from torchtitan_rl.assets.make_model import ensure_model

    return ensure_model("tiny", REPO_ROOT / "assets" / "models").resolve()


def _core(model_dir, **lora) -> PolicyTrainerCore:
    config = PolicyTrainerCore.Config(num_threads=1, lora=LoRA.Config(enabled=True, **lora))
    config.optimizer.lr = 1e-3
    return config.build(model_dir=model_dir)


def test_only_the_adapters_train_and_the_merged_weights_compute_the_same(model_dir) -> None:
    core = _core(model_dir, rank=8, alpha=16.0)
    before = {name: t.detach().clone() for name, t in core.model.state_dict().items()}
    adapters = LoRA.adapter_state_dict(before)
    # every attention and MLP projection of every layer, none on the embeddings or the head
    layers = 1 + max(int(name.split(".")[1]) for name in adapters)
    assert len(adapters) == layers * 7 * 2
    assert not any(name.startswith(("tok_embeddings", "lm_head")) for name in adapters)
    trainable = {id(p) for p in LoRA.trainable_parameters(core.model)}
    named = dict(core.model.named_parameters())
    assert {name for name, p in named.items() if id(p) in trainable} == set(adapters)
    # B starts at zero: the merged weights are the base's exactly
    assert all(torch.equal(t, before[name]) for name, t in core.full_model_state_dict().items())

    batch = random_batch(0)
    for _ in range(2):
        core.forward_backward(batch)
        metrics = core.optim_step()
    assert metrics["trainer/lr"] == pytest.approx(1e-2)  # 10 x optimizer.lr by default
    after = core.model.state_dict()
    for name, tensor in after.items():
        changed = not torch.equal(tensor, before[name])
        assert changed == name.endswith((".lora_a.weight", ".lora_b.weight")), name
    assert sum(len(state) for state in core.optimizer.state.values()) == 3 * len(adapters)

    # A model without LoRA loaded with the merged weights gives the adapted model's logits,
    # which the two steps moved away from the base's.
    merged = core.full_model_state_dict()
    assert set(merged) == set(after) - set(adapters)
    plain = PolicyTrainerCore.Config(num_threads=1).build(model_dir=model_dir)
    data = batch.microbatch(0, 0)
    with torch.no_grad():
        base_logits = plain._logits(data["input_ids"], data["positions"])
        plain.model.load_state_dict(merged)
        reference = plain._logits(data["input_ids"], data["positions"])
        adapted = core._logits(data["input_ids"], data["positions"])
    assert (adapted - base_logits).abs().max() > 1e-3
    torch.testing.assert_close(adapted, reference, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_resumes_the_adapters_bit_for_bit(model_dir, tmp_path) -> None:
    straight = _core(model_dir)
    batch = random_batch(1)
    straight.forward_backward(batch)
    straight.optim_step()
    straight.save_checkpoint(tmp_path / "step1", extra={})
    straight.forward_backward(batch)
    straight.optim_step()
    resumed = _core(model_dir)
    resumed.load_checkpoint(tmp_path / "step1")
    resumed.forward_backward(batch)
    resumed.optim_step()
    expected = straight.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name

    # The checkpoint holds the adapters and their AdamW state only, and the base's digest.
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(tmp_path / "step1")).read_metadata().state_dict_metadata
    saved_model = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert saved_model == set(LoRA.adapter_state_dict(expected))
    assert "trainer.base_digest" in saved
    # another base, or a run without LoRA, refuses it in one line
    other_base = tmp_path / "other_base"
    import shutil

    shutil.copytree(model_dir, other_base)
    from safetensors.torch import load_file, save_file

    weights = load_file(other_base / "model.safetensors")
    first = sorted(weights)[0]
    weights[first] = weights[first] + 1
    save_file(weights, other_base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="trained on a base model of digest"):
        _core(other_base).load_checkpoint(tmp_path / "step1")
    with pytest.raises(ValueError, match="a LoRA adapter checkpoint; this run trains the full"):
        PolicyTrainerCore.Config(num_threads=1).build(model_dir=model_dir).load_checkpoint(
            tmp_path / "step1")


def test_the_lora_config_names_its_mistakes() -> None:
    with pytest.raises(ValueError, match="k_proj and v_proj go together"):
        LoRA.Config(target_modules=["q_proj", "k_proj"])
    with pytest.raises(ValueError, match=r"unknown \['wq'\]"):
        LoRA.Config(target_modules=["wq"])
    with pytest.raises(ValueError, match="trainer.lora.rank must be >= 1"):
        LoRA.Config(rank=0)
    with pytest.raises(ValueError, match="trainer.lora.dropout"):
        LoRA.Config(dropout=1.0)
    with pytest.raises(ValueError, match="lora.enabled with trainer.critic.enabled"):
        from torchtitan_rl.trainer.critic import ValueCritic

        PolicyTrainerCore.Config(lora=LoRA.Config(enabled=True),
                                 critic=ValueCritic.Config(enabled=True))


def test_the_peft_export_loads_in_peft_and_computes_the_merged_exports_logits(
        model_dir, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    core = _core(model_dir, rank=8, alpha=16.0)
    batch = random_batch(2)
    for _ in range(2):
        core.forward_backward(batch)
        core.optim_step()
    core.export_hf(tmp_path / "merged")
    core.lora.config.export = "peft"
    core.export_hf(tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]

    input_ids = torch.tensor([batch.microbatch(0, 0)["input_ids"][0, :12].tolist()])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        expected = merged(input_ids=input_ids).logits
        actual = adapted(input_ids=input_ids).logits
        with adapted.disable_adapter():
            base_logits = adapted(input_ids=input_ids).logits
    assert (actual - base_logits).abs().max() > 1e-3  # the adapter is loaded and acts
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_adapter_dropout_draws_only_while_training(model_dir) -> None:
    core = _core(model_dir, dropout=0.5)
    batch = random_batch(3)
    core.forward_backward(batch)
    core.optim_step()
    core.forward_backward(batch)
    core.optim_step()  # B is non-zero now: the adapters' input matters
    data = batch.microbatch(0, 0)
    with torch.no_grad():
        core.model.train()
        one, two = (core._logits(data["input_ids"], data["positions"]) for _ in range(2))
        core.model.eval()
        three, four = (core._logits(data["input_ids"], data["positions"]) for _ in range(2))
    assert not torch.equal(one, two)
    assert torch.equal(three, four)
