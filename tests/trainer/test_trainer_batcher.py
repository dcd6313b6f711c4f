"""Batcher: first-fit decreasing packing into a [microbatch][dp rank] grid, shifted targets, drops counted."""

from __future__ import annotations

import math

import pytest
import torch

from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.types import TrainingSample


def _sample(index: int, num_tokens: int, prompt: int = 2, logprob: float = -1.0) -> TrainingSample:
    completion = num_tokens - prompt
    return TrainingSample(
        sample_id=f"group=0/rollout={index}/branch=0",
        group_id=0,
        token_ids=[100 * (index + 1) + i for i in range(num_tokens)],
        loss_mask=[0] * prompt + [1] * completion,
        generator_logprobs=[0.0] * prompt + [logprob] * completion,
        advantages=[0.0] * prompt + [float(index)] * completion,
        policy_versions=[-1] * prompt + [7] * completion,
    )


def test_trainer_batcher_first_fit_decreasing_grid_matches_the_worked_example():
    samples = [_sample(i, n) for i, n in enumerate([5, 3, 6, 2, 7])]
    batch = Batcher.Config(seq_len=8).build(dp_size=2).pack(samples)
    assert batch.input_ids.shape == (2, 2, 1, 8)
    # longest first: rows [7] [6+2] [5+3] [padding], dealt out microbatch-major then rank;
    # a document id is the sample's index in the input
    docs = batch.document_ids.reshape(4, 8)
    assert docs[0].tolist() == [4] * 7 + [-1]
    assert docs[1].tolist() == [2] * 6 + [3] * 2
    assert docs[2].tolist() == [0] * 5 + [1] * 3
    assert docs[3].tolist() == [-1] * 8
    assert batch.positions.reshape(4, 8)[2].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.metrics["batcher/pct_pad_in_batch"] == pytest.approx(100 * (32 - 23) / 32)
    assert batch.metrics["batcher/num_rows"] == 3
    assert batch.metrics["batcher/num_microbatches"] == 2
    # every completion token is the target of the position before it, so all of them count
    assert batch.num_valid_tokens == sum(n - 2 for n in [5, 3, 6, 2, 7])


def test_trainer_batcher_fills_earlier_rows_where_next_fit_would_open_new_ones():
    # next-fit in input order: [5] [6] [3+2], 3 rows; first-fit decreasing: [6+2] [5+3]
    samples = [_sample(i, n) for i, n in enumerate([5, 6, 3, 2])]
    batch = Batcher.Config(seq_len=8).build().pack(samples)
    assert batch.metrics["batcher/num_rows"] == 2
    assert batch.metrics["batcher/pct_pad_in_batch"] == 0.0
    docs = batch.document_ids.reshape(2, 8)
    assert docs[0].tolist() == [1] * 6 + [3] * 2
    assert docs[1].tolist() == [0] * 5 + [2] * 3
    # each sample's tokens are whole and in order wherever it lands
    tokens = batch.input_ids.reshape(2, 8)
    assert tokens[0, 6:].tolist() == [400, 401]
    assert tokens[1, :5].tolist() == [100, 101, 102, 103, 104]


def test_trainer_batcher_targets_are_the_next_token_and_stop_at_sample_end():
    batch = Batcher.Config(seq_len=8).build().pack([_sample(0, 5), _sample(1, 3)])
    row = {k: v.reshape(-1, 8)[0] for k, v in batch.microbatch(0, 0).items()}
    assert row["input_ids"].tolist() == [100, 101, 102, 103, 104, 200, 201, 202]
    assert row["labels"][:4].tolist() == [101, 102, 103, 104]
    # position 1 predicts token 2, the first completion token; a sample's last position predicts
    # nothing (mask 0), so no target crosses into the next sample
    assert row["loss_mask"].tolist() == [False, True, True, True, False, False, True, False]
    assert row["advantages"].tolist() == [0, 0, 0, 0, 0, 0, 1, 0]
    assert row["policy_versions"].tolist() == [-1, 7, 7, 7, -1, -1, 7, -1]


def test_trainer_batcher_drops_and_counts_overlong_samples_and_excludes_nan_tokens():
    samples = [_sample(0, 4), _sample(1, 9), _sample(2, 4, logprob=math.nan)]
    batch = Batcher.Config(seq_len=8, rows_per_microbatch=2).build().pack(samples)
    assert batch.metrics["batcher/num_dropped_samples"] == 1
    assert batch.metrics["batcher/num_samples"] == 2
    assert batch.input_ids.shape == (1, 1, 2, 8)
    assert set(batch.document_ids.unique().tolist()) == {-1, 0, 2}
    # the NaN sample's tokens are in the mask but not in the loss denominator
    assert int(batch.loss_mask.sum()) == 4
    assert batch.num_valid_tokens == 2
    assert torch.isnan(batch.generator_logprobs).sum() == 2


def test_trainer_batcher_empty_input_gives_one_padding_microbatch():
    batch = Batcher.Config(seq_len=4).build(dp_size=2).pack([])
    assert batch.input_ids.shape == (1, 2, 1, 4)
    assert batch.num_valid_tokens == 0
    assert batch.metrics["batcher/pct_pad_in_batch"] == 100.0


def test_trainer_batcher_config_rejects_bad_values():
    with pytest.raises(ValueError, match="seq_len must be >= 2, got 1"):
        Batcher.Config(seq_len=1)
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        Batcher.Config().build(dp_size=0)
