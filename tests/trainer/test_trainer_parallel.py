"""Two gloo ranks (FSDP dp_shard=2, or TP=2) give the loss, gradients and updated weights of one rank,
training the whole model, LoRA adapters, and several updates a step."""

from __future__ import annotations

import os
import pathlib
import socket

import pytest
import torch
import torch.multiprocessing as mp

from torchtitan_rl.trainer.batcher import Batcher, TrainingBatch
from torchtitan_rl.trainer.core import PolicyTrainerCore
from torchtitan_rl.trainer.lora import LoRA
from torchtitan_rl.types import TrainingSample

pytestmark = pytest.mark.slow  # two torch.multiprocessing trainer ranks

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _samples(num: int, seed: int = 0) -> list[TrainingSample]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num):
        n = int(torch.randint(8, 30, (1,), generator=gen))
        prompt = 4
        logprobs = (-4 * torch.rand(n - prompt, generator=gen)).tolist()
        if i == 1:
            logprobs[2] = float("nan")
        samples.append(
            TrainingSample(
                sample_id=f"group={i // 2}/rollout={i % 2}/branch=0",
                group_id=i // 2,
                token_ids=torch.randint(3, 1000, (n,), generator=gen).tolist(),
                loss_mask=[0] * prompt + [1] * (n - prompt),
                generator_logprobs=[0.0] * prompt + logprobs,
                advantages=[0.0] * prompt + [float(i % 3) - 1.0] * (n - prompt),
                policy_versions=[-1] * prompt + [0] * (n - prompt),
            )
        )
    return samples


def _config(lora_rank: int = 0, **parallel) -> PolicyTrainerCore.Config:
    config = PolicyTrainerCore.Config(
        max_grad_norm=1e9, num_threads=1,
        lora=LoRA.Config(enabled=lora_rank > 0, rank=max(lora_rank, 1)), **parallel)
    config.optimizer.lr = 1e-3
    # Adam turns float noise on near-zero gradients into +-lr steps; a large eps keeps the
    # update proportional to the gradient so weights can be compared after the step.
    config.optimizer.eps = 1e-3
    return config


def _step(core: PolicyTrainerCore, batch: TrainingBatch) -> dict:
    metrics = core.forward_backward(batch)
    grads = {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for name, p in core.model.named_parameters() if p.grad is not None
    }
    core.optim_step()
    return {"metrics": metrics, "grads": grads, "weights": core.full_model_state_dict()}


def _minibatch_step(core: PolicyTrainerCore) -> dict:
    """Several updates a step (2 mini-batches x 2 epochs), the ratio against the recomputed old
    policy (the correction on): every rank splits and packs alike."""
    core.config.num_minibatches, core.config.ppo_epochs = 2, 2
    core.config.loss.off_policy.enabled = "on"
    metrics = core.forward_backward_samples(_samples(8), Batcher.Config(seq_len=48))
    metrics.update(core.optim_step())
    return {"metrics": metrics, "weights": core.full_model_state_dict()}


def _worker(rank: int, world: int, port: int, model_dir: str, parallel: dict, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    core = _config(**parallel).build(model_dir=model_dir)
    batch = Batcher.Config(seq_len=48).build(dp_size=core.dp_size).pack(_samples(8))
    result = _step(core, batch)
    core.save_checkpoint(pathlib.Path(out).parent / "ckpt", extra={"ranks": world})
    # LoRA adapters (trainer.lora) on the same ranks, in the same process group
    lora = _config(lora_rank=8, **parallel).build(model_dir=model_dir)
    result["lora"] = _step(lora, batch)
    result["minibatches"] = _minibatch_step(_config(**parallel).build(model_dir=model_dir))
    if rank == 0:
        torch.save(result, out)
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_two_ranks(model_dir: pathlib.Path, parallel: dict, tmp_path: pathlib.Path) -> dict:
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(
        _worker, args=(2, _free_port(), str(model_dir), parallel, out), nprocs=2,
        join=True, start_method="spawn",
    )
    return torch.load(out, weights_only=True)


def _single_rank(model_dir: pathlib.Path) -> dict:
    batch = Batcher.Config(seq_len=48).build(dp_size=1).pack(_samples(8))
    result = _step(_config().build(model_dir=model_dir), batch)
    result["lora"] = _step(_config(lora_rank=8).build(model_dir=model_dir), batch)
    result["minibatches"] = _minibatch_step(_config().build(model_dir=model_dir))
    return result


def _assert_same_step(two: dict, one: dict) -> None:
    """The plain step, and the LoRA step: the frozen base gets no gradient, the adapters the
    gradients of one rank, and the merged weights are one rank's."""
    _assert_same_plain_step(two, one)
    assert set(one["lora"]["grads"]) == set(LoRA.adapter_state_dict(one["lora"]["grads"]))
    _assert_same_plain_step(two["lora"], one["lora"])
    mine, theirs = two["minibatches"], one["minibatches"]
    assert theirs["metrics"]["trainer/num_updates"] == 4
    assert abs(theirs["metrics"]["loss/ratio_mean_last"] - 1) > 1e-6  # the weights moved
    for key in ("loss/value", "loss/ratio_mean", "loss/ratio_mean_last", "loss/num_valid_tokens"):
        assert mine["metrics"][key] == pytest.approx(theirs["metrics"][key], rel=1e-5,
                                                     abs=1e-6), key
    for name, weight in theirs["weights"].items():
        torch.testing.assert_close(mine["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=name)


def _assert_same_plain_step(two: dict, one: dict) -> None:
    # The mismatch metrics (sums and maxima reduced over ranks) too, by policy age and turn.
    for key in ("loss/value", "loss/ratio_mean", "loss/entropy_mean", "loss/num_valid_tokens",
                "loss/generator_logprob_nan_frac", "loss/trainer_generator_abs_logprob_diff_max",
                "mismatch/k1_token_mean", "mismatch/k3_token_mean", "mismatch/k3_token_max",
                "mismatch/k1_seq_max", "mismatch/k3_seq_max", "mismatch/masked_token_frac",
                "mismatch/masked_seq_frac", "mismatch/weight_mean", "mismatch/weight_max",
                "mismatch/age_0/num_tokens", "mismatch/turn_0/k3_token_mean"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-6), key
    assert one["metrics"]["mismatch/masked_seq_frac"] > 0  # the default menu's mask bites
    assert two["metrics"]["loss/num_nan_generator_logprobs"] == 1
    assert set(two["grads"]) == set(one["grads"])
    for name, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_trainer_dp2_gives_the_loss_and_gradients_of_one_rank(tmp_path):
    from torchtitan_rl.assets.make_model import ensure_model

    model_dir = ensure_model("tiny", REPO_ROOT / "assets" / "models").resolve()
    two = _run_two_ranks(model_dir, {"data_parallel_shard_degree": 2}, tmp_path)
    _assert_same_step(two, _single_rank(model_dir))
    # the two ranks' sharded DCP checkpoint loads into one rank as the same weights
    one = _config().build(model_dir=model_dir)
    assert one.load_checkpoint(tmp_path / "ckpt") == {"ranks": 2}
    assert one.policy_version == 1
    for name, tensor in one.full_model_state_dict().items():
        assert torch.equal(tensor, two["weights"][name]), name


def test_trainer_tp2_gives_the_loss_and_gradients_of_one_rank(tmp_path):
    from torchtitan_rl.assets.make_model import ensure_model

    # tiny has one kv head; demo has four, so TP=2 can split them
    model_dir = ensure_model("demo", REPO_ROOT / "assets" / "models").resolve()
    two = _run_two_ranks(
        model_dir, {"tensor_parallel_degree": 2, "data_parallel_shard_degree": 1}, tmp_path
    )
    _assert_same_step(two, _single_rank(model_dir))

