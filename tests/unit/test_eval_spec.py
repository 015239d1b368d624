"""[eval]: every mistake is refused with its key by `jobgen validate` (before anything is
written or queued); paths are made absolute for the nodes; the held-out split and the
record of evaluations behave as the trainer relies on."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import DATA, jobgen, spec_issues, write_spec
from jobgen.spec.loader import load_run


def head(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir(exist_ok=True)
    return f"""
        site = "local"
        [job]
        name = "ev"
        time = "1h"
        [model]
        path = "model"
        [data]
        path = "{DATA}"
    """


@pytest.mark.parametrize(
    "table, key, words",
    [
        pytest.param("[eval]\nevery_steps = 5\n", "eval", "exactly one of eval.path", id="no-source"),
        pytest.param('[eval]\nsplit = 0.1\npath = "v.jsonl"\n', "eval", "exactly one of", id="both-sources"),
        pytest.param("[eval]\nsplit = 0.9\n", "eval.split", "less than or equal to 0.5", id="split-too-large"),
        pytest.param("[eval]\nsplit = 0\n", "eval.split", "greater than 0", id="split-zero"),
        pytest.param('[eval]\npath = "missing.jsonl"\n', "eval.path", "'missing.jsonl' does not exist", id="missing"),
        pytest.param('[eval]\npath = "empty.jsonl"\n', "eval.path", "is empty (0 rows)", id="empty"),
        pytest.param("[eval]\nsplit = 0.1\nat_end = false\n", "eval", "nothing to do", id="nothing-to-do"),
        pytest.param("[eval]\nsplit = 0.1\npatience = 3\n", "eval", "eval.patience counts", id="patience-alone"),
        pytest.param('[eval]\nsplit = 0.1\nevery = "10"\n', "eval.every", "no unit", id="bare-number"),
        pytest.param("[eval]\nsplit = 0.1\nevry_steps = 3\n", "eval.evry_steps", "Extra inputs", id="typo"),
        pytest.param(
            '[eval]\nsplit = 0.1\nprompts_file = "nope.txt"\n', "eval.prompts_file", "does not exist", id="no-prompts"
        ),
        pytest.param(
            '[eval]\nsplit = 0.1\nprompts_file = "bad.jsonl"\n', "eval.prompts_file", "line 2: not JSON", id="bad-line"
        ),
        pytest.param('[eval]\nsplit = 0.1\nprompts = ["a\\nb"]\n', "eval.prompts[0]", "control", id="newline"),
    ],
)
def test_a_bad_eval_table_is_refused_with_its_key(tmp_path: Path, table: str, key: str, words: str):
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{oops\n')
    found = spec_issues(write_spec(tmp_path, head(tmp_path) + table))
    assert key in found and words in found[key], found


def test_eval_with_another_program_is_refused(tmp_path: Path):
    doctor = 'site = "local"\n[job]\nname = "d"\nprogram = "doctor"\ntime = "1h"\n'
    spec = write_spec(tmp_path, doctor + "[eval]\nsplit = 0.1\n")
    found = spec_issues(spec)
    assert "only used with job.program = 'train'" in " ".join(found.values()), found


def test_validate_names_the_file_and_key_and_writes_nothing(tmp_path: Path):
    spec = write_spec(tmp_path, head(tmp_path) + '[eval]\npath = "missing.jsonl"\nevery_steps = 10\n')
    proc = jobgen("validate", str(spec))
    assert proc.returncode != 0
    assert f"{spec}: eval.path: 'missing.jsonl' does not exist" in proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "run.toml"]


def test_eval_paths_are_made_absolute_for_the_nodes(tmp_path: Path):
    (tmp_path / "valid.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    (tmp_path / "prompts.txt").write_text("Say hi.\n\nName a color.\n")
    spec = load_run(
        write_spec(tmp_path, head(tmp_path) + '[eval]\npath = "valid.jsonl"\nprompts_file = "prompts.txt"\n')
    )
    assert spec.run.eval.path == str(tmp_path / "valid.jsonl")
    assert spec.run.eval.prompts_file == str(tmp_path / "prompts.txt")
    from jobgen.spec.data_files import read_prompts

    assert read_prompts(spec.run.eval.prompts_file) == ["Say hi.", "Name a color."]


@pytest.mark.torch
def test_the_held_out_split_is_a_function_of_its_inputs_only():
    from trainer.data.eval_set import held_out, split_digest

    train, held = held_out(400, 0.02, seed=7)
    assert len(held) == 8 and len(train) == 392
    assert sorted([*train, *held]) == list(range(400))  # disjoint, and nothing left out
    again_train, again_held = held_out(400, 0.02, seed=7)
    assert (again_held == held).all() and (again_train == train).all()
    assert split_digest(held_out(400, 0.02, seed=8)[1]) != split_digest(held)
    assert len(held_out(3, 0.5, seed=1)[1]) == 2 and len(held_out(3, 0.01, seed=1)[1]) == 1
    with pytest.raises(ValueError, match="cannot be split"):
        held_out(1, 0.5, seed=1)


@pytest.mark.torch
def test_the_history_gives_the_best_the_count_since_and_the_best_saved():
    from trainer.evaluation.evaluator import EvalHistory

    history = EvalHistory(min_delta=0.05)
    assert history.add(10, 2.0) and history.add(20, 1.9)
    assert not history.add(30, 1.87)  # lower, but not by more than min_delta
    assert not history.add(40, 1.95)
    assert history.best() == (20, 1.9) and history.since_best() == 2
    assert history.lowest_among({10, 30, 40}) == (30, 1.87)  # step 20's checkpoint is gone
    assert history.lowest_among(set()) is None
    restored = EvalHistory(min_delta=0.05)
    restored.load_state_dict(history.state_dict())
    assert restored.evals == history.evals and restored.since_best() == 2
