"""What a local ``[data] path`` holds, judged from names and sizes: no ``datasets`` import.

Shared by ``jobgen validate`` (so a run that cannot have a single row is refused
before it queues) and the trainer's ``load_raw`` (which must agree on what counts
as a data file and as empty). Reading is limited to the first :data:`SNIFF_BYTES`
of small text files, so validating a terabyte dataset costs a directory listing.
"""

from __future__ import annotations

import re
from pathlib import Path

# suffix -> the ``datasets`` builder that reads it
DATA_FILE_TYPES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
_TEXT_SUFFIXES = (".jsonl", ".json", ".csv")
# Only files up to this size are read to see whether they hold nothing but blank lines:
# a larger file made of whitespace is not a mistake anyone makes.
SNIFF_BYTES = 64 * 1024
_LISTED = 5  # file names shown in a message


# A hub repository's id: 'org/name', or a canonical 'name' alone.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def looks_like_hub_id(value: str, *, data: bool, bare_name: bool = True) -> bool:
    """Whether ``value`` could name a repository on the Hugging Face hub rather than a path:
    relative, not starting with '.' or '~', hub id characters with at most one '/' (and one,
    unless ``bare_name``). A data file's name is a path even where nothing is there: with
    ``data``, 'data/train.jsonl' is a missing file, never the dataset 'train.jsonl' of a hub
    user 'data'."""
    if value.startswith(("/", ".", "~")) or not _HUB_ID.match(value) or ("/" not in value and not bare_name):
        return False
    return not (data and value.endswith(tuple(DATA_FILE_TYPES)))


def is_hub_id(path: str) -> bool:
    """A relative name that is not on disk and does not look like a file: 'org/name' or 'name'
    (a dataset on the Hugging Face hub)."""
    return looks_like_hub_id(path, data=True) and not Path(path).exists()


def data_files(directory: Path) -> list[Path]:
    """The data files under a directory (recursively, hidden ones skipped), sorted."""
    return sorted(
        f
        for f in directory.rglob("*")
        if f.is_file()
        and f.suffix in DATA_FILE_TYPES
        and not any(part.startswith(".") for part in f.relative_to(directory).parts)
    )


def is_saved_dataset(directory: Path) -> bool:
    return (directory / "state.json").is_file() or (directory / "dataset_dict.json").is_file()


def is_empty_file(path: Path) -> bool:
    """True when the file cannot hold a row: zero bytes, only blank lines, a CSV header alone,
    or a JSON file holding an empty array.

    ``datasets`` reports such files with an empty or unrelated message ("An error
    occurred while generating the dataset"), and a CSV one fails a whole directory.
    """
    size = path.stat().st_size
    if size == 0:
        return True
    if path.suffix not in _TEXT_SUFFIXES or size > SNIFF_BYTES:
        return False
    lines = [line.strip() for line in path.read_bytes().splitlines() if line.strip()]
    if path.suffix == ".json" and b"".join(lines).replace(b" ", b"") == b"[]":
        return True
    return not lines or (path.suffix == ".csv" and len(lines) == 1)


def _names(files: list[Path], root: Path) -> str:
    names = [f.relative_to(root).as_posix() for f in files[:_LISTED]]
    more = f" and {len(files) - _LISTED} more" if len(files) > _LISTED else ""
    return ", ".join(names) + more


def data_path_problem(path: str | Path) -> str | None:
    """Why an existing local data path cannot give a single row, or None if it may.

    The message starts with the path; callers prefix the key (``data.path: ``).
    A directory's empty files are only a problem when every one is empty: a
    sharded export often has empty parts, and the trainer skips them.
    """
    p = Path(path)
    if p.is_dir():
        if is_saved_dataset(p):
            return None  # Arrow files; the row count is checked after loading
        files = data_files(p)
        if not files:
            return f"{p} holds no {'/'.join(DATA_FILE_TYPES)} files and no save_to_disk dataset"
        kinds = {DATA_FILE_TYPES[f.suffix] for f in files}
        if len(kinds) > 1:
            return f"{p} mixes file types ({', '.join(sorted(kinds))}); use one"
        if all(is_empty_file(f) for f in files):
            return f"{p} is empty (0 rows): every data file in it is empty ({_names(files, p)})"
        return None
    if p.suffix not in DATA_FILE_TYPES:
        return f"{p}: unsupported type '{p.suffix}' (use {', '.join(DATA_FILE_TYPES)})"
    if is_empty_file(p):
        return f"{p} is empty (0 rows)"
    return None


class PromptsFileError(ValueError):
    """An ``[eval] prompts_file`` that gives no usable prompt; the message names the line."""


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of an ``[eval] prompts_file``: JSONL with a string ``prompt`` per line
    (``.jsonl``/``.json``), else plain text with one prompt per non-blank line."""
    import json

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptsFileError(f"{p}: cannot be read as UTF-8 text ({exc})") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if p.suffix not in (".jsonl", ".json"):
            prompts.append(line.strip())
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptsFileError(f"{p} line {number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise PromptsFileError(f"{p} line {number}: expected an object with a non-empty string 'prompt'")
        prompts.append(row["prompt"])
    if not prompts:
        raise PromptsFileError(f"{p} holds no prompt")
    return prompts


def prompts_file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot serve as ``[eval] prompts_file``, or None."""
    try:
        read_prompts(path)
    except PromptsFileError as exc:
        return str(exc)
    return None


def hub_caches(hf_home: str | None, environ: dict[str, str]) -> list[Path]:
    """Where a dataset from the hub is found without downloading it: the site's paths.hf_home,
    else $HF_HOME, else ~/.cache/huggingface."""
    home = hf_home or environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return [Path(home).expanduser()]


def in_hub_cache(repo_id: str, caches: list[Path]) -> bool:
    """Whether ``repo_id`` was downloaded into one of ``caches`` (huggingface_hub's
    ``hub/datasets--ORG--NAME`` or the datasets library's ``datasets/ORG___NAME``)."""
    org, _, name = repo_id.rpartition("/")
    hub = "datasets--" + "--".join(part for part in (org, name) if part)
    legacy = "___".join(part for part in (org, name) if part)
    return any((cache / "hub" / hub).is_dir() or (cache / "datasets" / legacy).is_dir() for cache in caches)


def offline_hub_problem(value: str, base_dir: Path, caches: list[Path]) -> str | None:
    """Where the site sets HF_HUB_OFFLINE: why ``value`` (a data path that is not on disk, so
    taken for a hub id) cannot be read by the job, or None. Offline, a hub id is only what the
    cache already holds; anything else is a local path that is missing."""
    local = Path(value).expanduser()
    local = local if local.is_absolute() else base_dir / local
    if local.exists() or not looks_like_hub_id(value, data=True, bare_name=False) or in_hub_cache(value, caches):
        return None
    return (
        f"'{value}' does not exist (resolved to {local}), and the site sets HF_HUB_OFFLINE=1, so it cannot be a "
        f"dataset from the hub either: {', '.join(map(str, caches))} holds no copy of it. Give the local path, "
        "or download it into the site's paths.hf_home first"
    )
