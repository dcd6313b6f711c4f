"""The generator side of an adapter push (``trainer.lora.push = "adapter"``): the pushed LoRA
adapters become the live vLLM engine's, from memory, under one adapter id.

    trainer rank 0 --push (push.py)--> Generator.pull_model_state_dict(policy_version, adapters)
      AdapterPuller.prepare(state_dict)   PEFT names (model.layers.N.self_attn.q_proj.lora_A.weight),
                                          checked: an A and a B for each module; copied (vLLM
                                          scales B in place)
      (engine loop: between two engine steps, or after a drain)
      AdapterPuller.apply(engine, pairs)  on the worker: LoRAModel.from_lora_tensors -> the worker's
                                          adapter manager: remove, add (packs qkv / gate_up, B *=
                                          alpha / rank), activate (copies into its slot), pin
    every request the engine loop adds: lora_request=puller.lora_request (None until the first pull)
    verify: Generator.read_hf_weights -> AdapterPuller.read_weights(engine): each module's slot of
            lora_a_stacked / lora_b_stacked, as the engine computes with them (B times alpha / rank)

One id for every version: replacing the adapter under the id the requests name, between two
engine steps, makes running requests continue with the new weights, as a full-weight pull does
(each token still records the version that sampled it). vLLM keys prefix-cache blocks by the
adapter's name, not its weights; the engine loop's per-version cache salt (WeightSyncPolicy) keeps
a new request off blocks that older adapters computed. A ``LoRARequest`` must carry a path; it is
never read, because the adapter is installed (and pinned against eviction) before any request
names it.

Tensor parallel: every rank installs the full adapters and vLLM's ``set_lora`` slices them for its
shard; the read-back is TP 1 only (``Generator.read_hf_weights``). vLLM is imported inside
functions.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from torchtitan_rl.weight_sync.pull import hf_named
from torchtitan_rl.weight_sync.shared_memory import StagedWeights

logger = logging.getLogger(__name__)

ADAPTER_ID = 1
ADAPTER_NAME = "policy"
ADAPTER_PATH = "in-memory://policy"
"""What the requests' LoRARequest names: never read (the adapter is installed from memory)."""
_KINDS = (".lora_A.weight", ".lora_B.weight")
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class AdapterPuller:
    """Loads pushed LoRA adapters of rank ``rank`` and scale ``alpha / rank`` into an engine built
    with ``enable_lora`` (vllm_engine.build_engine with ``lora_rank``) over the base model of
    ``model_dir``."""

    def __init__(self, model_dir: str, *, rank: int, alpha: float) -> None:
        self.model_dir = model_dir
        self.rank = rank
        self.alpha = alpha
        self.lora_request: Any = None
        """The LoRARequest every new request carries; None until the first adapter is in."""

    def setup(self, engine: Any) -> None:
        """Nothing to prepare: the base weights never change."""

    def prepare(self, state_dict: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """``(peft_name, tensor)`` pairs, each a copy; a name that is not an adapter's, or an A
        without its B, fails here, before the pull reaches the engine loop."""
        if not state_dict:
            raise ValueError("empty adapter state dict: nothing to pull")
        if not all(name.startswith("model.") for name in state_dict):  # a relay's: torchtitan's
            state_dict = hf_named(state_dict, self.model_dir, tied=False)
        bad = sorted(name for name in state_dict
                     if not name.startswith("model.layers.") or not name.endswith(_KINDS))
        if bad:
            raise ValueError(f"adapter push: {len(bad)} names are not LoRA adapters' PEFT names "
                             f"(model.layers.N.<module>.lora_A.weight): {bad[:3]}")
        modules = {name.rsplit(".", 2)[0] for name in state_dict}
        unpaired = sorted(m for m in modules if not all(m + kind in state_dict for kind in _KINDS))
        if unpaired:
            raise ValueError(f"adapter push: modules without both lora_A and lora_B: {unpaired[:3]}")
        return [(name, tensor) for name, tensor in state_dict.items()]

    def apply(self, engine: Any, weights: list[tuple[str, torch.Tensor]] | StagedWeights) -> None:
        """Install the adapters under ``ADAPTER_ID`` (replacing the previous ones), between
        engine steps."""
        # Copied: vLLM scales B in place, and a pushed tensor may view shared memory.
        tensors = {name: tensor.detach().clone() for name, tensor in weights}
        engine.collective_rpc(_install, args=(tensors, self.rank, self.alpha))
        if self.lora_request is None:
            from vllm.lora.request import LoRARequest

            self.lora_request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH)

    def read_weights(self, engine: Any) -> dict[str, torch.Tensor]:
        """The installed adapters by PEFT name, as the engine holds them: A as pushed, B times
        alpha / rank (vLLM's scaling, float32)."""
        (weights,) = engine.collective_rpc(_read_back, args=(self.rank,))
        return weights


def _adapter_manager(worker: Any) -> Any:
    return worker.model_runner.lora_manager._adapter_manager


def _install(worker: Any, tensors: dict[str, torch.Tensor], rank: int, alpha: float) -> None:
    """On the worker: build the adapter from ``tensors`` as vLLM's own loader would from a
    directory, and put it in ``ADAPTER_ID``'s slot."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    workers_manager = worker.model_runner.lora_manager
    manager = workers_manager._adapter_manager
    modules = sorted({name.rsplit(".", 3)[-3] for name in tensors})
    peft = PEFTHelper.from_dict({
        "r": rank, "lora_alpha": alpha, "target_modules": modules,
        "vllm_max_position_embeddings": workers_manager.max_position_embeddings})
    peft.validate_legal(workers_manager.lora_config)
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    adapter = LoRAModel.from_lora_tensors(
        lora_model_id=ADAPTER_ID, tensors=tensors, peft_helper=peft, device="cpu",
        dtype=workers_manager.lora_config.lora_dtype, model_vocab_size=workers_manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None))
    manager.remove_adapter(ADAPTER_ID)
    manager.add_adapter(adapter)
    manager.activate_adapter(ADAPTER_ID)
    manager.pin_adapter(ADAPTER_ID)


def _read_back(worker: Any, rank: int) -> dict[str, torch.Tensor]:
    """On the worker: every adapted module's A and scaled B from the installed slot, split into
    the HF projections a merged module (qkv_proj, gate_up_proj) holds."""
    manager = _adapter_manager(worker)
    slot = manager.lora_index_to_id.index(ADAPTER_ID)
    adapter = manager.get_adapter(ADAPTER_ID)
    out: dict[str, torch.Tensor] = {}
    for module_name, module in manager.modules.items():
        loaded = adapter.get_lora(module_name)
        if loaded is None:  # a module vLLM can adapt that the push left alone
            continue
        parent, leaf = module_name.rsplit(".", 1)
        for index, part in enumerate(_MERGED.get(leaf, (leaf,))):
            if isinstance(loaded.lora_a, list) and loaded.lora_a[index] is None:
                continue
            # stacked [slots, 1, max_rank, in] and [slots, 1, out, max_rank]: zero past the rank
            out[f"{parent}.{part}.lora_A.weight"] = module.lora_a_stacked[index][slot, 0, :rank].clone()
            out[f"{parent}.{part}.lora_B.weight"] = module.lora_b_stacked[index][slot, 0, :, :rank].clone()
    return out
