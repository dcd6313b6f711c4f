"""A scripted player for textarena's GuessTheNumber-v0 (run_configs/textarena.toml's warm start)."""

from examples.guess_the_number.solver import binary_search

__all__ = ["binary_search"]
