"""LoRA on the trainer (``[trainer.lora]``): torchtitan's LoRA component, and what RL needs of it.

    core = PolicyTrainerCore(config)                  every trainer rank
      lora = config.lora.build()
      model_config = lora.convert(model_config)       torchtitan's LoRAConverter: the target
                                                      Linears become LoRALinear, all else frozen
      model = build(model_config); lora.init_adapters(model, seed)
      optimizer over lora.trainable_parameters(model) at lora.learning_rate(optimizer lr)
    each push / verify (core.pushed_state_dict):
      push = "adapter": lora.adapter_state_dict(...)  the adapters alone (weight_sync/lora_pull.py
                                                      installs them in vLLM's LoRA slot)
      push = "merged":  lora.merged_state_dict(...)   W + (alpha / rank) * B @ A under W's name
    checkpoint: the adapters and their AdamW state, with the base model's digest (checkpoint.py)
    export: lora.merged_state_dict (an HF model) or lora.write_peft_adapter (a PEFT directory)

A LoRA Linear computes ``W x + (alpha / rank) * B A x`` (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models"), with ``A`` [rank, in] drawn like a Linear's weight and ``B``
[out, rank] zero, so the adapted model starts as the base model. Only ``A`` and ``B`` train: the
base model has no gradients and no optimizer state.

What torchtitan's component lacks and this module adds: PEFT's module names for the targets, a
default that leaves the embeddings and the (tied) output head alone, dropout on the adapter's input,
adapters initialised when the base weights come from an HF directory (torchtitan initialises them
only with a random model), and the merged weights the generators load.

Names: torchtitan's Qwen3 builds ``wk`` and ``wv`` from one ``wkv`` config, so ``k_proj`` and
``v_proj`` are adapted together or not at all.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Iterator
from typing import Literal

import torch

from torchtitan_rl.config.configurable import Configurable

PEFT_TO_TORCHTITAN = {
    "q_proj": "wq", "k_proj": "wkv", "v_proj": "wkv", "o_proj": "wo",
    "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
}
"""PEFT's (and HF's) Qwen3 projection names -> the torchtitan config each one is built from."""

ADAPTER_SUFFIXES = (".lora_a.weight", ".lora_b.weight")


class LoRA(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        enabled: bool = False
        """Train low-rank adapters instead of every weight (base model frozen)."""
        rank: int = 16
        """r: the adapters' inner dimension. vLLM loads ranks 1, 8, 16, 32, 64, ... only."""
        alpha: float = 32.0
        """The adapter's output is scaled by alpha / rank. > 0."""
        dropout: float = 0.0
        """Dropout on the adapter's input while training, in [0, 1). 0 keeps a step free of
        random draws (a resumed run then repeats the uninterrupted one bit for bit)."""
        target_modules: list[str] = dataclasses.field(
            default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"])
        """PEFT's projection names to adapt (every attention and MLP projection by default: the
        embeddings and the output head, tied in the demo models, stay as they are)."""
        push: Literal["adapter", "merged"] = "adapter"
        """What the generators receive after each step: "adapter", the adapters alone, served by
        vLLM's LoRA over the base it started with (weight_sync/lora_pull.py); "merged", the
        full weights with the adapters merged in (any engine; as many bytes as full training)."""
        export: Literal["merged", "peft"] = "merged"
        """The run's final ``hf/``: "merged", the base with the adapters merged in (loads in
        transformers and vLLM like any model); "peft", a PEFT adapter directory
        (adapter_config.json, adapter_model.safetensors) over the base it names."""
        lr: float | None = None
        """AdamW learning rate of the adapters; None: 10 x trainer.optimizer.lr (LoRA's best
        learning rate sits about 10x above full fine-tuning's: Schulman et al. 2025, "LoRA
        Without Regret"). > 0 when set."""

        def __post_init__(self) -> None:
            if self.rank < 1:
                raise ValueError(f"trainer.lora.rank must be >= 1, got {self.rank}")
            if self.alpha <= 0:
                raise ValueError(f"trainer.lora.alpha must be > 0, got {self.alpha}")
            if not 0 <= self.dropout < 1:
                raise ValueError(f"trainer.lora.dropout must be in [0, 1), got {self.dropout}")
            if self.push not in ("adapter", "merged"):
                raise ValueError(f"trainer.lora.push must be 'adapter' or 'merged', got "
                                 f"{self.push!r}")
            if self.export not in ("merged", "peft"):
                raise ValueError(f"trainer.lora.export must be 'merged' or 'peft', got "
                                 f"{self.export!r}")
            if self.lr is not None and self.lr <= 0:
                raise ValueError(f"trainer.lora.lr must be > 0 when set, got {self.lr}")
            unknown = sorted(set(self.target_modules) - set(PEFT_TO_TORCHTITAN))
            if unknown:
                raise ValueError(f"trainer.lora.target_modules: unknown {unknown}; one of "
                                 f"{sorted(PEFT_TO_TORCHTITAN)}")
            if not self.target_modules:
                raise ValueError("trainer.lora.target_modules is empty: nothing would train")
            if ("k_proj" in self.target_modules) != ("v_proj" in self.target_modules):
                raise ValueError("trainer.lora.target_modules: k_proj and v_proj go together "
                                 "(torchtitan's Qwen3 builds both from one wkv config)")

    def __init__(self, config: Config) -> None:
        self.config = config
        self.scaling = config.alpha / config.rank

    @property
    def torchtitan_targets(self) -> list[str]:
        return sorted({PEFT_TO_TORCHTITAN[name] for name in self.config.target_modules})

    def convert(self, model_config):  # Qwen3Model.Config -> the same type, LoRA applied
        """The model config with the targets replaced by LoRALinear and everything else frozen
        (torchtitan's LoRAConverter)."""
        from torchtitan.components.lora import LoRAConverter

        return LoRAConverter(LoRAConverter.Config(
            rank=self.config.rank, alpha=self.config.alpha,
            target_modules=self.torchtitan_targets)).convert(model_config)

    @staticmethod
    def adapted_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
        """(name, module) of every LoRALinear in ``model``."""
        for name, module in model.named_modules():
            if hasattr(module, "lora_a") and hasattr(module, "lora_b"):
                yield name, module

    def init_adapters(self, model: torch.nn.Module, seed: int) -> None:
        """A drawn as a Linear's weight (Kaiming uniform), B zero: the adapted model computes
        what the base computes. Drawn from ``seed`` alone, so every rank draws the same A; a
        dropout hook goes on A's input."""
        generator = torch.Generator().manual_seed(seed)
        modules = list(self.adapted_modules(model))
        if not modules:
            raise ValueError(f"trainer.lora: no module matched {self.config.target_modules}")
        with torch.no_grad():
            for _, module in modules:
                a, b = module.lora_a.weight, module.lora_b.weight
                bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
                drawn = torch.empty(a.shape, dtype=torch.float32).uniform_(
                    -bound, bound, generator=generator)
                a.copy_(drawn.to(device=a.device, dtype=a.dtype))
                b.zero_()
                if self.config.dropout > 0:
                    module.lora_a.register_forward_pre_hook(self._dropout_input)

    def _dropout_input(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]
                       ) -> tuple[torch.Tensor, ...]:
        return (torch.nn.functional.dropout(args[0], self.config.dropout, module.training),)

    @staticmethod
    def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    def learning_rate(self, full_lr: float) -> float:
        return self.config.lr if self.config.lr is not None else 10 * full_lr

    def merged_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plain full tensors with each adapted weight merged, W + (alpha / rank) * B @ A, and
        no adapter entries: the weights a model without LoRA loads to compute the same."""
        merged = {name: t for name, t in state_dict.items() if not name.endswith(ADAPTER_SUFFIXES)}
        for name, tensor in state_dict.items():
            if not name.endswith(".lora_a.weight"):
                continue
            prefix = name[: -len(".lora_a.weight")]
            a, b = tensor, state_dict[prefix + ".lora_b.weight"]
            base = state_dict[prefix + ".weight"]
            delta = (b.float() @ a.float()) * self.scaling
            merged[prefix + ".weight"] = (base.float() + delta).to(base.dtype)
        return merged

    @staticmethod
    def adapter_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Only the adapters' entries (torchtitan names)."""
        return {name: t for name, t in state_dict.items() if name.endswith(ADAPTER_SUFFIXES)}

    def write_peft_adapter(self, path: str | pathlib.Path, state_dict: dict[str, torch.Tensor],
                           model_config, base_model_dir: str | None) -> None:
        """``path`` as PEFT writes a LoRA adapter: adapter_config.json and
        adapter_model.safetensors with HF module names (``q_proj.lora_A.weight`` ...).
        ``state_dict``: plain full tensors, torchtitan names, adapters included."""
        from safetensors.torch import save_file

        from torchtitan_rl.models.qwen3 import hf_state_dict_from_torchtitan

        tensors = {"base_model.model." + name: t.detach().contiguous() for name, t in
                   hf_state_dict_from_torchtitan(self.adapter_state_dict(state_dict),
                                                 model_config).items()}
        out = pathlib.Path(path)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.config.rank,
            "lora_alpha": self.config.alpha, "lora_dropout": self.config.dropout,
            "target_modules": sorted(self.config.target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None,
            "base_model_name_or_path": (str(pathlib.Path(base_model_dir).resolve())
                                        if base_model_dir else None),
        }
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True)
                                                 + "\n")
