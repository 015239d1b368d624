#!/usr/bin/env bash
# The bundled trainer on the oldest torch jobgen's [train] extra admits, on this machine
# (submit --local: no Slurm needed). CI runs the launch path with the oldest torchrun
# (tests/cluster/test_slurm_old_torch.py, torch 2.8.0, your own program); this is the trainer's:
#   bash tests/scripts/oldest_torch.sh [VERSION]      # default: 2.9.0
# A venv in ~/.cache/jobgen-tests/torch-VERSION-train (PyPI's torch is its CUDA build: it runs on
# the CPU, about 7 GB and two minutes the first time) with that torch and the [train] extra's
# other dependencies; jobgen itself from this checkout. It trains the example with FSDP2 on 2
# processes (evaluation, packing, a checkpoint every 3 steps), stops it with the kill switch after
# step 4, and resumes it from its checkpoint to step 9.
# Prints "oldest torch VERSION: ok" and exits 0, or exits 1 with the run's last lines.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-2.9.0}
venv="$HOME/.cache/jobgen-tests/torch-$version-train"
jobgen=.venv/bin/jobgen
if [[ ! -e "$venv/.complete" ]]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==$version" numpy \
    "transformers>=4.50" "datasets>=3.0" "tokenizers>=0.20" "safetensors>=0.4" click pydantic jinja2 psutil
  touch "$venv/.complete"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$jobgen" example sft "$work" >/dev/null
"$jobgen" make-tiny-model "$work/tiny-model" >/dev/null
.venv/bin/python - "$work/sft.toml" "$venv" "$work/runs" <<'PY'
import re, sys
path, venv, runs = sys.argv[1:]
text = open(path).read()
text = text.replace('site = "local"', f'[site]\nprofile = "local"\npython.kind = "venv"\npython.venv = "{venv}"\n', 1)
for key, value in (("nodes", 1), ("max_steps", 9), ("save_every_steps", 3), ("every_steps", 3), ("array", 1)):
    text = re.sub(rf"^{key} = \d+", f"{key} = {value}", text, flags=re.MULTILINE)
text = text.replace('report_to = ["tensorboard"]', "report_to = []").replace("[job]", f'[job]\nruns_root = "{runs}"', 1)
# Paced steps (tests/paced/sitecustomize.py, on PYTHONPATH below): the kill switch finds it mid-run.
open(path, "w").write(text + '\n[env]\nPACED_STEP_SECONDS = "1"\n')
PY
run_dir="$work/runs/tiny-sft"
export PYTHONPATH="$PWD/tests/paced"
failed() {
  tail -n 30 "$work/out.txt"
  echo "oldest torch $version: $1"
  exit 1
}
step() { "$jobgen" status "$run_dir" --json 2>/dev/null | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["step"] or 0)' 2>/dev/null || echo 0; }
# The first task: stopped by the kill switch after step 4, with a checkpoint at step 3 or later.
"$jobgen" submit --local "$work/sft.toml" >"$work/out.txt" 2>&1 &
first=$!
for _ in $(seq 600); do
  (($(step) >= 4)) && break
  kill -0 "$first" 2>/dev/null || break
  sleep 0.5
done
touch "$run_dir/switches/kill"
wait "$first" || true
grep -q "kill switch" "$work/out.txt" || failed "the kill switch did not stop it"
# The second: resumes from that checkpoint and finishes.
rm -f "$run_dir/switches/kill"
"$jobgen" submit --local "$work/sft.toml" >"$work/out.txt" 2>&1 || failed "the resumed run failed"
if ! grep -q "resumed" "$work/out.txt" || ! grep -q "reached step 9 of 9" "$work/out.txt"; then
  failed "did not resume to step 9"
fi
echo "oldest torch $version: ok ($("$venv/bin/python" -c 'import torch; print(torch.__version__)'))"
