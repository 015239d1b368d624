"""Programs that run on the compute nodes under torchrun.

``python -m trainer.doctor`` is the node health check. Nothing in this package is
imported by the jobgen CLI: torch is only needed where these programs run.
"""
