"""``jobgen example``: the examples are package data, written where the user asks, from any
directory (a ``pip install``\\ed jobgen has no checkout to copy them from)."""

from __future__ import annotations

from pathlib import Path

from helpers import jobgen
from jobgen.cli.examples import EXAMPLES
from jobgen.spec.loader import load_run


def test_without_a_name_every_example_is_listed(tmp_path: Path):
    proc = jobgen("example", cwd=tmp_path, check=True)
    for example in EXAMPLES:
        assert example.name in proc.stdout


def test_every_example_is_written_and_validates(tmp_path: Path):
    for example in EXAMPLES:
        out = tmp_path / example.name
        proc = jobgen("example", example.name, str(out), cwd=tmp_path, check=True)
        for name in example.files:
            assert (out / name).is_file() and f"wrote {out / name}" in proc.stdout
        assert "next:" in proc.stdout
        (out / "tiny-model").mkdir()  # what `jobgen make-tiny-model DIR/tiny-model` makes
        for spec in out.glob("*.toml"):
            assert load_run(spec).run.job.name


def test_site_names_the_users_profile_and_nothing_is_overwritten(tmp_path: Path):
    out = tmp_path / "mine"
    jobgen("example", "sft", str(out), "--site", "my-cluster", check=True)
    assert 'site = "my-cluster"\n' in (out / "sft.toml").read_text()
    (out / "sft.toml").write_text("# my edits\n")
    proc = jobgen("example", "sft", str(out))
    assert proc.returncode == 1 and "not overwriting" in proc.stderr and "--force" in proc.stderr
    assert (out / "sft.toml").read_text() == "# my edits\n"
    jobgen("example", "sft", str(out), "--force", check=True)
    assert (out / "sft.toml").read_text().startswith("# The main example")


def test_unknown_name_and_bad_site_are_one_line(tmp_path: Path):
    proc = jobgen("example", "nope", str(tmp_path))
    assert proc.returncode == 1 and "no example 'nope'" in proc.stderr and "sft" in proc.stderr
    proc = jobgen("example", "sft", str(tmp_path / "x"), "--site", "a b")
    assert proc.returncode == 1 and "--site" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()
