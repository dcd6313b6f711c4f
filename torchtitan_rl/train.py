"""Entry point: resolve a run's config (defaults < TOML < CLI) and run it.

    python -m torchtitan_rl.train --config run_configs/alphabet_sort_cpu.toml [--dotted.key value ...]
    python -m torchtitan_rl.train --config ... --print-config    # the config as written, TOML
    python -m torchtitan_rl.train --config ... --print-resolved  # what each part gets, TOML
    torchrun --nproc_per_node=N -m torchtitan_rl.train --config ... --num_trainer_ranks N
        # the torchrun processes are the trainer ranks, rank 0 the controller
        # (controller/torchrun.py); rank 0 prints, the other ranks print nothing

From Python: ``torchtitan_rl.train.main(config)`` with an ``RLJob.Config`` you built or ``replace``d.
Config errors print one line (``error: ...``) and exit with code 2; a run that fails (an actor
proc died) prints one ``error: ...`` line and exits with code 1.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

# Monarch polls its procs' health every 10 s by default: a dead generator would stall the run that
# long before it is replaced. Set before Monarch starts (procs inherit it); a user's value wins.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.config.manager import config_to_toml, parse_args
from torchtitan_rl.controller.job import RLJob
from torchtitan_rl.controller.supervision import RunFailedError
from torchtitan_rl.controller.torchrun import run_follower, run_rank0, torchrun_rank

logger = logging.getLogger("torchtitan_rl")


def _setup_logging() -> None:
    level = os.environ.get("TORCHTITAN_RL_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(config: RLJob.Config) -> dict[str, Any]:
    """Run the job described by ``config``; returns its summary (also logged as the last line)."""
    return config.build().run()


def cli(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    rank = torchrun_rank()  # None unless torchrun started this process
    follower = rank is not None and rank > 0  # prints nothing: rank 0 reports for the job
    try:
        parsed = parse_args(RLJob.Config, argv)
    except ConfigError as e:
        if follower:  # rank 0 reports it (a failing follower would get rank 0 killed first)
            sys.exit(0)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if parsed.print_config:
        if not follower:
            sys.stdout.write(config_to_toml(parsed.config))
        return
    if parsed.print_resolved:
        if not follower:
            try:
                sys.stdout.write(config_to_toml(RLJob(parsed.config).resolve()))
            except ConfigError as e:
                print(f"error: {e}", file=sys.stderr)
                sys.exit(2)
        return
    _setup_logging()
    if rank is not None:
        sys.exit(run_follower(parsed.config) if follower
                 else run_and_report(parsed.config, run=run_rank0))
    sys.exit(run_and_report(parsed.config))


def run_and_report(config: RLJob.Config,
                   run: Callable[[RLJob.Config], dict[str, Any]] = main) -> int:
    """Run ``config`` as the command line does (with ``run``, default `main`): the summary as
    the last line, or one ``error:`` line. Returns the process exit code (0 ok, 1 run failed,
    2 bad config)."""
    try:
        summary = run(config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailedError as e:
        logger.debug("run failed", exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        return 1
    # The last line of the job: what a person (or a script) reads first.
    print(" ".join(f"{k}={_fmt(summary[k])}" for k in ("reward_before", "reward_after", "steps",
                                                        "wall_s")))
    return 0


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    cli()
