"""Weight sync: the trainer pushes its weights, every generator rank pulls them into vLLM.

    trainer ranks: full_model_state_dict()  (gather)
    rank 0: WeightPusher.push(policy_version, state_dict, generators)                    push.py
        "message": tensors in the call | "shared_memory": references to one segment  shared_memory.py
        -> generators.pull_model_state_dict(policy_version, state_dict)  (every generator rank)
        shared memory is streamed: the call first, then generators.weights_staged(version, bytes)
        as the copy goes; a rank copies each tensor once its bytes are staged (StagedWeights)
    generator rank: WeightPuller.prepare (HF names, checks) -> engine loop, between steps:
        WeightPuller.apply ("reload": vLLM reload_weights | "in_place": copy_)           pull.py
        -> the engine labels later tokens with policy_version
    verify: generators.read_hf_weights() -> weight_mismatches on rank 0 (bitwise)

No files: the weights travel in memory. This package imports neither the trainer nor the
generator; both import it.
"""

from torchtitan_rl.weight_sync.pull import (
    WEIGHT_LOADS,
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
from torchtitan_rl.weight_sync.shared_memory import (
    SharedMemoryStager,
    SharedTensorRef,
    machine_id,
)

__all__ = [
    "WEIGHT_LOADS",
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
