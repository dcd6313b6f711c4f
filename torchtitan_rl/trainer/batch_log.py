"""``trainer.debug_batch_log``: what each trainer rank trained on, one JSON line per microbatch
(debugging and tests; off by default)."""

from __future__ import annotations

import json

import torch


class BatchLog:
    """Appends to ``path`` (rank 0) or ``<path>.rank<r>``; never truncates (a resumed run
    appends)."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path if rank == 0 else f"{path}.rank{rank}"
        self.rank = rank

    def write(self, *, policy_version: int, dp_rank: int, microbatch: int,
              data: dict[str, torch.Tensor]) -> None:
        record = {"policy_version": policy_version, "rank": self.rank, "dp_rank": dp_rank,
                  "microbatch": microbatch}
        for name in ("input_ids", "positions", "document_ids", "loss_mask"):
            record[name] = data[name].to(torch.int64).tolist()
        record["advantages"] = data["advantages"].to(torch.float64).tolist()
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
