"""The relayed weight push through real Monarch procs (vLLM, torchtitan, simulated hosts): its
per-sender bytes do not grow with the generators, every generator reads back bit-exact, and a
relay generator killed mid-push is survived (weight_sync/relay.py, controller/fleet/generator_pool.py).
Each job runs in a process of its own (see tests/controller/run_tiny_job.py)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests.controller.jobs import REPO_ROOT, TINY_MODEL_BYTES, env_without_faults, read_metrics

CHUNK_BYTES = 64 << 10
"""9 chunks of the tiny model: the chain is pipelined, and a kill can land mid-push."""


def _run_job(out: pathlib.Path, name: str, num_steps: int, *extra: str,
             fault: str | None = None) -> subprocess.CompletedProcess:
    env = env_without_faults(fault)
    return subprocess.run(
        [sys.executable, "-m", "tests.controller.run_tiny_job", str(out), name, str(num_steps),
         "--num-generators", "4", "--placement", "process", "--verify",
         "--relay-chunk-bytes", str(CHUNK_BYTES), *extra],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
def test_a_relayed_push_sends_each_byte_once_lands_bit_exact_and_survives_a_killed_relay(tmp_path):
    """One job: two FSDP trainer ranks push through a chain of 4 generators; generator_1 is
    killed mid-push of v1 and replaced, and the run goes on long enough for later pushes to
    reach all 4 again: paced at 20 tokens/s, a step lasts about a second (asleep); a replacement
    took 11 s on an idle box and was serving by step 1, so 14 steps leave it about twice that."""
    num_steps = 14
    proc = _run_job(tmp_path, "relay", num_steps, "--num-prompts", str(2 * num_steps),
                    "--num-trainer-ranks", "2", "--engine", "stand_in",
                    "--stand-in-tokens-per-s", "20", fault="kill_generator_mid_relay:2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stderr
    assert "relay v1: generator_1 was lost (chain position 1 of 4)" in log, log[-4000:]
    # The survivors past it took a second attempt; all 3 were read back bit-exact.
    assert "relay v1: attempt 1 to generator_2,generator_3" in log, log[-4000:]
    metrics = read_metrics(tmp_path / "relay")
    assert metrics[0]["weight_sync/relayed_generators_verified"] == 3
    # The first four share one proc mesh (one health poll); the replacement has its own.
    assert "generators: one proc mesh for 4 on 4 host(s)" in log, log[-4000:]
    assert "generator generator_1_r1 started" in log, log[-4000:]
    assert "generator_1 replaced by generator_1_r1" in log, log[-4000:]  # pushed and verified
    assert metrics[num_steps - 1]["generator/restarts"] == 1
    whole = [m for m in metrics.values()
             if m.get("weight_sync/relayed_generators_verified") == 4]
    assert whole, "no push reached all 4 generators after the replacement"
    for m in whole:
        assert m["weight_sync/model_bytes"] == TINY_MODEL_BYTES
        # Two FSDP ranks: each sends its own shards, half the model, and never gathers it.
        assert m["weight_sync/busiest_trainer_rank_bytes"] == TINY_MODEL_BYTES / 2
        assert m["weight_sync/busiest_generator_bytes"] == TINY_MODEL_BYTES  # forwards once
        assert m["weight_sync/busiest_sender_bytes"] <= 2 * TINY_MODEL_BYTES
        # The trainer's ranks once, then three generators forward once each; the tail nothing.
        assert m["weight_sync/bytes_moved"] == 4 * TINY_MODEL_BYTES
        assert m["weight_sync/generators_by_shared_memory"] == 0
