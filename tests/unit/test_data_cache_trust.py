"""The tokenized-data cache cannot be turned against its user by another user of a shared runs
root (issue 45): a second uid, made in the test by forking and setuid (root only; skipped
with the reason elsewhere), prepares the cache root or swaps names in it, and the user's rank 0
either refuses in one line or goes on writing only into its own directories, touching nothing
the links point to.

The victim is this process (root here); the victim's "private" directory a 0700 directory of
its own holding a secret and two subdirectories (``work/``, ``raw/``) named like a build's
scratch, so a build that followed a link would write into it, remove them, or chmod it.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers import DATA, REPO

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]
pytest.importorskip("datasets")
pytest.importorskip("transformers")

from jobgen.base.owned_dir import OwnedDir, Sharing, UntrustedDirectory, check_trust  # noqa: E402
from jobgen.spec.tables.data import DataSpec  # noqa: E402
from trainer.data import encoder as encoder_mod  # noqa: E402
from trainer.data.cache import SHARDS_PREFIX, STAGING_PREFIX, DataCacheError, remove_stale_staging  # noqa: E402
from trainer.data.collective import prepare_dataset  # noqa: E402

# A uid no account has: the other user. Any uid works for setuid as root.
OTHER_UID = 54321


def as_other_user(action: Callable[[], None], uid: int = OTHER_UID, gid: int = OTHER_UID) -> None:
    """Run ``action`` in a forked child as another user; fail the test with what it raised."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        message = b""
        try:
            os.setgroups([gid])
            os.setgid(gid)
            os.setuid(uid)
            action()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            message = f"{type(exc).__name__}: {exc}".encode()
        os.write(write_end, message)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        message = fh.read().decode()
    os.waitpid(pid, 0)
    assert not message, f"the other user's action failed: {message}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A runs root both users may write (a team's directory), outside pytest's 0700 tmp."""
    if os.geteuid() != 0:
        pytest.skip("a second user needs root (setuid) on this machine")
    path = Path(tempfile.mkdtemp(prefix="jobgen-shared-runs-", dir="/tmp"))
    os.chmod(path, 0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Victim:
    """The user's own things the attack aims at: a private directory with a secret and
    scratch-named subdirectories, and a snapshot of them to compare with afterwards."""

    def __init__(self, base: Path):
        self.private = base / "victim-private"
        self.private.mkdir(mode=0o700)
        os.chmod(self.private, 0o700)
        (self.private / "secret.txt").write_text("api key\n")
        for scratch in ("work", "raw"):
            (self.private / scratch).mkdir()
            (self.private / scratch / "keep.txt").write_text("mine\n")
        self.before = self.state()

    def state(self) -> dict[str, tuple[int, int]]:
        found = {}
        for path in [self.private, *self.private.rglob("*")]:
            st = path.lstat()
            found[str(path.relative_to(self.private))] = (stat.S_IMODE(st.st_mode), st.st_size)
        return found

    def untouched(self) -> bool:
        return self.state() == self.before


def data_spec(base: Path) -> DataSpec:
    path = base / "data.jsonl"
    shutil.copy(DATA, path)
    return DataSpec(path=str(path), format="alpaca", max_length=256)


def alone(value: object) -> object:
    return value


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# --------------------------------------------------------------------------- the attack of the issue


def test_a_cache_root_another_user_made_first_is_refused_and_nothing_of_yours_is_touched(
    tokenizer, tiny_model, shared_root
):
    victim = Victim(shared_root)
    os.chmod(shared_root / "victim-private", 0o700)
    cache = shared_root / f".data-cache-{os.geteuid()}"
    # The other user makes the victim's cache root first, writable by all, as in the issue.
    as_other_user(lambda: (os.mkdir(cache), os.chmod(cache, 0o777)))
    with pytest.raises(DataCacheError) as refused:
        prepare_dataset(data_spec(shared_root), tokenizer, tiny_model, cache, rank=0, share=alone)
    assert f"{cache}: belongs to uid {OTHER_UID}, not to you" in one_line(refused.value)
    assert os.listdir(cache) == [] and victim.untouched()


def test_the_staging_swapped_for_a_link_mid_build_touches_nothing_of_yours(
    tokenizer, tiny_model, shared_root, monkeypatch
):
    """The issue's attack on a group's cache that lacks the sticky bit is refused at the start;
    on one with it the other user cannot move the staging directory; and where the user's own
    cache root is renamed away mid-build and a link put in its place (the runs root is the
    team's), the build goes on into its own directories and the next open refuses the link."""
    victim = Victim(shared_root)
    cache = shared_root / f".data-cache-{os.geteuid()}"
    staging_seen = threading.Event()
    go_on = threading.Event()
    original = encoder_mod.Encoder.__call__

    def paused(self, batch, indices):
        staging_seen.set()
        go_on.wait(60)
        return original(self, batch, indices)

    monkeypatch.setattr(encoder_mod.Encoder, "__call__", paused)
    outcome: dict[str, BaseException | None] = {}

    def build() -> None:
        try:
            prepare_dataset(data_spec(shared_root), tokenizer, tiny_model, cache, rank=0, share=alone)
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = exc

    builder = threading.Thread(target=build)
    builder.start()
    try:
        assert staging_seen.wait(120), "the build never started tokenizing"
        [staging] = [name for name in os.listdir(cache) if name.startswith(SHARDS_PREFIX)]  # the build's
        moved = shared_root / "moved-aside"

        def swap() -> None:
            # the victim's staging, 0700 in a 0700 root: neither may be entered nor renamed...
            try:
                os.rename(cache / staging, shared_root / "stolen")
                raise AssertionError("the other user could move the staging directory")
            except PermissionError:
                pass
            # ... but the root itself sits in the team's runs root: moved aside, a link in its place.
            os.rename(cache, moved)
            os.symlink(victim.private, cache)
            os.symlink(victim.private, shared_root / "victim-private-link")

        as_other_user(swap)
    finally:
        go_on.set()
        builder.join(240)
    # rank 0 built through its descriptors into the root it had opened (now at moved/) and then,
    # opening the root again by name to load the entry, met the link: one line, nothing followed.
    error = outcome["error"]
    assert isinstance(error, DataCacheError), error
    assert f"{cache}: is a symbolic link" in one_line(error)
    assert victim.untouched(), victim.state()
    entries = [
        p for p in (shared_root / "moved-aside").iterdir() if not p.name.startswith((STAGING_PREFIX, SHARDS_PREFIX))
    ]
    assert len(entries) == 1 and (entries[0] / "dataset" / "state.json").is_file()
    assert stat.S_IMODE(entries[0].stat().st_mode) == 0o700


def test_a_group_cache_without_the_sticky_bit_is_refused(tokenizer, tiny_model, shared_root):
    cache = shared_root / "team-cache"
    cache.mkdir()
    os.chmod(cache, 0o2775)  # setgid alone: a member could still rename your staging directory
    with pytest.raises(DataCacheError) as refused:
        prepare_dataset(
            data_spec(shared_root), tokenizer, tiny_model, cache, rank=0, share=alone, sharing=Sharing.GROUP
        )
    assert "lacks the setgid and sticky bits" in one_line(refused.value)
    os.chmod(cache, 0o777)
    with pytest.raises(DataCacheError, match="everyone may write it"):
        prepare_dataset(
            data_spec(shared_root), tokenizer, tiny_model, cache, rank=0, share=alone, sharing=Sharing.GROUP
        )


def test_a_group_cache_with_setgid_and_sticky_is_shared_and_a_members_entry_is_read(tokenizer, tiny_model, shared_root):
    cache = shared_root / "team-cache"
    cache.mkdir()
    os.chmod(cache, 0o3777 & ~0o002)
    dataset, stats, entry = prepare_dataset(
        data_spec(shared_root), tokenizer, tiny_model, cache, rank=0, share=alone, sharing=Sharing.GROUP
    )
    assert len(dataset) == stats.kept == 400
    assert stat.S_IMODE(entry.stat().st_mode) & 0o755 == 0o755  # the group reads it

    # a member cannot move it aside in a sticky directory
    def move() -> None:
        with pytest.raises(PermissionError):
            os.rename(entry, cache / "elsewhere")

    os.chmod(shared_root, 0o777)
    as_other_user(move, gid=os.getegid())


# --------------------------------------------------------------------------- links at staging names


def test_a_link_at_a_staging_name_is_removed_never_walked(shared_root, tmp_path):
    """A ``.tmp-*`` link in the user's own cache root (left by anything) is unlinked; what it
    points to is never listed (the old code walked it at every start: a link to /usr cost 1.8 s,
    to a filesystem root, hours) nor removed. Checked with an audit hook in a fresh interpreter:
    no listing of the target's path at all."""
    cache = tmp_path / "cache"
    target = tmp_path / "target"
    (target / "deep").mkdir(parents=True)
    (target / "deep" / "file").write_text("x")
    old = 1_000_000_000
    for path in (target / "deep" / "file", target / "deep", target):
        os.utime(path, (old, old))
    with OwnedDir.ensure(cache):
        os.symlink(target, cache / f"{STAGING_PREFIX}planted")
    code = f"""
import sys
listed = []
LISTINGS = ("os.scandir", "os.listdir", "os.walk", "os.fwalk")
sys.addaudithook(lambda event, args: listed.append(str(args[0])) if event in LISTINGS else None)
from jobgen.base.owned_dir import OwnedDir
from trainer.data.cache import remove_stale_staging
with OwnedDir.open({str(cache)!r}) as root:
    print(remove_stale_staging(root))
assert not any({str(target)!r} in item or "planted" in item for item in listed), listed
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"['{STAGING_PREFIX}planted']"
    assert not (cache / f"{STAGING_PREFIX}planted").exists() and (target / "deep" / "file").exists()


def test_a_teammates_link_at_a_staging_name_in_a_group_cache_is_left_and_not_walked(shared_root):
    cache = shared_root / "team-cache"
    cache.mkdir()
    os.chmod(cache, 0o3775)
    os.chmod(shared_root, 0o777)
    target = shared_root / "anything"
    target.mkdir()
    as_other_user(lambda: os.symlink(target, cache / f"{STAGING_PREFIX}theirs"), gid=os.getegid())
    with OwnedDir.open(cache, Sharing.GROUP) as root:
        assert remove_stale_staging(root) == []
    assert (cache / f"{STAGING_PREFIX}theirs").is_symlink()


@pytest.mark.parametrize("planted", ["a link to your directory", "a file", "an empty directory of another user"])
def test_something_planted_at_the_entrys_name_is_set_aside_or_refused(tokenizer, tiny_model, tmp_path, planted):
    victim = Victim(tmp_path)
    cache = tmp_path / "cache"
    spec = data_spec(tmp_path)
    prepare_dataset(spec, tokenizer, tiny_model, cache, rank=0, share=alone)  # learn the entry's name
    [entry] = [p for p in cache.iterdir() if not p.name.startswith(STAGING_PREFIX)]
    shutil.rmtree(entry)
    if planted == "a link to your directory":
        os.symlink(victim.private, entry)
    elif planted == "a file":
        entry.write_text("not an entry")
    else:
        entry.mkdir()
        os.chown(entry, OTHER_UID, OTHER_UID)
    dataset, _stats, again = prepare_dataset(spec, tokenizer, tiny_model, cache, rank=0, share=alone)
    assert again == entry and entry.is_dir() and not entry.is_symlink() and len(dataset) == 400
    assert entry.stat().st_uid == os.geteuid()
    assert victim.untouched()


# --------------------------------------------------------------------------- the trust rules themselves


def test_the_rules_of_a_private_and_a_group_directory(tmp_path):
    me = os.geteuid()
    private = tmp_path / "private"
    with OwnedDir.ensure(private, 0o700) as made:
        assert stat.S_IMODE(os.fstat(made.fd).st_mode) == 0o700
    old = os.umask(0o777)  # whatever the umask: the mode asked for
    try:
        with OwnedDir.ensure(tmp_path / "masked", 0o750):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "masked").stat().st_mode) == 0o750
    for mode, sharing, refused in [
        (0o700, Sharing.PRIVATE, None),
        (0o720, Sharing.PRIVATE, "others may write it"),
        (0o702, Sharing.PRIVATE, "others may write it"),
        (0o755, Sharing.GROUP, None),
        (0o2775, Sharing.GROUP, "lacks the setgid and sticky bits"),
        (0o3775, Sharing.GROUP, None),
        (0o3777, Sharing.GROUP, "everyone may write it"),
    ]:
        os.chmod(private, mode)
        if refused is None:
            check_trust(os.stat(private), private, sharing)
        else:
            with pytest.raises(UntrustedDirectory, match=refused):
                check_trust(os.stat(private), private, sharing)
    os.chmod(private, 0o700)
    link = tmp_path / "link"
    os.symlink(private, link)
    with pytest.raises(UntrustedDirectory, match="is a symbolic link"):
        OwnedDir.open(link)
    if me == 0:
        os.chown(private, OTHER_UID, -1)
        with pytest.raises(UntrustedDirectory, match=f"belongs to uid {OTHER_UID}"):
            OwnedDir.open(private)


def test_a_rank_that_finds_the_root_swapped_refuses_in_one_line(tokenizer, tiny_model, tmp_path):
    """Every rank opens the root and the entry the same way: a link at the entry's name after
    rank 0 published it (a teammate in a group cache) is refused, not read through."""
    cache = tmp_path / "cache"
    spec = data_spec(tmp_path)
    _ds, _stats, entry = prepare_dataset(spec, tokenizer, tiny_model, cache, rank=0, share=alone)
    entry.rename(tmp_path / "real-entry")
    os.symlink(tmp_path / "real-entry", entry)
    with pytest.raises(DataCacheError) as refused:
        prepare_dataset(spec, tokenizer, tiny_model, cache, rank=1, share=lambda _: ("entry", entry.name))
    assert f"{entry}: is a symbolic link" in one_line(refused.value)
