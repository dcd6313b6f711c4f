"""The policy's weights as the rest of a run reads them, on one trainer rank: what a push sends,
what a relay sends, the HF export, and what a checkpoint of a LoRA run records of its base.

    push / verify   pushed_state_dict()   plain full tensors (collective): the weights (with
                                          LoRA merged), or with ``lora.push = "adapter"`` the
                                          adapters alone
    relay           relayed_state_dict()  this rank's shards as it holds them (with LoRA:
                                          pushed_state_dict(), gathered)
    export          export_hf(path)       an HF model dir, or with ``lora.export = "peft"`` a
                                          PEFT adapter dir over the base
    checkpoints     base_digest()         what a LoRA run's frozen base is (checkpoint.py)

A tied weight (embeddings and output head) is gathered once and appears under both names.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_rl.trainer.lora import LoRA


class PolicyWeights:
    """Reads ``model``'s weights (torchtitan names) for pushes, relays and exports."""

    def __init__(self, *, model: torch.nn.Module, lora: LoRA | None, model_config: Any,
                 model_dir: str | None, flavor: str, seed: int, rank: int) -> None:
        self.model = model
        self.lora = lora
        self.model_config = model_config
        self.model_dir = model_dir
        """The HF directory the weights were loaded from (None for a flavor's random init)."""
        self.flavor = flavor
        self.seed = seed
        self.rank = rank
        self._base_digest: str | None = None

    def relayed_state_dict(self) -> dict[str, torch.Tensor]:
        """What this rank sends of a relayed push: the state dict as this rank holds it (DTensor
        shards when parallel). With LoRA, ``pushed_state_dict()``, gathered (a collective; rank 0
        sends it all)."""
        if self.lora is None:
            return self.model.state_dict()
        return self.pushed_state_dict()

    def pushed_state_dict(self) -> dict[str, torch.Tensor]:
        """What a push sends and a verify expects, plain full tensors (collective): the model's
        weights, or with ``trainer.lora.push = "adapter"`` the adapters alone."""
        if self.lora is not None and self.lora.config.push == "adapter":
            return LoRA.adapter_state_dict(self.gathered_state_dict())
        return self.full_state_dict()

    @property
    def pushed_lora_scaling(self) -> float | None:
        """alpha / rank when pushes carry adapters (the engine scales B by it), else None."""
        if self.lora is not None and self.lora.config.push == "adapter":
            return self.lora.scaling
        return None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Plain full tensors (collective). With LoRA: each adapted weight merged with its
        adapter, no adapter entries: what the generators and an HF export load."""
        result = self.gathered_state_dict()
        return self.lora.merged_state_dict(result) if self.lora is not None else result

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict as plain full tensors (collective; a tied weight once)."""
        from torch.distributed.tensor import DTensor

        full: dict[tuple[int, int], torch.Tensor] = {}
        result = {}
        for name, tensor in self.model.state_dict().items():
            # Each name is a new detached tensor: find a tied weight by storage (sent once).
            local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            key = (local.untyped_storage().data_ptr(), local.storage_offset())
            if key not in full:
                value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                full[key] = value.detach()
            result[name] = full[key]
        return result

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named plain full tensors (collective); no lm_head when embeddings are tied."""
        from torchtitan_rl.models.qwen3 import hf_state_dict_from_torchtitan

        return hf_state_dict_from_torchtitan(self.full_state_dict(), self.model_config)

    def export_hf(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Write an HF model dir (safetensors + config/tokenizer files of the source dir); with
        ``trainer.lora.export = "peft"``, a PEFT adapter dir over the base instead (collective;
        rank 0 writes)."""
        from torchtitan_rl.trainer import checkpoint as ckpt

        if self.lora is not None and self.lora.config.export == "peft":
            state_dict = self.gathered_state_dict()  # a collective: every rank gathers
            if self.rank == 0:
                self.lora.write_peft_adapter(path, state_dict, self.model_config, self.model_dir)
            if dist.is_initialized():
                dist.barrier()
            return
        ckpt.export_hf(path, self.hf_state_dict(), source_dir=self.model_dir, dtype=dtype,
                       write=self.rank == 0)

    def base_digest(self) -> str | None:
        """With LoRA, what the frozen base is: sha256 of its model directory (or the flavor and
        seed of a random one); None without LoRA."""
        if self.lora is None:
            return None
        if self._base_digest is None:
            if self.flavor:
                self._base_digest = f"flavor={self.flavor}/seed={self.seed}"
            else:
                from torchtitan_rl.assets.make_model import directory_digest

                self._base_digest = directory_digest(self.model_dir)
        return self._base_digest
