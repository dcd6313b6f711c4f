"""A stand-in for vLLM's ``LLMEngine`` with no model compute: scale benchmarks of everything around
the engine (controller, rollouts, weight pushes, Monarch) with many generators on few cores.

    Generator.Config(engine="stand_in", stand_in_tokens_per_s=...) -> build_engine(config)
    engine_loop: add_request (through vllm_engine.add_request: renderer + Sampling)
                 step()        one output token per running request, paced by sleeping
                 abort_request, has_unfinished_requests, reset_prefix_cache, set_weight_version
    pull (weight_sync/pull.py, load "reload"): collective_rpc("reload_weights", ...) copies every
                 tensor into the engine's own weights; apply_model(fn) runs fn on them
    verify: read_hf_weights() returns the weights it holds

Exactly the subset of ``LLMEngine`` that ``generator/engine_loop.py``, ``vllm_engine.py`` and
``weight_sync/pull.py`` use, with vLLM's output shapes (``RequestOutput``: request id, finished,
``outputs[0]`` with token ids, one ``{token: Logprob}`` per token, finish reason and
``weight_versions`` spans; ``num_cached_tokens``; ``metrics``).

Tokens: a request's tokens come from ``random.Random(seed)``, seeded by its ``Sampling.seed``
(the job seeds every request) or else by (engine seed, request id): the same request gives the
same reply on any engine. They are ordinary (non-special) ids of the model's tokenizer, so the
task's environment decodes real text; each reply has a drawn length in [1, max_tokens] and ends
with the first stop token (finish "stop"), or runs to max_tokens / max_model_len ("length").

Pacing: a step emits one token per running request and takes ``tokens / tokens_per_s`` seconds,
slept in the engine thread (no CPU burnt); a GPU engine's throughput, not its latency, is what the
controller and the push path see. Prefill is free. The prefix cache is simulated by block
(``block_size``), so multi-turn sessions report cached prompt tokens as vLLM would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pathlib
import random
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(slots=True)
class Logprob:
    """vLLM's ``Logprob`` (what ``completion_from_output`` reads)."""

    logprob: float


@dataclasses.dataclass(slots=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were sampled by weights labelled ``version`` (vLLM's)."""

    version: str
    start: int
    end: int


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str | None
    weight_versions: list[WeightVersionSpan]


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    """The fields of vLLM's request stats that ``first_token_latency_s`` reads."""

    first_token_latency: float
    num_generation_tokens: int


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics


@dataclasses.dataclass(slots=True)
class _Request:
    """One running request: its reply is drawn at admission and emitted a token per step."""

    request_id: str
    prompt_token_ids: list[int]
    reply: list[int]
    finish_reason: str
    num_cached_tokens: int
    admitted_at: float
    cache_salt: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    spans: list[WeightVersionSpan] = dataclasses.field(default_factory=list)
    first_token_at: float | None = None

    def emit(self, version: str) -> None:
        self.token_ids.append(self.reply[len(self.token_ids)])
        if self.spans and self.spans[-1].version == version:
            self.spans[-1].end += 1
        else:
            n = len(self.token_ids)
            self.spans.append(WeightVersionSpan(version, n - 1, n))

    @property
    def done(self) -> bool:
        return len(self.token_ids) == len(self.reply)

    def make_request_output(self, new_token_ids: list[int], pooling_output: Any,
                            finish_reason: Any, stop_reason: Any) -> RequestOutput:
        """vLLM's ``RequestState.make_request_output`` as ``vllm_engine.partial_output`` calls
        it for an abort: the tokens so far, the given finish reason."""
        return self.output(str(finish_reason))

    def output(self, finish_reason: str) -> RequestOutput:
        # logprob of a uniform draw over the reply alphabet: a fixed, finite value per token
        logprobs = [{token: Logprob(-1.0)} for token in self.token_ids]
        first = (self.first_token_at or self.admitted_at) - self.admitted_at
        return RequestOutput(
            request_id=self.request_id,
            outputs=[CompletionOutput(list(self.token_ids), logprobs, finish_reason,
                                      [dataclasses.replace(s) for s in self.spans])],
            finished=True, num_cached_tokens=self.num_cached_tokens,
            metrics=RequestMetrics(first, len(self.token_ids)),
        )


class _Renderer:
    """vLLM's input renderer for token-id prompts: the prompt dict is the engine input."""

    def render_cmpl(self, prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return list(prompts)


class _OutputProcessor:
    """The two maps of vLLM's output processor that ``vllm_engine.partial_output`` reads."""

    def __init__(self, requests: dict[str, _Request]) -> None:
        self.request_states = requests

    @property
    def external_req_ids(self) -> dict[str, list[str]]:
        return {rid: [rid] for rid in self.request_states}


class StandInEngine:
    """Answers requests at ``tokens_per_s`` output tokens per second and holds a full copy of
    the model's weights, which pulls overwrite byte for byte."""

    accepts_sampling: ClassVar[bool] = True
    """``vllm_engine.add_request`` passes the request's ``Sampling`` (no vLLM import)."""
    abort_finish_reason: ClassVar[str] = "abort"
    """What ``vllm_engine.partial_output`` gives an aborted request (no vLLM import)."""

    def __init__(self, model_dir: str | pathlib.Path, *, tokens_per_s: float, seed: int = 0,
                 max_model_len: int = 2048, block_size: int = 32, dtype: str = "auto",
                 enable_prefix_caching: bool = True,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if tokens_per_s <= 0:
            raise ValueError(f"stand_in_tokens_per_s must be > 0, got {tokens_per_s}")
        self.model_dir = pathlib.Path(model_dir)
        self.tokens_per_s = tokens_per_s
        self.seed = seed
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._sleep = sleep
        hf_config = json.loads((self.model_dir / "config.json").read_text())
        self.eos_token_id = int(hf_config["eos_token_id"])
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        self._reply_ids = _ordinary_token_ids(self.model_dir, int(hf_config["vocab_size"]))
        self.weights = _load_weights(self.model_dir, _DTYPES.get(dtype))
        self.model = _module_tree(self.weights, tied=self.tied)
        """The weights as a module tree by HF name (what ``apply_model`` functions get)."""
        self.renderer = _Renderer()
        self._running: dict[str, _Request] = {}
        self.output_processor = _OutputProcessor(self._running)
        self._cached_blocks: set[bytes] = set()
        self._weight_version = "0"
        self._free_at = time.monotonic()
        # ---- counters ----------------------------------------------------------------------
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_reloaded_bytes = 0

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any,
                    lora_request: Any = None) -> None:
        """``params``: the request's ``Sampling`` or vLLM ``SamplingParams`` (max_tokens, seed,
        stop_token_ids are read). ``lora_request`` is always None: a stand-in serves no
        adapters (``Generator.Config.lora_rank`` needs vLLM)."""
        if request_id in self._running:
            raise ValueError(f"request id {request_id!r} is already running")
        prompt_ids = list(prompt["prompt_token_ids"])
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under "
                             f"max_model_len={self.max_model_len}")
        seed = params.seed if params.seed is not None else _seed_of(self.seed, request_id)
        rng = random.Random(seed)
        cap = params.max_tokens or room
        length = rng.randint(1, cap)
        if length < cap and length <= room:  # ends on its own: the last token is a stop token
            reply = [rng.choice(self._reply_ids) for _ in range(length - 1)]
            reply.append((list(params.stop_token_ids or []) or [self.eos_token_id])[0])
            reason = "stop"
        else:
            reply = [rng.choice(self._reply_ids) for _ in range(min(cap, room))]
            reason = "length"
        salt = prompt.get("cache_salt") or ""
        self._running[request_id] = _Request(
            request_id, prompt_ids, reply, reason, self._cached_prefix(salt, prompt_ids),
            admitted_at=time.monotonic(), cache_salt=salt)

    def step(self) -> list[RequestOutput]:
        """One token for every running request, after the time the engine's rate allows; the
        finished requests' outputs (vLLM's FINAL_ONLY)."""
        if not self._running:
            return []
        num_tokens = len(self._running)
        self._pace(num_tokens)
        now = time.monotonic()
        finished: list[RequestOutput] = []
        for rid in list(self._running):
            request = self._running[rid]
            request.emit(self._weight_version)
            request.first_token_at = request.first_token_at or now
            if request.done:
                del self._running[rid]
                self._remember(request)
                finished.append(request.output(request.finish_reason))
        self.num_steps += 1
        self.num_generated_tokens += num_tokens
        return finished

    def abort_request(self, request_ids: Iterable[str], internal: bool = False) -> None:
        for rid in request_ids:
            self._running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running)

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        self._cached_blocks.clear()
        return True

    def set_weight_version(self, weight_version: str) -> None:
        self._weight_version = weight_version

    # ---- weights ---------------------------------------------------------------------------
    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Only ``reload_weights(weights_iterator=[(hf_name, tensor)], is_checkpoint_format=True)``:
        every tensor is copied into the engine's own; a misnamed or misshapen one raises before
        the first copy (``WeightPuller.prepare`` has checked that every weight is given)."""
        if method != "reload_weights":
            raise NotImplementedError(f"the stand-in engine has no collective_rpc {method!r}")
        pairs = list((kwargs or {})["weights_iterator"])
        for name, tensor in pairs:
            mine = self.weights.get(name)
            if mine is None or mine.shape != tensor.shape:
                raise ValueError(f"reload_weights: {name} {tuple(tensor.shape)} does not match "
                                 f"the engine's {None if mine is None else tuple(mine.shape)}")
        with torch.no_grad():
            for name, tensor in pairs:
                self.weights[name].copy_(tensor)
                self.num_reloaded_bytes += tensor.numel() * tensor.element_size()
        return [None]

    def apply_model(self, func: Callable[[nn.Module], Any]) -> list[Any]:
        return [func(self.model)]

    def read_hf_weights(self) -> dict[str, torch.Tensor]:
        """Every weight by HF name, as held (``lm_head.weight`` included when tied)."""
        weights = {name: t.clone() for name, t in self.weights.items()}
        if self.tied:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return weights

    # ---- helpers ---------------------------------------------------------------------------
    def _pace(self, num_tokens: int) -> None:
        # A deadline clock: the engine is free again num_tokens / rate after it last was (or
        # after now, when idle), so the loop's own work between steps hides inside the step time
        # as a GPU's would, instead of adding to it.
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + num_tokens / self.tokens_per_s
        if self._free_at > now:
            self._sleep(self._free_at - now)

    def _cached_prefix(self, salt: str, tokens: list[int]) -> int:
        if not self.enable_prefix_caching:
            return 0
        cached = 0
        for end in range(self.block_size, len(tokens), self.block_size):
            if _block_key(salt, tokens[:end]) not in self._cached_blocks:
                break
            cached = end
        return cached

    def _remember(self, request: _Request) -> None:
        if not self.enable_prefix_caching:
            return
        tokens = request.prompt_token_ids + request.token_ids
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            self._cached_blocks.add(_block_key(request.cache_salt, tokens[:end]))


def build_engine(config: Any) -> StandInEngine:
    """``Generator.Config`` -> a stand-in engine (``Generator.Config.engine = "stand_in"``)."""
    if config.model_dir is None:
        raise ValueError("generator model_dir must be set (an HF model directory), got None")
    engine = StandInEngine(
        config.model_dir, tokens_per_s=config.stand_in_tokens_per_s, seed=config.seed,
        max_model_len=config.max_model_len, block_size=config.block_size or 32,
        dtype=config.dtype, enable_prefix_caching=config.enable_prefix_caching)
    logger.info("stand-in engine ready: %s at %g tokens/s, %.1f MB of weights", config.model_dir,
                config.stand_in_tokens_per_s,
                sum(t.numel() * t.element_size() for t in engine.weights.values()) / 1e6)
    return engine


def _seed_of(seed: int, request_id: str) -> int:
    digest = hashlib.sha256(f"{seed}|{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _block_key(salt: str, tokens: list[int]) -> bytes:
    return hashlib.blake2b(f"{salt}|{tokens}".encode(), digest_size=16).digest()


def _ordinary_token_ids(model_dir: pathlib.Path, vocab_size: int) -> list[int]:
    """Token ids the tokenizer decodes to text: every id below vocab_size but its added
    (special) tokens."""
    special: set[int] = set()
    tokenizer = model_dir / "tokenizer.json"
    if tokenizer.exists():
        special = {t["id"] for t in json.loads(tokenizer.read_text()).get("added_tokens", [])}
    return [i for i in range(vocab_size) if i not in special]


def _load_weights(model_dir: pathlib.Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model dir {str(model_dir)!r}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            weights[name] = tensor.to(dtype) if dtype is not None else tensor
    if "lm_head.weight" in weights and weights["lm_head.weight"].data_ptr() == \
            weights.get("model.embed_tokens.weight", torch.empty(0)).data_ptr():
        del weights["lm_head.weight"]
    return weights


def _module_tree(weights: dict[str, torch.Tensor], *, tied: bool) -> nn.Module:
    """Modules named like the HF model (``model.layers.0.mlp.up_proj``), each holding its
    weight tensor (the same storage, not a copy); a tied ``lm_head`` holds the embedding."""
    root = nn.Module()
    for name, tensor in weights.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_buffer(leaf, tensor, persistent=False)
    if tied and "model.embed_tokens.weight" in weights:
        head = nn.Module()
        head.register_buffer("weight", weights["model.embed_tokens.weight"], persistent=False)
        root.add_module("lm_head", head)
    return root
