"""Real text every machine has offline: the Python standard library's own source, as bytes.

Byte-level tokens (vocabulary 256) need no tokenizer download. The split is deterministic:
files are sorted by path and every 10th file is validation, so two runs (or two variants in
one benchmark) see exactly the same batches.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig

import torch


def stdlib_text_files(limit_bytes: int = 8 << 20) -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    out, total = [], 0
    for p in files:
        out.append(p)
        total += p.stat().st_size
        if total >= limit_bytes:
            break
    return out


def load_corpus(source: str | None = None, limit_bytes: int = 8 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) uint8 token streams. `source`: None (stdlib), a text file or a directory."""
    if source is None:
        files = stdlib_text_files(limit_bytes)
    elif os.path.isdir(source):
        files = sorted(p for p in pathlib.Path(source).rglob("*") if p.is_file())
    elif os.path.isfile(source):
        files = [pathlib.Path(source)]
    else:
        raise FileNotFoundError(f"moepass: data source {source!r} is neither a file nor a directory")
    train, val = bytearray(), bytearray()
    for i, p in enumerate(files):
        (val if i % 10 == 9 else train).extend(p.read_bytes()[:limit_bytes])
    if not val:  # a single file: hold out its last 10%
        cut = int(len(train) * 0.9)
        train, val = train[:cut], train[cut:]
    if len(train) < 2 or len(val) < 2:
        raise ValueError(f"moepass: data source {source!r} has too little text to train on")
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8)


class Batches:
    """Deterministic (inputs, targets) batches of byte tokens: batch `i` is the same in every run."""

    def __init__(self, stream: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0):
        if len(stream) <= seq_len + 1:
            raise ValueError(f"moepass: {len(stream)} tokens cannot fill a sequence of {seq_len}")
        self.stream, self.batch_size, self.seq_len, self.seed = stream, batch_size, seq_len, seed

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        starts = torch.randint(0, len(self.stream) - self.seq_len - 1, (self.batch_size,), generator=g)
        rows = torch.stack([self.stream[s: s + self.seq_len + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]
