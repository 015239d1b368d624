"""The ``[eval]`` table of ``run.toml``: held-out evaluation during training, the best
checkpoint, early stopping and samples.

The evaluation set is either a file or directory of its own (``path``, read with the
same ``[data]`` format, template, masks and ``max_length`` as the training data) or a
deterministic share of the training examples (``split``), held out by the run's seed:
never trained on, the same examples on every resume and at every world size.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from jobgen.spec.fields import Duration, EnvValue, SpecModel


class EvalSpec(SpecModel):
    """Evaluation on held-out data while training; requires job.program = 'train'."""

    path: str | None = Field(
        None,
        description=(
            "Validation data: a JSONL/JSON/CSV/Parquet/Arrow file, a directory of them or a save_to_disk directory "
            "(relative to run.toml), in the [data] format, template and masks. Give path or split, not both."
        ),
    )
    split: float | None = Field(
        None,
        gt=0,
        le=0.5,
        description=(
            "Hold out this share of the training examples for evaluation (e.g. 0.02), chosen by train.seed: "
            "never trained on, the same examples on every resume and world size. Give path or split, not both."
        ),
    )
    every_steps: int = Field(
        0, ge=0, description="Evaluate every N optimizer steps; 0 turns step-based evaluation off."
    )
    every: Duration = Field(
        "0s",
        description=(
            "Also evaluate after this much wall time since the last evaluation (e.g. '1h'), decided by all ranks "
            "together at a step boundary; '0s' turns it off."
        ),
    )
    max_batches: int = Field(
        0,
        ge=0,
        description=(
            "Evaluate on at most this many batches of micro_batch_size rows, counted over all ranks together (the "
            "same rows at every world size); 0 = the whole evaluation set."
        ),
    )
    micro_batch_size: int | None = Field(
        None, ge=1, le=4096, description="Rows per process per evaluation batch; default: train.micro_batch_size."
    )
    at_end: bool = Field(True, description="Evaluate once more when the run reaches train.max_steps.")
    patience: int = Field(
        0,
        ge=0,
        description=(
            "Early stopping: finish the run (final save, the done marker, COMPLETED) after this many evaluations in "
            "a row without an improvement of the best eval loss by more than min_delta; 0 never stops early."
        ),
    )
    min_delta: float = Field(
        0.0, ge=0, description="An evaluation improves on the best only if its loss is lower by more than this."
    )
    prompts: list[EnvValue] = Field(
        default_factory=list,
        description=(
            "Prompts to answer at every evaluation, greedily, through the model's chat template; the answers go "
            "to samples.jsonl (jobgen samples RUN) and TensorBoard's text tab."
        ),
    )
    prompts_file: str | None = Field(
        None,
        description=(
            "A file of prompts (relative to run.toml): JSONL with a 'prompt' key per line, or plain text with one "
            "prompt per line. Added to prompts."
        ),
    )
    max_new_tokens: int = Field(64, ge=1, le=8192, description="Tokens generated per prompt for the samples.")

    @model_validator(mode="after")
    def _one_source_and_a_schedule(self) -> EvalSpec:
        if (self.path is None) == (self.split is None):
            raise ValueError(
                "give exactly one of eval.path (a validation file) and eval.split (a share of the training data)"
            )
        if not (self.every_steps or self.every or self.at_end):
            raise ValueError(
                "eval has nothing to do: set eval.every_steps, eval.every or eval.at_end = true (the default)"
            )
        if self.patience and not (self.every_steps or self.every):
            raise ValueError(
                "eval.patience counts evaluations during training: set eval.every_steps or eval.every as well"
            )
        return self

    @property
    def periodic(self) -> bool:
        """Whether any evaluation happens before the end of the run."""
        return bool(self.every_steps or self.every)
