"""An agent that answers reasoning-gym arithmetic with a calculator tool
(run_configs/reasoning_gym_tools.toml)."""

from examples.calculator.agent import TOOLS, calculate, demonstration, run

__all__ = ["TOOLS", "calculate", "demonstration", "run"]
