"""Trained samples per second: the training loop at staleness 4 (async) vs staleness 0 (sync), on
the same config, in one run.

    python bench/async_vs_sync.py [--size demo] [--steps 40] [--repeats 3] [--max-staleness 4]
                                  [--kv-at-pull recompute|keep_running|keep_all]

Heavy-tailed response lengths come from the environment mix: most episodes end after one
assistant turn, one in ``--long-every`` runs ``--long-turns`` turns (the env answers "go on"
each time), and every reply ends at one of ``--stop-every``-th token ids (a geometric length, as
the tiny random model almost never says end-of-turn), so a synchronous step always waits for its
slowest groups while the generator batch runs nearly empty and the trainer idles. Both runs use
one torch thread for the generator and one for the trainer (two cores), no validation and no
checkpoints; samples/s is training samples over the loop's wall time (sum of ``time/step_s``, the
step windows tile the loop).

One workload from the first step to the last, and the same on both sides: the learning rate is
tiny by default (``--lr``), so the policy, and with it the reply lengths, stays where it started.
With lr 1e-3 the replies shortened as the model learned, and differently on each side (60 steps,
trained tokens a step in the second half: sync 1209, async 1005, from 1303 / 1262 in the first),
so the two sides no longer did the same work; with 1e-7 both train 1,400-1,420 tokens a step from
the first half to the second.

Each repeat runs sync then async, after ``--warmup`` uncounted pairs; the figures are medians
over repeats, with their spread ((max - min) / median). The bound: the sync run's work at a step
time equal to the busier of the generator and the trainer (their busy seconds in the sync run,
from the idle ratios), i.e. what a perfect overlap of those seconds would give;
``efficiency = async / bound`` and ``ceiling = bound / sync``. Async can pass the bound: the sync
generator's busy seconds include the ones its nearly empty batch spends on stragglers, which the
async generator fills with later steps' requests. The default workload (``demo`` model, groups
of 8) kept the generator and the trainer nearly as busy, where overlap gives the most; each
faster trainer since (less padding, per-sample attention) left the generator the busier (a
ceiling of 1.64-1.65 in the sync run); with ``--size tiny`` the generator is the busier by far.
``trainer_slowdown`` is the trainer's median forward-backward time in the async run over the sync
run: what running next to the generator costs it.

Every figure comes twice: over the whole run, and over the steady window, steps S + 1 to
N - S - 1 of both sides. The async run's first S + 1 steps fill its pipeline (step 0 waits for a
whole generation; the (S + 1) * P groups admitted at version 0 are all due by step S) and in its
last S steps the generator has nothing left to generate: a cost paid once per run, however long,
that the window leaves out. A window gets no credit for groups generated before it (the async
generator runs up to S steps ahead): its samples/s counts at most the groups that finished
generating inside it. Last line:

    ratio=... async_samples_per_s=... efficiency=... ... steady_ratio=... steady_efficiency=...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import statistics
import sys
import tempfile

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from torchtitan_rl.assets.model_source import ModelSource  # noqa: E402
from torchtitan_rl.config.configurable import Configurable  # noqa: E402
from torchtitan_rl.controller.checkpoint.checkpointer import Checkpointer  # noqa: E402
from torchtitan_rl.controller.job import RLJob  # noqa: E402
from torchtitan_rl.controller.loop.loop import TrainingLoop  # noqa: E402
from torchtitan_rl.controller.loop.staleness import StalenessGate  # noqa: E402
from torchtitan_rl.controller.loop.validation import Validator  # noqa: E402
from torchtitan_rl.generator.config import WeightSyncPolicy  # noqa: E402
from torchtitan_rl.generator.generator import Generator  # noqa: E402
from torchtitan_rl.rollout.message_env import EnvStep, Message, MessageEnv  # noqa: E402
from torchtitan_rl.rollout.rollouter import Rollouter  # noqa: E402
from torchtitan_rl.task import TaskConfig  # noqa: E402
from torchtitan_rl.train import main  # noqa: E402
from torchtitan_rl.trainer.batcher import Batcher  # noqa: E402
from torchtitan_rl.trainer.core import OptimizerConfig  # noqa: E402
from torchtitan_rl.trainer.trainer import PolicyTrainer  # noqa: E402
from torchtitan_rl.types import Sampling  # noqa: E402

logger = logging.getLogger("bench.async_vs_sync")


class GoOnEnv(MessageEnv):
    """Asks for ``num_turns`` replies; reward = share of the letters a..m (spread for GRPO)."""

    def __init__(self, episode: tuple[str, int]) -> None:
        self.prompt, self.num_turns = episode
        self.turn = 0

    async def init(self) -> list[Message]:
        return [{"role": "user", "content": self.prompt}]

    async def step(self, assistant_message: Message) -> EnvStep:
        self.turn += 1
        if self.turn >= self.num_turns:
            return EnvStep(done=True)
        return EnvStep(done=False, messages=[{"role": "user", "content": "go on"}])

    def score(self, replies: list[str], reward_parts: list[dict[str, float]]) -> float:
        letters = [c for c in "".join(replies).lower() if c.isalpha()]
        return sum(c <= "m" for c in letters) / len(letters) if letters else 0.0


class LongTailTask(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TaskConfig):
        num_prompts: int = 256
        long_every: int = 4
        long_turns: int = 8
        system_prompt: str | None = None

    def __init__(self, config: Config) -> None:
        self.config = config

    def dataset(self, split: str) -> list[tuple[str, int]]:
        cfg = self.config
        return [(f"Write words, {split} prompt {i}:",
                 cfg.long_turns if i % cfg.long_every == 0 else 1)
                for i in range(cfg.num_prompts)]

    def make_env(self, episode: tuple[str, int]) -> GoOnEnv:
        return GoOnEnv(episode)


def bench_job(output_dir: pathlib.Path, name: str, args: argparse.Namespace,
              mode: str) -> RLJob.Config:
    max_tokens = args.max_tokens
    budget = args.long_turns * (max_tokens + 16) + 64
    return RLJob.Config(
        name=name, output_dir=str(output_dir), seed=0,
        model=ModelSource.Config(size=args.size, assets_dir=str(REPO_ROOT / "assets" / "models")),
        task=LongTailTask.Config(long_every=args.long_every, long_turns=args.long_turns),
        rollouter=Rollouter.Config(group_size=args.group_size, max_turns=args.long_turns,
                                   max_rollout_tokens=budget),
        sampling=Sampling(max_tokens=max_tokens,
                          stop_token_ids=list(range(3, 1024, args.stop_every))),
        generator=Generator.Config(
            max_model_len=budget + 64, kv_cache_bytes=64 << 20, torch_num_threads=1,
            weight_sync=WeightSyncPolicy(reset_prefix_cache=args.kv_at_pull != "keep_all",
                                         reset_running_requests=args.kv_at_pull == "recompute")),
        batcher=Batcher.Config(seq_len=budget),
        trainer=PolicyTrainer.Config(optimizer=OptimizerConfig(lr=args.lr), num_threads=1),
        loop=TrainingLoop.Config(
            num_steps=args.steps, groups_per_step=args.groups_per_step,
            staleness=StalenessGate.Config(
                max_staleness=args.max_staleness if mode == "async" else 0),
            partial_rollout=args.partial_rollout if mode == "async" else "none"),
        validation=Validator.Config(num_prompts=0),
        checkpoint=Checkpointer.Config(every_steps=0, export_hf=False),
    )


@dataclasses.dataclass
class RunTimes:
    samples: float = 0.0
    seconds: float = 0.0
    generator_busy_s: float = 0.0
    trainer_busy_s: float = 0.0
    forward_backward_s: list[float] = dataclasses.field(default_factory=list)
    groups_trained: float = 0.0
    groups_finished: float = 0.0
    """Groups whose generation finished in the window (some may be trained after it)."""

    @property
    def samples_per_s(self) -> float:
        """Trained samples a second, counting only what the generator kept up with in the
        window: a window that trains groups generated before it (an async run's generator runs
        up to S steps ahead) gets no credit for them."""
        kept_up = min(1.0, self.groups_finished / self.groups_trained)
        return self.samples * kept_up / self.seconds

    @property
    def bound_samples_per_s(self) -> float:
        """This work with generation and training perfectly overlapped."""
        return self.samples / max(self.generator_busy_s, self.trainer_busy_s)


def run_times(run_dir: pathlib.Path, steps: slice = slice(None)) -> RunTimes:
    """The run's times over ``steps`` (all of them by default)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "time/step_s" in r]
    first, stop, _ = steps.indices(len(records))
    before = records[first - 1] if first > 0 else {}
    times = RunTimes()
    for record in records[first:stop]:
        step_s = record["time/step_s"]
        times.samples += record["throughput/num_training_samples"]
        times.seconds += step_s
        times.generator_busy_s += (1 - record["time/generator_idle_ratio"]) * step_s
        times.trainer_busy_s += (1 - record["time/trainer_idle_ratio"]) * step_s
        times.forward_backward_s.append(record["trainer/forward_backward_s"])
    last = records[stop - 1]
    for counter in ("trained", "finished"):
        key = f"async/groups_{counter}"
        setattr(times, f"groups_{counter}", last[key] - before.get(key, 0.0))
    return times


def figures_of(sync: RunTimes, asynchronous: RunTimes) -> dict[str, float]:
    bound = sync.bound_samples_per_s
    return {
        "sync": sync.samples_per_s, "async": asynchronous.samples_per_s, "bound": bound,
        "ratio": asynchronous.samples_per_s / sync.samples_per_s,
        "efficiency": asynchronous.samples_per_s / bound,
        "ceiling": bound / sync.samples_per_s,
        "trainer_slowdown": statistics.median(asynchronous.forward_backward_s)
        / statistics.median(sync.forward_backward_s),
    }


def median_and_spread(values: list[float]) -> tuple[float, float]:
    middle = statistics.median(values)
    return middle, (max(values) - min(values)) / middle


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="demo", choices=["tiny", "demo", "small"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1,
                        help="sync + async pairs run first and not counted (cold caches)")
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--stop-every", type=int, default=8)
    parser.add_argument("--long-every", type=int, default=4)
    parser.add_argument("--long-turns", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=4, help="S of the async side")
    parser.add_argument("--lr", type=float, default=1e-7,
                        help="small by default: the policy (and so the reply lengths) stays put, "
                             "so every step of both sides draws from one workload")
    parser.add_argument("--partial-rollout", default="none", choices=["abort", "none"],
                        help="the async side's loop.partial_rollout (none: the shipped default)")
    parser.add_argument("--kv-at-pull", default="recompute",
                        choices=["recompute", "keep_running", "keep_all"],
                        help="both sides' generator.weight_sync at a pull. recompute (the "
                             "default): drop the prefix cache, recompute running requests' KV. "
                             "keep_running: running requests keep their KV (reset_running_requests "
                             "off), new ones never reuse older weights' KV. keep_all: both off")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    out = pathlib.Path(tempfile.mkdtemp(prefix="bench_async_vs_sync_"))
    steady = slice(args.max_staleness + 1, args.steps - args.max_staleness)
    if steady.start >= steady.stop:
        parser.error(f"--steps {args.steps} leaves no steady window at --max-staleness "
                     f"{args.max_staleness} (it needs more than {2 * args.max_staleness + 1})")
    figures: dict[str, dict[str, list[float]]] = {"whole": {}, "steady": {}}
    for repeat in range(-args.warmup, args.repeats):
        for mode in ("sync", "async"):
            name = f"{mode}-{repeat}"
            main(bench_job(out, name, args, mode))
            times = run_times(out / name)
            logger.warning("%s: %.0f samples in %.1f s", name, times.samples, times.seconds)
        if repeat < 0:
            continue
        for window, steps in (("whole", slice(None)), ("steady", steady)):
            pair = figures_of(run_times(out / f"sync-{repeat}", steps),
                              run_times(out / f"async-{repeat}", steps))
            for key, value in pair.items():
                figures[window].setdefault(key, []).append(value)
    print(f"bench=async_vs_sync size={args.size} steps={args.steps} repeats={args.repeats} "
          f"max_staleness={args.max_staleness} partial_rollout={args.partial_rollout} "
          f"kv_at_pull={args.kv_at_pull} "
          f"groups_per_step={args.groups_per_step} group_size={args.group_size} "
          f"long_every={args.long_every} long_turns={args.long_turns} "
          f"stop_every={args.stop_every} steady_steps={steady.start}..{steady.stop - 1}")
    median: dict[str, dict[str, float]] = {}
    for window, values_by_key in figures.items():
        median[window] = {}
        for key, values in values_by_key.items():
            middle, spread = median_and_spread(values)
            median[window][key] = middle
            print(f"{window} {key}: median={middle:.3f} spread={spread:.1%} runs="
                  + ",".join(f"{v:.3f}" for v in values))
    whole, steady_median = median["whole"], median["steady"]
    print(f"ratio={whole['ratio']:.2f} async_samples_per_s={whole['async']:.2f} "
          f"sync_samples_per_s={whole['sync']:.2f} bound_samples_per_s={whole['bound']:.2f} "
          f"efficiency={whole['efficiency']:.2f} ceiling={whole['ceiling']:.2f} "
          f"trainer_slowdown={whole['trainer_slowdown']:.2f} "
          f"steady_ratio={steady_median['ratio']:.2f} "
          f"steady_async_samples_per_s={steady_median['async']:.2f} "
          f"steady_sync_samples_per_s={steady_median['sync']:.2f} "
          f"steady_bound_samples_per_s={steady_median['bound']:.2f} "
          f"steady_efficiency={steady_median['efficiency']:.2f} "
          f"steady_ceiling={steady_median['ceiling']:.2f}")


if __name__ == "__main__":
    run()
