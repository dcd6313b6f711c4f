"""Evaluate a model on a config's held-out validation episodes, as a job's validation does.

    python -m torchtitan_rl.eval --model runs/alphabet_sort_cpu/hf \
        --config run_configs/alphabet_sort_cpu.toml [--dotted.key value ...] [--pass-threshold 1.0]

Prints the mean reward with its standard error, per-turn rewards (when the task's environment
reports them) and pass@k (k = validation.samples_per_prompt), then one ``key=value`` line.
run.py runs it, report.py computes what is printed, cli.py is the command line.
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
