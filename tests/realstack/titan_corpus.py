"""A stand-in for torchtitan's `c4_test` dataset (tests/assets/c4_test/data.json in its repository, not in the
wheel): JSON lines of {"text": ...}, one document per Python standard-library source file, the text every
machine has offline (moepass.harness.corpus picks the files: sorted by path, tests left out).

    python tests/realstack/titan_corpus.py DIR      # writes DIR/data.json
    ... --dataloader.dataset c4_test --dataloader.dataset_path DIR

torchtitan loads `c4_test` as `datasets.load_dataset(DIR, split="train")` and reads each row's "text".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT_BYTES = 256 << 10  # far more than 8 steps of 2 x 2 x 128 tokens need, quick to tokenize


def write_corpus(directory: str | Path, limit_bytes: int = DEFAULT_BYTES) -> Path:
    """DIR/data.json from the first standard-library files (by sorted path) up to `limit_bytes` of text."""
    from moepass.harness.corpus import stdlib_text_files

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "data.json"
    with path.open("w", encoding="utf-8") as out:
        for source in stdlib_text_files(limit_bytes):
            text = source.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                out.write(json.dumps({"text": text}) + "\n")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(write_corpus(sys.argv[1]))
