"""trainer.data.cache: tokenize once, reuse, survive concurrent builders and a SIGKILLed rank 0."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import DATA, REPO, VENV_BIN, make_run, wait_for

pytestmark = pytest.mark.torch
datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

from jobgen.base.owned_dir import OwnedDir  # noqa: E402
from jobgen.spec.tables.data import DataSpec  # noqa: E402
from trainer.data import build as data_mod  # noqa: E402
from trainer.data import collective as collective_mod  # noqa: E402
from trainer.data.build import DataError  # noqa: E402
from trainer.data.cache import (  # noqa: E402
    SHARDS_PREFIX,
    STAGING_PREFIX,
    DataCacheError,
    cache_key,
    hash_path,
    remove_stale_staging,
    tokenizer_fingerprint,
)
from trainer.data.collective import prepare_dataset  # noqa: E402

# rank 0 of a job, in its own process; the encoder is slowed (and optionally gated on
# other builders being mid-way too) through trainer.data.build's module attributes.
WORKER = r"""
import json, sys, time
from pathlib import Path
args = json.loads(sys.argv[1])
import datasets
datasets.disable_progress_bars()
from transformers import AutoTokenizer
from jobgen.spec.tables.data import DataSpec
from trainer.data import build as data
from trainer.data import prepare
from trainer.data.collective import prepare_dataset

prepare.BATCH_ROWS = args["batch_size"]
data.SHARD_ROWS = args["shard_rows"]
from trainer.data import encoder
original = encoder.Encoder.__call__

def slow(self, batch, indices):
    Path(args["marker"]).touch()
    for other in args["wait_for"]:
        deadline = time.time() + 120
        while not Path(other).exists() and time.time() < deadline:
            time.sleep(0.05)
    time.sleep(args["delay"])
    return original(self, batch, indices)

encoder.Encoder.__call__ = slow
tokenizer = AutoTokenizer.from_pretrained(args["model"])
ds, stats, entry = prepare_dataset(DataSpec(**args["spec"]), tokenizer, args["model"], args["cache"],
                                   rank=0, share=lambda value: value)
print(json.dumps({"entry": str(entry), "rows": len(ds), "stats": stats.to_dict()}))
"""


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def spec(tmp_path) -> DataSpec:
    path = tmp_path / "data" / "instructions.jsonl"
    path.parent.mkdir()
    shutil.copy(DATA, path)
    return DataSpec(path=str(path), format="alpaca", max_length=256)


def alone(value: object) -> object:
    """``share`` for a world of one: rank 0 gets its own value back."""
    return value


def entries(cache: Path) -> list[Path]:
    return sorted(
        p for p in cache.iterdir() if not p.name.startswith((STAGING_PREFIX, SHARDS_PREFIX)) and p.name != "hub"
    )


def complete(entry: Path) -> bool:
    return (entry / "stats.json").is_file() and (entry / "dataset" / "state.json").is_file()


def staging_dirs(cache: Path) -> list[Path]:
    return sorted(cache.glob(STAGING_PREFIX + "*"))


def start_worker(tiny_model, spec, cache, marker, *, delay, batch_size=20, wait_for=(), shard_rows=20_000):
    args = {
        "shard_rows": shard_rows,
        "model": str(tiny_model),
        "cache": str(cache),
        "spec": spec.model_dump(),
        "marker": str(marker),
        "delay": delay,
        "batch_size": batch_size,
        "wait_for": [str(w) for w in wait_for],
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# --------------------------------------------------------------------------- reuse and keys


def test_second_call_reuses_the_cache_without_tokenizing(tokenizer, tiny_model, spec, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    ds, stats, entry = prepare_dataset(spec, tokenizer, tiny_model, cache, rank=0, share=alone)
    assert entries(cache) == [entry] and complete(entry) and not staging_dirs(cache)
    assert len(ds) == stats.kept == 400 and ds.column_names == ["input_ids", "labels", "length"]
    assert json.loads((entry / "stats.json").read_text())["inputs"]["format"] == "alpaca"

    def forbidden(*args, **kwargs):
        raise AssertionError("re-tokenized although the cache was complete")

    monkeypatch.setattr(data_mod, "build_dataset", forbidden)
    monkeypatch.setattr(data_mod, "open_rows", forbidden)
    again, stats2, entry2 = prepare_dataset(spec, tokenizer, tiny_model, cache, rank=0, share=alone)
    assert entry2 == entry and stats2 == stats
    assert again.column("input_ids") == ds.column("input_ids") and again.column("labels") == ds.column("labels")


def test_fingerprint_follows_content_tokenizer_and_format_not_packing(tokenizer, tiny_model, spec, tmp_path):
    import copy

    tok_hash = tokenizer_fingerprint(tokenizer, tiny_model)
    data_hash = hash_path(spec.path)
    key = cache_key(spec, data_hash, tok_hash)[0]
    assert cache_key(spec.model_copy(update={"packing": True}), data_hash, tok_hash)[0] == key
    assert cache_key(spec.model_copy(update={"max_length": 512}), data_hash, tok_hash)[0] != key
    assert cache_key(spec.model_copy(update={"format": "text"}), data_hash, tok_hash)[0] != key
    other = copy.deepcopy(tokenizer)
    other.chat_template = "{{ messages }}"
    assert tokenizer_fingerprint(other, tiny_model) != tok_hash
    assert tokenizer_fingerprint(tokenizer, tiny_model) == tok_hash
    copy_path = tmp_path / "elsewhere.jsonl"
    shutil.copy(spec.path, copy_path)
    assert hash_path(copy_path) == data_hash  # content, not the path
    with open(copy_path, "a") as fh:
        fh.write(json.dumps({"instruction": "x", "input": "", "output": "y"}) + "\n")
    assert hash_path(copy_path) != data_hash


def test_save_to_disk_source_is_keyed_by_content(tokenizer, tiny_model, spec, tmp_path):
    rows = datasets.load_dataset("json", data_files=spec.path, split="train", cache_dir=str(tmp_path / "hf"))
    rows.save_to_disk(str(tmp_path / "saved_a"))
    shutil.copytree(tmp_path / "saved_a", tmp_path / "saved_b")
    cache = tmp_path / "cache"
    results = [
        prepare_dataset(
            spec.model_copy(update={"path": str(tmp_path / name)}), tokenizer, tiny_model, cache, rank=0, share=alone
        )
        for name in ("saved_a", "saved_b")
    ]
    assert results[0][2] == results[1][2] and len(results[0][0]) == 400
    assert len(entries(cache)) == 1


def test_hub_id_offline_fails_naming_it(tokenizer, tiny_model, spec, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="'someorg/some-data'"):
        prepare_dataset(
            spec.model_copy(update={"path": "someorg/some-data"}),
            tokenizer,
            tiny_model,
            tmp_path / "cache",
            rank=0,
            share=alone,
        )


# --------------------------------------------------------------------------- ranks


class ThreadBroadcast:
    """broadcast_object_list's contract for threads standing in for ranks: rank 0's value to all."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=120)
        self.value: object = None

    def __call__(self, value: object) -> object:
        if threading.current_thread().name == "rank-0":
            self.value = value
        self.barrier.wait()
        return self.value


def run_ranks(spec, tokenizer, tiny_model, cache, world=2):
    share = ThreadBroadcast(world)
    results: dict[int, object] = {}

    def run(rank):
        try:
            results[rank] = prepare_dataset(spec, tokenizer, tiny_model, cache, rank=rank, share=share)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


def test_only_rank_0_tokenizes_and_every_rank_loads_the_same_entry(tokenizer, tiny_model, spec, tmp_path, monkeypatch):
    calls = []
    real = data_mod.build_dataset

    def counting(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)

    hashed = []
    real_hash = collective_mod.hash_path

    def counting_hash(*args, **kwargs):
        hashed.append(threading.current_thread().name)
        return real_hash(*args, **kwargs)

    monkeypatch.setattr(data_mod, "build_dataset", counting)
    monkeypatch.setattr(collective_mod, "hash_path", counting_hash)
    results = run_ranks(spec, tokenizer, tiny_model, tmp_path / "cache", world=3)
    assert calls == ["rank-0"] and hashed == ["rank-0"]
    assert all(not isinstance(r, Exception) for r in results.values()), results
    assert len({r[2] for r in results.values()}) == 1
    assert all(r[0].column("input_ids") == results[0][0].column("input_ids") for r in results.values())


def test_a_failing_rank_0_makes_the_others_fail_at_once(tokenizer, tiny_model, spec, tmp_path):
    bad = spec.model_copy(update={"format": "text", "text_column": "body"})
    results = run_ranks(bad, tokenizer, tiny_model, tmp_path / "cache")
    assert isinstance(results[0], DataError) and "'body'" in str(results[0])
    # The same class on every rank (the same exit code), naming this rank and rank 0's error.
    assert isinstance(results[1], DataError) and "rank 1" in str(results[1]) and "'body'" in str(results[1])


def test_a_cache_root_other_nodes_cannot_see_is_named(tokenizer, tiny_model, spec, tmp_path):
    # Rank 1 is told of an entry that its node does not have (cache_root not shared).
    with pytest.raises(DataCacheError, match=r"rank 1: no complete preprocessed data .*shares"):
        prepare_dataset(
            spec,
            tokenizer,
            tiny_model,
            tmp_path / "cache",
            rank=1,
            share=lambda value: ("entry", "0123456789abcdef0123456789abcdef"),
        )


# --------------------------------------------------------------------------- concurrency and kills


def test_two_concurrent_builders_end_with_one_valid_entry(tiny_model, spec, tmp_path):
    cache = tmp_path / "cache"
    markers = [tmp_path / "a.tokenizing", tmp_path / "b.tokenizing"]
    # Each waits, inside tokenization, until the other has started too: they really overlap.
    procs = [start_worker(tiny_model, spec, cache, m, delay=0.05, wait_for=markers) for m in markers]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert outputs[0] == outputs[1]
    assert outputs[0]["rows"] == 400
    entry = Path(outputs[0]["entry"])
    assert entries(cache) == [entry] and complete(entry)
    assert not staging_dirs(cache), "the loser must discard its copy"
    assert len(datasets.load_from_disk(str(entry / "dataset"))) == 400


def test_a_killed_build_publishes_nothing_and_the_next_does_only_the_shards_left(
    tokenizer, tiny_model, spec, tmp_path, monkeypatch
):
    import trainer.data.prepare as prepare_mod

    cache, marker = tmp_path / "cache", tmp_path / "tokenizing"
    proc = start_worker(tiny_model, spec, cache, marker, delay=0.3, batch_size=10, shard_rows=100)
    try:
        wait_for(lambda: any(cache.glob(f"{SHARDS_PREFIX}*/done/shard-00000.json")), 120, "shard 0", process=proc)
        wait_for(lambda: any(cache.glob(f"{SHARDS_PREFIX}*/dataset/.part-00001-*")), 60, "shard 1 begun", process=proc)
    finally:
        proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert entries(cache) == [], "a killed build must not publish an entry"
    [shards] = cache.glob(f"{SHARDS_PREFIX}*")
    assert (shards / "dataset" / "data-00000-of-00004.arrow").is_file()

    done = []
    real = prepare_mod.tokenize_shard
    monkeypatch.setattr(prepare_mod, "tokenize_shard", lambda work, k, *a: done.append(k) or real(work, k, *a))
    monkeypatch.setattr(data_mod, "SHARD_ROWS", 100)
    monkeypatch.setattr(prepare_mod, "BATCH_ROWS", 10)  # as the killed build had them: the same bytes
    ds, stats, entry = prepare_dataset(spec, tokenizer, tiny_model, cache, rank=0, share=alone)
    assert done == [1, 2, 3], "shard 0 was done before the kill"
    assert complete(entry) and len(ds) == stats.kept == 400 and not shards.exists()
    assert not list(entry.rglob(".part-*")) and not (entry / "done").exists()
    assert len(datasets.load_from_disk(str(entry / "dataset"))) == 400

    # The same bytes as a build that was never interrupted.
    _, _, clean = prepare_dataset(spec, tokenizer, tiny_model, tmp_path / "clean", rank=0, share=alone)
    for file in sorted((clean / "dataset").glob("*.arrow")):
        assert (entry / "dataset" / file.name).read_bytes() == file.read_bytes()


def test_stale_builds_are_swept_young_ones_left(tokenizer, tiny_model, spec, tmp_path):
    cache = tmp_path / "cache"
    prepare_dataset(spec, tokenizer, tiny_model, cache, rank=0, share=alone)
    staging, shards = cache / f"{STAGING_PREFIX}x-host-1-ab", cache / f"{SHARDS_PREFIX}y-{os.geteuid()}"
    for directory in (staging, shards):
        (directory / "dataset").mkdir(parents=True)
        (directory / "dataset" / "data-00000-of-00001.arrow").write_bytes(b"x")
    with OwnedDir.open(cache) as root:
        assert remove_stale_staging(root) == [], "a young build may be a live one"

    def age(directory: Path, seconds: float) -> None:
        old = time.time() - seconds
        for path in [directory, *directory.rglob("*")]:
            os.utime(path, (old, old), follow_symlinks=False)

    age(staging, 2 * 3600)
    age(shards, 2 * 3600)  # a build killed two hours ago: its shards wait for the resubmission
    with OwnedDir.open(cache) as root:
        assert remove_stale_staging(root) == [staging.name]
    age(shards, 8 * 86400)
    with OwnedDir.open(cache) as root:
        assert remove_stale_staging(root) == [shards.name]
    assert [p.name for p in cache.iterdir()] == [entries(cache)[0].name]


# --------------------------------------------------------------------------- real ranks under torchrun

# Both ranks through the trainer's own DataPipeline (gloo, 2 processes): a cold start, a warm
# start, then a spec rank 0 must refuse. Each rank records which paths it hashed and what it raised.
TORCHRUN_WORKER = r"""
import dataclasses, json, sys
from pathlib import Path
import datasets
datasets.disable_progress_bars()
import torch.distributed as dist
from jobgen.runs.rundir import RunDir
from trainer.data import collective as data_cache
from trainer.data.batches import DataPipeline
from trainer.distributed import exit_now, init_distributed
from trainer.model.build import load_tokenizer

run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
env = init_distributed(120, 2)
hashed = []
real_hash_path = data_cache.hash_path

def counting_hash_path(path, **kwargs):
    hashed.append(str(path))
    return real_hash_path(path, **kwargs)

data_cache.hash_path = counting_hash_path
spec = RunDir(run_dir).load_spec()
tokenizer = load_tokenizer(spec.run.model.path)
result = {}
for start in ("cold", "warm"):
    hashed.clear()
    pipeline = DataPipeline(spec, tokenizer, env, run_dir)
    result[start] = {"hashed": list(hashed), "entry": str(pipeline.entry), "rows": len(pipeline.rows)}
bad_data = spec.run.data.model_copy(update={"format": "text", "text_column": "body"})
bad = dataclasses.replace(spec, run=spec.run.model_copy(update={"data": bad_data}))
try:
    DataPipeline(bad, tokenizer, env, run_dir)
    result["bad"] = None
except Exception as exc:
    result["bad"] = [type(exc).__name__, str(exc)]
(out / f"rank{env.rank}.json").write_text(json.dumps(result))
dist.barrier()
dist.destroy_process_group()
exit_now(0)  # no interpreter finalization for gloo's threads to abort in
"""


def test_under_torchrun_only_rank_0_hashes_the_data_and_its_error_reaches_rank_1(tiny_model, tmp_path):
    run_dir = make_run(tmp_path / "spec", tiny_model)
    worker = tmp_path / "worker.py"
    worker.write_text(TORCHRUN_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(worker), str(run_dir), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    data_path = str(DATA)
    for start in ("cold", "warm"):
        # World size x dataset size read from the shared filesystem per start is the defect: rank 0 only.
        assert ranks[0][start]["hashed"] == [data_path], ranks[0][start]
        assert ranks[1][start]["hashed"] == [], ranks[1][start]
        assert ranks[0][start]["entry"] == ranks[1][start]["entry"] and ranks[0][start]["rows"] > 0
    # rank 0's own error on rank 0; the same kind of error, naming it, on rank 1, instead of a hang.
    assert ranks[0]["bad"][0] == "DataError" and "'body'" in ranks[0]["bad"][1], ranks[0]["bad"]
    assert ranks[1]["bad"][0] == "DataError", ranks[1]["bad"]
    assert "rank 1" in ranks[1]["bad"][1] and "rank 0" in ranks[1]["bad"][1] and "'body'" in ranks[1]["bad"][1]
