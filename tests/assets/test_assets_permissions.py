"""Model files are written with the user's umask (0644 / 0755 under 022), not tempfile's 0700 or
safetensors' 0600: another user or host on a shared file system can read them."""

from __future__ import annotations

import os
import pathlib
import stat
import tempfile
from collections.abc import Iterator

import pytest

from torchtitan_rl.assets.make_model import ensure_model, make_model
from torchtitan_rl.assets.permissions import current_umask, is_private, share_like_umask


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_current_umask_reads_without_changing_it(umask_022):
    assert current_umask() == 0o022
    os.umask(0o027)
    assert current_umask() == 0o027


def test_share_like_umask_opens_what_mkdtemp_and_safetensors_close(tmp_path, umask_022):
    import torch
    from safetensors.torch import save_file

    directory = pathlib.Path(tempfile.mkdtemp(dir=tmp_path))
    (directory / "sub").mkdir()
    save_file({"w": torch.zeros(2)}, str(directory / "sub" / "model.safetensors"))
    assert _mode(directory) == 0o700 and _mode(directory / "sub" / "model.safetensors") == 0o600
    assert is_private(directory)
    share_like_umask(directory)
    assert _mode(directory) == 0o755 and _mode(directory / "sub") == 0o755
    assert _mode(directory / "sub" / "model.safetensors") == 0o644
    assert not is_private(directory)


def test_a_made_model_is_readable_to_others(tmp_path, umask_022):
    made = make_model("tiny", tmp_path / "tiny")
    assert _mode(made) == 0o755
    for file in made.iterdir():
        assert _mode(file) == 0o644, file.name


def test_ensure_model_opens_a_model_cached_private(tmp_path, umask_022):
    made = ensure_model("tiny", tmp_path)
    os.chmod(made / "model.safetensors", 0o600)  # as make_model wrote it before
    os.chmod(made, 0o700)
    assert ensure_model("tiny", tmp_path) == made
    assert _mode(made) == 0o755 and _mode(made / "model.safetensors") == 0o644


def test_exported_hf_weights_are_readable_to_others(tmp_path, umask_022):
    import torch

    from torchtitan_rl.trainer.checkpoint import export_hf

    export_hf(tmp_path / "hf", {"w": torch.ones(3)}, source_dir=None)
    assert _mode(tmp_path / "hf" / "model.safetensors") == 0o644
