"""The relay: a weight push whose cost does not grow with the number of generators.

    every trainer rank: local_pieces(model state dict)   its own DTensor shards (to_local + global
        shape + global offset; a replicated slice from one rank only; plain tensors from rank 0)
        -> plan_chunks(pieces, chunk_bytes) -> send_chunks: one paced, non-blocking message a
        chunk -> chain[0] rank 0 .receive_chunk(RelayChunk, chain, 0) (the chain rides on a
        sender's first chunk only, None after: a mesh reference costs as much to send as a chunk)
    generator chain[i] rank 0: RelayNode.receive: forward the chunk at once to chain[i + 1]
        (broadcast, paced), then store its pieces (Assembly); the tail forwards nothing
    once every byte of (policy_version, attempt) is in: Assembly.state_dict() (full tensors,
        copied at their global offsets) -> pull into vLLM (every rank of the generator, as a
        message push does) -> wait_weights(policy_version, attempt) answers the controller

Cost model: with C chunks, N generators and t the time one chunk takes on a link, a push takes
about (C + N - 1) * t instead of N * C * t (rank 0 sending the whole model to each generator in
turn), and no process sends more than about one model's bytes: a trainer rank its own shards,
each generator what it received, once.

Attempts: a re-push of one version (a generator of the chain was lost) gets a higher
``attempt``; a node drops chunks older than the (policy_version, attempt) it holds and discards a
partial assembly when a newer one begins.

Simulated link (benchmarks only): ``TORCHTITAN_RL_SIMULATED_LINK_MBPS=<MB/s>`` (10^6 bytes a
second, per sending process) makes every relay sender sleep so that its bytes leave no faster
than that rate. On one machine the processes share its cores and memory bus, so wall time cannot
show how a push scales over a network; with pacing a chunk takes chunk_bytes / rate on every
link, as it would between machines. Unset (the default): no pacing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

LINK_ENV_VAR = "TORCHTITAN_RL_SIMULATED_LINK_MBPS"


@dataclasses.dataclass(slots=True)
class Piece:
    """A block of one tensor: ``tensor`` holds the global rows/columns starting at
    ``global_offset`` of the full tensor of shape ``global_shape``."""

    name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclasses.dataclass(slots=True)
class RelayChunk:
    """One relay message: ``pieces`` of the weights of ``policy_version`` (push ``attempt``).
    ``model_bytes`` (all distinct tensors) tells a node when it has everything; ``aliases``
    (tied name -> the name whose tensor it shares) ride along in every chunk (a few names)."""

    policy_version: int
    attempt: int
    model_bytes: int
    aliases: dict[str, str]
    pieces: list[Piece]

    @property
    def num_bytes(self) -> int:
        return sum(piece.num_bytes for piece in self.pieces)


# ---- the trainer's side -------------------------------------------------------------------------
def local_pieces(state_dict: dict[str, torch.Tensor], *, rank: int
                 ) -> tuple[list[Piece], dict[str, str], int]:
    """This rank's share of ``state_dict`` (torchtitan names, DTensors or plain tensors): its
    pieces, the tied aliases and the model's bytes (each distinct tensor once). No collective,
    except for a DTensor placement without a plain block layout (e.g. _StridedShard of FSDP+TP),
    gathered on every rank (same order everywhere) and sent by rank 0."""
    # Here, not at the top: the generators import this module, and torch.distributed.tensor
    # costs most of a second to import.
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    pieces: list[Piece] = []
    aliases: dict[str, str] = {}
    first_name: dict[tuple[int, int], str] = {}
    model_bytes = 0
    for name, tensor in state_dict.items():
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        if key in first_name:  # a tied weight: its first name carries it
            aliases[name] = first_name[key]
            continue
        first_name[key] = name
        model_bytes += tensor.numel() * tensor.element_size()
        global_shape = tuple(tensor.shape)
        if isinstance(tensor, DTensor) and not _block_layout(tensor):
            full = tensor.full_tensor().detach()
            if rank == 0:
                pieces.append(Piece(name, full, global_shape, (0,) * len(global_shape)))
        elif isinstance(tensor, DTensor):
            mesh, coordinate = tensor.device_mesh, tensor.device_mesh.get_coordinate()
            if coordinate is None:
                continue  # not on this rank's mesh
            # A slice replicated over a mesh dim is sent by the rank at coordinate 0 there.
            if any(isinstance(p, Replicate) and coordinate[d] != 0
                   for d, p in enumerate(tensor.placements)):
                continue
            _, offset = compute_local_shape_and_global_offset(global_shape, mesh,
                                                              tensor.placements)
            block = tensor.to_local().detach()
            if block.numel():
                pieces.append(Piece(name, block, global_shape, tuple(offset)))
        elif rank == 0:
            pieces.append(Piece(name, tensor.detach(), global_shape, (0,) * len(global_shape)))
    return pieces, aliases, model_bytes


def _block_layout(tensor: DTensor) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    return all(type(p) in (Shard, Replicate) for p in tensor.placements)


def plan_chunks(pieces: list[Piece], chunk_bytes: int) -> list[list[Piece]]:
    """Pieces packed into chunks of at most ``chunk_bytes`` (a piece larger than that is split
    along its first dim; one row larger than that travels alone). Views: nothing is copied."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    room = chunk_bytes
    for piece in pieces:
        for part in _split_rows(piece, chunk_bytes):
            if current and part.num_bytes > room:
                chunks.append(current)
                current, room = [], chunk_bytes
            current.append(part)
            room -= part.num_bytes
    if current:
        chunks.append(current)
    return chunks


def _split_rows(piece: Piece, chunk_bytes: int) -> list[Piece]:
    if piece.tensor.dim() == 0 or piece.num_bytes <= chunk_bytes:
        return [piece]
    rows = piece.tensor.shape[0]
    row_bytes = max(1, piece.num_bytes // rows)
    per_part = max(1, chunk_bytes // row_bytes)
    parts = []
    for start in range(0, rows, per_part):
        length = min(per_part, rows - start)
        offset = (piece.global_offset[0] + start,) + piece.global_offset[1:]
        parts.append(Piece(piece.name, piece.tensor.narrow(0, start, length), piece.global_shape,
                           offset))
    return parts


async def send_chunks(chunks: list[RelayChunk], chain: list[Any], pacer: LinkPacer) -> int:
    """Send ``chunks`` to the head of ``chain`` (generator actor meshes), paced; returns the
    bytes sent. Non-blocking sends: a dead head bounces them to the sender's
    ``_handle_undeliverable_message``; the controller sees the loss."""
    sent = 0
    head = chain[0].slice(procs=0)
    for i, chunk in enumerate(chunks):
        await pacer.wait(chunk.num_bytes)
        head.receive_chunk.broadcast(chunk, chain if i == 0 else None, 0)
        sent += chunk.num_bytes
    return sent


# ---- the generator's side -----------------------------------------------------------------------
class Assembly:
    """Full tensors of one (policy_version, attempt), filled from pieces at their offsets."""

    def __init__(self, model_bytes: int, aliases: dict[str, str]) -> None:
        self.model_bytes = model_bytes
        self.aliases = dict(aliases)
        self.received_bytes = 0
        self._tensors: dict[str, torch.Tensor] = {}

    def add(self, pieces: list[Piece]) -> bool:
        """Copy ``pieces`` into their full tensors; whether every byte has arrived."""
        for piece in pieces:
            full = self._tensors.get(piece.name)
            if full is None:
                full = torch.empty(piece.global_shape, dtype=piece.tensor.dtype)
                self._tensors[piece.name] = full
            target = full
            for dim, (start, length) in enumerate(zip(piece.global_offset, piece.tensor.shape)):
                target = target.narrow(dim, start, length)
            target.copy_(piece.tensor)
            self.received_bytes += piece.num_bytes
        if self.received_bytes > self.model_bytes:
            raise RuntimeError(f"relay: {self.received_bytes} bytes received for a model of "
                               f"{self.model_bytes} (a piece came twice)")
        return self.complete

    @property
    def complete(self) -> bool:
        return self.received_bytes == self.model_bytes

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every name, a tied alias sharing its tensor (call once ``complete``)."""
        assert self.complete, (self.received_bytes, self.model_bytes)
        out = dict(self._tensors)
        out.update({alias: self._tensors[name] for alias, name in self.aliases.items()})
        return out


PullFn = Callable[[int, dict[str, torch.Tensor]], Awaitable[dict[str, float]]]
"""Pull a full state dict into every rank of this generator as a policy version."""


class RelayNode:
    """Rank 0 of one generator in a relay chain: forwards, assembles, pulls, reports.

    ``wait(version, attempt)`` resolves with ``{"sent_bytes", "convert_s", "load_s"}`` once
    that push is pulled; it fails when a newer push replaces it first."""

    def __init__(self, pull: PullFn, pacer: LinkPacer | None = None) -> None:
        self.pull = pull
        self.pacer = pacer or LinkPacer.from_env()
        self._key: tuple[int, int] = (-1, -1)
        self._assembly: Assembly | None = None
        self._sent_bytes = 0
        self._done: dict[tuple[int, int], asyncio.Future[dict[str, float]]] = {}
        self._chain: list[Any] | None = None
        """The current push's chain (from its first chunk), and the next node's rank 0."""
        self._next: Any = None
        self._chain_forwarded = False

    def receive(self, chunk: RelayChunk, chain: list[Any] | None, position: int) -> None:
        """A chunk of ``chain[position]`` (this node): forward it, then store it. ``chain``
        comes with a sender's first chunk of a push (None on the others)."""
        key = (chunk.policy_version, chunk.attempt)
        if key < self._key:
            return  # an abandoned attempt (or an older version) still draining: discard
        if key > self._key:
            self._begin(key, chunk)
        if chain is not None and self._chain is None:
            self._chain = chain
            if position + 1 < len(chain):
                self._next = chain[position + 1].slice(procs=0)
        if self._chain is None:
            raise RuntimeError(f"relay push {key}: a chunk came before the chain (a sender's "
                               "first chunk carries it)")
        if self._next is not None:
            self._sent_bytes += chunk.num_bytes
            # Reserved now, in arrival order: the chunks leave in the order they came.
            delay = self.pacer.reserve(chunk.num_bytes)
            forwarded_chain = None if self._chain_forwarded else self._chain
            self._chain_forwarded = True
            asyncio.ensure_future(self._forward(self._next, chunk, forwarded_chain, position + 1,
                                                delay))
        assert self._assembly is not None
        if self._assembly.add(chunk.pieces):
            state_dict = self._assembly.state_dict()
            self._assembly = None
            asyncio.ensure_future(self._pull(key, state_dict))

    async def wait(self, policy_version: int, attempt: int) -> dict[str, float]:
        return await asyncio.shield(self._future((policy_version, attempt)))

    def _begin(self, key: tuple[int, int], chunk: RelayChunk) -> None:
        for old, future in list(self._done.items()):
            if old < key and not future.done():
                future.set_exception(RuntimeError(f"relay push {old} replaced by {key}"))
            if old < key:
                del self._done[old]
        self._key = key
        self._assembly = Assembly(chunk.model_bytes, chunk.aliases)
        self._sent_bytes = 0
        self._chain, self._next, self._chain_forwarded = None, None, False

    @staticmethod
    async def _forward(target: Any, chunk: RelayChunk, chain: list[Any] | None, position: int,
                       delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            target.receive_chunk.broadcast(chunk, chain, position)
        except Exception:  # the next node is gone: the controller re-pushes past it
            logger.warning("relay: forwarding to chain[%d] failed", position, exc_info=True)

    async def _pull(self, key: tuple[int, int], state_dict: dict[str, torch.Tensor]) -> None:
        future = self._future(key)
        try:
            timings = await self.pull(key[0], state_dict)
        except Exception as e:
            logger.exception("relay: pulling policy version %d failed", key[0])
            if not future.done():
                future.set_exception(e)
            return
        if not future.done():
            future.set_result({"sent_bytes": float(self._sent_bytes), **timings})

    def _future(self, key: tuple[int, int]) -> asyncio.Future[dict[str, float]]:
        if key not in self._done:
            self._done[key] = asyncio.get_running_loop().create_future()
            if key < self._key:
                self._done[key].set_exception(
                    RuntimeError(f"relay push {key} was replaced by {self._key}"))
        return self._done[key]


class LinkPacer:
    """Lets bytes leave no faster than ``bytes_per_s`` (None: no pacing); the simulated link of
    the module docstring. Each ``wait`` reserves the link before it sleeps, so concurrent
    senders of one process leave in the order they called."""

    def __init__(self, bytes_per_s: float | None) -> None:
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"{LINK_ENV_VAR} must be > 0, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0

    @classmethod
    def from_env(cls) -> LinkPacer:
        value = os.environ.get(LINK_ENV_VAR, "")
        if not value:
            return cls(None)
        try:
            mb_per_s = float(value)
        except ValueError:
            raise ValueError(f"{LINK_ENV_VAR}={value!r}: expected megabytes per second") from None
        return cls(mb_per_s * 1e6)

    def reserve(self, num_bytes: int) -> float:
        """Seconds from now until ``num_bytes`` queued behind earlier reservations have left."""
        if self.bytes_per_s is None:
            return 0.0
        now = time.monotonic()
        seconds = num_bytes / self.bytes_per_s
        # A link that fell idle by up to one message's time (the sender's own CPU between two
        # sends) is still busy with that message: the CPU overlaps the wire, as on a real NIC.
        self._free_at = max(now - seconds, self._free_at) + seconds
        return max(0.0, self._free_at - now)

    async def wait(self, num_bytes: int) -> None:
        delay = self.reserve(num_bytes)
        if delay > 0:
            await asyncio.sleep(delay)



def relay_chunks(state_dict: dict[str, torch.Tensor], *, policy_version: int, attempt: int,
                 rank: int, chunk_bytes: int) -> tuple[list[RelayChunk], int]:
    """This trainer rank's chunks of ``state_dict`` for one push, and the model's bytes."""
    pieces, aliases, model_bytes = local_pieces(state_dict, rank=rank)
    chunks = [RelayChunk(policy_version, attempt, model_bytes, aliases, group)
              for group in plan_chunks(pieces, chunk_bytes)]
    return chunks, model_bytes
