"""The staleness gate under random finish orders: bound never violated, S = 0 is the sync loop."""

from __future__ import annotations

import asyncio
import random

import pytest

from torchtitan_rl.controller.loop.data_cursor import DataCursor
from torchtitan_rl.controller.loop.staleness import StalenessGate


async def _simulate(max_staleness: int, groups_per_step: int, num_steps: int, seed: int, *,
                    replacements: int = 0, dropped: frozenset[int] = frozenset()):
    """Workers admit groups (as the loop's producer: up to the run's total) and finish them in a
    random order; the trainer consumes P per step and publishes a new version after each. Groups
    in ``dropped`` finish without a signal (dynamic sampling replaces up to ``replacements`` a
    version). Returns per-step (group_id, admit_version) lists, the most groups outstanding at
    once, and the ids replaced."""
    rng = random.Random(seed)
    gate = StalenessGate.Config(max_staleness=max_staleness).build(
        groups_per_step=groups_per_step, replacements_per_version=replacements)
    running: list[int] = []
    steps: list[list[tuple[int, int]]] = []
    replaced: list[int] = []
    max_admitted_seen = 0

    async def trainer() -> None:
        for step in range(num_steps):
            taken = await gate.take_step_groups(step)
            steps.append([(g, v) for g, v, _ in taken])
            await gate.publish_policy_version(step + 1)

    train_task = asyncio.create_task(trainer())
    while not train_task.done():
        # admit whatever capacity allows, then finish one random running group
        while gate.can_admit() and gate.num_admitted_live < num_steps * groups_per_step:
            group_id, _ = await gate.admit()
            running.append(group_id)
        max_admitted_seen = max(max_admitted_seen, gate.num_admitted_live - gate.num_consumed)
        if running:
            group_id = running.pop(rng.randrange(len(running)))
            if await gate.finish(group_id, f"g{group_id}", replaceable=group_id in dropped):
                replaced.append(group_id)
        await asyncio.sleep(0)  # let the trainer task run (a scheduling point, not a wait on time)
    await train_task
    return steps, max_admitted_seen, replaced


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_staleness_bound_holds_under_random_finish_orders(max_staleness, seed):
    P = 3
    steps, max_outstanding, _ = asyncio.run(
        asyncio.wait_for(_simulate(max_staleness, P, num_steps=12, seed=seed), timeout=30)
    )
    assert len(steps) == 12
    consumed = [g for step in steps for g, _ in step]
    assert len(consumed) == len(set(consumed)) == 12 * P  # nothing lost, nothing twice
    for step_index, step in enumerate(steps):
        assert len(step) == P
        for _, admit_version in step:
            assert step_index <= admit_version + max_staleness
    assert max_outstanding <= (max_staleness + 1) * P


def test_staleness_zero_partitions_groups_like_the_sync_loop():
    steps, _, _ = asyncio.run(asyncio.wait_for(_simulate(0, 4, num_steps=5, seed=3), timeout=30))
    assert [[g for g, _ in s] for s in steps] == [list(range(4 * t, 4 * t + 4)) for t in range(5)]
    assert all(v == t for t, s in enumerate(steps) for _, v in s)


def test_negative_staleness_is_rejected_with_the_field_name():
    with pytest.raises(ValueError, match="max_staleness must be >= 0, got -1"):
        StalenessGate.Config(max_staleness=-1)


def test_data_cursor_issues_every_prompt_once_per_epoch_and_is_a_pure_function():
    cursor = DataCursor(num_prompts=7, seed=11)
    epoch0 = [cursor.prompt_index(g) for g in range(7)]
    epoch1 = [cursor.prompt_index(g) for g in range(7, 14)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(7))
    assert epoch0 != epoch1  # reshuffled per epoch
    assert DataCursor(num_prompts=7, seed=11).prompt_index(9) == cursor.prompt_index(9)


def test_finished_groups_overtake_stragglers_within_the_bound():
    overtakes = 0
    for seed in range(5):
        steps, _, _ = asyncio.run(asyncio.wait_for(_simulate(2, 3, num_steps=12, seed=seed),
                                                   timeout=30))
        order = [g for s in steps for g, _ in sorted(s)]
        overtakes += sum(1 for a, b in zip(order, order[1:]) if b < a)
    assert overtakes > 0  # the long tail does not hold finished groups back


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_dynamic_sampling_replaces_dropped_groups_within_the_staleness_bound(max_staleness, seed):
    P, num_steps = 3, 10
    dropped = set(random.Random(100 + seed).sample(range(80), 30))  # ~40 % carry no signal
    steps, _, replaced = asyncio.run(asyncio.wait_for(_simulate(
        max_staleness, P, num_steps, seed, replacements=100, dropped=frozenset(dropped)),
        timeout=30))
    consumed = [g for step in steps for g, _ in step]
    assert len(consumed) == len(set(consumed)) == num_steps * P
    assert not set(consumed) & dropped  # no step trains a group without a signal
    assert set(replaced) == dropped & set(range(max(consumed) + 1))  # each dropped one replaced
    everything = set(consumed) | set(replaced)
    assert len(everything) == len(consumed) + len(replaced)  # nothing lost, nothing twice
    for step_index, step in enumerate(steps):
        assert len(step) == P
        for _, admit_version in step:
            assert step_index <= admit_version + max_staleness


@pytest.mark.parametrize("replacements", [1, 2, 100])
def test_dynamic_sampling_at_s0_trains_the_same_groups_in_any_finish_order(replacements):
    P, num_steps = 4, 6
    dropped = set(random.Random(7).sample(range(60), 25))
    runs = [asyncio.run(asyncio.wait_for(_simulate(
        0, P, num_steps, seed, replacements=replacements, dropped=frozenset(dropped)),
        timeout=30)) for seed in range(5)]
    kept = [[sorted(g for g, _ in step if g not in dropped) for step in steps]
            for steps, _, _ in runs]
    assert all(k == kept[0] for k in kept)  # what a step trains does not depend on the order
    for steps, _, replaced in runs:
        per_step = [len([g for g, _ in step if g in dropped]) for step in steps]
        # a dropped group is trained (as nothing) only once the step's replacements ran out
        if replacements == 100:
            assert per_step == [0] * num_steps
        else:
            assert len(replaced) <= replacements * num_steps
            assert any(per_step)


def test_dynamic_sampling_off_counts_dropped_groups_toward_the_step():
    steps, _, replaced = asyncio.run(asyncio.wait_for(_simulate(
        0, 2, 3, 0, dropped=frozenset({0, 3})), timeout=30))
    assert replaced == []
    assert [[g for g, _ in step] for step in steps] == [[0, 1], [2, 3], [4, 5]]
