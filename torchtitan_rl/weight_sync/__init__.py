"""Weight sync: the trainer pushes its weights, every generator rank pulls them into vLLM.

    a generator on the trainer's machine (shared memory), one at a time:
      trainer ranks: full_model_state_dict() (gather); rank 0: WeightPusher.push     push.py
        references to one segment (shared_memory.py), streamed: the call first, then
        generators.weights_staged(version, bytes) as the copy goes
        -> generators.pull_model_state_dict(policy_version, state_dict)  (every generator rank)
    generators elsewhere (message), all at once down one chain:                       relay.py
      every trainer rank: its own shards, chunked -> chain[0] rank 0 -forward-> chain[1] ...
        each stores the pieces at their global offsets; when whole: pull on every rank
        controller: wait_weights(version, attempt) per generator; re-push past a lost one
    generator rank: WeightPuller.prepare (HF names, checks) -> engine loop, between steps:
        WeightPuller.apply ("reload": vLLM reload_weights | "in_place": copy_)           pull.py
        -> the engine labels later tokens with policy_version
    verify: generators.read_hf_weights() -> weight_mismatches on trainer rank 0 (bitwise)

No files: the weights travel in memory. This package imports neither the trainer nor the
generator; both import it.
"""

from torchtitan_rl.weight_sync.pull import (
    WeightLoad,
    WeightPuller,
    read_hf_weights,
    read_vllm_hf_weights,
    vllm_model,
    weight_mismatches,
)
from torchtitan_rl.weight_sync.push import (
    WEIGHT_TRANSPORTS,
    PullTimings,
    WeightPusher,
    WeightTransport,
    num_bytes,
    pull_on_every_rank,
)
from torchtitan_rl.weight_sync.relay import (
    Assembly,
    LinkPacer,
    Piece,
    RelayChunk,
    RelayNode,
    local_pieces,
    plan_chunks,
    relay_chunks,
    send_chunks,
)
from torchtitan_rl.weight_sync.shared_memory import (
    SharedMemoryStager,
    SharedTensorRef,
    machine_id,
)

__all__ = [
    "Assembly",
    "LinkPacer",
    "Piece",
    "RelayChunk",
    "RelayNode",
    "local_pieces",
    "plan_chunks",
    "relay_chunks",
    "send_chunks",
    "WEIGHT_TRANSPORTS",
    "PullTimings",
    "SharedMemoryStager",
    "SharedTensorRef",
    "WeightLoad",
    "WeightPuller",
    "WeightPusher",
    "WeightTransport",
    "num_bytes",
    "pull_on_every_rank",
    "machine_id",
    "read_hf_weights",
    "read_vllm_hf_weights",
    "vllm_model",
    "weight_mismatches",
]
