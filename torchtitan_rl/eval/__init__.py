"""Evaluate a model on a config's held-out validation episodes, as a job's validation does.

    python -m torchtitan_rl.eval --model runs/alphabet_sort_cpu/hf \
        --config run_configs/alphabet_sort_cpu.toml [--dotted.key value ...] [--pass-threshold 1.0]

Prints the mean reward with its standard error, per-turn rewards (when the task's environment
reports them) and pass@k (k = validation.samples_per_prompt), then one ``key=value`` line.

Where it writes: its own folder, ``<output_dir>/<name>``, by default the config's run folder name
plus ``-eval`` beside it (``runs/alphabet_sort_cpu-eval`` for the command above, whose trained run
is ``runs/alphabet_sort_cpu``); ``--output_dir`` and ``--name`` choose another. It holds the log,
``logs/eval.log`` (one header line per eval, appended), as an output_dir of a TRL or verl eval
would. The trained run's folder is read (its ``hf``), never written: a folder holding a training
run's outputs, or the model itself, is refused. ``--json PATH`` also writes the report to PATH.

What it takes: ``--model`` and the config keys its parts read (options.py: the episodes, their
sampling, the rollout limits, the engine), from the TOML and as dotted overrides. A job's other
keys on the command line, ``--model.path`` included, are one ``error:`` line naming the key;
``--help`` lists only what eval takes; ``--print-config`` prints those keys as TOML and
``--print-resolved`` what each eval part gets.

run.py runs it, report.py computes what is printed, options.py says which keys it takes, cli.py is
the command line.
"""

from typing import Any

__all__ = ["EvalReport", "TurnReward", "evaluate", "summarize"]


def __getattr__(name: str) -> Any:
    """Lazy: ``python -m torchtitan_rl.eval --help`` imports nothing heavy (run.py imports the
    job's modules: torch, vLLM, Monarch)."""
    if name == "evaluate":
        from torchtitan_rl.eval.run import evaluate

        return evaluate
    if name in __all__:
        from torchtitan_rl.eval import report

        return getattr(report, name)
    raise AttributeError(name)
