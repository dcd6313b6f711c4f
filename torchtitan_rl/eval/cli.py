"""The eval command line: what eval takes, its folder, and one ``error:`` line for anything else.

    python -m torchtitan_rl.eval --model HF_DIR [--config TOML] [--output_dir DIR] [--name NAME]
        [--pass-threshold X] [--json PATH] [--print-config | --print-resolved]
        [--log.level info|debug] [--SECTION.KEY VALUE ...]

Every flag is used or refused: the config keys eval reads (eval/options.py: the episodes, their
sampling, the rollout limits, the engine) are dotted overrides as the train command takes them; a
job's other keys (``--trainer.optimizer.lr``, ``--model.path``, ...) are one error line naming the
key (exit 2). ``--help`` (``--help SECTION``) lists only what eval takes.

The eval writes into its own folder, `eval_folder`: ``<output_dir>/<name>``, by default
``<the config's output_dir>/<the config's name>-eval`` (``runs/alphabet_sort_cpu-eval``, beside the
run folder ``runs/alphabet_sort_cpu``): its log ``logs/eval.log`` (appended, one header line per
eval). Never into a training run's folder (refused) and never anything else, but the report at
``--json PATH`` when asked. The console is as quiet as the train command's: one line naming the
model and the log, what was measured, or one ``error:`` line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import sys
from typing import Any

from torchtitan_rl.config.errors import ConfigError
from torchtitan_rl.eval.options import refusal, uses
from torchtitan_rl.eval.report import DEFAULT_PASS_THRESHOLD
from torchtitan_rl.threads import set_openmp_spin

set_openmp_spin()  # before torch loads: idle threads spin briefly (threads.py)

USAGE = ("usage: python -m torchtitan_rl.eval --model HF_DIR [--config TOML] [--output_dir DIR] "
         "[--name NAME] [--pass-threshold X] [--json PATH] [--print-config] [--print-resolved] "
         "[--log.level info|debug] [--SECTION.KEY VALUE ...]")
DESCRIPTION = ("Evaluate a model on the config's held-out validation episodes (validation.* "
               "below: episodes, samples per episode, temperature) with the configured generator "
               "and the job's seed, exactly as a job's validation runs. Prints the mean reward "
               "with its standard error, per-turn rewards and pass@k. The config options below "
               "are the ones eval uses; a job's other options are refused.")
EVAL_SUFFIX = "-eval"
"""The default eval folder is the config's run folder name plus this."""
TRAINING_OUTPUTS = ("checkpoints", "summary.json", "metrics.jsonl", "trained_samples.jsonl",
                    "logs/train.log")
"""What only a training run writes: a folder holding one is a run folder, never an eval's."""

EVAL_OPTIONS: list[tuple[str, str]] = [
    ("-h, --help [SECTION]", "show this help (the options eval uses, each with its type, default "
                             "and docstring; SECTION: one section) and exit"),
    ("--model HF_DIR", "the model to evaluate: an HF directory (e.g. a job's runs/<name>/hf)"),
    ("--config TOML", "a run config: eval takes its episodes, rollout and engine settings (the "
                      "options below) and leaves its training keys to the job; its values are "
                      "shown beside the defaults below"),
    ("--output_dir DIR", "where the eval folder goes (default: the config's output_dir)"),
    ("--name NAME", f"the eval folder's name (default: <the config's name>{EVAL_SUFFIX}, beside "
                    f"the trained run's folder); eval writes its log to <output_dir>/<name>/logs/"
                    f"eval.log and nothing else there. One folder name; a training run's folder "
                    f"is refused"),
    ("--pass-threshold X", f"a rollout passes when its reward is >= X (default "
                           f"{DEFAULT_PASS_THRESHOLD:g}: a perfect score); pass@k counts the "
                           f"episodes with a passing rollout among k samples"),
    ("--json PATH", "also write the report (full precision) as JSON to PATH"),
    ("--print-config", "print the options eval uses, as written (defaults < TOML < command "
                       "line), as TOML and exit (no --model needed)"),
    ("--print-resolved", "print what the eval's parts get (the model, its folder, the episodes, "
                         "the sampling each request gets, the engine), resolved, and exit"),
    ("--log.level info | debug", "info (default): a quiet console, every log line in "
                                 "<eval folder>/logs/eval.log; debug: every line on the console. "
                                 "Also the env var TORCHTITAN_RL_LOG_LEVEL."),
]
_GLOBAL_FLAGS = ("config", "print-config", "print-resolved", "log.level")
"""Flags the config parser takes itself (not config keys)."""


class _Parser(argparse.ArgumentParser):
    """Errors are one ``error:`` line (exit 2), as the train command's."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


@dataclasses.dataclass(kw_only=True, slots=True)
class EvalArgs:
    """The command line, split: eval's own flags and the job config it reads."""

    parsed: Any
    """config/manager.py ParsedArgs: the job's config (defaults < TOML < the eval keys given)."""
    model: str | None
    folder: pathlib.Path
    """The eval's own folder (`eval_folder`)."""
    pass_threshold: float
    json: str | None


def eval_folder(config: Any, *, output_dir: str | None, name: str | None) -> pathlib.Path:
    """``<output_dir>/<name>``: by default ``<config.output_dir>/<config.name>-eval``, beside the
    run folder of the job the config describes. ``name`` is checked as a run name."""
    from torchtitan_rl.config.run_name import check_run_name

    if name is not None:
        check_run_name("name", name)
    return (pathlib.Path(output_dir if output_dir is not None else config.output_dir)
            / (name if name is not None else f"{config.name}{EVAL_SUFFIX}"))


def check_eval_folder(folder: pathlib.Path, model_dir: pathlib.Path) -> None:
    """Refuse (one ConfigError line) a folder that is a training run's or holds the model."""
    outputs = [name for name in TRAINING_OUTPUTS if (folder / name).exists()]
    if outputs:
        raise ConfigError(f"name: {folder} is a training run's folder (it holds "
                          f"{', '.join(outputs)}); eval writes into its own: choose another "
                          f"--name or --output_dir")
    model, where = model_dir.resolve(), folder.resolve()
    if model == where or where in model.parents:
        raise ConfigError(f"name: {folder} holds the model being evaluated ({model_dir}); eval "
                          f"writes into its own folder: choose another --name or --output_dir")


def parse(argv: list[str]) -> EvalArgs:
    """The eval's command line (raises ConfigError, one line, for anything it does not take)."""
    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model")
    parser.add_argument("--pass-threshold", type=float, default=DEFAULT_PASS_THRESHOLD)
    parser.add_argument("--json")
    parser.add_argument("--output_dir")
    parser.add_argument("--name")
    args, rest = parser.parse_known_args(argv)
    for token in rest:  # before parsing: a job's key is refused as such, not type-checked
        if token.startswith("--"):
            key = token[2:].split("=", 1)[0]
            if key not in _GLOBAL_FLAGS and not uses(key):
                from torchtitan_rl.config.convert import leaf_paths
                from torchtitan_rl.controller.job import RLJob

                if key in leaf_paths(RLJob.Config, instance=RLJob.Config()):
                    raise ConfigError(refusal(key))
    from torchtitan_rl.config.manager import parse_args
    from torchtitan_rl.controller.job import RLJob

    parsed = parse_args(RLJob.Config, rest)  # an unknown key: one line with a did-you-mean
    folder = eval_folder(parsed.config, output_dir=args.output_dir, name=args.name)
    return EvalArgs(parsed=parsed, model=args.model, folder=folder,
                    pass_threshold=args.pass_threshold, json=args.json)


def eval_view(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The part of a config's TOML data that eval uses (`uses`), nested as the TOML is."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            kept = eval_view(value, f"{path}.")
            if kept:
                out[key] = kept
        elif uses(path):
            out[key] = value
    return out


def print_config(args: EvalArgs) -> str:
    """``--print-config``: the keys eval uses, as written, as TOML (it loads back as --config)."""
    import tomli_w

    from torchtitan_rl.config.convert import to_data

    header = (f"# python -m torchtitan_rl.eval: the options eval uses (a job's others are "
              f"left to it); eval folder: {args.folder}\n")
    return header + tomli_w.dumps(eval_view(to_data(args.parsed.config)))


def print_resolved(args: EvalArgs) -> str:
    """``--print-resolved``: what the eval's parts get, as the job would derive it."""
    import tomli_w

    from torchtitan_rl.config.convert import to_data
    from torchtitan_rl.eval.run import eval_plan

    plan = eval_plan(args.parsed.config, _model_dir(args))
    sampling = dataclasses.replace(plan.sampling, temperature=plan.validation.temperature)
    return tomli_w.dumps(to_data({
        "model_dir": plan.model_dir, "eval_folder": str(args.folder), "seed": plan.seed,
        "pass_threshold": args.pass_threshold, "task": plan.task,
        "validation": plan.validation, "rollouter": plan.rollouter, "sampling": sampling,
        "generator": plan.generators[0]}))


def _model_dir(args: EvalArgs) -> pathlib.Path:
    if not args.model:
        raise ConfigError("--model: name the HF model directory to evaluate")
    model = pathlib.Path(args.model)
    if not (model / "config.json").is_file():
        raise ConfigError(f"--model: {model} is not an HF model directory (no config.json)")
    return model


def help_text(argv: list[str]) -> str:
    """``--help`` of eval: the job's help, only the options eval uses (`uses`)."""
    from torchtitan_rl.config import help as config_help

    sections = [dataclasses.replace(s, options=[o for o in s.options if uses(o.path)])
                for s in config_help.sections_for(argv)]
    sections = [s for s in sections if s.options]
    topic = config_help.help_topic(argv)
    if topic is not None:
        return "\n".join(config_help.render_sections(
            config_help.select(sections, topic))[1:]) + "\n"
    text = config_help.render(sections, usage=USAGE, description=DESCRIPTION,
                              global_options=EVAL_OPTIONS)
    # the job's help names a training section as its example; eval has none
    return text.replace("e.g. --help trainer)", "e.g. --help validation)")


def cli(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from torchtitan_rl.config.help import wants_help

    try:
        if wants_help(argv):  # fast: read from source, nothing heavy imported
            sys.stdout.write(help_text(argv))
            return
        args = parse(argv)
        from torchtitan_rl.config.manager import log_level

        level = log_level(args.parsed.log_level)
        if args.parsed.print_config and args.parsed.print_resolved:
            raise ConfigError("--print-config and --print-resolved: give one")
        if args.parsed.print_config:
            sys.stdout.write(print_config(args))
            return
        if args.parsed.print_resolved:
            sys.stdout.write(print_resolved(args))
            return
        model = _model_dir(args)
        check_eval_folder(args.folder, model)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from torchtitan_rl.console import console_line, console_out, setup_run_logging
    from torchtitan_rl.train import guarded

    log_file = setup_run_logging(args.folder, level, command="eval")
    config = args.parsed.config
    validation = config.validation
    console_line(f"evaluating {model.resolve()} on {validation.num_prompts} held-out episodes x "
                 f"{validation.samples_per_prompt} samples (temperature "
                 f"{validation.temperature:g}, seed {config.seed}; log: {log_file})")

    def run() -> int:
        from torchtitan_rl.eval.run import evaluate

        try:
            report = asyncio.run(evaluate(config, model, pass_threshold=args.pass_threshold))
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
