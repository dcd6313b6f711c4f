"""A streamed shared-memory push, as pure logic in one process: the stager announces staged
bytes only once they hold their tensors, and a pull copies a tensor only after its bytes were
announced (the real actors' end-to-end push with bitwise verify: tests/weight_sync/test_weight_sync_in_place_pull.py)."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from torchtitan_rl.weight_sync.shared_memory import (
    SharedMemoryStager,
    StagedWeights,
    StagingProgress,
    segment_end,
)


def _state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    embed = torch.randn(64, 32, generator=generator)
    return {
        "tok_embeddings.weight": embed,
        "layers.0.attention.wq.weight": torch.randn(32, 32, generator=generator),
        "layers.0.feed_forward.w1.weight": torch.randn(96, 32, generator=generator),
        "norm.weight": torch.randn(32, generator=generator),
        "output.weight": embed,  # tied: staged once
    }


def test_each_announcement_covers_only_tensors_already_copied() -> None:
    state_dict = _state_dict()
    stager = SharedMemoryStager()
    try:
        refs, plan = stager.layout(state_dict)
        # The generator side: unpickling a reference attaches the segment (no copy).
        views = {name: pickle.loads(pickle.dumps(ref)) for name, ref in refs.items()}
        ends = {name: segment_end(view) for name, view in views.items()}
        assert None not in ends.values()
        assert views["output.weight"].data_ptr() == views["tok_embeddings.weight"].data_ptr()
        announced: list[int] = []

        def on_staged(num_bytes: int) -> None:
            announced.append(num_bytes)
            for name, end in ends.items():
                if end <= num_bytes:  # announced: must already hold the trainer's values
                    assert torch.equal(views[name], state_dict[name]), name

        stager.copy(plan, on_staged, chunk_bytes=32 * 32 * 4)
        assert announced == sorted(set(announced)), "announcements only grow"
        assert announced[-1] == max(ends.values()), "the last one covers every tensor"
        assert len(announced) >= 3, "chunks smaller than the state dict announce more than once"
        for name, view in views.items():
            assert torch.equal(view, state_dict[name])
    finally:
        stager.close()


def test_staged_weights_yield_in_segment_order_once_staged() -> None:
    state_dict = _state_dict()
    stager = SharedMemoryStager()
    try:
        refs, plan = stager.layout(state_dict)
        views = {name: pickle.loads(pickle.dumps(ref)) for name, ref in refs.items()}
        progress = StagingProgress()
        staged = StagedWeights(list(reversed(views.items())), progress)
        stager.copy(plan, progress.advance)
        order = [name for name, _ in staged]
        ends = [segment_end(views[name]) for name in order]
        assert ends == sorted(ends) and len(order) == len(views)
        # A tensor outside any segment (the message transport) never waits.
        StagedWeights([("x", torch.ones(3))], StagingProgress()).wait(torch.ones(3))
    finally:
        stager.close()


def test_a_pull_whose_pusher_stops_fails_instead_of_hanging() -> None:
    progress = StagingProgress()
    progress.advance(100)
    progress.wait_for(100)  # covered: returns at once
    with pytest.raises(RuntimeError, match="100 of the 200 bytes needed were staged"):
        progress.wait_for(200, stall_timeout_s=0.01)

    closing = StagingProgress()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            closing.wait_for(1)
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=waiter)
    thread.start()
    closing.fail(RuntimeError("generator closed"))
    thread.join(timeout=60)
    assert not thread.is_alive() and [str(e) for e in errors] == ["generator closed"]
