"""Write a randomly initialised HF-format Qwen3 model directory, deterministically, with no hub.

    python -m torchtitan_rl.assets.make_model --size tiny --out assets/models/tiny

The directory (config.json, model.safetensors, tokenizer.json + chat template, generation_config.json)
loads in vLLM, in transformers and, through torchtitan's Qwen3 state-dict adapter, in torchtitan.
Same size and seed give byte-identical files.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Sequence

from torchtitan_rl.assets.permissions import is_private, share_like_umask

logger = logging.getLogger(__name__)

TOKENIZER_VOCAB_SIZE = 1024

MAKER_VERSION = 3
"""Bumped whenever the same size and seed would give different files, so `ensure_model` remakes a
cached model made by an older maker. 2: the pad token's embedding row is initialised like every
other row (it was all zeros: see `make_model`). 3: the chat template renders tools, tool calls and
tool results (`tokenizer.CHAT_TEMPLATE`); weights and tokens are unchanged."""
MAKER_FILE = "made_by.json"
"""Written next to config.json: the maker version, size and seed of the directory."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 2048


MODEL_SIZES: dict[str, ModelSize] = {
    # ~0.14M params, tied embeddings (exercises the tied lm_head path of weight sync): tests.
    "tiny": ModelSize(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, intermediate_size=128,
                      tie_word_embeddings=True),
    # ~1.1M params, untied: the measured sweet spot for learning AlphabetSort on 2 CPU cores. Four
    # heads of 32, not two of 64: the 1600-step warm start learns to copy names for every seed
    # measured (loss 0.21-0.25), where two heads did for seed 0 only (seed 1 stalled at 0.69).
    "demo": ModelSize(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=32, intermediate_size=384,
                      tie_word_embeddings=False),
    # ~torchtitan's qwen3 debugmodel shape (dim 256, 8 layers, 16x128 heads, MLP 3072): benchmarks.
    "small": ModelSize(hidden_size=256, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       tie_word_embeddings=True, max_position_embeddings=4096),
}


def make_model(size: str, out_dir: str | os.PathLike, *, seed: int = 0,
               corpus: Sequence[str] | None = None) -> pathlib.Path:
    """Create the model directory ``out_dir`` (replaced if present) and return its path; its
    tokenizer is trained on ``corpus`` (default: the AlphabetSort text)."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from transformers.generation import GenerationConfig

    from torchtitan_rl.assets.tokenizer import (
        CHAT_TEMPLATE, END_OF_TEXT, IM_END, IM_START, train_tokenizer,
    )

    if size not in MODEL_SIZES:
        raise ValueError(f"--size must be one of {sorted(MODEL_SIZES)}, got {size!r}")
    spec = MODEL_SIZES[size]
    out = pathlib.Path(out_dir)

    raw_tokenizer = train_tokenizer(TOKENIZER_VOCAB_SIZE, seed=seed, corpus=corpus)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw_tokenizer,
        bos_token=None,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )
    vocab_size = len(tokenizer)
    pad_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    # The pad token (<|endoftext|>, id 0) gets a random embedding row like every other token:
    # with padding_idx set, transformers zero-initialises that row, and a rollout that samples the
    # token then feeds RMSNorm a zero vector, whose gradient is amplified ~1/eps (one such sample
    # gave a grad norm of 11.4 against ~0.02, and clipping shrank the whole step 11x). So the model
    # is built without a padding_idx; config.json still names the pad id for vLLM and HF.
    config.pad_token_id = None
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.config.pad_token_id = pad_id

    # Write into a temporary sibling, then swap: a crashed run never leaves a half-written model.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(tmp)
        (tmp / MAKER_FILE).write_text(json.dumps(
            _maker_record(size, seed, corpus), indent=2) + "\n")
        share_like_umask(tmp)  # mkdtemp made it 0700 and safetensors writes 0600
        if out.exists():
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:  # another process made it meanwhile: keep theirs when it is current
            if not _matches_spec(out, spec, size=size, seed=seed, corpus=corpus):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    logger.info("wrote %s model (%d params) to %s", size, model.num_parameters(), out)
    return out


def directory_digest(path: str | os.PathLike) -> str:
    """sha256 over every file's name and bytes (to check that two builds are identical)."""
    digest = hashlib.sha256()
    for file in sorted(pathlib.Path(path).rglob("*")):
        if file.is_file():
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def corpus_digest(corpus: Sequence[str]) -> str:
    """A short digest of a tokenizer corpus: it names the model directory made from it."""
    digest = hashlib.sha256()
    for line in corpus:
        digest.update(line.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _maker_record(size: str, seed: int, corpus: Sequence[str] | None) -> dict[str, object]:
    record: dict[str, object] = {"maker_version": MAKER_VERSION, "size": size, "seed": seed}
    if corpus is not None:
        record["tokenizer_corpus"] = corpus_digest(corpus)
    return record


def ensure_model(size: str, root: str | os.PathLike = "assets/models", *, seed: int = 0,
                 corpus: Sequence[str] | None = None) -> pathlib.Path:
    """The model directory for ``size`` (its tokenizer trained on ``corpus``, default the
    AlphabetSort text) under ``root``, created on first use."""
    name = size if seed == 0 else f"{size}-seed{seed}"
    if corpus is not None:
        name += f"-corpus{corpus_digest(corpus)}"
    out = pathlib.Path(root) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    # Runs (and test processes) starting at once on a fresh checkout: one makes the model while
    # the others wait for it, instead of reading a half-written directory.
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _matches_spec(out, MODEL_SIZES.get(size), size=size, seed=seed, corpus=corpus):
            make_model(size, out, seed=seed, corpus=corpus)
        elif any(is_private(p) for p in (out, *out.glob("*.safetensors"))):
            # made before make_model set the umask's modes (0700 / 0600): readable to others now
            share_like_umask(out)
            logger.info("%s: modes set from the umask (it was readable to its owner only)", out)
    return out


def _matches_spec(model_dir: pathlib.Path, spec: ModelSize | None, *, size: str,
                  seed: int, corpus: Sequence[str] | None = None) -> bool:
    """Whether ``model_dir`` holds what `make_model` makes today for this size and seed: the same
    shape and a current maker version (a cached model made before the size's shape or the
    maker's initialisation changed is remade, not silently reused; warm starts cached on the old
    one are keyed by its digest, so they are remade too)."""
    config_file = model_dir / "config.json"
    maker_file = model_dir / MAKER_FILE
    if spec is None or not config_file.is_file() or not maker_file.is_file():
        return False
    try:
        maker = json.loads(maker_file.read_text())
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False
    if maker != _maker_record(size, seed, corpus):
        return False
    return all(config.get(field.name) == getattr(spec, field.name)
               for field in dataclasses.fields(ModelSize))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="tiny")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    make_model(args.size, args.out, seed=args.seed)


if __name__ == "__main__":
    main()
