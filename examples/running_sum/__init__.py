"""RunningSum: add numbers over several turns ("What is 3 + 4?", then "Add 5 to that.").

The example task of docs/tasks.md, which shows and explains every line of it.
"""

from examples.running_sum.env import RunningSumEnv, closeness, first_integer
from examples.running_sum.episode import RunningSumEpisode, make_episode
from examples.running_sum.task import RunningSumDataset, RunningSumTask

__all__ = ["RunningSumDataset", "RunningSumEnv", "RunningSumEpisode", "RunningSumTask",
           "closeness", "first_integer", "make_episode"]
