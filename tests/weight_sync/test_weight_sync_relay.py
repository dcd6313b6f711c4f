"""The relay's pure pieces (weight_sync/relay.py), no Monarch, no vLLM: which pieces a trainer
rank sends, chunk planning, assembly at global offsets, the relay node's forward/store/discard
order, and the simulated link's pacing."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan_rl.weight_sync.relay import (
    Assembly,
    LinkPacer,
    Piece,
    RelayChunk,
    RelayNode,
    local_pieces,
    plan_chunks,
    relay_chunks,
)


def _pieces_of_rank(rank: int, world: int, mesh_shape: tuple[int, ...],
                    build) -> tuple[list[Piece], dict[str, str], int]:
    """``local_pieces`` as trainer rank ``rank`` sees it: a fake process group stands in for the
    others (no collective runs: the layouts here are plain blocks)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", mesh_shape)
        return local_pieces(build(mesh), rank=rank)
    finally:
        dist.destroy_process_group()


def _sharded(full: torch.Tensor, mesh, placements) -> DTensor:
    """The DTensor ``full`` distributed as ``placements`` on this rank (torch.chunk split: an
    uneven dim leaves the last rank fewer rows, as FSDP2 does)."""
    local = full
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            local = torch.chunk(local, mesh.size(dim), dim=placement.dim)[coordinate[dim]]
    return DTensor.from_local(local.contiguous(), mesh, placements, shape=full.shape,
                              stride=full.stride(), run_check=False)


WEIGHTS = {
    "uneven": torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3),      # 3 + 2 rows
    "both_dims": torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6),
    "replicated": torch.arange(4, dtype=torch.float32),
    "embed": torch.arange(6 * 2, dtype=torch.float32).reshape(6, 2),
}


def _fsdp_tp_state_dict(mesh) -> dict[str, torch.Tensor]:
    embed = _sharded(WEIGHTS["embed"], mesh, [Shard(0), Replicate()])
    return {
        "uneven": _sharded(WEIGHTS["uneven"], mesh, [Shard(0), Replicate()]),
        "both_dims": _sharded(WEIGHTS["both_dims"], mesh, [Shard(0), Shard(1)]),
        "replicated": _sharded(WEIGHTS["replicated"], mesh, [Replicate(), Replicate()]),
        "embed": embed,
        "output": embed,  # tied: the same tensor under a second name
        "plain_norm": torch.ones(3),
    }


def _every_rank(world: int, mesh_shape: tuple[int, ...], build) -> list:
    ranks = range(world)
    if not dist.is_initialized():
        return [_pieces_of_rank(rank, world, mesh_shape, build) for rank in ranks]
    # An earlier test of this process left torch's default process group (a vLLM engine's):
    # the fake groups need a process of their own.
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_pieces_of_rank, ranks, [world] * world, [mesh_shape] * world,
                             [build] * world))


def test_every_rank_sends_only_its_own_blocks_and_they_assemble_bit_exact():
    per_rank = _every_rank(4, (2, 2), _fsdp_tp_state_dict)
    model_bytes = per_rank[0][2]
    assert model_bytes == 4 * (15 + 24 + 4 + 12 + 3)  # the tied weight once
    assert all(aliases == {"output": "embed"} for _, aliases, _ in per_rank)
    sent = [sum(p.num_bytes for p in pieces) for pieces, _, _ in per_rank]
    assert sum(sent) == model_bytes  # every byte sent exactly once over the ranks
    names = [sorted({p.name for p in pieces}) for pieces, _, _ in per_rank]
    assert names[0] == ["both_dims", "embed", "plain_norm", "replicated", "uneven"]
    assert names[1] == ["both_dims"]  # a replica along the TP dim sends its Shard(1) half only
    assert names[2] == ["both_dims", "embed", "uneven"]
    uneven = sorted((p.global_offset, tuple(p.tensor.shape)) for pieces, _, _ in per_rank
                    for p in pieces if p.name == "uneven")
    assert uneven == [((0, 0), (3, 3)), ((3, 0), (2, 3))]

    assembly = Assembly(model_bytes, per_rank[0][1])
    done = [assembly.add(pieces) for pieces, _, _ in reversed(per_rank)]  # any order
    assert done == [False, False, False, True]
    state_dict = assembly.state_dict()
    for name, full in WEIGHTS.items():
        assert torch.equal(state_dict[name], full), name
    assert state_dict["output"] is state_dict["embed"]
    assert torch.equal(state_dict["plain_norm"], torch.ones(3))


def test_chunks_hold_at_most_chunk_bytes_and_split_big_tensors_by_rows():
    big = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)  # 16 bytes a row
    pieces = [Piece("big", big, (10, 4), (0, 0)),
              Piece("small", torch.ones(2), (2,), (0,)),
              Piece("scalar", torch.tensor(3.0), (), ())]
    chunks = plan_chunks(pieces, 48)
    assert [sum(p.num_bytes for p in chunk) for chunk in chunks] == [48, 48, 48, 28]
    rows = [(p.global_offset[0], p.tensor.shape[0]) for chunk in chunks for p in chunk
            if p.name == "big"]
    assert rows == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assembly = Assembly(sum(p.num_bytes for p in pieces), {})
    for chunk in chunks:
        assembly.add(chunk)
    assert torch.equal(assembly.state_dict()["big"], big)
    assert assembly.state_dict()["scalar"].item() == 3.0
    # A row larger than a chunk travels alone; nothing is lost.
    assert [len(c) for c in plan_chunks([Piece("big", big, (10, 4), (0, 0))], 1)] == [1] * 10
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1"):
        plan_chunks(pieces, 0)


def test_a_piece_sent_twice_is_refused():
    assembly = Assembly(8, {})
    piece = Piece("w", torch.ones(2), (4,), (0,))
    assembly.add([piece])
    with pytest.raises(RuntimeError, match="a piece came twice"):
        assembly.add([piece, piece])


class _Mesh:
    """Stands in for a generator actor mesh: records what a RelayNode forwards to it."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.receive_chunk = self

    def slice(self, **_) -> _Mesh:
        return self

    def broadcast(self, chunk: RelayChunk, chain: list | None, position: int) -> None:
        self.log.append((position, chunk.policy_version, chunk.attempt, chunk.num_bytes,
                         chain is not None))


def test_a_node_forwards_each_chunk_once_discards_old_attempts_and_pulls_when_whole():
    async def scenario():
        pulled = []

        async def pull(version, state_dict):
            pulled.append((version, state_dict["w"].clone()))
            return {"convert_s": 0.0, "load_s": 0.0}

        forwarded: list = []
        chain = [_Mesh([]), _Mesh(forwarded)]
        full = torch.arange(8, dtype=torch.float32)
        chunks, model_bytes = relay_chunks({"w": full}, policy_version=3, attempt=1, rank=0,
                                           chunk_bytes=16)
        assert model_bytes == 32 and len(chunks) == 2
        node = RelayNode(pull, LinkPacer(None))
        waiting = asyncio.ensure_future(node.wait(3, 1))
        node.receive(chunks[0], chain, 0)
        stale = RelayChunk(3, 0, 32, {}, [Piece("w", torch.zeros(4), (8,), (4,))])
        node.receive(stale, chain, 0)  # an abandoned attempt: neither stored nor forwarded
        node.receive(chunks[1], None, 0)  # a sender's later chunks come without the chain
        result = await asyncio.wait_for(waiting, 10)
        # The chain rides on the first forwarded chunk only.
        assert forwarded == [(1, 3, 1, 16, True), (1, 3, 1, 16, False)]
        assert result["sent_bytes"] == 32.0
        assert pulled[0][0] == 3 and torch.equal(pulled[0][1], full)
        # The tail forwards nothing.
        tail = RelayNode(pull, LinkPacer(None))
        tail_wait = asyncio.ensure_future(tail.wait(3, 1))
        for i, chunk in enumerate(chunks):
            tail.receive(chunk, chain if i == 0 else None, 1)
        assert (await asyncio.wait_for(tail_wait, 10))["sent_bytes"] == 0.0
        assert forwarded == [(1, 3, 1, 16, True), (1, 3, 1, 16, False)]
        # A newer attempt replaces a partial one; waiting on the old attempt fails.
        old = asyncio.ensure_future(node.wait(4, 0))
        node.receive(RelayChunk(4, 0, 32, {}, chunks[0].pieces), chain, 1)
        node.receive(RelayChunk(4, 1, 32, {}, chunks[0].pieces), chain, 1)
        with pytest.raises(RuntimeError, match="replaced"):
            await asyncio.wait_for(old, 10)

    asyncio.run(scenario())


def test_the_simulated_link_paces_bytes_in_order(monkeypatch):
    monkeypatch.setenv("TORCHTITAN_RL_SIMULATED_LINK_MBPS", "2")
    link = LinkPacer.from_env()
    assert link.bytes_per_s == 2e6
    first = link.reserve(1_000_000)
    second = link.reserve(1_000_000)
    third = link.reserve(1_000_000)
    # An idle link takes a message at once (it is on the wire while the next is prepared); the
    # next ones queue behind it, 0.5 s each at 2 MB/s.
    assert first == 0.0
    assert 0.49 < second <= 0.5 and 0.99 < third <= 1.0
    monkeypatch.delenv("TORCHTITAN_RL_SIMULATED_LINK_MBPS")
    assert LinkPacer.from_env().reserve(10**9) == 0.0
    monkeypatch.setenv("TORCHTITAN_RL_SIMULATED_LINK_MBPS", "fast")
    with pytest.raises(ValueError, match="expected megabytes per second"):
        LinkPacer.from_env()
