"""``jobgen image``: the container image a ``[python] kind = "container"`` site runs its steps in
(the command group is built when asked for: jobgen.cli.main's ``lazy`` table).

    jobgen image build --base IMAGE --tag TAG [--wheel FILE] [--wheelhouse DIR] [--extras E] [--tool podman|docker]
    jobgen image dev

``build`` puts jobgen and the trainer's packages on the site's base image with the bundled
Containerfile (:mod:`jobgen.sites.image`); ``dev`` makes the dev cluster's image from Debian's
packages and this checkout, once (:mod:`jobgen.devcluster.image`), and prints what a podman site
profile of the dev cluster sets.
"""

from __future__ import annotations

from pathlib import Path

import click

from jobgen.cli.common import fail


@click.group(name="image")
def image() -> None:
    """Container images for sites whose jobs run in containers (docs/containers.md)."""


@image.command(name="build")
@click.option("--base", required=True, help="the site's base image (python3 >= 3.10; its torch, if any, >= 2.9)")
@click.option("--tag", required=True, help="the image to build, e.g. registry.example.org/team/jobgen:0.1.0")
@click.option(
    "--wheel",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="jobgen's wheel [default: built from the checkout jobgen runs from]",
)
@click.option(
    "--wheelhouse",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="more wheels to install from (the build then reaches no index: --no-index)",
)
@click.option("--extras", default="train,lora", show_default=True, help="jobgen's extras to install")
@click.option("--tool", type=click.Choice(["podman", "docker"]), default="podman", show_default=True)
def build(base: str, tag: str, wheel: Path | None, wheelhouse: Path | None, extras: str, tool: str) -> None:
    """Build an image holding jobgen and the trainer's packages on top of BASE."""
    import tempfile

    from jobgen.sites.image import ImageBuildError, build_image, jobgen_wheel

    with tempfile.TemporaryDirectory(prefix="jobgen-wheel-") as tmp:
        try:
            wheels = [jobgen_wheel(Path(tmp), wheel), *(sorted(wheelhouse.glob("*.whl")) if wheelhouse else [])]
            built = build_image(base=base, tag=tag, wheels=wheels, extras=extras, offline=bool(wheelhouse), tool=tool)
        except ImageBuildError as exc:
            fail(f"jobgen image build: {exc}", 2)
    click.echo(f"built {built}")


@image.command(name="dev")
def dev() -> None:
    """The dev cluster's image for podman jobs (built once from Debian's packages and this checkout)."""
    from jobgen.devcluster.image import dev_image
    from jobgen.devcluster.state import ClusterError

    try:
        tag, conf = dev_image(build_dev_image, log=lambda line: click.echo(line, err=True))
    except ClusterError as exc:
        fail(f"jobgen image dev: {exc}", 2)
    click.echo(f"image: {tag}")
    click.echo(f"containers_conf: {conf}")


def build_dev_image(*, base: str, tag: str, wheels: list[Path], env: dict[str, str]) -> None:
    """jobgen.devcluster.image's ``build``: this checkout's wheel and the wheelhouse, offline."""
    import tempfile

    from jobgen.devcluster.image import EXTRAS
    from jobgen.devcluster.state import ClusterError
    from jobgen.sites.image import ImageBuildError, build_image, jobgen_wheel

    with tempfile.TemporaryDirectory(prefix="jobgen-wheel-") as tmp:
        try:
            build_image(
                base=base,
                tag=tag,
                wheels=[jobgen_wheel(Path(tmp)), *wheels],
                extras=EXTRAS,
                offline=True,
                log=lambda line: click.echo(f"image: {line}", err=True),
                extra_args=["--network=none"],
                env=env,
            )
        except ImageBuildError as exc:
            raise ClusterError(str(exc)) from None
