"""DCP checkpoints resume bit for bit; torchtitan flavors build; HF export reloads as the same model."""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests.trainer.trainer_testlib import random_batch
from torchtitan_rl.trainer.core import PolicyTrainerCore

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir():
    from torchtitan_rl.assets.make_model import ensure_model

    return ensure_model("tiny", REPO_ROOT / "assets" / "models").resolve()


def _core(model_dir) -> PolicyTrainerCore:
    config = PolicyTrainerCore.Config(num_threads=1, lr_warmup_steps=3)
    config.optimizer.lr = 1e-2
    return config.build(model_dir=model_dir)


def test_trainer_checkpoint_resume_repeats_the_uninterrupted_run_bit_for_bit(model_dir, tmp_path):
    straight = _core(model_dir)
    losses = []
    for step in range(3):
        losses.append(straight.forward_backward(random_batch(step))["loss/value"])
        lr = straight.optim_step()["trainer/lr"]
        if step == 1:
            straight.save_checkpoint(tmp_path / "step2", extra={"cursor": 7, "name": "x"})
    assert lr == pytest.approx(1e-2)  # warm-up: 1/3, 2/3, then the full lr at step 3

    resumed = _core(model_dir)
    extra = resumed.load_checkpoint(tmp_path / "step2")
    assert extra == {"cursor": 7, "name": "x"}
    assert resumed.policy_version == 2
    metrics = resumed.forward_backward(random_batch(2))
    assert resumed.optim_step()["trainer/lr"] == lr
    assert metrics["loss/value"] == losses[2]
    expected = straight.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_trainer_checkpoint_rejects_non_json_extra_and_missing_dirs(model_dir, tmp_path):
    core = _core(model_dir)
    with pytest.raises(ValueError, match="JSON"):
        core.save_checkpoint(tmp_path / "c", extra={"t": torch.zeros(1)})
    with pytest.raises(FileNotFoundError, match="no DCP checkpoint"):
        core.load_checkpoint(tmp_path / "missing")


def test_trainer_export_hf_reloads_as_the_same_weights(model_dir, tmp_path):
    from torchtitan_rl.models.qwen3 import load_hf_state_dict

    core = _core(model_dir)
    core.forward_backward(random_batch(0))
    core.optim_step()
    core.export_hf(tmp_path / "hf")
    exported = load_hf_state_dict(tmp_path / "hf")
    assert set(exported) == set(load_hf_state_dict(model_dir))
    for name, tensor in core.hf_state_dict().items():
        assert torch.equal(exported[name], tensor), name
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_trainer_builds_from_a_torchtitan_flavor():
    config = PolicyTrainerCore.Config(flavor="debugmodel", num_threads=1, seed=3)
    core = config.build()
    assert core.model_config.enable_weight_tying
    names = set(core.hf_state_dict())
    assert "model.layers.7.mlp.down_proj.weight" in names and "lm_head.weight" not in names
    again = PolicyTrainerCore.Config(flavor="debugmodel", num_threads=1, seed=3).build()
    weight = "layers.0.attention.wo.weight"
    assert torch.equal(core.model.state_dict()[weight], again.model.state_dict()[weight])
