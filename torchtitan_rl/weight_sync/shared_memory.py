"""Same-host weight push through POSIX shared memory: tensors that pickle as references.

    trainer rank 0:  refs = stager.stage(state_dict)       # one copy into a shared segment
    Monarch message: {name: SharedTensorRef}               # ~100 bytes per tensor
    generator:       unpickling a ref returns a plain torch.Tensor viewing the segment (no copy)

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
from multiprocessing import resource_tracker, shared_memory

import torch

logger = logging.getLogger(__name__)

_ALIGN = 64
_attached: dict[str, shared_memory.SharedMemory] = {}
_attached_lock = threading.Lock()
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
            # unlink it when this process exits; the trainer owns it.
            resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
            _attached[name] = segment
        return segment


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
        layout: dict[int, tuple[int, torch.Tensor]] = {}
        size = 0
        for tensor in state_dict.values():
            if id(tensor) not in layout:
                layout[id(tensor)] = (size, tensor)
                size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        segment = self._ensure(max(size, _ALIGN))
        refs: dict[int, SharedTensorRef] = {}
        for key, (offset, tensor) in layout.items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            view = torch.frombuffer(
                segment.buf, dtype=tensor.dtype, count=tensor.numel(), offset=offset
            ).view(tensor.shape)
            view.copy_(tensor.detach())
            refs[key] = SharedTensorRef(
                segment.name, self._hostname, offset, tuple(tensor.shape), dtype
            )
        return {name: refs[id(tensor)] for name, tensor in state_dict.items()}

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
        logger.info("weight staging segment %s: %.1f MiB", name, size / 2**20)
        return self._segment
