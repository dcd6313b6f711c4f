"""The main job as a new user meets it: a fresh clone's first run, a cached rerun, seeds 0-2 and
another box's matrix kernels. Does it rise clearly everywhere, and how long does it take?

    python bench/demo.py [--seeds 0,1,2] [--avx2-seed 0] [--out DIR] [-- extra job options]

Every run is ``bash scripts/train.sh`` (the main job, run_configs/alphabet_sort_cpu.toml) in one
fresh clone of this repository's committed HEAD, made under ``--out``:

1. ``first_run``: seed 0 from nothing (set-up, model, warm start, GRPO), timed as a whole;
2. ``rerun``: seed 0 again under another run name: set-up, model and warm start cached;
3. each further seed of ``--seeds`` (its own warm start: the cache is keyed by seed);
4. ``avx2``: seed ``--avx2-seed`` with ``MKL_ENABLE_INSTRUCTIONS=AVX2`` and a warm-start cache of
   its own, so that the warm start too runs on the kernels an AVX2-only box picks; then a line
   saying whether that setting changes this CPU's results at all (40 training steps of the demo
   model with and without it, compared bit for bit: on a CPU where MKL already picks its AVX2
   kernels, the avx2 run trains what the seed's own run does).

The table gives each run's rewards from its ``summary.json`` (before and after GRPO, the rise paired
by episode, its z with standard errors clustered by episode) and wall time, after a line with the
CPU's model and its vector flags. Last line::

    min_rise=.. min_z=.. min_after=.. first_run_s=.. rerun_s=..

(the minimum over the runs that trained from their own warm start: first_run, the seeds, avx2).
The first run's set-up uses this machine's uv and pip caches as they are: on a machine that never
installed the stack, downloading the packages comes on top.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def cpu_line() -> str:
    model, flags = "?", set()
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    have = [f for f in VECTOR_FLAGS if f in flags]
    return f"cpu: {model}, {os.cpu_count()} cores, {' '.join(have) or 'no avx2'}"


KERNEL_PROBE = """
import hashlib, sys, torch
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
digest = hashlib.sha256()
for _ in range(40):
    ids = torch.randint(0, model.config.vocab_size, (16, 96))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
for parameter in model.parameters():
    digest.update(parameter.detach().numpy().tobytes())
print(digest.hexdigest())
"""
"""40 AdamW steps of the demo model on random tokens, one thread; prints a digest of its weights
(the warm start's kind of work, in seconds)."""


def avx2_changes_kernels(clone: pathlib.Path) -> bool:
    """Whether ``MKL_ENABLE_INSTRUCTIONS=AVX2`` changes this CPU's results: `KERNEL_PROBE` with
    and without it. Where it does not (MKL already runs its AVX2 kernels here), the avx2 run
    trains what seed's run does, up to vLLM's batching."""
    digests = []
    for env in ({}, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}):
        proc = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c", KERNEL_PROBE,
                               str(clone / "assets" / "models" / "demo")],
                              env={**os.environ, **env}, capture_output=True, text=True,
                              check=True)
        digests.append(proc.stdout.strip())
    return digests[0] != digests[1]


def train(clone: pathlib.Path, name: str, seed: int, extra: list[str],
          env: dict[str, str] | None = None) -> dict:
    """One ``bash scripts/train.sh`` in ``clone``; its summary and wall time."""
    command = ["bash", "scripts/train.sh", "--name", name, "--seed", str(seed), *extra]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=clone, env={**os.environ, **(env or {})},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}): "
                         f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    summary = json.loads((clone / "runs" / name / "summary.json").read_text())
    return {"name": name, "seed": seed, "wall_s": wall_s, **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated; the first is timed")
    parser.add_argument("--avx2-seed", type=int, default=0, help="-1: no AVX2 run")
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "runs" / "bench_demo" /
                        time.strftime("%Y%m%d-%H%M%S"), help="where the clone is made")
    parser.add_argument("extra", nargs="*", help="options for every run (after --)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    args.out.mkdir(parents=True, exist_ok=True)
    clone = args.out / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)

    print(cpu_line(), flush=True)
    print(f"{'run':<12} {'seed':>4} {'before':>7} {'after':>7} {'rise':>7} {'z':>5} {'wall_s':>7}",
          flush=True)
    rows = []

    def report(row: dict) -> None:
        rows.append(row)
        z = row.get("rise_z")
        print(f"{row['name']:<12} {row['seed']:>4} {row['reward_before']:7.4f} "
              f"{row['reward_after']:7.4f} {row['rise']:+7.4f} "
              f"{z if z is None else round(z, 1)!s:>5} {row['wall_s']:7.0f}", flush=True)

    first = train(clone, "first_run", seeds[0], args.extra)
    report(first)
    rerun = train(clone, "rerun", seeds[0], args.extra)
    report(rerun)
    trained = [first]
    for seed in seeds[1:]:
        row = train(clone, f"seed{seed}", seed, args.extra)
        report(row)
        trained.append(row)
    if args.avx2_seed >= 0:
        row = train(clone, "avx2", args.avx2_seed,
                    [*args.extra, "--warm_start.cache_dir", str(args.out / "warmstart_avx2")],
                    env={"MKL_ENABLE_INSTRUCTIONS": "AVX2"})
        report(row)
        trained.append(row)
        print(f"MKL_ENABLE_INSTRUCTIONS=AVX2 changes this CPU's results: "
              f"{avx2_changes_kernels(clone)}", flush=True)
    zs = [r["rise_z"] for r in trained if r.get("rise_z") is not None]
    print(f"min_rise={min(r['rise'] for r in trained):+.4f} "
          f"min_z={min(zs) if zs else float('nan'):.1f} "
          f"min_after={min(r['reward_after'] for r in trained):.4f} "
          f"first_run_s={first['wall_s']:.0f} rerun_s={rerun['wall_s']:.0f}")


if __name__ == "__main__":
    sys.exit(main())
