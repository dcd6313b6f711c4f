"""Entry point: resolve a run's config (defaults < TOML < CLI) and run it.

    python -m torchtitan_rl.train --config run_configs/alphabet_sort_cpu.toml [--dotted.key value ...]
    python -m torchtitan_rl.train --config ... --print-config      # resolved config as TOML, exit 0

From Python: ``torchtitan_rl.train.main(config)`` with an ``RLJob.Config`` you built or ``replace``d.
Config errors print one line (``error: ...``) and exit with code 2.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import config_to_toml, parse_args
from torchtitan_rl.controller.job import RLJob

logger = logging.getLogger("torchtitan_rl")


def _setup_logging() -> None:
    level = os.environ.get("TORCHTITAN_RL_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(config: RLJob.Config) -> dict[str, Any]:
    """Run the job described by ``config``; returns its summary (also logged as the last line)."""
    return config.build().run()


def cli(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parsed = parse_args(RLJob.Config, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if parsed.print_config:
        sys.stdout.write(config_to_toml(parsed.config))
        return
    _setup_logging()
    try:
        summary = main(parsed.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # The last line of the job: what a person (or a script) reads first.
    print(" ".join(f"{k}={_fmt(summary[k])}" for k in ("reward_before", "reward_after", "steps",
                                                        "wall_s")))


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    cli()
