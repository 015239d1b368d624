#!/usr/bin/env bash
# The demo on a fresh machine (root, Debian): install everything, start the local dev
# cluster with every node as its own host on the network, build a tiny model and
# tokenizer locally, submit the example fine-tuning run (2 nodes x 2 processes, FSDP2,
# a 2-task job array) and follow it until it finishes.
#   bash examples/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup
jobgen=.venv/bin/jobgen
"$jobgen" cluster up --netns --nodes 2
[[ -d examples/tiny-model ]] || "$jobgen" make-tiny-model examples/tiny-model
"$jobgen" validate examples/sft.toml
"$jobgen" submit examples/sft.toml
"$jobgen" status tiny-sft --watch
"$jobgen" logs tiny-sft | grep -E 'trainer\[0\]|jobgen:' | sed 's/^\[default0\]://'
