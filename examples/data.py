"""Deterministic byte-level data for the diverging example.

The corpus is real text present on every Python installation: the standard
library's top-level ``*.py`` files (``os.path.dirname(os.__file__)``),
concatenated in sorted order up to ``max_bytes``. Tokens are bytes (vocab 256).

The corpus is cut into ``num_sequences`` fixed windows of ``seq_len + 1``
bytes (sequence ``i`` starts at byte ``i * seq_len``). The global batch of a
step is a pure function of ``(seed, step)``; each rank takes its own slice of
it, so the batch of ``(seed, step, rank)`` never depends on what ran before:
a run resumed at step N sees exactly the batches it would have seen, and a
skipped step range skips exactly those batches. With the same global batch
(``batch * world_size``) a 1-rank run sees the same data as a 2-rank run.
"""

from __future__ import annotations

import glob
import os
import random

import torch

DEFAULT_MAX_BYTES = 4 * 1024 * 1024


def stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None) -> torch.Tensor:
    """The stdlib's top-level ``*.py`` files, sorted, concatenated, as a uint8 tensor."""
    root = root or stdlib_dir()
    chunks: list[bytes] = []
    total = 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1024:
        raise RuntimeError(f"too little text under {root} ({total} bytes)")
    buf = bytearray(b"".join(chunks))
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


class Batches:
    """Batches drawn deterministically from ``(seed, step, rank)``."""

    def __init__(
        self, corpus: torch.Tensor, seq_len: int, batch: int, world_size: int = 1, seed: int = 0
    ):
        self.corpus = corpus
        self.seq_len = seq_len
        self.batch = batch
        self.world_size = world_size
        self.seed = seed
        self.num_sequences = (corpus.numel() - 1) // seq_len
        if self.num_sequences < batch * world_size:
            raise ValueError("corpus too small for this batch")

    def global_ids(self, step: int) -> torch.Tensor:
        """Sequence indices of the whole (all-rank) batch of ``step``."""
        # A string seed is hashed (SHA-512) by ``random``: every (seed, step) gets its own
        # stream. (torch.Generator.manual_seed keeps only 32 bits on CPU, so packing
        # seed and step into one integer would make different seeds collide.)
        rng = random.Random(f"spikeguard-example:{self.seed}:{step}")
        n = self.num_sequences
        return torch.tensor(
            [rng.randrange(n) for _ in range(self.batch * self.world_size)], dtype=torch.long
        )

    def ids(self, step: int, rank: int) -> list[int]:
        """Sequence indices of this rank's share of the batch of ``step``."""
        ids = self.global_ids(step)
        return ids[rank * self.batch : (rank + 1) * self.batch].tolist()

    def get(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``(x, y, ids)``: inputs and next-byte targets, int64 ``[batch, seq_len]``."""
        ids = self.ids(step, rank)
        starts = torch.tensor(ids, dtype=torch.long) * self.seq_len
        offs = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = self.corpus[offs].long()
        return window[:, :-1], window[:, 1:], ids
