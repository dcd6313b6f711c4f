"""Supervised warm start: teach a random model the task's answer format before RL.

A from-scratch model scores ~0 on AlphabetSort, so GRPO has no signal. This step fine-tunes the model
on the task's own solved conversations (loss on assistant tokens only) for a fixed number of steps and
writes an HF model directory. The result is cached under `cache_dir` by a digest of everything that
determines it (base model files, task config, these settings), so later runs reuse it.

It is honest supervision on generated solutions, not on validation prompts: the solved
conversations come from the training split only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import pathlib
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torchtitan_rl.assets.permissions import is_private, share_like_umask
from torchtitan_rl.assets.tokenizer import messages_and_tools
from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.console import progress_bar

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]] | dict[str, Any]
"""A solved conversation (`tokenizer.messages_and_tools`): its tools are rendered as the rollouts
render a request's ``tools``."""
Example = tuple[list[int], list[int]]
"""(token ids, assistant mask) of one conversation."""

LENGTH_GROUP_BATCHES = 8
LOSS_FILE = "warm_start_loss.json"
"""Written beside the model: its training loss at every step and the seconds it trained
(`warm_start_metrics` reads it; a model cached before it was written has none)."""


class WarmStartStopped(Exception):
    """The run was stopped (SIGTERM, Ctrl-C) during the warm start; nothing was written."""


class WarmStart(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enabled: bool = False
        """Fine-tune on solved training conversations before RL (cached)."""
        num_steps: int = 400
        """Optimizer steps."""
        batch_size: int = 16
        """Conversations per step."""
        lr: float = 2e-3
        """AdamW learning rate (measured: 2e-3 learns, 5e-3 fails to take off)."""
        beta2: float = 0.98
        """AdamW's second-moment decay (beta1 is 0.9), in [0, 1)."""
        warmup_steps: int = 20
        """Linear learning-rate warm-up: step s (0-based) uses lr * min(1, (s + 1) /
        warmup_steps); 0 or 1: no warm-up."""
        num_conversations: int = 4096
        """Distinct solved training conversations to sample batches from."""
        group_by_length: bool = False
        """Draw `LENGTH_GROUP_BATCHES` batches of conversations at once, sort them by length and
        cut them into batches (HF Trainer's group_by_length): far less padding where
        conversations differ in length (multi-turn episodes), the same conversations seen."""
        num_threads: int | None = None
        """torch threads while it trains (None: torch's default, one per core). Alone on a
        2-core box the default is fastest; beside another CPU-bound job, 1 avoids the threads of
        the two jobs spinning against each other (docs/main_job.md, "Threads")."""
        cache_dir: str = "assets/warmstart"
        """Where warm-started models are cached, one folder per digest of their inputs (base
        model files, task settings, seed, these settings); a later run with the same inputs
        reuses it."""

        def __post_init__(self) -> None:
            for name in ("num_steps", "batch_size", "num_conversations"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if not self.lr > 0:
                raise ValueError(f"lr must be > 0, got {self.lr}")
            if self.num_threads is not None and self.num_threads < 1:
                raise ValueError(f"num_threads must be >= 1 or None, got {self.num_threads}")

    def __init__(self, config: Config) -> None:
        self.config = config

    def cache_key(self, base_model_dir: pathlib.Path, task_fingerprint: str, seed: int) -> str:
        from torchtitan_rl.assets.make_model import directory_digest

        payload = json.dumps({
            "base": directory_digest(base_model_dir),
            "task": task_fingerprint,
            "seed": seed,
            # where it is cached and how many threads train it do not change what it learns
            "config": {k: v for k, v in dataclasses.asdict(self.config).items()
                       if k != "num_threads"} | {"cache_dir": None},
        }, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def output_dir(self, base_model_dir: pathlib.Path, task_fingerprint: str,
                   seed: int) -> pathlib.Path:
        """Where the warm-started model of these inputs is cached."""
        key = self.cache_key(base_model_dir, task_fingerprint, seed)
        return pathlib.Path(self.config.cache_dir) / key

    def run(
        self,
        *,
        base_model_dir: pathlib.Path,
        out: pathlib.Path,
        solved_conversation: Callable[[int], Conversation],
        seed: int,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        stop: threading.Event | None = None,
    ) -> pathlib.Path:
        """Train the warm start into ``out`` (`output_dir`) unless it is cached there.
        ``chat_template_kwargs``: what the run's rollouts render with
        (`token_env.chat_template_kwargs`), so the warm start learns the replies in the same
        frame; the task fingerprint in ``out``'s cache key includes it. ``stop`` set: raises
        WarmStartStopped before the next step, with nothing written."""
        if (out / "config.json").is_file():
            logger.info("warm start: reusing %s", out)
            if any(is_private(p) for p in (out, *out.glob("*.safetensors"))):
                share_like_umask(out)  # cached before the umask's modes were set (0700 / 0600)
            return out
        conversations = [solved_conversation(i) for i in range(self.config.num_conversations)]
        self._train(base_model_dir, conversations, out, seed, chat_template_kwargs or {},
                    stop or threading.Event())
        return out

    def _train(
        self, base_model_dir: pathlib.Path, conversations: Sequence[Conversation],
        out: pathlib.Path, seed: int, chat_template_kwargs: Mapping[str, Any],
        stop: threading.Event,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
        model = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
        model.train()
        examples = [_tokenize_with_assistant_mask(tokenizer, c, chat_template_kwargs)
                    for c in conversations]
        cfg = self.config
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.beta2),
                                      weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps))
        )
        rng = random.Random(seed)
        pad_id = tokenizer.pad_token_id
        start = time.perf_counter()
        logger.info("warm start: %d steps x %d conversations from %s", cfg.num_steps,
                    cfg.batch_size, base_model_dir)
        batches = self._batches(examples, rng)
        losses: list[float] = []
        with _torch_threads(cfg.num_threads), progress_bar(total=cfg.num_steps,
                                                           desc="warm start") as bar:
            for step in range(cfg.num_steps):
                if stop.is_set():
                    raise WarmStartStopped(f"warm start stopped at step {step}/{cfg.num_steps}")
                loss = self._step(model, optimizer, schedule, next(batches), pad_id)
                losses.append(loss)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
                if step % 50 == 0 or step == cfg.num_steps - 1:
                    logger.info("warm start step %d/%d loss=%.4f (%.0f s)", step + 1,
                                cfg.num_steps, loss, time.perf_counter() - start)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".warm-", dir=out.parent))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / LOSS_FILE).write_text(json.dumps({
                "loss": [round(x, 5) for x in losses],
                "train_s": round(time.perf_counter() - start, 1)}))
            for extra in ("generation_config.json",):
                if (base_model_dir / extra).exists():
                    shutil.copy(base_model_dir / extra, tmp / extra)
            share_like_umask(tmp)  # mkdtemp made it 0700 and safetensors writes 0600
            try:
                tmp.rename(out)
            except OSError:
                # Another run trained the same key beside this one and finished first: the same
                # inputs, so its files serve; they may be in use, so they are not replaced.
                if not (out / "config.json").is_file():
                    raise
                logger.info("warm start: %s was written by another run meanwhile; using it", out)
                return
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        logger.info("warm start: wrote %s in %.0f s", out, time.perf_counter() - start)

    def _batches(self, examples: Sequence[Example], rng: random.Random) -> Iterator[list[Example]]:
        """Endless batches of ``batch_size`` random examples (grouped by length when asked)."""
        size = self.config.batch_size
        if not self.config.group_by_length:
            while True:
                yield rng.sample(examples, size)
        while True:
            drawn = sorted(rng.sample(examples, min(len(examples), size * LENGTH_GROUP_BATCHES)),
                           key=lambda example: len(example[0]))
            batches = [drawn[i: i + size] for i in range(0, len(drawn), size)]
            rng.shuffle(batches)
            yield from batches

    @staticmethod
    def _step(model: Any, optimizer: Any, schedule: Any,
              batch: list[Example], pad_id: int) -> float:
        """One optimizer step on ``batch`` (token ids, assistant mask); returns the loss."""
        import torch

        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()


def _tokenize_with_assistant_mask(tokenizer: Any, conversation: Conversation,
                                  chat_template_kwargs: Mapping[str, Any] | None = None) -> Example:
    """Token ids of the rendered conversation and a mask that is 1 on assistant replies
    (their text or tool calls and end-of-turn token), computed by rendering growing prefixes."""
    kwargs = dict(chat_template_kwargs or {})
    conversation, tools = messages_and_tools(conversation)
    if tools:
        kwargs["tools"] = tools
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(conversation):
        if message["role"] == "assistant":
            prefix = tokenizer.apply_chat_template(conversation[:i], add_generation_prompt=True,
                                                   tokenize=False, **kwargs)
            full = tokenizer.apply_chat_template(conversation[: i + 1], tokenize=False, **kwargs)
            prompt_ids = tokenizer.encode(prefix, add_special_tokens=False)
            full_ids = tokenizer.encode(full, add_special_tokens=False)
            if full_ids[: len(prompt_ids)] != prompt_ids or prompt_ids[: len(ids)] != ids:
                raise ValueError("chat template does not render conversations prefix-stably")
            ids_before = len(ids)
            ids = prompt_ids + full_ids[len(prompt_ids):]
            reply = full_ids[len(prompt_ids):]
            # The reply ends "<|im_end|>\n": learn the end-of-turn token, not the newline after it.
            mask += [0] * (len(prompt_ids) - ids_before) + [1] * (len(reply) - 1) + [0]
    return ids, mask


@contextlib.contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``num_threads`` (None: left as they are), then given back
    (the warm start trains in the controller's process)."""
    import torch

    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def warm_start_metrics(model_dir: pathlib.Path) -> dict[str, float]:
    """The warm start's loss as metrics (`warm_start/loss_first`: its first step's,
    `warm_start/loss_last`: the mean over its last tenth of steps), its steps and the seconds it
    trained, from ``model_dir``'s `LOSS_FILE`; {} when there is none."""
    path = pathlib.Path(model_dir) / LOSS_FILE
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    losses = record["loss"]
    if not losses:
        return {}
    tail = losses[-max(1, len(losses) // 10):]
    return {"warm_start/loss_first": float(losses[0]),
            "warm_start/loss_last": sum(tail) / len(tail),
            "warm_start/num_steps": float(len(losses)),
            "warm_start/train_s": float(record["train_s"])}
