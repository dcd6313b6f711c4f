"""Entry point: resolve a run's config (defaults < TOML < CLI) and run it.

    python -m torchtitan_rl.train --config run_configs/alphabet_sort_cpu.toml [--dotted.key value ...]
    python -m torchtitan_rl.train --config ... --help            # every option, documented
    python -m torchtitan_rl.train --config ... --print-config    # the config as written, TOML
    python -m torchtitan_rl.train --config ... --print-resolved  # what each part gets, TOML
    python -m torchtitan_rl.train --config ... --log.level debug # every log line on the console
    torchrun --nproc_per_node=N -m torchtitan_rl.train --config ... --num_trainer_ranks N
        # the torchrun processes are the trainer ranks, rank 0 the controller
        # (controller/torchrun.py); rank 0 prints, the other ranks print nothing

From Python: ``torchtitan_rl.train.main(config)`` with an ``RLJob.Config`` you built or ``replace``d.
Config errors print one line (``error: ...``) and exit with code 2; a run that fails (an actor
proc died) prints one ``error: ...`` line and exits with code 1.

The console is quiet (console.py): the run folder, progress bars, validations, the last line; every
other line goes to ``<run folder>/logs/train.log``. ``--help`` imports nothing heavy (the job's
modules import torch, vLLM and Monarch; the help reads the options from source).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.controller.hosts.reaper import RunStopped, set_monarch_defaults
from torchtitan_rl.threads import set_openmp_spin

set_monarch_defaults()  # a dead controller's procs end in seconds, not minutes (controller/hosts/reaper.py)
set_openmp_spin()  # before torch loads: idle threads spin briefly (threads.py)

if TYPE_CHECKING:
    from torchtitan_rl.controller.job import RLJob

logger = logging.getLogger("torchtitan_rl")

USAGE = ("usage: python -m torchtitan_rl.train [-h] [--config TOML] [--print-config] "
         "[--print-resolved] [--log.level info|debug] [--SECTION.KEY VALUE ...]")
DESCRIPTION = ("Run GRPO post-training as the config describes (defaults < TOML file < command "
               "line). Every field below is a dotted command-line option; lists are "
               "comma-separated, a bare bool flag means true.")


def main(config: RLJob.Config) -> dict[str, Any]:
    """Run the job described by ``config``; returns its summary (also logged as the last line)."""
    return config.build().run()


def cli(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from torchtitan_rl.config.help import print_help, wants_help

    if wants_help(argv):  # before importing the job: the help reads the options from source
        from torchtitan_rl.config.manager import GLOBAL_OPTIONS

        print_help(argv, usage=USAGE, description=DESCRIPTION, global_options=GLOBAL_OPTIONS)
        return
    from torchtitan_rl.config.manager import (
        config_error_line,
        config_to_toml,
        log_level,
        parse_args,
    )
    from torchtitan_rl.controller.job import RLJob
    from torchtitan_rl.controller.torchrun import run_follower, run_rank0, torchrun_rank

    rank = torchrun_rank()  # None unless torchrun started this process
    follower = rank is not None and rank > 0  # prints nothing: rank 0 reports for the job
    try:
        parsed = parse_args(RLJob.Config, argv)
        level = log_level(parsed.log_level)
    except ConfigError as e:
        if follower:  # rank 0 reports it (a failing follower would get rank 0 killed first)
            sys.exit(0)
        print(config_error_line(e, RLJob.Config, argv), file=sys.stderr)
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
    from torchtitan_rl.console import console_line, setup_run_logging

    log_file = setup_run_logging(parsed.config.run_dir, level)
    if not follower:
        console_line(f"run folder: {parsed.config.run_dir.resolve()} (log: {log_file})")
    if rank is not None:
        sys.exit(guarded(lambda: run_follower(parsed.config)) if follower
                 else guarded(lambda: run_and_report(parsed.config, run=run_rank0)))
    sys.exit(guarded(lambda: run_and_report(parsed.config)))


def guarded(run: Callable[[], int]) -> int:
    """``run()``'s exit code; an unexpected exception is one ``error:`` line on the console (its
    traceback goes to the log file) and exit code 1, Ctrl-C exit code 130, SIGTERM 143 (the
    run's processes closed first: controller/hosts/reaper.py)."""
    from torchtitan_rl.console import LOG_FILE_ENV, console_err, error_line

    try:
        return run()
    except RunStopped as e:  # its console line was logged when the signal came
        logger.info("%s", e)
        return e.exit_code
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return 130
    except Exception as e:
        logging.getLogger("torchtitan_rl.train").error(
            "the run raised %s", type(e).__name__, exc_info=True,
            extra={"console": False})  # the traceback: log file only (see console.py)
        # A remote traceback (ActorError) in one line: the actor call and the exception.
        print(error_line(e, log_file=os.environ.get(LOG_FILE_ENV)), file=console_err())
        return 1


def run_and_report(config: RLJob.Config,
                   run: Callable[[RLJob.Config], dict[str, Any]] = main) -> int:
    """Run ``config`` as the command line does (with ``run``, default `main`): the summary as
    the last line, or one ``error:`` line. Returns the process exit code (0 ok, 1 run failed,
    2 bad config)."""
    from torchtitan_rl.console import console_err, console_out, error_line
    from torchtitan_rl.controller.supervision import RunFailedError

    try:
        summary = run(config)
    except ConfigError as e:
        print(f"error: {_one_line(e)}", file=console_err())
        return 2
    except RunFailedError as e:
        logger.debug("run failed", exc_info=True)
        print(error_line(e, name_type=False), file=console_err())  # a report: what and why
        return 1
    # The last line of the job: what a person (or a script) reads first.
    fields = [f"reward_before={_fmt(summary['reward_before'])}",
              f"reward_after={_fmt(summary['reward_after'])}"]
    if summary.get("rise") is not None:
        z = summary["rise_z"]
        fields += [f"rise={summary['rise']:+.4f}", f"z={'n/a' if z is None else f'{z:.1f}'}"]
    fields.append(f"steps={summary['steps']}")
    if summary.get("trained_steps") is not None:  # steps that changed the weights (run_health.py)
        fields.append(f"trained_steps={summary['trained_steps']}/{summary['steps']}")
    fields.append(f"wall_s={_fmt(summary['wall_s'])}")
    print(" ".join(fields), file=console_out())
    return 0


def _one_line(error: BaseException) -> str:
    """Monarch's failure reports span lines; the console gets one."""
    return " ".join(str(error).split())


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    cli()
