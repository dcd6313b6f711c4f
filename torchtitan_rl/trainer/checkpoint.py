"""Trainer checkpoints: torch DCP (model, AdamW state, step, extra), loaded weights_only; HF export.

Layout of a DCP checkpoint directory (one per step, written by every trainer rank together):

    model.*            sharded parameters (DTensor shards are saved as such; any world size loads);
                       with a frozen base (LoRA) only the trainable ones
    optimizer.*        AdamW exp_avg / exp_avg_sq / step per parameter
    trainer.step       int: optimizer steps done (= policy_version)
    trainer.extra_json str: the controller's ``extra`` dict as JSON (cursor, counters, ...)
    trainer.base_digest str, with a frozen base only: the base model directory's digest (a resume on
                       another base would load the adapters onto weights they were not trained on)

Loading never unpickles arbitrary objects: tensors come through DCP's weights_only reader and the
non-tensor leaves through ``torch.load(weights_only=True)`` (``_WeightsOnlyLoadPlanner``).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pathlib
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from torchtitan_rl.assets.permissions import share_like_umask

logger = logging.getLogger(__name__)

# Files of an HF model dir that export_hf copies next to the new weights.
_HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, but non-tensor leaves are unpickled with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    extra: dict[str, Any],
    base_digest: str | None = None,
) -> None:
    """Write a DCP checkpoint to ``path`` (collective over the trainer ranks). ``base_digest``
    given: the base is frozen; only the trainable parameters are written, with the digest."""
    try:
        extra_json = json.dumps(extra, sort_keys=True)
    except TypeError as error:
        raise ValueError(f"checkpoint extra must be JSON-serialisable: {error}") from error
    model_sd, optim_sd = _state_dicts(model, optimizer, frozen_base=base_digest is not None)
    trainer: dict[str, Any] = {"step": int(step), "extra_json": extra_json}
    if base_digest is not None:
        trainer["base_digest"] = base_digest
    state = {"model": model_sd, "optimizer": optim_sd, "trainer": trainer}
    dcp.save(state, checkpoint_id=str(path))
    logger.info("saved trainer checkpoint step %d to %s", step, path)


def load_checkpoint(
    path: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    base_digest: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """Load ``path`` into model and optimizer in place; return (step, extra). ``base_digest``
    given: the checkpoint must hold the trainable parameters of a frozen base of that digest."""
    if not (pathlib.Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"no DCP checkpoint (.metadata) at {str(path)!r}")
    frozen_base = base_digest is not None
    saved_keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if frozen_base != ("trainer.base_digest" in saved_keys):
        raise ValueError(
            f"{path}: " + ("a full-model checkpoint; this run trains LoRA adapters" if frozen_base
                           else "a LoRA adapter checkpoint; this run trains the full model")
            + " (trainer.lora.enabled must match the run that wrote it)")
    model_sd, optim_sd = _state_dicts(model, optimizer, frozen_base=frozen_base)
    trainer: dict[str, Any] = {"step": -1, "extra_json": ""}
    if frozen_base:
        trainer["base_digest"] = ""
    state = {"model": model_sd, "optimizer": optim_sd, "trainer": trainer}
    dcp.load(state, checkpoint_id=str(path), planner=_WeightsOnlyLoadPlanner())
    if frozen_base and state["trainer"]["base_digest"] != base_digest:
        raise ValueError(
            f"{path}: its adapters were trained on a base model of digest "
            f"{state['trainer']['base_digest'][:16]}, this run's base is {base_digest[:16]}")
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
        options=StateDictOptions(strict=not frozen_base, ignore_frozen_params=frozen_base),
    )
    step = int(state["trainer"]["step"])
    logger.info("loaded trainer checkpoint step %d from %s", step, path)
    return step, json.loads(state["trainer"]["extra_json"])


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, frozen_base: bool
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's model and optimizer state dicts; with a frozen base, the trainable parameters only
    (by name: torch's ``ignore_frozen_params`` keeps a tied frozen weight's second name)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if frozen_base:
        trainable = {name for name, p in model.named_parameters(remove_duplicate=False)
                     if p.requires_grad}
        model_sd = {name: value for name, value in model_sd.items() if name in trainable}
    return model_sd, optim_sd


def export_hf(
    path: str | os.PathLike,
    hf_state_dict: dict[str, torch.Tensor],
    *,
    source_dir: str | None,
    dtype: torch.dtype | None = None,
    write: bool = True,
) -> None:
    """Write ``hf_state_dict`` as ``path/model.safetensors`` plus the source dir's config and
    tokenizer files, so vLLM and transformers load it. Only the rank with ``write`` writes; all
    ranks wait for it when a process group exists."""
    if write:
        from safetensors.torch import save_file

        out = pathlib.Path(path)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {
            name: (t.to(dtype) if dtype is not None else t).contiguous()
            for name, t in hf_state_dict.items()
        }
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        share_like_umask(out / "model.safetensors")  # save_file writes 0600
        if source_dir is not None:
            for name in _HF_SIDE_FILES:
                src = pathlib.Path(source_dir) / name
                if src.is_file():
                    shutil.copyfile(src, out / name)
            if dtype is not None:
                _set_config_dtype(out / "config.json", dtype)
        logger.info("exported HF model (%d tensors) to %s", len(tensors), out)
    if dist.is_initialized():
        dist.barrier()


def _set_config_dtype(config_path: pathlib.Path, dtype: torch.dtype) -> None:
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
