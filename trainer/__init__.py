"""Programs that run on the compute nodes under torchrun.

``python -m trainer.doctor`` is the node health check. Nothing in this package is
imported by the jobgen CLI: torch is only needed where these programs run.

The code lives in rooms, one concern each: every subpackage is a room, and so is every module
directly in trainer/ (each of those is one concern already, and a room of its own keeps the
arrows between them, doctor to site_facts to site_checks, loop to job_record, in sight).
:data:`ROOMS` says which room may import which, lowest first (tests/unit/test_trainer_layering.py
holds every import to it, inside functions and under ``if TYPE_CHECKING`` too).
"""

# Each room and the rooms it may import besides itself: a DAG, lowest first. jobgen is always
# allowed. __main__ is the composition root (``python -m trainer``); doctor, with the site
# checks it runs, is a program of its own (``python -m trainer.doctor``).
ROOMS: dict[str, tuple[str, ...]] = {
    "distributed": (),
    "metrics": (),
    "tracking": (),
    "optim": (),
    "model": ("distributed",),
    "data": ("distributed", "model"),
    "memory": ("model", "data"),
    "parallel": ("distributed", "optim", "model", "data", "memory"),
    "checkpoints": ("distributed", "model"),
    "evaluation": ("distributed", "tracking", "data", "memory", "parallel", "checkpoints"),
    "job_record": ("distributed", "metrics", "tracking", "memory"),
    "loop": (
        "distributed",
        "metrics",
        "tracking",
        "optim",
        "model",
        "data",
        "memory",
        "parallel",
        "checkpoints",
        "evaluation",
        "job_record",
    ),
    "__main__": ("distributed", "metrics", "model", "data", "memory", "checkpoints", "loop"),
    "prepare_data": ("model", "data"),
    "site_checks": (),
    "site_facts": ("site_checks",),
    "doctor": ("distributed", "site_checks", "site_facts"),
}
