"""The supervised warm start (assets/warm_start.py) on the tiny model: what it trains on,
how it batches, that it learns, and that its cache is reused."""

from __future__ import annotations

import logging
import os
import random
import threading

import pytest

from examples.alphabet_sort import AlphabetSortTask
from torchtitan_rl.assets.warm_start import (
    LENGTH_GROUP_BATCHES,
    WarmStart,
    _tokenize_with_assistant_mask,
    warm_start_metrics,
)

TASK = AlphabetSortTask.Config(min_turns=1, max_turns=3, min_names_per_turn=1,
                               max_names_per_turn=3).build()


def _conversation(i: int) -> list[dict[str, str]]:
    return TASK.solved_conversation(TASK.dataset("train")[i])


def test_mask_is_exactly_every_assistant_reply_and_its_end_token(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    conversation = _conversation(next(i for i in range(50)
                                      if TASK.dataset("train")[i].num_turns == 3))
    ids, mask = _tokenize_with_assistant_mask(tokenizer, conversation)
    assert len(ids) == len(mask)
    runs, current = [], []  # the masked runs of tokens, in order
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    replies = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert len(runs) == len(replies) == 3
    for run, reply in zip(runs, replies):
        assert run[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert tokenizer.decode(run[:-1]) == reply


def test_group_by_length_batches_see_random_examples_of_similar_length():
    examples = [([0] * n, [1] * n) for n in range(1, 200)]
    warm = WarmStart(WarmStart.Config(batch_size=4, group_by_length=True))
    batches = warm._batches(examples, random.Random(0))
    drawn = [next(batches) for _ in range(LENGTH_GROUP_BATCHES)]  # one draw, cut in batches
    assert all(len(b) == 4 for b in drawn)
    lengths = sorted(len(ids) for b in drawn for ids, _ in b)
    assert len(set(lengths)) == 4 * LENGTH_GROUP_BATCHES  # drawn without replacement
    for batch in drawn:  # each batch is a run of the sorted draw
        mine = sorted(len(ids) for ids, _ in batch)
        start = lengths.index(mine[0])
        assert lengths[start: start + 4] == mine
    assert [len(b[0][0]) for b in drawn] != sorted(len(b[0][0]) for b in drawn)  # shuffled

    plain = WarmStart(WarmStart.Config(batch_size=4))._batches(examples, random.Random(0))
    assert next(plain) == random.Random(0).sample(examples, 4)  # unchanged without it


@pytest.mark.slow  # 40 training steps in this process: the fast tier's largest cost by far
def test_warm_start_learns_and_its_cache_is_reused(tiny_model_dir, tmp_path, caplog,
                                                   monkeypatch):
    import torch

    warm = WarmStart(WarmStart.Config(enabled=True, num_steps=40, batch_size=8,
                                      num_conversations=64, group_by_length=True,
                                      num_threads=1, cache_dir=str(tmp_path)))
    out = warm.output_dir(tiny_model_dir, "alphabet", seed=0)
    caplog.set_level(logging.INFO, logger="torchtitan_rl.assets.warm_start")
    threads_in_steps: set[int] = set()
    train_step = WarmStart._step

    def counting_threads(*args):
        threads_in_steps.add(torch.get_num_threads())
        return train_step(*args)

    monkeypatch.setattr(WarmStart, "_step", staticmethod(counting_threads))
    # What the warm start sets, recorded as it calls it, and applied with torch._C's own setter:
    # an in-process vLLM CPU engine built earlier in this worker replaces torch.set_num_threads
    # with a no-op that warns, so reading the setting back would not show what was asked.
    set_threads: list[int] = []
    set_num_threads = torch._C.set_num_threads

    def recording_set(n: int) -> None:
        set_threads.append(n)
        set_num_threads(n)

    monkeypatch.setattr(torch, "set_num_threads", recording_set)
    set_num_threads(2)
    try:
        assert warm.run(base_model_dir=tiny_model_dir, out=out,
                        solved_conversation=_conversation, seed=0) == out
        assert threads_in_steps == {1} and set_threads == [1, 2]  # set, then given back
    finally:
        set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
    losses = [float(r.getMessage().split("loss=")[1].split()[0]) for r in caplog.records
              if "loss=" in r.getMessage()]
    assert losses[-1] < 0.6 * losses[0], losses
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    # its loss, kept beside the model for the run's metrics: the logged first step's, and the
    # mean of its last tenth (4 steps) around the logged last step's
    metrics = warm_start_metrics(out)
    assert metrics["warm_start/num_steps"] == 40 and metrics["warm_start/train_s"] > 0
    assert metrics["warm_start/loss_first"] == pytest.approx(losses[0], abs=1e-4)
    assert metrics["warm_start/loss_last"] < 0.6 * metrics["warm_start/loss_first"]
    written = (out / "model.safetensors").stat().st_mtime_ns

    caplog.clear()
    assert warm.run(base_model_dir=tiny_model_dir, out=out, solved_conversation=_conversation,
                    seed=0) == out
    assert any("reusing" in r.getMessage() for r in caplog.records)
    assert (out / "model.safetensors").stat().st_mtime_ns == written
    # A run that trained the same key beside this one and finishes second keeps the first's
    # files (in use by then) and leaves no temporary folder behind.
    caplog.clear()
    WarmStart(WarmStart.Config(num_steps=2, batch_size=2, num_threads=1))._train(
        tiny_model_dir, [_conversation(i) for i in range(4)], out, 0, {}, threading.Event())
    assert any("written by another run" in r.getMessage() for r in caplog.records)
    assert (out / "model.safetensors").stat().st_mtime_ns == written
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    # what determines the result is in the key; where it is cached is not
    other = WarmStart(WarmStart.Config(enabled=True, num_steps=41, cache_dir=str(tmp_path)))
    assert other.output_dir(tiny_model_dir, "alphabet", seed=0) != out
    elsewhere = WarmStart(WarmStart.Config(enabled=True, num_steps=40, batch_size=8,
                                           num_conversations=64, group_by_length=True,
                                           cache_dir=str(tmp_path / "x")))  # threads unset
    assert elsewhere.output_dir(tiny_model_dir, "alphabet", seed=0).name == out.name


@pytest.mark.slow  # trains in this process until the signal
def test_sigterm_during_the_warm_start_stops_it_at_its_next_step_writing_nothing(
        tiny_model_dir, tmp_path, monkeypatch):
    """The job trains its warm start in a worker thread, so the run's signal handler runs: the
    warm start stops between two steps, nothing is cached, the run ends as stopped (143)."""
    import asyncio
    import os
    import signal
    import types

    from torchtitan_rl.controller.hosts.reaper import RunStopped, run_stoppable
    from torchtitan_rl.controller.job import _make_model

    config = WarmStart.Config(enabled=True, num_steps=100_000, batch_size=2,
                              num_conversations=8, cache_dir=str(tmp_path))
    out = WarmStart(config).output_dir(tiny_model_dir, "alphabet", seed=0)
    plan = types.SimpleNamespace(
        warm_start=config, task=AlphabetSortTask.Config(), base_model_dir=str(tiny_model_dir),
        model_dir=str(out), seed=0, rollouter=types.SimpleNamespace(enable_thinking=None))
    loop: list[asyncio.AbstractEventLoop] = []
    steps: list[int] = []
    train_step = WarmStart._step

    def step_then_signal(self, *args):
        steps.append(len(steps))
        if len(steps) == 1:  # SIGTERM from the event loop's thread, as a terminal's would land
            loop[0].call_soon_threadsafe(os.kill, os.getpid(), signal.SIGTERM)
        return train_step(self, *args)

    monkeypatch.setattr(WarmStart, "_step", step_then_signal)

    async def run() -> None:
        loop.append(asyncio.get_running_loop())
        await _make_model(plan)

    with pytest.raises(RunStopped) as stopped:
        run_stoppable(run())
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert 1 <= len(steps) < config.num_steps
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing cached, no temp dir
