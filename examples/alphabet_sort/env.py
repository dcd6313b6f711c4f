"""AlphabetSortEnv: one episode as a chat whose user side is scripted.

    init() -> [system?, user: turn 0 prompt]
    step(reply t) -> reward part {"turn_score": score of turn t}; then user: turn t+1 prompt, or done
    score(replies) -> alphabet_sort_reward over all expected turns (a turn never reached scores 0)
    turn_rewards(replies) -> each reply's turn_score (score() is their mean over expected turns)

The reply's content only matters for scoring: the next prompt is fixed by the episode.
"""

from __future__ import annotations

from examples.alphabet_sort.episode import AlphabetSortEpisode
from examples.alphabet_sort.reward import alphabet_sort_reward, turn_score
from torchtitan_rl.rollout.message_env import EnvStep, Message, MessageEnv


class AlphabetSortEnv(MessageEnv):
    def __init__(
        self,
        episode: AlphabetSortEpisode,
        *,
        system_prompt: str | None = None,
        similarity_power: int = 4,
        power_per_turn: bool = True,
    ) -> None:
        self.episode = episode
        self._system_prompt = system_prompt
        self._similarity_power = similarity_power
        self._power_per_turn = power_per_turn
        self._turn = 0

    async def init(self) -> list[Message]:
        self._turn = 0
        messages: list[Message] = []
        if self._system_prompt:
            messages.append({"role": "system", "content": self._system_prompt})
        messages.append({"role": "user", "content": self.episode.prompts[0]})
        return messages

    async def step(self, assistant_message: Message) -> EnvStep:
        t = self._turn
        if t >= self.episode.num_turns:
            raise RuntimeError(f"episode {self.episode.episode_id} has {self.episode.num_turns} "
                               f"turns; step() called for turn {t}")
        power = self._similarity_power if self._power_per_turn else 1
        score = turn_score(assistant_message.get("content", ""),
                           list(self.episode.ground_truths[t]), t, power=power)
        self._turn += 1
        parts = {"turn_score": score}
        if self._turn >= self.episode.num_turns:
            return EnvStep(done=True, reward_parts=parts)
        return EnvStep(messages=[{"role": "user", "content": self.episode.prompts[self._turn]}],
                       reward_parts=parts)

    def score(self, replies: list[str], reward_parts: list[dict[str, float]]) -> float:
        return alphabet_sort_reward(
            replies, [list(g) for g in self.episode.ground_truths],
            similarity_power=self._similarity_power, power_per_turn=self._power_per_turn,
        )

    def turn_rewards(self, replies: list[str], reward_parts: list[dict[str, float]]) -> list[float]:
        if not self._power_per_turn:  # the power of a mean does not split into turns
            raise ValueError("per-turn credit needs task.power_per_turn = true (a reward raised "
                             "to a power after averaging has no per-turn share)")
        return [parts.get("turn_score", 0.0) for parts in reward_parts]
