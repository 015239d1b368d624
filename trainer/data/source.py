"""The rows of ``[data] path``: a data file, a directory of them, a ``save_to_disk``
directory or a hub dataset, loaded untouched as a ``datasets.Dataset``.

Below both :mod:`trainer.data.build`, which tokenizes the rows, and
:mod:`trainer.data.cache`, which must load a hub dataset before it can name its
cache entry (a hub id has no bytes on disk to hash).
"""

from __future__ import annotations

from pathlib import Path

import datasets

from jobgen.spec.data_files import (
    DATA_FILE_TYPES,
    data_files,
    data_path_problem,
    is_empty_file,
    is_hub_id,
    is_saved_dataset,
)
from trainer.data.formats import DataError


def load_raw(path: str, *, cache_dir: str | Path | None = None) -> datasets.Dataset:
    """The rows of a data file, a directory of them, a ``save_to_disk`` directory or a hub dataset.

    ``cache_dir`` is where the ``datasets`` builders write their Arrow files for
    local files; pass a private directory so that concurrent jobs never share them.
    """
    cache = str(cache_dir) if cache_dir is not None else None
    if is_hub_id(path):
        try:
            loaded = datasets.load_dataset(path, split="train")
        except Exception as exc:  # offline, unknown id, no 'train' split: all end the same way
            raise DataError(
                f"data path '{path}' is not a local file or directory, and loading it as a hub dataset failed: {exc}"
            ) from exc
        if len(loaded) == 0:
            raise DataError(f"data.path: hub dataset '{path}' is empty (0 rows in its 'train' split)")
        return loaded
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data.path: {p} does not exist")
    # The same judgement `jobgen validate` made; repeated because the data may have changed
    # since, and because datasets reports an empty file with an empty or unrelated message.
    problem = data_path_problem(p)
    if problem:
        raise DataError(f"data.path: {problem}")
    if p.is_dir() and is_saved_dataset(p):
        loaded = _load_saved(p)
    else:
        if p.is_dir():
            # Empty parts of a sharded export hold no rows, and one empty CSV fails datasets' whole load.
            files = [f for f in data_files(p) if not is_empty_file(f)]
            builder = DATA_FILE_TYPES[files[0].suffix]
        else:
            files, builder = [p], DATA_FILE_TYPES[p.suffix]
        try:
            loaded = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", cache_dir=cache)
        except Exception as exc:
            raise DataError(f"data.path: could not read {p} as {builder}: {exc}") from exc
    if len(loaded) == 0:
        raise DataError(f"data.path: {p} is empty (0 rows)")
    return loaded


def _load_saved(p: Path) -> datasets.Dataset:
    try:
        loaded = datasets.load_from_disk(str(p))  # Arrow and JSON: nothing unpickled (see data_cache.load_entry)
    except Exception as exc:
        raise DataError(f"could not load the save_to_disk dataset {p}: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            return loaded["train"]
        if len(loaded) == 1:
            return next(iter(loaded.values()))
        raise DataError(f"save_to_disk dataset {p} has splits {sorted(loaded)} and none is named 'train'")
    return loaded
