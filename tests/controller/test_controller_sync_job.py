"""The synchronous job end to end (Monarch meshes, vLLM generator, torchtitan trainer): a 3-step run
leaves finite metrics, TensorBoard scalars and checkpoints; resuming it from its step-2 checkpoint
repeats step 3 bit for bit; cross-field config errors are one line each."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import subprocess
import sys

import pytest
import torch

from tests.controller.jobs import (
    LETTERS_TOML,
    REPO_ROOT,
    read_hf_weights,
    read_metrics,
    run_module,
    tiny_job,
)
from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import parse_args
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.metrics import step_breakdown, trace_plot
from torchtitan_rl.train import main


@pytest.fixture
def uninterrupted_run(sync_tiny_run):
    return sync_tiny_run


@pytest.mark.slow
def test_three_step_sync_run_logs_finite_metrics_tensorboard_and_checkpoints(uninterrupted_run):
    run_dir, summary = uninterrupted_run
    assert summary["steps"] == 3
    metrics = read_metrics(run_dir)
    # the summary's rewards are the first and the last validation's, as logged
    assert summary["reward_before"] == metrics[0]["validation/reward_mean"]
    assert summary["reward_after"] == metrics[3]["validation/reward_mean"]
    # the rise is paired by episode: with every episode's samples counted, its mean is the
    # difference of the two means, and its standard error the episodes' (validation.py)
    assert summary["rise"] == pytest.approx(summary["reward_after"] - summary["reward_before"])
    state = json.loads((run_dir / "checkpoints" / "step-000003" / "controller.json").read_text())
    before, after = (state["first_validation_episode_means"],
                     state["last_validation_episode_means"])
    assert len(before) == len(after) == 2  # validation.num_prompts episodes
    assert summary["rise_stderr"] == pytest.approx(
        abs((after[0] - before[0]) - (after[1] - before[1])) / 2)  # stdev of 2 over sqrt(2)
    if summary["rise_stderr"] > 1e-12:
        assert summary["rise_z"] == pytest.approx(summary["rise"] / summary["rise_stderr"])
    else:
        assert summary["rise_z"] is None
    for step in range(3):
        for key in ("loss/value", "loss/ratio_mean", "loss/clipped_frac", "rollout_reward/mean",
                    "rollout_reward/std", "rollout/num_turns", "batcher/pct_pad_in_batch",
                    "time/generate_s", "time/train_s", "time/push_s",
                    "throughput/generated_tokens_per_s", "trainer/grad_norm"):
            assert key in metrics[step], (step, key)
            assert math.isfinite(metrics[step][key]), (step, key, metrics[step][key])
    assert metrics[0]["loss/num_valid_tokens"] > 0  # the tiny model really trained
    # every step trained (the random model's rewards have spread): counted, step by step, and
    # said by the summary; the answers per step, none collapsed
    assert summary["trained_steps"] == 3 and summary["untrained_steps"] == 0
    assert [metrics[step]["run/steps_trained"] for step in range(3)] == [1.0, 2.0, 3.0]
    assert all(metrics[step]["run/step_trained"] == 1.0 for step in range(3))
    for step in range(3):
        assert 1 <= metrics[step]["rollout/answers_distinct_per_group"] <= 4  # group_size 4
        assert 1 / 8 <= metrics[step]["rollout/answers_top_share"] <= 1  # 2 groups x 4
        assert metrics[step]["rollout/entropy_estimate"] > 0  # -mean(sampled logprobs)
    assert summary["answer_collapse"] is None
    assert summary["constant_answer_reward"] is None  # LetterTask cannot solve its episodes
    # where the wall time went: every part measured, together within the run's wall time
    breakdown = summary["wall_s_breakdown"]
    assert list(breakdown) == ["model", "warm_start", "start_up", "validation", "steps",
                               "checkpoints", "export", "shutdown"]
    assert breakdown["start_up"] > 0 and breakdown["steps"] > 0
    assert all(seconds >= 0 for seconds in breakdown.values())
    assert sum(breakdown.values()) <= summary["wall_s"] + 0.01 * len(breakdown)  # rounding
    # each validation's rollouts are kept, decoded, as the training rollouts are
    validation = [json.loads(line) for line in
                  (run_dir / "rollouts" / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in validation] == [0, 0, 3, 3]  # 2 prompts, before and after
    assert [r["reward"] for r in validation[:2]] == before  # the first validation's episodes
    assert sum(r["reward"] for r in validation[2:]) / 2 == pytest.approx(summary["reward_after"])
    assert all(r["completion_text"] and r["prompt_text"].startswith("<|im_start|>")
               for r in validation)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"loss/value", "rollout_reward/mean", "validation/reward_mean"} <= scalars
    assert [e.step for e in events.Scalars("loss/value")] == [0, 1, 2]

    for step in (1, 2, 3):
        checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
        assert (checkpoint / "controller.json").is_file()
        assert (checkpoint / "checksums.sha256").read_text().count("trainer/") >= 2  # DCP's files
        assert json.loads((checkpoint / "controller.json").read_text())["step"] == step
    assert (run_dir / "hf" / "config.json").is_file()
    assert (run_dir / "reward_curve.png").stat().st_size > 0
    assert (run_dir / "step_breakdown.png").stat().st_size > 0


@pytest.mark.slow
def test_each_steps_wall_time_is_broken_down_and_the_engines_report_their_own_numbers(
        uninterrupted_run):
    """time/breakdown/* (metrics/step_breakdown.py): the parts of each step's wall time, from
    the previous step's push to its own, sum to time/step_wall_s, which equals the distance
    between the timeline's push ends; validation 0 falls in step 0, checkpoints 1 and 2 in steps
    1 and 2. engine/generator_0/* (generator/engine_stats.py) are vLLM's own counts: at step 2
    (no validation in its window) its generated tokens are the step's rollout tokens."""
    run_dir, _ = uninterrupted_run
    metrics = read_metrics(run_dir)
    events = json.loads((run_dir / "trace.json").read_text())
    push_ends = [e["ts"] + e["dur"] for e in events if e["ph"] == "X" and e["name"] == "push"
                 and e["pid"] == 1]
    for step in range(3):
        m = metrics[step]
        parts = {part: m[f"time/breakdown/{part}_s"] for part in step_breakdown.PARTS}
        assert all(seconds >= 0 for seconds in parts.values()), (step, parts)
        assert sum(parts.values()) == pytest.approx(m["time/step_wall_s"], abs=1e-9)
        assert parts["wait_for_batch"] == m["time/generate_s"]
        assert parts["train"] == m["time/train_s"] and parts["push"] == m["time/push_s"]
        if step:  # the trace's clock is the loop's: the push ends are the step boundaries
            assert m["time/step_wall_s"] * 1e6 == pytest.approx(
                push_ends[step] - push_ends[step - 1], abs=5.0)
    assert [metrics[s]["time/breakdown/validate_s"] > 0 for s in range(3)] == [True, False, False]
    assert [metrics[s]["time/breakdown/checkpoint_s"] > 0 for s in range(3)] == [
        False, True, True]
    rows = step_breakdown.read_breakdowns(run_dir / "metrics.jsonl")
    assert [step for step, _ in rows] == [0, 1, 2]

    for step in range(3):
        m = {k.removeprefix("engine/generator_0/"): v for k, v in metrics[step].items()
             if k.startswith("engine/generator_0/")}
        assert m["num_steps"] > 0 and m["generation_tokens"] > 0 and m["prompt_tokens"] > 0
        assert 0 < m["kv_cache_usage_max"] <= 1 and 0 < m["num_running_max"] <= 8
        assert 0 <= m["prefix_cache_hit_rate"] <= 1 and m["num_preemptions"] == 0
        for name in ("time_to_first_token_s", "inter_token_latency_s"):
            assert 0 < m[f"{name}_p50"] <= m[f"{name}_p90"] <= m[f"{name}_p99"]
    step_tokens = metrics[2]["throughput/generated_tokens_per_s"] * metrics[2]["time/step_s"]
    assert metrics[2]["engine/generator_0/generation_tokens"] == pytest.approx(step_tokens)
    assert (run_dir / "rollouts" / "rollouts.jsonl").read_text().count("\n") == 3 * 2 * 4


@pytest.mark.slow
def test_the_run_writes_its_timeline_for_perfetto(uninterrupted_run, tmp_path):
    """trace.json (metrics/trace.py) in the Trace Event Format Perfetto and chrome://tracing
    read: valid JSON once closed; the controller's tracks named; every step's wait, train and
    push in order without overlap; validations and checkpoints; each routed request one async
    slice on its generator's track, as many as the router counted."""
    run_dir, _ = uninterrupted_run
    events = json.loads((run_dir / "trace.json").read_text())
    assert isinstance(events, list) and events[-1]["name"] == "trace_end"
    for event in events:
        assert event["ph"] in ("M", "X", "b", "e") and isinstance(event["pid"], int)
        assert event["ph"] == "M" or event["ts"] >= 0
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and "args" in e
             and e["name"] in ("process_name", "thread_name")}
    assert {(1, "controller"), (1, "steps"), (1, "staleness gate"), (100, "generator_0")} <= names
    steps = [e for e in events if e["ph"] == "X" and e["name"] in
             ("wait for batch", "train", "push")]
    assert [(e["args"]["step"], e["name"]) for e in steps] == [
        (step, name) for step in range(3) for name in ("wait for batch", "train", "push")]
    for before, after in zip(steps, steps[1:]):  # one step's phases follow each other
        assert before["ts"] + before["dur"] <= after["ts"] + 0.2
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["args"]["step"] for e in spans if e["name"] == "validation"] == [0, 3]
    assert [e["args"]["step"] for e in spans if e["name"] == "checkpoint"] == [1, 2, 3]
    assert len([e for e in spans if e["name"] == "admit"]) == 3 * 2  # one per group
    begins = [e for e in events if e["ph"] == "b"]
    ends = {e["id"]: e for e in events if e["ph"] == "e"}
    assert len(ends) == len(begins) and all(ends[b["id"]]["ts"] >= b["ts"] for b in begins)
    assert {b["pid"] for b in begins} == {100}
    assert all(b["args"]["key"].startswith("group=") for b in begins)  # the request's id
    # routed by step 2's metrics: the first validation and the 3 steps' requests; then the last
    # validation's, as many as the first's (one request a single-turn rollout)
    routed = read_metrics(run_dir)[2]["router/generator_0/num_routed"]
    validation_rollouts = (run_dir / "rollouts" / "validation.jsonl").read_text().count("\n")
    assert len(begins) == routed + validation_rollouts // 2
    assert all(b["args"]["outcome"] == "done" for b in begins)
    # the generator's own tracks: its engine steps, as many as vLLM counted in the steps' windows
    # (the last validation's come after the last read), and its part of each push
    engine_steps = [e for e in spans if e["pid"] == 100 and e["name"] == "step"]
    assert len(engine_steps) == sum(read_metrics(run_dir)[s]["engine/generator_0/num_steps"]
                                    for s in range(3))
    assert all(e["args"]["requests"] >= 1 and e["args"]["tokens"] >= 1 for e in engine_steps)
    pushes = [e for e in spans if e["pid"] == 100 and e["name"].startswith("push v")]
    assert [e["name"] for e in pushes] == ["push v1", "push v2", "push v3"]
    for push in pushes:
        inside = [e for e in spans if e["pid"] == 100 and push["ts"] <= e["ts"]
                  and e["ts"] + e["dur"] <= push["ts"] + push["dur"] + 0.2]
        assert {"gather", "send and pull", "convert", "load"} <= {e["name"] for e in inside}
    # each trainer rank's forward and backward per microbatch and its optimizer step, inside the
    # controller's train slice of the step
    assert (10, "trainer rank 0") in names
    trains = [e for e in steps if e["name"] == "train"]
    for pid in {e["pid"] for e in spans if 10 <= e["pid"] < 100}:
        rank = [e for e in spans if e["pid"] == pid]
        assert [e["name"] for e in rank if e["name"] == "optimizer"] == ["optimizer"] * 3
        for name in ("forward", "backward"):
            assert [e["args"]["microbatch"] for e in rank if e["name"] == name][:1] == [0]
        for e in rank:  # wall clock mapped onto the controller's: within a millisecond
            assert any(t["ts"] - 1e3 <= e["ts"] and e["ts"] + e["dur"] <= t["ts"] + t["dur"] + 1e3
                       for t in trains), e
    # drawn offline as a Gantt chart (metrics/trace_plot.py), step 1 alone and the whole run
    for steps in ((1, 1), None):
        out = trace_plot.plot(run_dir / "trace.json", tmp_path / f"timeline-{steps}.png", steps)
        assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_a_run_resumed_from_its_step_2_checkpoint_repeats_step_3_bit_for_bit(
        uninterrupted_run, tmp_path, caplog):
    """The uninterrupted run's folder with one bit of its step-3 checkpoint's largest trainer
    shard flipped and the export gone (the logs of step 3 still there), resumed: the corrupt
    checkpoint is found by its checksums and set aside in one logged line, the run resumes from
    step 2, and step 3's metrics and the final weights equal the uninterrupted run's exactly.
    (That two runs of one seed are identical at every step is the rollout-worker job's check
    against the same run.)"""
    full_dir, _ = uninterrupted_run
    run_dir = tmp_path / "full"
    shutil.copytree(full_dir, run_dir)
    shard = max((run_dir / "checkpoints" / "step-000003" / "trainer").glob("*.distcp"),
                key=lambda path: path.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    shutil.rmtree(run_dir / "hf")
    config = tiny_job(tmp_path, "full")
    with caplog.at_level(logging.WARNING, logger="torchtitan_rl.controller.checkpoint"):
        summary = main(dataclasses.replace(config, checkpoint=dataclasses.replace(
            config.checkpoint, resume="must")))
    assert summary["steps"] == 3 and summary["resumed_from_step"] == 2
    unusable = [r.getMessage() for r in caplog.records if "is unusable" in r.getMessage()]
    assert len(unusable) == 1 and "step-000003 is unusable (trainer/" in unusable[0], unusable
    assert f"trainer/{shard.name} does not match its sha256" in unusable[0]
    (aside,) = (run_dir / "checkpoints").glob("step-000003.unusable-*")  # kept, renamed
    assert (aside / "trainer" / shard.name).read_bytes() == bytes(data)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss/value" in r] == [0, 1, 2]  # step 3 logged once
    full, again = read_metrics(full_dir), read_metrics(run_dir)
    for step in range(3):
        for key in ("loss/value", "trainer/grad_norm", "rollout_reward/mean",
                    "loss/num_valid_tokens"):
            assert again[step][key] == full[step][key], (step, key)  # exact, not approximate
        assert again[step]["async/policy_age_max"] == 0
    final_full = read_hf_weights(full_dir / "hf")
    final_again = read_hf_weights(run_dir / "hf")
    assert final_full.keys() == final_again.keys()
    for name in final_full:
        assert torch.equal(final_full[name], final_again[name]), name
    # and training did move the weights
    start = read_hf_weights(REPO_ROOT / "assets" / "models" / "tiny")
    assert any(not torch.equal(start[n], final_full[n]) for n in final_full if n in start)


def _config(*argv: str) -> RLJob.Config:
    return parse_args(RLJob.Config, ["--model.size", "tiny", "--task.type",
                                     "tests.controller.letter_task:LetterTask", *argv]).config


@pytest.mark.parametrize("argv, message", [
    (["--generator.tensor_parallel_degree", "4"],
     "generator.tensor_parallel_degree=4 must divide the model's attention heads (2) and either"),
    (["--trainer.tensor_parallel_degree", "2", "--num_trainer_ranks", "2"],
     "trainer.tensor_parallel_degree=2 must divide the model's attention heads (2) and kv heads (1)"),
    (["--num_trainer_ranks", "3", "--trainer.data_parallel_shard_degree", "2"],
     "num_trainer_ranks=3 must equal trainer.data_parallel_shard_degree (2)"),
    (["--batcher.seq_len", "100", "--rollouter.max_rollout_tokens", "200"],
     "batcher.seq_len=100 is shorter than a rollout can be"),
    (["--rollouter.max_rollout_tokens", "4096"],
     "rollouter.max_rollout_tokens=4096 exceeds generator.max_model_len=2048"),
    (["--sampling.max_tokens", "600", "--rollouter.max_rollout_tokens", "512"],
     "sampling.max_tokens=600 leaves no room for the prompt"),
    (["--loop.partial_rollout", "abort"],
     "loop.partial_rollout='abort' needs loop.staleness.max_staleness >= 1"),
    (["--generator.seed", "3"], "generator.seed: a job's parts take the job's seed"),
    (["--trainer.num_minibatches", "9", "--loop.groups_per_step", "8"],
     "trainer.num_minibatches=9 is more mini-batches than a step has groups"),
    (["--warm_start.enabled"], "warm_start.enabled needs a task that solves its episodes"),
])
def test_cross_field_errors_name_the_fields(tiny_model_dir, argv, message):
    with pytest.raises(ConfigError) as e:
        RLJob(_config(*argv)).resolve()
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_group_size_below_two_is_rejected_before_anything_runs():
    with pytest.raises(ConfigError, match=r"^rollouter: group_size must be >= 2 .*got 1$"):
        _config("--rollouter.group_size", "1")


@pytest.mark.slow
def test_a_task_defined_only_in_tests_runs_a_real_job_from_a_toml_file(letters_toml_run):
    run_dir, proc = letters_toml_run  # python -m torchtitan_rl.train --config <its TOML>
    assert "steps=2" in proc.stdout.strip().splitlines()[-1].split()
    metrics = read_metrics(run_dir)
    assert all(metrics[step]["loss/num_valid_tokens"] > 0 for step in (0, 1))
    # the rollouts are LetterTask's episodes (its prompt text), recorded at step 0
    recorded = (run_dir / "rollouts" / "rollouts.jsonl").read_text()
    assert "Write words, train prompt" in recorded
    # The TOML's algorithms: REINFORCE++ (a rollout's advantage is its reward until the step
    # whitens it in the trainer), dual-clip PPO with seq-mean-token-sum, all finite.
    rollouts = [json.loads(line) for line in recorded.splitlines()]
    assert all(r["advantage"] == r["reward"] for r in rollouts if not r["group_dropped"])
    assert all(math.isfinite(metrics[step]["loss/objective"]) for step in (0, 1))
    # trainer.num_minibatches = 2, ppo_epochs = 2: four updates a step, one policy version
    assert all(metrics[step]["trainer/num_updates"] == 4 for step in (0, 1))
    assert [metrics[step]["trainer/policy_version"] for step in (0, 1)] == [1, 2]
    # Dynamic sampling: a broken prompt's group (all its rollouts error_env) has no signal; each
    # was replaced, none trained.
    trained = [json.loads(line) for line in (run_dir / "trained_samples.jsonl").read_text(
        ).splitlines()]
    replaced = [g for record in trained for g in record["replaced_group_ids"]]
    assert replaced and metrics[1]["async/groups_replaced"] == len(replaced)
    assert metrics[1]["async/groups_dropped"] == len(replaced)
    assert all(len(record["group_ids"]) == 2 for record in trained)
    assert all(r["group_dropped"] is None for r in rollouts)
    assert not {r["group_id"] for r in rollouts} & set(replaced)
    # The greedy reference (validation.greedy_reference): measured once, at the first validation,
    # logged, kept in the summary and drawn in reward_curve.png beside validation's line.
    summary = json.loads((run_dir / "summary.json").read_text())
    greedy = summary["greedy_reward_before"]
    assert isinstance(greedy, float) and 0.0 <= greedy <= 1.0
    assert metrics[0]["validation/greedy_reward"] == greedy
    assert "validation/greedy_reward" not in metrics[2]  # the last validation: not measured again
    firsts = [line for line in (proc.stdout + proc.stderr).splitlines()
              if "validation step=0" in line]
    assert len(firsts) == 1 and f"greedy answers {greedy:.4f}" in firsts[0], proc.stderr[-3000:]


@pytest.mark.slow
def test_a_task_failing_on_some_rollouts_goes_on_with_one_line_per_validation(letters_toml_run):
    """The shared run's task raises in score() on one prompt in three: the run finishes, and
    each validation says so in one console line naming the error and the task's file:line."""
    run_dir, proc = letters_toml_run
    warnings = [line for line in proc.stderr.splitlines() if "failed in the task" in line]
    assert len(warnings) == 2, proc.stderr[-3000:]  # before the first step and after the last
    for line in warnings:
        assert "20 of 64 rollouts failed in the task: score() raised ValueError(\"this prompt's " \
               "scorer is broken on purpose\") at tests/controller/letter_task.py:" in line, line
        assert "(x20)" in line and "the run goes on" in line
    assert "rollout env" not in proc.stderr and "scoring raised" not in proc.stderr


@pytest.mark.slow
def test_a_task_failing_on_every_rollout_stops_at_once_with_one_line(tmp_path):
    """Every prompt's score() raises: the run stops in its first validation (before any step),
    exit 1, one error line naming the task, the count, the error and its file:line; nothing is
    written as if trained."""
    proc = run_module("torchtitan_rl.train", "--config", LETTERS_TOML, "--output_dir",
                      str(tmp_path), "--task.broken_score_every", "1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert ("task tests.controller.letter_task:LetterTask: validation at step 0: 2 of 2 rollouts "
            "failed in the task: score() raised ValueError(\"this prompt's scorer is broken on "
            "purpose\") at tests/controller/letter_task.py:") in errors[0], errors[0]
    assert "loop.max_task_error_fraction" in errors[0]
    assert "Traceback" not in proc.stderr and "rollout env" not in proc.stderr
    run_dir = tmp_path / "letters"
    assert not (run_dir / "summary.json").exists() and not (run_dir / "hf").exists()
    assert not list(run_dir.glob("checkpoints/step-*"))
    assert proc.stdout.strip() == ""  # no last line with rewards


@pytest.mark.slow
def test_missing_model_directory_exits_2_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_rl.train", "--model.path", str(tmp_path / "nope"),
         "--output_dir", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: model.path: {tmp_path / 'nope'} is not an HF model directory "
                      "(no config.json)"]
    assert "Traceback" not in proc.stderr
