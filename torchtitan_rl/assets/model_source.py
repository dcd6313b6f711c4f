"""Where a run's model comes from: a local HF directory, or one of the project's own sizes made offline."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Literal

from torchtitan_rl.config.configurable import Configurable
from torchtitan_rl.config.errors import ConfigError


class ModelSource(Configurable):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        path: str = ""
        """A local HF model directory (config.json, safetensors, tokenizer). Empty: use `size`."""
        size: Literal["tiny", "demo", "small"] = "tiny"
        """With an empty `path`: the project's own random model of this size, written to
        `<assets_dir>/<size>` on first use (no hub). tiny: ~0.14M parameters, tied embeddings
        (tests). demo: ~1.1M, untied (the CPU GRPO demo). small: ~32M, torchtitan's Qwen3
        debugmodel shape (benchmarks)."""
        assets_dir: str = "assets/models"
        """Where made models are cached."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def resolve(self) -> pathlib.Path:
        """The model directory, made first if it is one of ours and absent."""
        if self.config.path:
            path = pathlib.Path(self.config.path)
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"model.path: {path} is not an HF model directory (no config.json)"
                )
            return path
        from torchtitan_rl.assets.make_model import ensure_model

        return ensure_model(self.config.size, self.config.assets_dir)
