"""The rollout layer: environments in messages and tokens, rollouts, advantages, packing, metrics.

    episode spec --Rollouter.run_group_rollouts(generate_fn, episode)--> RolloutGroup
        (each turn: GenerateRequest --generate_fn--> Completion; GenerateFn from
         torchtitan_rl.types; HttpGenerateFn is one over an OpenAI-compatible server)
    RolloutGroup --rollout_group_to_training_samples--> [TrainingSample] --> batcher -> trainer
"""

from torchtitan_rl.rollout.advantage import group_advantages
from torchtitan_rl.rollout.http_generate import HttpGenerateFn
from torchtitan_rl.rollout.message_env import EnvStep, Message, MessageEnv
from torchtitan_rl.rollout.metrics import rollout_metrics
from torchtitan_rl.rollout.packing import (
    rollout_group_to_training_samples,
    rollout_to_training_samples,
    split_branches,
)
from torchtitan_rl.rollout.recorder import RolloutRecorder
from torchtitan_rl.rollout.rollouter import Rollouter
from torchtitan_rl.rollout.token_env import TokenEnv, TokenEnvStep
from torchtitan_rl.rollout.types import (
    Rollout,
    RolloutGroup,
    RolloutStatus,
    RolloutTurn,
    request_id,
    request_seed,
    session_id,
)
from torchtitan_rl.types import GenerateFn, GenerateRequest

__all__ = [
    "EnvStep",
    "GenerateFn",
    "GenerateRequest",
    "HttpGenerateFn",
    "Message",
    "MessageEnv",
    "Rollout",
    "RolloutGroup",
    "RolloutRecorder",
    "RolloutStatus",
    "RolloutTurn",
    "Rollouter",
    "TokenEnv",
    "TokenEnvStep",
    "group_advantages",
    "request_id",
    "request_seed",
    "rollout_group_to_training_samples",
    "rollout_metrics",
    "rollout_to_training_samples",
    "session_id",
    "split_branches",
]
