"""Qwen3 between Hugging Face and torchtitan: config, state dicts, construction, packed attention.

    HF dir (config.json + model.safetensors)
      --torchtitan_qwen3_config-->   Qwen3Model.Config (non-fused q/k/v, packed-row SDPA on CPU)
      --build_qwen3_from_hf-->       torchtitan Qwen3Model with the HF weights
    torchtitan state dict  <--torchtitan_state_dict_from_hf / hf_state_dict_from_torchtitan-->  HF names

Public API:
    torchtitan_qwen3_config(model_dir, *, attn_backend="sdpa_packed") -> Qwen3Model.Config
    qwen3_flavor_config(flavor, *, attn_backend="sdpa_packed") -> Qwen3Model.Config
    hf_state_dict_from_torchtitan(state_dict, model_config) -> dict[str, Tensor]
    torchtitan_state_dict_from_hf(hf_state_dict, model_config) -> dict[str, Tensor]
    load_hf_state_dict(model_dir) -> dict[str, Tensor]          (all *.safetensors, HF names)
    build_qwen3_from_hf(model_dir, *, dtype=torch.float32, device="cpu") -> Qwen3Model
    document_spans(positions) -> DocumentSpans                  (for the "sdpa_packed" backend)
    model_attention_masks(model, positions) -> masks or None     (dispatch on the model's backend)
    PackedSDPAttention                                          (inner attention, CPU-safe)

Packed rows: a row holds several samples back to back; ``positions`` restart at 0 where a sample
begins. torchtitan's flex backend has no CPU backward and varlen needs flash kernels, so on CPU the
inner attention is causal SDPA run on each sample of a row (``document_spans`` finds them from those
positions): a token sees earlier tokens of its own sample only. Call the model as
``model(tokens, positions, model_attention_masks(model, positions))``.

Weight names: q/k/v stay separate parameters (``fuse_qkv=False``) so the torchtitan state dict is
the parameter list itself: ``state_dict()`` of a sharded model keeps its DTensor shards (the fused
layout would all-gather q/k/v in a state-dict hook). With tied embeddings the HF dict has no
``lm_head.weight`` (as torchtitan's adapter writes it) and loading re-ties it to the embedding.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import Qwen3Model, qwen3_configs
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.module import Module

logger = logging.getLogger(__name__)

AttnBackend = Literal["sdpa_packed", "flex", "varlen"]

__all__ = [
    "AttnBackend",
    "DocumentSpans",
    "PackedSDPAttention",
    "Span",
    "build_qwen3_from_hf",
    "document_spans",
    "hf_state_dict_from_torchtitan",
    "load_hf_state_dict",
    "model_attention_masks",
    "qwen3_flavor_config",
    "torchtitan_qwen3_config",
    "torchtitan_state_dict_from_hf",
]


class PackedSDPAttention(Module):
    """Inner attention for packed rows: causal SDPA over each sample of a row on its own.

    ``attention_masks`` is None (plain causal, one sample per row) or the rows'
    ``DocumentSpans``. Each span of two or more tokens is one causal SDPA call on that sample's
    q/k/v (so the kernel skips the blocks above the diagonal and never computes across samples);
    a run of one-token samples (the padding tail) attends only to itself, so its output is its v.
    (A dense [L, L] block-causal mask computes every query against every key of the row: on the
    async bench's rows, 576 tokens holding samples of 20-250, attention took 308 ms of an 824 ms
    step that way, 78 ms per sample.) Works on CPU for forward and backward, and under
    tensor parallelism (q/k/v arrive as local head shards through the local_map torchtitan
    installs on inner attentions; the spans are per row, not per head).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: DocumentSpans | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attention_masks is None:
            q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
            )
            return out.transpose(1, 2)
        heads_per_kv_head = q_BLNH.shape[2] // v_BLNH.shape[2]
        used_qk = False
        rows = []
        for row, spans in enumerate(attention_masks.rows):
            parts = []
            for span in spans:
                s = slice(span.start, span.end)
                if span.single_tokens:
                    v = v_BLNH[row : row + 1, s]
                    parts.append(v.repeat_interleave(heads_per_kv_head, dim=2)
                                 if heads_per_kv_head > 1 else v)
                    continue
                used_qk = True
                q, k, v = (t[row : row + 1, s].transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
                )
                parts.append(out.transpose(1, 2))
            rows.append(torch.cat(parts, dim=1))
        out = torch.cat(rows, dim=0)
        if not used_qk:
            # An all-padding microbatch (the grid's tail under FSDP) uses no q/k, and FSDP
            # reduce-scatters only parameters that got a gradient: give q/k a zero one, so every
            # rank reduces the same tensors.
            out = out + 0.0 * (q_BLNH.sum() + k_BLNH.sum())
        return out


@dataclass(frozen=True, slots=True)
class Span:
    """Tokens [start, end) of a row: one sample, or (``single_tokens``) a run of one-token
    samples, each of which sees only itself."""

    start: int
    end: int
    single_tokens: bool


@dataclass(frozen=True, slots=True)
class DocumentSpans:
    """The samples of each packed row, in order, covering the row (``document_spans``)."""

    rows: tuple[tuple[Span, ...], ...]


def document_spans(positions: torch.Tensor) -> DocumentSpans:
    """The samples of each row of ``positions`` (``[B, L]``), found where positions restart at 0
    (the convention torchtitan's flex and varlen document masks use); consecutive one-token
    samples (padding) merge into one ``single_tokens`` span."""
    if positions.dim() != 2:
        raise ValueError(f"positions must be [batch, seq_len], got shape {tuple(positions.shape)}")
    rows = []
    for row in positions.cpu().tolist():
        starts = [i for i, p in enumerate(row) if p == 0]
        if not starts or starts[0] != 0:
            raise ValueError("a packed row must start a sample (position 0) at its first token")
        spans: list[Span] = []
        for start, end in zip(starts, starts[1:] + [len(row)]):
            single = end - start == 1
            if single and spans and spans[-1].single_tokens:
                spans[-1] = Span(spans[-1].start, end, True)
            else:
                spans.append(Span(start, end, single))
        rows.append(tuple(spans))
    return DocumentSpans(tuple(rows))


def model_attention_masks(model: nn.Module, positions: torch.Tensor) -> Any:
    """The ``attention_masks`` argument for ``model(tokens, positions, masks)``, by backend."""
    inner = model.config.first_attention.inner_attention
    if isinstance(inner, PackedSDPAttention.Config):
        return document_spans(positions)
    if isinstance(inner, (FlexAttention.Config, VarlenAttention.Config)):
        return model.get_attention_masks(positions)
    raise TypeError(f"unsupported inner attention {type(inner).__name__}")


def _inner_attention_config(attn_backend: AttnBackend) -> Module.Config:
    if attn_backend == "sdpa_packed":
        return PackedSDPAttention.Config()
    if attn_backend == "flex":
        return FlexAttention.Config()
    if attn_backend == "varlen":
        return VarlenAttention.Config()
    raise ValueError(
        f"attn_backend must be one of 'sdpa_packed', 'flex', 'varlen', got {attn_backend!r}"
    )


# Same initialisers as torchtitan's Qwen3 flavors: only used when a model is built from a
# config and initialised with ``init_states`` instead of loading HF weights.
_LINEAR_INIT = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
_NORM_INIT = {"weight": nn.init.ones_}
_EMBEDDING_INIT = {"weight": partial(nn.init.normal_, std=0.02)}


def _read_hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = pathlib.Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model dir {str(model_dir)!r}")
    with open(path) as f:
        return json.load(f)


def _rope_theta(hf: dict[str, Any], path: str) -> float:
    # transformers >= 5 nests rope settings under rope_parameters; older files keep rope_theta.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{path}: rope_type must be 'default', got {rope_type!r}")
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{path}: no rope_theta in rope_parameters or at top level")
    return float(theta)


def torchtitan_qwen3_config(
    model_dir: str | os.PathLike, *, attn_backend: AttnBackend = "sdpa_packed"
) -> Qwen3Model.Config:
    """Map an HF Qwen3 ``config.json`` to torchtitan's dense ``Qwen3Model.Config``.

    Raises ValueError naming the key for what torchtitan's Qwen3 cannot express (MoE, biases,
    sliding window, non-default RoPE, activations other than silu).
    """
    hf = _read_hf_config(model_dir)
    path = str(pathlib.Path(model_dir) / "config.json")
    if hf.get("model_type") != "qwen3":
        raise ValueError(f"{path}: model_type must be 'qwen3', got {hf.get('model_type')!r}")
    if hf.get("attention_bias", False):
        raise ValueError(f"{path}: attention_bias must be false, got true")
    if hf.get("use_sliding_window", False):
        raise ValueError(f"{path}: use_sliding_window must be false, got true")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act must be 'silu', got {hf.get('hidden_act')!r}")

    dim = int(hf["hidden_size"])
    n_layers = int(hf["num_hidden_layers"])
    n_heads = int(hf["num_attention_heads"])
    n_kv_heads = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or dim // n_heads)
    vocab_size = int(hf["vocab_size"])
    eps = float(hf.get("rms_norm_eps", 1e-6))
    max_seq_len = int(hf.get("max_position_embeddings", 4096))
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=_rope_theta(hf, path))

    def norm(size: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=size, eps=eps, param_init=_NORM_INIT)

    wo_init = {"weight": partial(nn.init.normal_, std=0.02 / math.sqrt(2 * n_layers))}
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                wqkv_param_init=_LINEAR_INIT,
                wo_param_init=wo_init,
                inner_attention=_inner_attention_config(attn_backend),
                fuse_qkv=False,
                rope=rope,
                qk_norm=norm(head_dim),
            ),
            feed_forward=make_ffn_config(
                dim=dim,
                hidden_dim=int(hf["intermediate_size"]),
                w1_param_init=_LINEAR_INIT,
                w2w3_param_init=_LINEAR_INIT,
            ),
        )
        for _ in range(n_layers)
    ]
    return Qwen3Model.Config(
        vocab_size=vocab_size,
        dim=dim,
        norm=norm(dim),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_LINEAR_INIT),
        layers=layers,
    )


def qwen3_flavor_config(
    flavor: str, *, attn_backend: AttnBackend = "sdpa_packed"
) -> Qwen3Model.Config:
    """torchtitan's own Qwen3 flavor (``debugmodel``, ``0.6B``, ...) with the chosen attention."""
    if flavor not in qwen3_configs:
        raise ValueError(f"flavor must be one of {sorted(qwen3_configs)}, got {flavor!r}")
    config = qwen3_configs[flavor](attn_backend="flex")
    for layer in config.layers:
        layer.attention.inner_attention = _inner_attention_config(attn_backend)
    return config


def _adapter(model_config: Qwen3Model.Config) -> Qwen3StateDictAdapter:
    return Qwen3StateDictAdapter(model_config, hf_assets_path=None)


LORA_KINDS = {"lora_a": "lora_A", "lora_b": "lora_B"}
"""torchtitan's LoRA entry names (``...wq.lora_a.weight``) -> PEFT's (``...q_proj.lora_A.weight``)."""
_LORA_SUFFIXES = tuple(f".{kind}.weight" for kind in LORA_KINDS)


def hf_state_dict_from_torchtitan(
    state_dict: dict[str, torch.Tensor], model_config: Qwen3Model.Config
) -> dict[str, torch.Tensor]:
    """Rename a torchtitan Qwen3 state dict to HF names. Values are the same objects (DTensors
    stay DTensors, nothing is copied or gathered); a tied ``lm_head.weight`` is left out. LoRA
    entries (trainer/lora.py) take PEFT's names under their module's HF name:
    ``model.layers.0.self_attn.q_proj.lora_A.weight``."""
    adapter = _adapter(model_config)
    lora = {name: t for name, t in state_dict.items() if name.endswith(_LORA_SUFFIXES)}
    hf = adapter.to_hf({name: t for name, t in state_dict.items() if name not in lora})
    for name, tensor in lora.items():
        module, kind, _ = name.rsplit(".", 2)
        (module_weight,) = adapter.to_hf({module + ".weight": tensor})
        hf[f"{module_weight.removesuffix('.weight')}.{LORA_KINDS[kind]}.weight"] = tensor
    return hf


def torchtitan_state_dict_from_hf(
    hf_state_dict: dict[str, torch.Tensor], model_config: Qwen3Model.Config
) -> dict[str, torch.Tensor]:
    """Rename an HF Qwen3 state dict to torchtitan names (tied: ``lm_head.weight`` is the
    embedding tensor). The input dict is not modified."""
    return _adapter(model_config).from_hf(dict(hf_state_dict))


def load_hf_state_dict(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of ``model_dir/*.safetensors`` by HF name."""
    from safetensors.torch import load_file

    files = sorted(pathlib.Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model dir {str(model_dir)!r}")
    hf_state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        hf_state_dict.update(load_file(str(file)))
    return hf_state_dict


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    # Parameters only: the RoPE cos/sin cache stays float32, as torchtitan computes it.
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and param.dtype != dtype:
                param.data = param.data.to(dtype)


def build_qwen3_from_hf(
    model_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_backend: AttnBackend = "sdpa_packed",
    model_config: Qwen3Model.Config | None = None,
) -> Qwen3Model:
    """torchtitan Qwen3 with the weights of ``model_dir`` (through torchtitan's adapter), on
    ``device``, parameters in ``dtype``; not parallelised. ``model_config`` overrides the config
    mapped from config.json (it must describe the same shapes)."""
    config = model_config or torchtitan_qwen3_config(model_dir, attn_backend=attn_backend)
    with torch.device(device):
        model = config.build()
    state_dict = torchtitan_state_dict_from_hf(load_hf_state_dict(model_dir), config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # LoRA adapters (trainer/lora.py) are not in an HF checkpoint: they start from their init.
    missing = [name for name in missing if not name.endswith(_LORA_SUFFIXES)]
    if unexpected or missing:
        raise ValueError(
            f"{model_dir}: weights do not match the model config: missing={missing}, "
            f"unexpected={unexpected}"
        )
    _cast_parameters(model, dtype)
    logger.info("built torchtitan Qwen3 from %s (%s, %s)", model_dir, dtype, device)
    return model
