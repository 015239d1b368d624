#!/usr/bin/env bash
# The GPU proofs in one command (issue 34): the 7B memory-lean run, MFU against the HF Trainer,
# the CPU-offload check and greedy samples through flex attention, one table (bench/gpu_proofs.py).
#
#   bash bench/gpu_proofs.sh --fetch-wheels     # here, where pip's index is reachable: the Python
#                                               # packages a bare GPU machine lacks, as wheels in .whl/
#   bash bench/gpu_proofs.sh [--out DIR] [--only 7b mfu offload samples] [--budget 480]
#                                               # on the GPU machine, from a copy of the repository
#                                               # with .whl/ beside it; nothing is fetched there
#   bash bench/gpu_proofs.sh --smoke [--work DIR]   # any machine with .venv: CPU, tiny shapes (CI)
#
# On the GPU machine the image's python3 holds torch, transformers and most of what the trainer
# needs, but not pydantic, datasets or submitit, and no network. The script makes a virtual
# environment whose bin/ holds `jobgen` and `torchrun` (the benchmarks launch both from beside
# their interpreter, as from .venv/bin), whose site-packages holds the carried wheels, and which
# sees the image's own packages after its own (a .pth file) and this checkout (another).
set -euo pipefail
cd "$(dirname "$0")/.."

# What the GPU image lacks, at the versions CI tests with (read from .venv, Python 3.11 here;
# the wheels are fetched for the image's Python 3.12). typing-extensions: pydantic needs a
# newer one than images tend to hold.
CARRIED="pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess submitit"
WHEEL_PYTHON=${WHEEL_PYTHON:-3.12}

fetch_wheels() {
    local py=.venv/bin/python specs
    # shellcheck disable=SC2086  # CARRIED is a list of names
    specs=$("$py" -c 'import sys, importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $CARRIED)
    rm -rf .whl && mkdir .whl
    local platforms=()
    for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    # shellcheck disable=SC2086  # specs is a list of NAME==VERSION
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$WHEEL_PYTHON" --implementation cp \
        "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl $specs
    ls .whl
    du -sh .whl
}

gpu_environment() {
    local py=${PYTHON:-python3} venv=${JOBGEN_PROOFS_VENV:-/tmp/jobgen-proofs-venv} site
    if [ ! -x "$venv/bin/jobgen" ]; then
        rm -rf "$venv"
        "$py" -m venv --without-pip "$venv"
        site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
        # The image's packages (torch among them) after the venv's own; addsitedir also reads
        # the .pth files there. Then this checkout, so `import jobgen` and `-m trainer` work.
        "$py" -c 'import site; print("".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages()))' \
            > "$site/zz_image_site.pth"
        pwd > "$site/jobgen_checkout.pth"
        if compgen -G ".whl/*.whl" > /dev/null; then
            "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
        fi
        printf '#!%s\nimport sys\nfrom jobgen.cli.main import main\nsys.exit(main())\n' "$venv/bin/python" > "$venv/bin/jobgen"
        printf '#!%s\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n' "$venv/bin/python" > "$venv/bin/torchrun"
        chmod +x "$venv/bin/jobgen" "$venv/bin/torchrun"
    fi
    if ! "$venv/bin/python" -c 'import pydantic, datasets, submitit, torch, transformers, jobgen.cli.main' 2>/dev/null; then
        "$venv/bin/python" -c 'import pydantic, datasets, submitit, torch, transformers, jobgen.cli.main' || true
        echo "gpu_proofs: the environment at $venv is incomplete (above); carry the wheels: bash bench/gpu_proofs.sh --fetch-wheels here, .whl/ there" >&2
        exit 1
    fi
    PROOFS_PYTHON=$venv/bin/python
}

case "${1:-}" in
    --fetch-wheels)
        fetch_wheels
        ;;
    --smoke)
        exec "${PYTHON:-.venv/bin/python}" bench/gpu_proofs.py "$@"
        ;;
    *)
        gpu_environment
        exec "$PROOFS_PYTHON" bench/gpu_proofs.py "$@"
        ;;
esac
