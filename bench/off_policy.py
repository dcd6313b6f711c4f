"""The off-policy correction on the asynchronous main job: none, token TIS alone (the old
default), and the new default (token TIS + IcePop mask), from one warm start, in one run; and
several updates a step (k mini-batches x e epochs, ``trainer.num_minibatches`` /
``trainer.ppo_epochs``) on the same job.

    python bench/off_policy.py [--steps 20] [--max-staleness 4] [--seed 0] [--config TOML]
                               [--variants none,token_tis,default] [--out DIR] [-- job options]
    python bench/off_policy.py --max-staleness 0 --variants default,mb_2x1,mb_1x2,mb_2x2

Each variant is the main job (run_configs/alphabet_sort_cpu.toml: multi-turn AlphabetSort, the
demo model, its cached warm start), or the run config ``--config`` names, at
``loop.staleness.max_staleness = --max-staleness``, for ``--steps`` steps with the same seed,
changed only by the ``trainer.loss.off_policy`` lines in ``VARIANTS``; validation before and
after, no checkpoints; each its own ``python -m torchtitan_rl.train`` process, one after the
other (bench/algorithms.py's ``run_variant``). docs/algorithms.md has the tables of
``--config run_configs/reasoning_gym.toml --steps 30`` at seeds 0 and 1, and of the mini-batch
variants on the main job (``--max-staleness 0 --steps 30``).

The table, per variant: held-out reward before and after, the rise with its standard error and z
(paired by episode), the trainer/generator mismatch (``mismatch/k3_token_mean``) at the first
trained step, the middle one and the last, and its mean over steps; the masked token fraction
(for "none": what the default menu would have masked) and the mean policy age of the trained
samples, over steps; with several updates a step, the clipped token fraction and the last
update's mean ratio (``loss/ratio_mean_last``, how far the step's updates moved the policy from
the one that sampled), over steps; the median step time; whether every step was finite. Last
line::

    variants=<n run> all_finite=<bool> learned=<n with z >= 2>
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "bench"))

from algorithms import run_variant  # noqa: E402  (bench/algorithms.py, beside this file)

_KEY = "--trainer.loss.off_policy."
VARIANTS: dict[str, list[str]] = {
    "none": [f"{_KEY}enabled", "off"],
    "token_tis": [f"{_KEY}enabled", "on", f"{_KEY}token_mask_low", "none",
                  f"{_KEY}token_mask_high", "none"],
    "default": [],  # "auto": on at max_staleness >= 1, token TIS at 2 + token mask [1/8, 8]
    # several updates a step, the correction as "default": k mini-batches x e epochs
    "mb_2x1": ["--trainer.num_minibatches", "2"],
    "mb_1x2": ["--trainer.ppo_epochs", "2"],
    "mb_2x2": ["--trainer.num_minibatches", "2", "--trainer.ppo_epochs", "2"],
}


def mismatch_series(run_dir: pathlib.Path) -> dict[str, float]:
    """The trained steps' mismatch figures from the run's metrics.jsonl."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "mismatch/k3_token_mean" in m]
    k3 = [m["mismatch/k3_token_mean"] for m in trained]
    return {
        "k3_first": k3[0], "k3_mid": k3[len(k3) // 2], "k3_last": k3[-1],
        "k3_mean": statistics.fmean(k3),
        "masked": statistics.fmean(m["mismatch/masked_token_frac"] for m in trained),
        "age": statistics.fmean(m.get("async/policy_age_mean", 0.0) for m in trained),
        "clipped": statistics.fmean(m["loss/clipped_frac"] for m in trained),
        "ratio_last": statistics.fmean(m.get("loss/ratio_mean_last", m["loss/ratio_mean"])
                                       for m in trained),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default="run_configs/alphabet_sort_cpu.toml")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--out", type=pathlib.Path,
                        default=REPO_ROOT / "runs" / "bench_off_policy" / time.strftime(
                            "%Y%m%d-%H%M%S"), help="where the variants' run folders go")
    parser.add_argument("job_options", nargs="*", help="options for every variant's job (after --)")
    args = parser.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    common = ["--loop.staleness.max_staleness", str(args.max_staleness), *args.job_options]

    print(f"{'variant':<10} {'before':>7} {'after':>7} {'rise':>7} {'stderr':>7} {'z':>6} "
          f"{'k3_first':>9} {'k3_mid':>9} {'k3_last':>9} {'k3_mean':>9} {'masked':>8} "
          f"{'age':>5} {'clipped':>8} {'ratio_last':>10} {'step_s':>7} {'finite':>6}",
          flush=True)
    rows = []
    for name in names:
        row = run_variant(name, VARIANTS[name], config=args.config, steps=args.steps,
                          seed=args.seed, out=args.out, job_options=common)
        rows.append(row)
        if "failed" in row:
            print(f"{name:<10} failed: {row['failed'][0]}", flush=True)
            continue
        row.update(mismatch_series(args.out / name))
        print(f"{name:<10} {row['before']:7.4f} {row['after']:7.4f} {row['rise']:+7.4f} "
              f"{row['stderr']:7.4f} {row['z']:6.2f} {row['k3_first']:9.2e} "
              f"{row['k3_mid']:9.2e} {row['k3_last']:9.2e} {row['k3_mean']:9.2e} "
              f"{row['masked']:8.5f} {row['age']:5.2f} {row['clipped']:8.5f} "
              f"{row['ratio_last']:10.6f} {row['step_s']:7.2f} "
              f"{str(row['finite']):>6}", flush=True)
    ran = [r for r in rows if "failed" not in r]
    learned = sum(r["z"] is not None and r["z"] >= 2 for r in ran)
    all_finite = len(ran) == len(rows) and all(r["finite"] for r in ran)
    print(f"variants={len(ran)} all_finite={all_finite} learned={learned}")


if __name__ == "__main__":
    main()
