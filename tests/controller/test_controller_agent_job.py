"""An agent task through the whole stack (Monarch meshes, vLLM generator, torchtitan trainer, the
run's OpenAI-compatible endpoint on 127.0.0.1, the real `openai` client): the job trains 2 steps
and every trained sample's tokens are the tokens the generator produced, as the endpoint returned
them to the agent (vLLM's ``return_token_ids``), the loss mask exactly on the model's tokens; and
agents run in rollout workers (each serving its own endpoint) train the same samples and losses.
The job in the controller also gets junk on a live episode's URL while it trains (letter_agent's
SEND_JUNK: bad bodies, 200 concurrent connections, a client gone mid-body): each is a 4xx, and
its samples and losses equal those of the workers' job, which got none.

What the trainer received is read from ``trainer.debug_batch_log``; which document is which sample
from trained_samples.jsonl (see test_controller_multi_turn_job.py).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import pytest

from tests.controller import letter_agent
from tests.controller.jobs import read_metrics, tiny_job
from tests.controller.letter_task import LetterTask
from tests.controller.test_controller_multi_turn_job import STOP_TOKEN_IDS, _received_samples
from torchtitan_rl.controller.checkpoint.checkpointer import Checkpointer
from torchtitan_rl.controller.loop.validation import VALIDATION_GROUP_OFFSET, Validator
from torchtitan_rl.generator.generator import Generator
from torchtitan_rl.rollout.agent_task import AgentTask
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.train import main
from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.types import Sampling

pytestmark = pytest.mark.slow  # a whole job

NUM_STEPS = 2
SEQ_LEN = 512  # rollout 1 offers a tool: the listing of it is ~370 tiny-tokenizer tokens


def _agent_job(tmp_path: pathlib.Path, name: str, *, num_workers: int = 0,
               batch_log: pathlib.Path | None = None):
    base = tiny_job(tmp_path, name, num_steps=NUM_STEPS)
    return dataclasses.replace(
        base,
        task=AgentTask.Config(agent="tests.controller.letter_agent:run",
                              episodes=LetterTask.Config(), tool_parser="hermes"),
        rollouter=Rollouter.Config(group_size=4, max_turns=2, max_rollout_tokens=SEQ_LEN,
                                   num_workers=num_workers),
        sampling=Sampling(max_tokens=12, stop_token_ids=STOP_TOKEN_IDS),
        generator=Generator.Config(max_model_len=SEQ_LEN, kv_cache_bytes=32 << 20),
        batcher=Batcher.Config(seq_len=SEQ_LEN),
        trainer=dataclasses.replace(
            base.trainer, debug_batch_log=str(batch_log) if batch_log is not None else ""),
        validation=Validator.Config(num_prompts=2),
        checkpoint=Checkpointer.Config(every_steps=0, export_hf=False),
    )


@dataclasses.dataclass(frozen=True)
class AgentRun:
    """The agents-in-the-controller job, and what its agents saw (letter_agent's records)."""

    run_dir: pathlib.Path
    summary: dict[str, Any]
    batch_log: pathlib.Path
    calls: dict[tuple[int, int], list[dict[str, Any]]]
    checks: list[tuple[str, str]]
    tool_calls: list[Any]
    junk: list[tuple[str, int]]


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory: pytest.TempPathFactory) -> AgentRun:
    """One job shared by both tests: the second compares it with agents in rollout workers."""
    out = tmp_path_factory.mktemp("agent_job")
    letter_agent.CALLS.clear()
    letter_agent.CHECKS.clear()
    letter_agent.TOOL_CALLS.clear()
    letter_agent.JUNK.clear()
    batch_log = out / "trainer_batches.jsonl"
    letter_agent.SEND_JUNK = True
    try:
        summary = main(_agent_job(out, "agent", batch_log=batch_log))
    finally:
        letter_agent.SEND_JUNK = False
    return AgentRun(out / "agent", summary, batch_log, dict(letter_agent.CALLS),
                    list(letter_agent.CHECKS), list(letter_agent.TOOL_CALLS),
                    list(letter_agent.JUNK))


def test_agent_job_trains_exactly_the_generated_tokens(agent_run: AgentRun) -> None:
    summary, batch_log, run_dir = agent_run.summary, agent_run.batch_log, agent_run.run_dir
    assert summary["steps"] == NUM_STEPS

    # the error answers, through the real server and client
    assert agent_run.checks, "no agent of rollout 0 ran"
    for unknown, malformed in agent_run.checks:
        assert unknown.startswith("404 ") and "no episode unknown-g" in unknown, unknown
        assert malformed.startswith("400 messages[0].role "), malformed
        assert "messages[0].role: one of ['system'" in malformed, malformed
    # the junk sent to a live episode while the run trained: each answered 4xx (the client gone
    # mid-body gets nothing); that it changed nothing is the workers' test (no junk there)
    assert agent_run.junk == [("started", 0), ("malformed JSON", 400), ("wrong type", 400),
                              ("missing field", 400), ("unknown model", 404),
                              ("negative max_tokens", 400), ("huge max_tokens", 400),
                              ("token id out of the vocabulary", 400)] + [
        ("200 concurrent: unknown model", 404)] * 200 + [
        ("body over the size limit", 413), ("not HTTP", 400), ("disconnects mid-body", 0)]

    received = _received_samples(batch_log)
    trained = {json.loads(line)["step"]: json.loads(line)["sample_ids"]
               for line in (run_dir / "trained_samples.jsonl").read_text().splitlines()}
    metrics = read_metrics(run_dir)
    assert sorted(received) == sorted(trained) == list(range(NUM_STEPS))
    num_two_call_samples = num_tool_samples = 0
    for step in range(NUM_STEPS):
        assert sorted(received[step]) == list(range(len(trained[step])))
        assert metrics[step]["rollout/status/error_env"] > 0  # rollout 3's agent raised
        num_valid = 0
        for document, sample_id in enumerate(trained[step]):
            group, rollout, branch = (int(part.split("=")[1]) for part in sample_id.split("/"))
            assert group < VALIDATION_GROUP_OFFSET and branch == 0
            assert rollout != 3, "an errored rollout was trained on"
            calls = agent_run.calls[(group, rollout)]
            tokens, mask, _ = received[step][document]
            last = calls[-1]
            # the sample is the last call's prompt + completion, token for token
            assert tokens == last["prompt_token_ids"] + last["token_ids"], sample_id
            # the trained tokens are exactly the generated ones, every call's
            assert [t for t, m in zip(tokens, mask) if m] == [
                t for call in calls for t in call["token_ids"]], sample_id
            start = 0
            for call in calls:  # ... at their positions: each call's prompt is the sequence so far
                assert tokens[: len(call["prompt_token_ids"])] == call["prompt_token_ids"]
                begin = len(call["prompt_token_ids"])
                assert mask[start:begin] == [0] * (begin - start)
                assert mask[begin:begin + len(call["token_ids"])] == [1] * len(call["token_ids"])
                start = begin + len(call["token_ids"])
            num_two_call_samples += len(calls) == 2
            num_tool_samples += len(calls) == 2 and rollout == 1
            num_valid += len(last["token_ids"]) + sum(len(c["token_ids"]) for c in calls[:-1])
        assert metrics[step]["loss/num_valid_tokens"] == num_valid, step
    assert num_two_call_samples > 0
    # rollout 1's tool result continued its sample (checked above like every other sample)
    assert agent_run.tool_calls and num_tool_samples > 0


def test_agents_in_rollout_workers_train_the_samples_and_losses_of_agents_in_the_controller(
        agent_run: AgentRun, tmp_path: pathlib.Path) -> None:
    # Each worker serves its own endpoint (a free port) to the agents of its groups; S = 0 and
    # one seed: where an agent runs must change nothing but the wires (the trainer's batch log
    # of the run in the controller changes nothing either), and the junk the run in the
    # controller got changed nothing (the workers' agents send none).
    main(_agent_job(tmp_path, "in_workers", num_workers=2))
    trained = [[json.loads(line)["sample_ids"] for line in
                (run_dir / "trained_samples.jsonl").read_text().splitlines()]
               for run_dir in (agent_run.run_dir, tmp_path / "in_workers")]
    assert trained[0] == trained[1] and all(trained[0])
    expected, got = read_metrics(agent_run.run_dir), read_metrics(tmp_path / "in_workers")
    for step in range(NUM_STEPS):
        for key in ("loss/value", "loss/num_valid_tokens", "rollout_reward/mean",
                    "rollout/status/error_env"):
            assert got[step][key] == expected[step][key], (step, key)
        assert got[step]["rollout/status/error_env"] > 0  # rollout 3's agent raised, in a worker
        assert "rollout/workers_replaced" in got[step]  # the workers' pool ran the groups
        assert "rollout/workers_replaced" not in expected[step]
