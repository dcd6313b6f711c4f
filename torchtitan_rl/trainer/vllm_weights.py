"""Load HF-named weights into a running vLLM engine, and read them back bit for bit to verify a push.

    reload_vllm_weights(engine, hf_state_dict)   reload_weights + the CPU tied-lm_head fix
    read_vllm_hf_weights(vllm_model)             HF-named tensors as the engine computes with them
    weight_mismatches(expected, actual, tied=)   names whose tensors are not bitwise equal
    unpack_cpu_linears(vllm_model)               once: CPU linears -> F.linear over plain weights
    load_hf_weights_inplace(vllm_model, hf_sd)   then each push: copy_ into those weights

The last two are a faster load for CPU engines (TP=1): ``reload_weights`` re-runs vLLM's loaders
and repacks every linear weight for oneDNN, which alone costs ~5 memcpys of the weights (measured
on the ``small`` model); unpacked F.linear engines generated as fast in our measurement (small,
float32: 52 vs 41 tokens/s at batch 1, 311 vs 301 at batch 32), and a push becomes one ``copy_``
per tensor into the live parameters. A tied lm_head is the embedding parameter itself, so it
follows without any fix.

Read-back on vLLM's CPU backend: linear weights are repacked for oneDNN / sgl kernels after loading
(the ``.weight`` parameter becomes shape (0,) and the packed copy is opaque). The read-back
multiplies each packed layer by the identity through the layer's own kernel: ``I @ W^T`` is exact
(every output is one product by 1.0 plus exact zeros), so it returns the packed weights bit for bit.
Merged layers are split by ``output_sizes`` (qkv_proj -> q/k/v, gate_up_proj -> gate/up). The
engine's ``lm_head`` is read the same way, which catches a stale tied head. Only tensor-parallel
size 1 engines are supported (a sharded engine would need a gather across its workers).

vLLM is imported inside functions: this module is safe to import from config code.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)

# vLLM's merged Qwen3 projections -> the HF projections they hold, in output order.
_MERGED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def vllm_model(engine: Any) -> nn.Module:
    """The torch model of an in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) ``LLMEngine``."""
    return engine.model_executor.driver_worker.worker.model_runner.model


def reload_vllm_weights(engine: Any, hf_state_dict: dict[str, torch.Tensor]) -> None:
    """Load HF-named full tensors into ``engine`` in place (its prefix cache is reset).

    On CPU, a tied ``lm_head`` keeps its old packed copy after ``reload_weights`` (vLLM logs
    "ParallelLMHead: Failed to load weights"); re-dispatching its GEMM from the (reloaded, shared)
    embedding weight fixes it.
    """
    from vllm.platforms import current_platform

    engine.collective_rpc(
        "reload_weights",
        kwargs={"weights_iterator": list(hf_state_dict.items()), "is_checkpoint_format": True},
    )
    if current_platform.is_cpu():
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        head = vllm_model(engine).lm_head
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    engine.reset_prefix_cache()


@torch.no_grad()
def _linear_weight(layer: nn.Module) -> torch.Tensor:
    weight = layer.weight
    if weight.numel() > 0 and not hasattr(layer, "cpu_linear"):
        return weight.detach().clone()
    in_features = getattr(layer, "input_size_per_partition", None) or weight.shape[-1]
    if hasattr(layer, "embedding_dim"):  # ParallelLMHead: a linear over the hidden size
        in_features = layer.embedding_dim
    eye = torch.eye(in_features, dtype=weight.dtype, device=weight.device)
    out = layer.cpu_linear(eye, weight, None) if hasattr(layer, "cpu_linear") else eye @ weight.T
    return out.T.contiguous()


@torch.no_grad()
def read_vllm_hf_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of a vLLM Qwen3 model (TP=1) by HF name, as the engine computes with it.

    ``lm_head.weight`` is included even when tied (it is what the logits use)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() != 1:
        raise NotImplementedError("read_vllm_hf_weights supports tensor_parallel_size=1 engines")
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or name.endswith("rotary_emb"):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _MERGED:
            full = _linear_weight(module)
            parts = torch.split(full, list(module.output_sizes), dim=0)
            prefix = name[: -len(leaf)]
            for hf_leaf, part in zip(_MERGED[leaf], parts, strict=True):
                out[f"{prefix}{hf_leaf}.weight"] = part.contiguous()
        elif leaf != "embed_tokens" and (hasattr(module, "cpu_linear") or weight.numel() == 0):
            out[f"{name}.weight"] = _linear_weight(module)
        else:
            out[f"{name}.weight"] = weight.detach().clone()
        vocab = getattr(module, "org_vocab_size", None)
        if vocab is not None:  # vLLM pads the vocab rows of embed_tokens / lm_head
            out[f"{name}.weight"] = out[f"{name}.weight"][:vocab].contiguous()
    return out


def weight_mismatches(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], *, tied: bool
) -> list[str]:
    """HF names whose tensor in ``actual`` is missing or not bitwise equal to ``expected`` (cast to
    the actual dtype, as the engine stores it). With ``tied``, the engine's ``lm_head.weight``
    must equal the expected embedding."""
    checks = dict(expected)
    if tied:
        checks["lm_head.weight"] = expected["model.embed_tokens.weight"]
    bad = []
    for name, tensor in checks.items():
        got = actual.get(name)
        if got is None or got.shape != tensor.shape:
            bad.append(name)
            continue
        if not torch.equal(got.cpu(), tensor.detach().cpu().to(got.dtype)):
            bad.append(name)
    if bad:
        logger.warning("weight verify: %d of %d tensors differ: %s", len(bad), len(checks), bad[:5])
    return bad


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _is_linear(name: str, module: nn.Module) -> bool:
    return hasattr(module, "cpu_linear") and not name.endswith("embed_tokens")


@torch.no_grad()
def unpack_cpu_linears(model: nn.Module) -> int:
    """Give every packed CPU linear of a vLLM model (TP=1) a plain weight and F.linear; returns
    how many layers were converted. The weights are read back bit for bit (identity probe)."""
    count = 0
    for name, module in model.named_modules():
        if not _is_linear(name, module):
            continue
        if module.weight.numel() == 0:
            module.weight = nn.Parameter(_linear_weight(module), requires_grad=False)
        module.cpu_linear = _plain_linear
        count += 1
    return count


@torch.no_grad()
def load_hf_weights_inplace(model: nn.Module, hf_state_dict: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into an unpacked (``unpack_cpu_linears``) vLLM Qwen3 model, TP=1.
    Every weight of the model must be given (a tied lm_head may be left out); names and shapes
    are all checked before the first copy, so a bad state dict changes nothing."""
    remaining = dict(hf_state_dict)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or name.endswith("rotary_emb"):
            continue
        if _is_linear(name, module) and weight.numel() == 0:
            raise RuntimeError(f"{name} is packed: call unpack_cpu_linears(model) first")
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _MERGED:
            prefix = name[: -len(leaf)]
            start = 0
            for hf_leaf, size in zip(_MERGED[leaf], module.output_sizes, strict=True):
                copies.append((weight.narrow(0, start, size), _pop(remaining, f"{prefix}{hf_leaf}.weight")))
                start += size
            continue
        key = f"{name}.weight"
        if key == "lm_head.weight" and key not in remaining:
            embed = model.get_submodule("model.embed_tokens").weight
            if weight.data_ptr() != embed.data_ptr():
                raise ValueError("lm_head.weight missing and the model's lm_head is not tied")
            continue
        tensor = _pop(remaining, key)
        # narrow: vLLM pads the vocab rows of embed_tokens / lm_head
        copies.append((weight.narrow(0, 0, tensor.shape[0]), tensor))
    if remaining:
        raise ValueError(f"names the vLLM model does not have: {sorted(remaining)[:5]}")
    for dst, src in copies:
        if dst.shape != src.shape:
            raise ValueError(f"shape mismatch: vLLM {tuple(dst.shape)} vs given {tuple(src.shape)}")
    for dst, src in copies:
        dst.copy_(src)


def _pop(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"state dict has no {name}")
    return tensors.pop(name)
