"""Long documents for the benchmark profiles: a JSONL file whose every record fills one packed row exactly.

    python -m moe_tune.engine.bench.documents OUT.jsonl --seq-len 4096 [--count 64] [--seed 0]

The built-in corpus holds ~150-token stories, so a row of a benchmark profile packs dozens of documents, while the
transformers baseline's linear-attention layers run over whole rows (its softmax attention keeps the documents apart,
engine/bench/against.py). With this file (`--set data.path=OUT.jsonl`) every row is one document of seq_len tokens
under the byte tokenizer (<bos> and seq_len - 1 bytes; the labels are those bytes and <eos>), so both sides run
every layer over the whole row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_tune.engine.data.corpus import generate_corpus

# The byte tokenizer puts <bos> before a document's bytes: a record of seq_len - 1 ASCII bytes is seq_len inputs.
BOS_TOKENS = 1
# Stories per document drawn at a time while a document grows (each is ~150 bytes).
STORY_BATCH = 64


def long_documents(seq_len: int, count: int, seed: int = 0) -> list[str]:
    """`count` texts of seq_len - 1 ASCII bytes each, generated stories joined by spaces and cut."""
    length = seq_len - BOS_TOKENS
    texts, pending, batch = [], "", 0
    while len(texts) < count:
        while len(pending) < length:
            pending += " ".join(generate_corpus(STORY_BATCH, seed * 1_000_003 + batch)) + " "
            batch += 1
        texts.append(pending[:length])
        pending = pending[length:]
    return texts


def write_long_documents(path: Path, seq_len: int, count: int, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in long_documents(seq_len, count, seed)),
                    encoding="utf-8")  # fmt: skip
    return path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m moe_tune.engine.bench.documents",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("out", type=Path, metavar="OUT.jsonl", help="where the documents are written")
    parser.add_argument("--seq-len", type=int, required=True, help="the profile's data.seq_len (>= 8)")
    parser.add_argument("--count", type=int, default=64, help="documents (one row each; default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated stories")
    args = parser.parse_args(argv)
    if args.seq_len < 8 or args.count < 1:
        parser.exit(2, f"{parser.prog}: --seq-len ({args.seq_len}) must be >= 8 and --count ({args.count}) >= 1\n")
    write_long_documents(args.out, args.seq_len, args.count, args.seed)
    print(f"{args.count} documents of {args.seq_len} tokens (byte tokenizer) written to {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
