#!/usr/bin/env bash
# The demo on a fresh machine (root, Debian): install everything, start the local dev
# cluster with every node as its own host on the network, submit the example run and
# follow it until it ends.
#   bash examples/quickstart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup
jobgen=.venv/bin/jobgen
"$jobgen" cluster up --netns --nodes 2
"$jobgen" validate examples/doctor.toml
"$jobgen" submit examples/doctor.toml
"$jobgen" status doctor --watch || true
"$jobgen" logs doctor | grep -v '^\[default[1-9]' | tail -n 30
