"""Which config keys the eval command takes: those its parts read, nothing a job only trains with.

Eval runs a job's validation (controller/loop/validation.py) on one generator: it reads the episodes
(``task.*``, the validation split), how many and how sampled (``validation.num_prompts``,
``samples_per_prompt``, ``temperature``), the rollout limits, the request sampling and the engine.
Everything else of the job (trainer, loop, batcher, checkpoints, metrics, placement, weight sync,
the warm start, advantages, how often a job validates) never runs in an eval: given on the eval's
command line it is one error line naming the key, and ``--help`` does not list it. A ``--config``
TOML is a job's and may set any key: eval reads the keys below from it and leaves the rest to the
job (they are still checked, as the job checks them).

Pure data, no heavy imports: the help reads it before anything is imported.
"""

from __future__ import annotations

EVAL_KEYS: tuple[str, ...] = (
    "seed",                                 # the episodes' order and the requests' seeds
    "task.",                                # the task and its held-out episodes
    "validation.num_prompts", "validation.samples_per_prompt", "validation.temperature",
    "rollouter.max_turns", "rollouter.max_rollout_tokens", "rollouter.step_timeout_s",
    "rollouter.error_reward",
    # sampling.temperature is not one: validation.temperature replaces it for every request
    "sampling.max_tokens", "sampling.top_p", "sampling.top_k", "sampling.seed",
    "sampling.stop_token_ids",
    "generator.dtype", "generator.tensor_parallel_degree", "generator.max_model_len",
    "generator.max_num_seqs", "generator.kv_cache_bytes", "generator.enforce_eager",
    "generator.enable_prefix_caching", "generator.block_size",
    "generator.max_engine_steps_between_decisions", "generator.torch_num_threads",
)
"""The config keys eval takes (a key ending in "." covers its section)."""


def uses(key: str) -> bool:
    """Whether eval reads the dotted config key ``key``."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in EVAL_KEYS)


def refusal(key: str) -> str:
    """The one error line for a config key eval does not take (``uses(key)`` is False)."""
    if key == "model" or key.startswith("model.") or key == "generator.model_dir":
        return (f"{key}: eval takes the model to evaluate as --model HF_DIR (the config's "
                f"[model] is the job's starting point)")
    if key in ("generator.seed", "rollouter.seed"):
        return f"{key}: eval takes the job's seed; set seed instead"
    return (f"{key}: a job's option that eval does not use (python -m torchtitan_rl.eval "
            f"--help lists what eval takes)")
