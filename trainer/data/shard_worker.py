"""A tokenizing worker of :func:`trainer.data.prepare.tokenize_shards`: shards asked for on
stdin, tokenized, answered on stdout. Started by it as

    python -m trainer.data.shard_worker

It reads the work (length-prefixed pickle, written by its parent through the pipe) from
stdin, then shard numbers, one per line, until -1; for each it tokenizes the shard
(:func:`trainer.data.prepare.tokenize_shard`) and answers on stdout, one JSON object per
line: ``{"rows": n}`` after every batch, ``{"done": k}`` after the shard, or
``{"shard": k, "kind": "data" | "error", "error": message}`` and exits 1.
"""

from __future__ import annotations

import json
import pickle
import sys

from trainer.data.formats import DataError
from trainer.data.prepare import _encoder, tokenize_shard


def _say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    size = int.from_bytes(sys.stdin.buffer.read(8), "little")
    work = pickle.loads(sys.stdin.buffer.read(size))
    encoder = _encoder(work)
    for line in sys.stdin.buffer:
        shard = int(line)
        if shard < 0:
            return 0
        try:
            tokenize_shard(work, shard, encoder, lambda n: _say({"rows": n}))
        except DataError as exc:
            _say({"shard": shard, "kind": "data", "error": str(exc)})
            return 1
        except Exception as exc:  # noqa: BLE001 - told to the parent, which stops the others
            _say({"shard": shard, "kind": "error", "error": f"{type(exc).__name__}: {exc}"})
            return 1
        _say({"done": shard})
    return 0


if __name__ == "__main__":
    sys.exit(main())
