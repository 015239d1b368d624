"""What checking a tokenized cache entry in full costs a rank's start (issue 45), against reading
it unchecked, the way ranks read it before, measured in the same run.

Writes a synthetic entry as ``datasets``' ``save_to_disk`` lays one out (``state.json`` naming
Arrow IPC stream files of ``input_ids`` and ``labels`` as ``list<int32>`` and ``length``,
record batches of 1000 rows, shards of at most ``--rows-per-shard``), ``--rows`` rows of
``--tokens`` ids each, then times, alternating, ``--repeats`` opens of each:

- baseline: each file memory-mapped and ``pa.ipc.open_stream(...).read_all()``, nothing checked;
- checked: :meth:`trainer.data.examples.Examples.open` with the vocabulary (schema, offsets,
  lengths, every id within the vocabulary), what every rank does now.

Both run warm (the page cache holds the files after the first open). On any machine with the
[train] extra (about a minute and 1 GB of disk for the default 200k x 512):

    .venv/bin/python bench/cache_check.py --work DIR [--rows 200000] [--tokens 512]

Prints the medians and their ratio and writes ``DIR/cache_check.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VOCAB = 32000
BATCH_ROWS = 1000


def write_entry(directory: Path, rows: int, tokens: int, rows_per_shard: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(45)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())), ("length", pa.int32())])
    offsets = pa.array(np.arange(0, (BATCH_ROWS + 1) * tokens, tokens, dtype=np.int32))
    names = []
    for shard, start in enumerate(range(0, rows, rows_per_shard)):
        name = f"data-{shard:05d}-of-{(rows + rows_per_shard - 1) // rows_per_shard:05d}.arrow"
        names.append({"filename": name})
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for _ in range(start, min(rows, start + rows_per_shard), BATCH_ROWS):
                ids = pa.array(rng.integers(0, VOCAB, BATCH_ROWS * tokens, dtype=np.int32))
                labels = pa.ListArray.from_arrays(offsets, ids)
                length = pa.array(np.full(BATCH_ROWS, tokens, dtype=np.int32))
                writer.write_batch(pa.record_batch([labels, labels, length], schema=schema))
    (directory / "state.json").write_text(json.dumps({"_data_files": names}))


def unchecked(directory: Path) -> int:
    state = json.loads((directory / "state.json").read_text())
    tables = []
    for entry in state["_data_files"]:
        with pa.memory_map(str(directory / entry["filename"])) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return pa.concat_tables(tables).num_rows


def checked(directory: Path) -> int:
    from trainer.data.examples import Examples

    return len(Examples.open(directory, vocab_size=VOCAB))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rows-per-shard", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    entry = args.work / f"entry-{args.rows}x{args.tokens}"
    if not (entry / "state.json").exists():
        write_entry(entry, args.rows, args.tokens, args.rows_per_shard)
    assert unchecked(entry) == checked(entry) == args.rows  # and warms the page cache
    times: dict[str, list[float]] = {"unchecked": [], "checked": []}
    for _ in range(args.repeats):
        for name, read in (("unchecked", unchecked), ("checked", checked)):
            started = time.perf_counter()
            read(entry)
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    size = sum(p.stat().st_size for p in entry.glob("*.arrow"))
    print(f"{args.rows} rows x {args.tokens} tokens ({size / 2**20:.0f} MiB), median of {args.repeats}, warm:")
    for name, seconds in medians.items():
        print(f"  {name:<10} {seconds * 1000:8.1f} ms")
    print(f"  checked / unchecked: {medians['checked'] / medians['unchecked']:.1f}x")
    result = {
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}",
        "rows": args.rows,
        "tokens": args.tokens,
        "mib": round(size / 2**20),
        "seconds": {name: [round(v, 4) for v in values] for name, values in times.items()},
        "median_ms": {name: round(seconds * 1000, 1) for name, seconds in medians.items()},
    }
    (args.work / "cache_check.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
