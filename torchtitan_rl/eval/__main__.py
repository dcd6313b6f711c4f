"""``python -m torchtitan_rl.eval``: see torchtitan_rl/eval/cli.py."""

from torchtitan_rl.eval.cli import cli

cli()
