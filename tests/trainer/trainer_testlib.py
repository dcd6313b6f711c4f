"""What several trainer tests build: a small packed batch of random sequences."""

from __future__ import annotations

import torch

from torchtitan_rl.trainer.batcher import Batcher, TrainingBatch
from torchtitan_rl.types import TrainingSample


def random_batch(seed: int) -> TrainingBatch:
    """Four 12-token sequences of one group (4 prompt tokens, 8 generated), advantages -1/+1
    by rollout, packed into rows of 32."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(4):
        n = 12
        samples.append(TrainingSample(
            sample_id=f"group=0/rollout={i}/branch=0", group_id=0,
            token_ids=torch.randint(3, 1000, (n,), generator=gen).tolist(),
            loss_mask=[0] * 4 + [1] * 8,
            generator_logprobs=[0.0] * 4 + (-3 * torch.rand(8, generator=gen)).tolist(),
            advantages=[0.0] * 4 + [1.0 if i % 2 else -1.0] * 8,
            policy_versions=[-1] * 4 + [0] * 8,
        ))
    return Batcher.Config(seq_len=32).build().pack(samples)
