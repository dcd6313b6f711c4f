"""AlphabetSort: sort generated names by first or last name over several turns.

    task = AlphabetSortTask.Config(seed=0).build()
    episode = task.dataset("train")[0]
    env = task.make_env(episode)          # a MessageEnv for the Rollouter
"""

from examples.alphabet_sort.env import AlphabetSortEnv
from examples.alphabet_sort.episode import AlphabetSortEpisode, make_episode
from examples.alphabet_sort.reward import alphabet_sort_reward, turn_score
from examples.alphabet_sort.task import AlphabetSortDataset, AlphabetSortTask

__all__ = [
    "AlphabetSortDataset",
    "AlphabetSortEnv",
    "AlphabetSortEpisode",
    "AlphabetSortTask",
    "alphabet_sort_reward",
    "make_episode",
    "turn_score",
]
