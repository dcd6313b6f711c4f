"""The eval command line: ``--model DIR`` and ``--pass-threshold X``, the rest as the train command
takes it (``--config TOML``, dotted overrides, ``--log.level``, ``--help``).

The console is as quiet as the train command's: what it measured, one ``error:`` line on failure;
every log line goes to ``<the config's run folder>/logs/eval.log`` (``--log.level debug``: the
console too).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import sys

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.eval.report import DEFAULT_PASS_THRESHOLD

USAGE = ("usage: python -m torchtitan_rl.eval --model HF_DIR [--config TOML] "
         "[--pass-threshold X] [--log.level info|debug] [--SECTION.KEY VALUE ...]")
DESCRIPTION = ("Evaluate a model on the config's held-out validation episodes (validation.* "
               "below: episodes, samples per episode, temperature) with the configured generator "
               "and the job's seed, exactly as a job's validation runs. Prints the mean reward "
               "with its standard error, per-turn rewards and pass@k.")
EVAL_OPTIONS: list[tuple[str, str]] = [
    ("--model HF_DIR", "the model to evaluate: an HF directory (e.g. a job's runs/<name>/hf)"),
    ("--pass-threshold X", f"a rollout passes when its reward is >= X (default "
                           f"{DEFAULT_PASS_THRESHOLD:g}: a perfect score); pass@k counts the "
                           f"episodes with a passing rollout among k samples"),
    ("--json PATH", "also write the report (full precision) as JSON to PATH"),
]


class _Parser(argparse.ArgumentParser):
    """Errors are one ``error:`` line (exit 2), as the train command's."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def cli(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from torchtitan_rl.config.help import print_help, wants_help
    from torchtitan_rl.config.manager import GLOBAL_OPTIONS

    if wants_help(argv):  # fast: read from source, nothing imported
        options = EVAL_OPTIONS + [o for o in GLOBAL_OPTIONS if "print-" not in o[0]]
        print_help(argv, usage=USAGE, description=DESCRIPTION, global_options=options)
        return
    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model")
    parser.add_argument("--pass-threshold", type=float, default=DEFAULT_PASS_THRESHOLD)
    parser.add_argument("--json")
    try:
        args, rest = parser.parse_known_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from torchtitan_rl.config.manager import log_level, parse_args
    from torchtitan_rl.controller.job import RLJob

    try:
        if not args.model:
            raise ConfigError("--model: name the HF model directory to evaluate")
        parsed = parse_args(RLJob.Config, rest)
        level = log_level(parsed.log_level)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from torchtitan_rl.console import console_line, console_out, setup_run_logging
    from torchtitan_rl.train import guarded

    log_file = setup_run_logging(parsed.config.run_dir, level, command="eval")
    validation = parsed.config.validation
    console_line(f"evaluating {pathlib.Path(args.model).resolve()} on {validation.num_prompts} "
                 f"held-out episodes x {validation.samples_per_prompt} samples (temperature "
                 f"{validation.temperature:g}, seed {parsed.config.seed}; log: {log_file})")

    def run() -> int:
        from torchtitan_rl.eval.run import evaluate

        try:
            report = asyncio.run(evaluate(parsed.config, pathlib.Path(args.model),
                                          pass_threshold=args.pass_threshold))
        except ConfigError as e:
            from torchtitan_rl.console import console_err

            print(f"error: {e}", file=console_err())
            return 2
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(dataclasses.asdict(report), indent=2))
        for line in report.lines():
            print(line, file=console_out())
        return 0

    sys.exit(guarded(run))
