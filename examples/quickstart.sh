#!/usr/bin/env bash
# The demo on a fresh machine (root, Debian): install everything, start the local dev
# cluster with every node as its own host on the network, build a tiny model and
# tokenizer locally, submit the example fine-tuning run (2 nodes x 2 processes, FSDP2,
# a 2-task job array), stop it half-way with the kill switch, continue it from its
# checkpoint until it finishes, then print a sample, export the best checkpoint by eval loss
# and plot the run (training and eval loss).
#   bash examples/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup
jobgen=.venv/bin/jobgen
run=tiny-sft
"$jobgen" cluster up --netns --nodes 2
# The example spec and data ship inside the package (a pip-installed jobgen writes them the same way).
[[ -f examples/sft.toml ]] || "$jobgen" example sft examples
[[ -d examples/tiny-model ]] || "$jobgen" make-tiny-model examples/tiny-model
"$jobgen" validate examples/sft.toml
if "$jobgen" status "$run" --json 2>/dev/null | grep -q '"state": "finished"'; then
  echo "quickstart: $run already finished; move its run directory away to run it again"
  "$jobgen" status "$run"
else
  "$jobgen" submit examples/sft.toml

  # Half-way, the kill switch (any teammate may flip it): the run saves and stops, and
  # its queued array task exits at once.
  step() { "$jobgen" status "$run" --json | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["step"] or 0)'; }
  until (($(step) >= 20)); do sleep 2; done
  "$jobgen" stop "$run"
  # The watch ends with the run's status block: no `jobgen status` after it to print it again.
  "$jobgen" status "$run" --watch || true

  # Continue: lift the switch and submit again; the run resumes from its checkpoint.
  run_dir=$("$jobgen" status "$run" --json | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["run_dir"])')
  rm -f "$run_dir/switches/kill"
  "$jobgen" submit examples/sft.toml
  "$jobgen" status "$run" --watch
fi
"$jobgen" logs "$run" --rank 0 --grep 'resumed|first step|eval at|exit [0-9]+:|checkpoint step' | tail -n 14
# The answer to the [eval] prompt at the last evaluation (every one: jobgen samples tiny-sft).
"$jobgen" samples "$run" --step 60
rm -rf examples/tiny-sft-export
"$jobgen" export "$run" --best --to examples/tiny-sft-export
"$jobgen" plot "$run" -o examples/tiny-sft.png   # the eval loss is drawn on the loss panel
