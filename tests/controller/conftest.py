"""The uninterrupted 3-step synchronous tiny run, shared by the sync and async job tests."""

from __future__ import annotations

import pytest

from tests.controller.jobs import tiny_job
from torchtitan_rl.train import main


@pytest.fixture(scope="session")
def sync_tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    summary = main(tiny_job(out, "full"))
    return out / "full", summary
