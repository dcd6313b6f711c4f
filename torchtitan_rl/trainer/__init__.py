"""The policy trainer: torchtitan Qwen3 under FSDP/TP, GRPO loss, batcher, weight push, checkpoints."""
