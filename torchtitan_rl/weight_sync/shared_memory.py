"""Same-host weight push through POSIX shared memory: tensors that pickle as references.

    trainer rank 0:  refs = stager.stage(state_dict)       # one copy into a shared segment
    Monarch message: {name: SharedTensorRef}               # ~100 bytes per tensor
    generator:       unpickling a ref returns a plain torch.Tensor viewing the segment (no copy)

Streamed (what a push does): the references go first, then the copy, chunk by chunk, each chunk
announced (``on_staged(bytes staged so far)``, a ``weights_staged`` message); the generator copies a
tensor out as soon as its bytes are announced (`StagedWeights`), so the two copies overlap:

    trainer:   refs, plan = stager.layout(sd) -> pull call(refs) -> stager.copy(plan, on_staged)
    generator: StagedWeights.wait(tensor) until StagingProgress covers the tensor's bytes -> copy_

Why: a Monarch message pickles a tensor's bytes (copy), ships them over a socket (kernel copies)
and unpickles them (copy). A ``SharedTensorRef`` pickles to (segment name, offset, shape, dtype),
so the generator gets ``torch.Tensor`` values with no change to its pull path:
``Generator.pull_model_state_dict(policy_version, state_dict)`` sees an ordinary dict of tensors.

Lifetime: the stager owns one segment (``/dev/shm/ttrl_w_<pid>_<n>``, memory, never disk),
re-created only when the state dict's size changes, unlinked at close/exit. The next ``stage``
overwrites it, so every generator must finish its pull (copy into its own weights) before the
trainer stages again: ``WeightPusher.push`` awaits every generator rank's pull before returning,
which gives that. A generator on another host cannot attach and raises a RuntimeError naming the
segment.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker, shared_memory

import torch

logger = logging.getLogger(__name__)

_ALIGN = 64
STAGE_CHUNK_BYTES = 32 << 20
"""A streamed stage announces its progress after about this many bytes."""
STAGING_STALL_TIMEOUT_S = 120.0
"""A streamed pull fails when its pusher announces no progress for this long (it died)."""
_attached: dict[str, shared_memory.SharedMemory] = {}
_attached_spans: dict[str, tuple[int, int]] = {}
"""Attached segment name -> (base address, size) in this process (`segment_end`)."""
_attached_lock = threading.Lock()
_created: set[str] = set()
"""Segments created by stagers of this process."""
_counter = 0


def machine_id() -> str:
    """This process's machine: hostname and boot id (POSIX shared memory reaches exactly the
    processes that share both). The controller compares the trainer's with each generator's to
    pick a push's transport."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _segment(name: str, hostname: str) -> shared_memory.SharedMemory:
    with _attached_lock:
        segment = _attached.get(name)
        if segment is None:
            if hostname != socket.gethostname():
                raise RuntimeError(
                    f"weight segment {name} lives on host {hostname}, this is "
                    f"{socket.gethostname()}: use weight_transport='message' across hosts"
                )
            segment = shared_memory.SharedMemory(name=name, create=False)
            # Attaching registers the segment with this process's resource tracker, which would
            # unlink it when this process exits; the trainer owns it (unless this process is
            # the trainer: its own registration must stay for its unlink).
            if name not in _created:
                resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
            _attached[name] = segment
            base = torch.frombuffer(segment.buf, dtype=torch.uint8, count=1).data_ptr()
            _attached_spans[name] = (base, segment.size)
        return segment


def segment_end(tensor: torch.Tensor) -> int | None:
    """The byte offset just past ``tensor`` in the shared segment it views (attached in this
    process), or None when it views no such segment."""
    start = tensor.data_ptr()
    for base, size in _attached_spans.values():
        if base <= start < base + size:
            return start - base + tensor.numel() * tensor.element_size()
    return None


def _attach_tensor(
    name: str, hostname: str, offset: int, shape: tuple[int, ...], dtype: str
) -> torch.Tensor:
    segment = _segment(name, hostname)
    torch_dtype = getattr(torch, dtype)
    count = 1
    for size in shape:
        count *= size
    flat = torch.frombuffer(segment.buf, dtype=torch_dtype, count=count, offset=offset)
    return flat.view(shape)


@dataclasses.dataclass(frozen=True, slots=True)
class SharedTensorRef:
    """Pickles as a reference into a shared segment; unpickles as a ``torch.Tensor`` view."""

    segment: str
    hostname: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    def __reduce__(self):  # type: ignore[override]
        return _attach_tensor, (self.segment, self.hostname, self.offset, self.shape, self.dtype)


class SharedMemoryStager:
    """Copies state dicts into one shared segment and hands out ``SharedTensorRef``s."""

    def __init__(self) -> None:
        self._segment: shared_memory.SharedMemory | None = None
        self._hostname = socket.gethostname()
        atexit.register(self.close)

    def stage(self, state_dict: dict[str, torch.Tensor]) -> dict[str, SharedTensorRef]:
        """Copy every tensor (a tensor shared under two names once) into the segment."""
        refs, plan = self.layout(state_dict)
        self.copy(plan)
        return refs

    def layout(self, state_dict: dict[str, torch.Tensor]
               ) -> tuple[dict[str, SharedTensorRef], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The references (valid once ``copy(plan)`` ran) and the plan: (segment view, tensor)
        pairs in offset order. Copies nothing."""
        layout: dict[int, tuple[int, torch.Tensor]] = {}
        size = 0
        for tensor in state_dict.values():
            if id(tensor) not in layout:
                layout[id(tensor)] = (size, tensor)
                size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        segment = self._ensure(max(size, _ALIGN))
        refs: dict[int, SharedTensorRef] = {}
        plan = []
        for key, (offset, tensor) in layout.items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            view = torch.frombuffer(
                segment.buf, dtype=tensor.dtype, count=tensor.numel(), offset=offset
            ).view(tensor.shape)
            plan.append((view, tensor))
            refs[key] = SharedTensorRef(
                segment.name, self._hostname, offset, tuple(tensor.shape), dtype
            )
        return {name: refs[id(tensor)] for name, tensor in state_dict.items()}, plan

    def copy(self, plan: list[tuple[torch.Tensor, torch.Tensor]],
             on_staged: Callable[[int], None] | None = None,
             chunk_bytes: int = STAGE_CHUNK_BYTES) -> None:
        """Copy ``layout``'s plan into the segment; ``on_staged(n)`` once the first ``n`` bytes
        of the segment hold their tensors: after every ~``chunk_bytes`` and at the end."""
        assert self._segment is not None, "layout() first"
        base = torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=1).data_ptr()
        announced = 0
        for index, (view, tensor) in enumerate(plan):
            view.copy_(tensor.detach())
            staged = view.data_ptr() - base + view.numel() * view.element_size()
            last = index == len(plan) - 1
            if on_staged is not None and (last or staged - announced >= chunk_bytes):
                on_staged(staged)
                announced = staged

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment.unlink()
            self._segment = None

    def _ensure(self, size: int) -> shared_memory.SharedMemory:
        global _counter
        if self._segment is not None and self._segment.size >= size:
            return self._segment
        self.close()
        _counter += 1
        name = f"ttrl_w_{os.getpid()}_{_counter}"
        self._segment = shared_memory.SharedMemory(name=name, create=True, size=size)
        _created.add(name)
        logger.info("weight staging segment %s: %.1f MiB", name, size / 2**20)
        return self._segment


class StagingProgress:
    """How much of one push's segment its pusher has filled (``weights_staged`` messages, on the
    event loop), for the engine thread that copies out of it. Thread-safe."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.num_bytes = 0
        self._error: BaseException | None = None

    def advance(self, num_bytes: int) -> None:
        with self._changed:
            self.num_bytes = max(self.num_bytes, num_bytes)
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """Wake every waiter with ``error`` (the generator is closing or failed)."""
        with self._changed:
            self._error = error
            self._changed.notify_all()

    def wait_for(self, num_bytes: int, stall_timeout_s: float = STAGING_STALL_TIMEOUT_S) -> None:
        """Block until the first ``num_bytes`` are staged; raise after ``stall_timeout_s`` with
        no progress at all (the pusher died mid-copy)."""
        with self._changed:
            while self.num_bytes < num_bytes:
                if self._error is not None:
                    raise self._error
                before = self.num_bytes
                notified = self._changed.wait(stall_timeout_s)
                if not notified and self.num_bytes == before and self._error is None:
                    raise RuntimeError(
                        f"weight push stalled: {before} of the {num_bytes} bytes needed were "
                        f"staged and nothing more came for {stall_timeout_s:.0f} s (did the "
                        f"trainer die mid-push?)")


class StagedWeights:
    """A pull's prepared ``(name, tensor)`` pairs whose shared-segment bytes may still be in
    flight: iterating yields them in segment order, each once its bytes are staged."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor]], progress: StagingProgress) -> None:
        self.pairs = sorted(pairs, key=lambda pair: pair[1].data_ptr())
        self.progress = progress

    def wait(self, tensor: torch.Tensor) -> None:
        """Block until ``tensor``'s bytes are staged (at once for a tensor in no segment)."""
        end = segment_end(tensor)
        if end is not None:
            self.progress.wait_for(end)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.pairs:
            self.wait(tensor)
            yield name, tensor

    def __len__(self) -> int:
        return len(self.pairs)
