"""The main job with each algorithm variant, from one warm start: does each train, and how well?

    python bench/algorithms.py [--steps 30] [--seed 0] [--variants grpo,rloo,...] [--out DIR]
                               [--config run_configs/alphabet_sort_cpu.toml] [-- job options]

Every variant is the main job (run_configs/alphabet_sort_cpu.toml: multi-turn AlphabetSort, the
demo model, its cached warm start, per-turn credit), or the run config ``--config`` names, for
``--steps`` GRPO steps with the same seed, changed only by the config lines in ``VARIANTS``;
validation before and after (the config's held-out episodes and samples), no checkpoints. Each
runs as its own ``python -m torchtitan_rl.train`` process, one after the other (the first makes
the warm start if the cache has none). Options after ``--`` go to every variant's job, for
example more validation episodes, which tighten the standard errors without changing training:
``-- --task.num_validation_episodes 384 --validation.num_prompts 384``.

The table: rise (reward after - before, paired by episode), its standard error and z (clustered by
episode: controller/loop/validation.py), reward_after, the median step time, whether every step's
loss and gradient norm were finite. Last line::

    variants=<n run> all_finite=<bool> learned=<n variants with z >= 2>
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

VARIANTS: dict[str, list[str]] = {
    # the main job as it is: PPO-clip, GRPO advantages with the mean baseline only, token-mean
    "grpo": [],
    "grpo_std": ["--rollouter.advantage_std", "sample"],
    "dr_grpo": ["--trainer.loss.aggregation", "seq-mean-token-sum-norm"],
    "rloo": ["--rollouter.advantage", "rloo"],
    "reinforce_pp": ["--rollouter.advantage", "reinforce_pp"],
    "reinforce_pp_baseline": ["--rollouter.advantage", "reinforce_pp_baseline"],
    "dual_clip": ["--trainer.loss.clip_ratio_c", "3.0"],
    "gspo": ["--trainer.loss.policy_loss", "gspo", "--trainer.loss.aggregation",
             "seq-mean-token-mean", "--trainer.loss.clip_low", "3e-4",
             "--trainer.loss.clip_high", "4e-4"],
    "cispo": ["--trainer.loss.policy_loss", "cispo", "--trainer.loss.clip_high", "0.28"],
    "kl_k3": ["--trainer.loss.kl_coef", "0.05", "--trainer.loss.kl_estimator", "k3"],
    "dynamic_sampling": ["--loop.replace_dropped_groups", "16"],
    "ppo_critic": ["--rollouter.advantage", "gae", "--trainer.critic.enabled", "true",
                   "--trainer.critic.lr", "1e-3"],
    "dppo_tv": ["--trainer.loss.policy_loss", "dppo_tv"],
    "dppo_kl": ["--trainer.loss.policy_loss", "dppo_kl"],
    "sapo": ["--trainer.loss.policy_loss", "sapo", "--trainer.loss.aggregation",
             "seq-mean-token-mean"],
    "gmpo": ["--trainer.loss.policy_loss", "gmpo", "--trainer.loss.aggregation",
             "seq-mean-token-mean", "--trainer.loss.clip_low", "0.4",
             "--trainer.loss.clip_high", "0.4"],
    "clip_cov": ["--trainer.loss.policy_loss", "clip_cov"],
    "kl_cov": ["--trainer.loss.policy_loss", "kl_cov"],
    "gpg": ["--trainer.loss.policy_loss", "gpg"],
    "opo": ["--rollouter.advantage", "opo"],
    "grpo_passk": ["--rollouter.advantage", "grpo_passk"],
    # GDPO's parts are the rollout's (the main job's turn scores summed): rollout credit
    "gdpo": ["--rollouter.advantage", "gdpo", "--rollouter.credit", "rollout"],
    "minibatch_2x2": ["--trainer.num_minibatches", "2", "--trainer.ppo_epochs", "2"],
}


def run_variant(name: str, overrides: list[str], *, config: str, steps: int, seed: int,
                out: pathlib.Path, job_options: list[str]) -> dict:
    command = [
        sys.executable, "-m", "torchtitan_rl.train", "--config", config,
        "--output_dir", str(out), "--name", name, "--seed", str(seed),
        "--loop.num_steps", str(steps), "--validation.every_steps", "0",
        "--checkpoint.every_steps", "0", "--checkpoint.export_hf", "false",
        *job_options, *overrides,
    ]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        return {"name": name, "failed": proc.stderr.strip().splitlines()[-1:] or ["?"],
                "wall_s": wall_s}
    run_dir = out / name
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(
        ).splitlines()]
    trained = [m for m in steps_metrics if "trainer/grad_norm" in m]
    finite = all(math.isfinite(m["loss/objective"]) and math.isfinite(m["trainer/grad_norm"])
                 for m in trained)
    return {
        "name": name,
        "before": summary["reward_before"],
        "after": summary["reward_after"],
        "rise": summary["rise"],
        "stderr": summary["rise_stderr"],
        "z": summary["rise_z"],
        "step_s": statistics.median(m["time/step_s"] for m in trained),
        "finite": finite and len(trained) == steps,
        "wall_s": wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default="run_configs/alphabet_sort_cpu.toml",
                        help="the run config every variant changes (default: the main job)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--out", type=pathlib.Path,
                        default=REPO_ROOT / "runs" / "bench_algorithms" / time.strftime(
                            "%Y%m%d-%H%M%S"), help="where the variants' run folders go")
    parser.add_argument("job_options", nargs="*", help="options for every variant's job (after --)")
    args = parser.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")

    header = (f"{'variant':<22} {'before':>7} {'after':>7} {'rise':>7} {'stderr':>7} {'z':>6} "
              f"{'step_s':>7} {'finite':>6} {'wall_s':>7}")
    print(header, flush=True)
    rows = []
    for name in names:
        row = run_variant(name, VARIANTS[name], config=args.config, steps=args.steps,
                          seed=args.seed, out=args.out, job_options=args.job_options)
        rows.append(row)
        if "failed" in row:
            print(f"{name:<22} failed: {row['failed'][0]}", flush=True)
            continue
        print(f"{name:<22} {row['before']:7.4f} {row['after']:7.4f} {row['rise']:+7.4f} "
              f"{row['stderr']:7.4f} {row['z']:6.2f} {row['step_s']:7.2f} "
              f"{str(row['finite']):>6} {row['wall_s']:7.0f}", flush=True)
    ran = [r for r in rows if "failed" not in r]
    learned = sum(r["z"] is not None and r["z"] >= 2 for r in ran)
    all_finite = len(ran) == len(rows) and all(r["finite"] for r in ran)
    print(f"variants={len(ran)} all_finite={all_finite} learned={learned}")


if __name__ == "__main__":
    main()
