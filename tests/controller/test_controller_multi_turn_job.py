"""Multi-turn episodes through the whole stack (Monarch meshes, vLLM generator, torchtitan
trainer): the loss mask the trainer trains with covers exactly the tokens the generator produced
in every turn (turn 2 and 3 included) and none of the prompt or of the user messages the env
inserts between turns. The job trains with REINFORCE++ with a group baseline (per-turn credit,
whitened over each step), GSPO and a k3 KL term to the reference model: the advantages the
trainer received are the step-whitened per-turn ones, and the KL is 0 before the first update.

What the trainer received is read from ``trainer.debug_batch_log`` (each rank appends, per
microbatch, the input ids, positions, document ids and loss mask its loss used); what was
generated from the rollouts JSONL (per turn: prompt length, completion length and texts); which
sample is which document from trained_samples.jsonl (document id = index in the step's samples).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import pytest

from tests.controller.jobs import REPO_ROOT, read_metrics, tiny_job
from tests.controller.multi_turn_letter_task import MultiTurnLetterTask, env_message
from torchtitan_rl.controller.checkpoint.checkpointer import Checkpointer
from torchtitan_rl.controller.loop.validation import Validator
from torchtitan_rl.generator.generator import Generator
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.train import main
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.types import Sampling

pytestmark = pytest.mark.slow  # a whole job

NUM_STEPS = 2
NUM_TURNS = 3
SEQ_LEN = 160
TURN_DISCOUNT = 0.5
# Every 5th token id stops a reply (as in tests/rollout/test_rollout_vllm.py): the random tiny
# model rarely samples its end-of-turn token, and a reply cut at max_tokens ends the rollout.
STOP_TOKEN_IDS = list(range(3, 1024, 5))


@pytest.fixture(scope="module")
def multi_turn_run(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    out = tmp_path_factory.mktemp("multi_turn")
    batch_log = out / "trainer_batches.jsonl"
    base = tiny_job(out, "multi_turn", num_steps=NUM_STEPS)
    config = dataclasses.replace(
        base,
        task=MultiTurnLetterTask.Config(num_turns=NUM_TURNS),
        rollouter=Rollouter.Config(group_size=4, max_turns=NUM_TURNS,
                                   max_rollout_tokens=SEQ_LEN, credit="turn",
                                   turn_discount=TURN_DISCOUNT,
                                   advantage="reinforce_pp_baseline"),
        sampling=Sampling(max_tokens=12, stop_token_ids=STOP_TOKEN_IDS),
        generator=Generator.Config(max_model_len=SEQ_LEN, kv_cache_bytes=32 << 20),
        batcher=Batcher.Config(seq_len=SEQ_LEN),
        trainer=dataclasses.replace(
            base.trainer, debug_batch_log=str(batch_log),
            loss=dataclasses.replace(base.trainer.loss, policy_loss="gspo",
                                     aggregation="seq-mean-token-mean", clip_low=3e-3,
                                     clip_high=4e-3, kl_coef=0.1, kl_estimator="k3")),
        validation=Validator.Config(num_prompts=4, samples_per_prompt=2, temperature=1.0),
        checkpoint=Checkpointer.Config(every_steps=0, export_hf=False),
    )
    summary = main(config)
    assert summary["steps"] == NUM_STEPS
    return out / "multi_turn", batch_log


def _jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


Received = tuple[list[int], list[int], list[float]]


def _received_samples(batch_log: pathlib.Path) -> dict[int, dict[int, Received]]:
    """{policy version (= step): {document id: (token ids, token mask, token advantages)}} as the
    trainer got them. Token mask (advantage) j is the loss mask (advantage) at position j - 1
    (position i predicts token i + 1)."""
    by_step: dict[int, dict[int, Received]] = {}
    for record in _jsonl(batch_log):
        assert record["rank"] == 0 and record["dp_rank"] == 0
        documents = by_step.setdefault(record["policy_version"], {})
        for ids, positions, docs, mask, advantages in zip(
                record["input_ids"], record["positions"], record["document_ids"],
                record["loss_mask"], record["advantages"], strict=True):
            for j, doc in enumerate(docs):
                if doc == -1:
                    assert mask[j] == 0, "a padding position is trained on"
                    continue
                tokens, token_mask, token_advantages = documents.setdefault(doc, ([], [0], [0.0]))
                assert positions[j] == len(tokens), "a sample is split or out of order"
                tokens.append(ids[j])
                token_mask.append(mask[j])
                token_advantages.append(advantages[j])
    for documents in by_step.values():
        for tokens, token_mask, token_advantages in documents.values():
            # the last position of a sample predicts nothing
            assert token_mask.pop() == 0
            token_advantages.pop()
            assert len(token_mask) == len(token_advantages) == len(tokens)
    return by_step


def test_multi_turn_loss_mask_reaches_the_trainer_exactly_on_generated_tokens(multi_turn_run):
    from transformers import AutoTokenizer

    run_dir, batch_log = multi_turn_run
    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "assets" / "models" / "tiny")
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731

    received = _received_samples(batch_log)
    trained = {r["step"]: r["sample_ids"] for r in _jsonl(run_dir / "trained_samples.jsonl")}
    recorded = {(r["step"], r["sample_id"]): r
                for r in _jsonl(run_dir / "rollouts" / "rollouts.jsonl")}
    metrics = read_metrics(run_dir)
    assert sorted(received) == sorted(trained) == list(range(NUM_STEPS))

    num_multi_turn = num_later_turn_tokens = 0
    for step in range(NUM_STEPS):
        documents = received[step]
        assert sorted(documents) == list(range(len(trained[step])))  # every sample, none dropped
        expected_valid = 0
        for document, sample_id in enumerate(trained[step]):
            session, branch = sample_id.rsplit("/", 1)
            assert branch == "branch=0"  # one growing prefix: no branch
            rollout = recorded[(step, session)]
            assert rollout["group_dropped"] is None and rollout["advantage"] is not None
            turns = rollout["turns"]
            tokens, token_mask, _ = documents[document]
            last = turns[-1]
            assert len(tokens) == last["num_prompt_tokens"] + last["num_completion_tokens"]

            spans = [range(t["num_prompt_tokens"],
                           t["num_prompt_tokens"] + t["num_completion_tokens"]) for t in turns]
            # the mask is exactly the union of the turns' generated spans
            assert [j for j, m in enumerate(token_mask) if m] == [j for s in spans for j in s], (
                sample_id, token_mask)
            previous_end = 0
            for k, (turn, span) in enumerate(zip(turns, spans, strict=True)):
                # the masked tokens are this turn's completion ...
                assert decode(tokens[span.start:span.stop]) == turn["completion_text"]
                # ... and the unmasked tokens before it are what the env added to the prompt
                # (the first prompt; after turn 1 the turn's closer and the env's user message)
                gap = decode(tokens[previous_end:span.start])
                assert gap == (rollout["prompt_text"] if k == 0 else turn["prompt_added_text"])
                if k > 0:
                    assert env_message(k + 1) in gap
                    num_later_turn_tokens += len(span)
                previous_end = span.stop
            num_multi_turn += len(turns) >= 2
            expected_valid += sum(t["num_completion_tokens"] for t in turns)
        # the trainer's own count of trained tokens: every turn's generated tokens, no more
        assert metrics[step]["loss/num_valid_tokens"] == expected_valid, step
        assert metrics[step]["rollout/num_turns"] > 1.0

    assert num_multi_turn > 0
    assert num_later_turn_tokens > 0


def test_per_turn_credit_reaches_the_trainer_and_validation_reports_each_turn(multi_turn_run):
    """credit = "turn": each turn's tokens were trained with that turn's own advantage, the
    group-relative return G_t = r_t + gamma * G_{t+1} of the env's per-turn rewards; validation
    logs each turn's reward part, and the summary holds the last validation's."""
    run_dir, batch_log = multi_turn_run
    received = _received_samples(batch_log)
    trained = {r["step"]: r["sample_ids"] for r in _jsonl(run_dir / "trained_samples.jsonl")}
    recorded = {(r["step"], r["sample_id"]): r
                for r in _jsonl(run_dir / "rollouts" / "rollouts.jsonl")}

    by_group: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for (step, _), rollout in recorded.items():
        by_group.setdefault((step, rollout["group_id"]), []).append(rollout)
    num_checked = 0
    for rollouts in by_group.values():
        if rollouts[0]["group_dropped"]:
            continue
        returns = []
        for rollout in rollouts:
            # a reply cut at max_tokens ends the rollout unstepped: no parts, reward 0
            assert [t["reward"] for t in rollout["turns"]] == [
                t["reward_parts"].get("a_to_m", 0.0) for t in rollout["turns"]]
            to_go, values = 0.0, []
            for turn in reversed(rollout["turns"]):
                to_go = turn["reward"] + TURN_DISCOUNT * to_go
                values.append(to_go)
            returns.append(values[::-1])
        for t in range(max(len(v) for v in returns)):
            reached = [(r, v[t]) for r, v in zip(rollouts, returns) if len(v) > t]
            mean = sum(g for _, g in reached) / len(reached)
            for rollout, g in reached:  # reinforce_pp_baseline: the mean baseline only
                assert rollout["turns"][t]["advantage"] == pytest.approx(g - mean, abs=1e-12)
                num_checked += 1
    assert num_checked > 0

    different_turn_advantages = 0
    for step, sample_ids in trained.items():
        expected_by_document, trained_values = [], []
        for document, sample_id in enumerate(sample_ids):
            rollout = recorded[(step, sample_id.rsplit("/", 1)[0])]
            tokens, _, _ = received[step][document]
            expected: list[float | None] = [None] * len(tokens)
            for turn in rollout["turns"]:
                for j in range(turn["num_prompt_tokens"],
                               turn["num_prompt_tokens"] + turn["num_completion_tokens"]):
                    expected[j] = turn["advantage"]
                    trained_values.append(turn["advantage"])
            expected_by_document.append(expected)
            different_turn_advantages += len({t["advantage"] for t in rollout["turns"]}) > 1
        # REINFORCE++: whitened over every trained token of the step (Bessel, eps 1e-8)
        mean = sum(trained_values) / len(trained_values)
        var = sum((a - mean) ** 2 for a in trained_values) / (len(trained_values) - 1)
        for document, expected in enumerate(expected_by_document):
            whitened = [0.0 if a is None else (a - mean) / (var + 1e-8) ** 0.5 for a in expected]
            assert received[step][document][2] == pytest.approx(whitened, abs=1e-5), document
    assert different_turn_advantages > 0  # turns of one rollout were credited differently

    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_metrics(run_dir)
    per_turn = summary["reward_after_per_turn"]
    assert sorted(per_turn) == [f"turn_{t}/a_to_m" for t in range(1, NUM_TURNS + 1)]
    for key, value in per_turn.items():
        assert metrics[NUM_STEPS][f"validation/{key}"] == value
        # the model's replies mix letters of both halves of the alphabet: 0 or 1 would mean the
        # turn's part was not averaged over its rollouts
        assert 0.0 < value < 1.0, (key, value)
    assert "validation/turn_1/a_to_m" in metrics[0]
    # The reference model is the starting policy: no KL before the first update, some after it.
    assert metrics[0]["loss/kl_mean"] == 0.0
    assert metrics[1]["loss/kl_mean"] > 0.0
    assert all(math.isfinite(metrics[s]["loss/objective"]) for s in range(NUM_STEPS))


def test_rollout_viewer_of_the_run_works_in_a_real_browser(multi_turn_run):
    """The page the run wrote, in headless Chromium (tests/metrics/rollout_viewer_browser.py):
    every recorded rollout and turn shown, the filters and the side-by-side step exact, no
    console error."""
    from tests.metrics.headless_chromium import require_chromium
    from tests.metrics.rollout_viewer_browser import assert_viewer_works

    require_chromium()
    run_dir, _ = multi_turn_run
    assert_viewer_works(run_dir, screenshot=run_dir / "rollout_viewer.png")
