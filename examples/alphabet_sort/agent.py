"""AlphabetSort as an agent program: the MessageEnv's episode (same prompts, same reward) played
with the `openai` client against the run's endpoint (run_configs/alphabet_sort_agent.toml)."""

from openai import AsyncOpenAI

from examples.alphabet_sort.reward import alphabet_sort_reward, turn_score


async def run(episode, client: AsyncOpenAI) -> tuple[float, list[float]]:
    """The reward, and each turn's own score (for rollouter.credit = "turn")."""
    messages, replies = [], []
    for prompt in episode.prompts:
        messages.append({"role": "user", "content": prompt})
        response = await client.chat.completions.create(model="policy", messages=messages)
        reply = response.choices[0].message.content or ""
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
        if response.choices[0].finish_reason == "length":  # cut off: the episode ends
            break
    truths = [list(names) for names in episode.ground_truths]
    return (alphabet_sort_reward(replies, truths),
            [turn_score(reply, truths[t], t, power=4) for t, reply in enumerate(replies)])
