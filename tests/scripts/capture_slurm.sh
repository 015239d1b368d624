#!/usr/bin/env bash
# Captures what jobgen.slurm asks Slurm for, on a dev cluster of one series, into
# tests/unit/slurm_captured/<series>/, for tests/unit/test_slurm_captured.py:
#
#   jobgen cluster up --netns --slurm 24.11 --state-dir /var/tmp/cap-24.11   # or 22.05
#   SLURM_CONF=/var/tmp/cap-24.11/slurm.conf PATH=<its bin>:$PATH \
#     bash tests/scripts/capture_slurm.sh 24.11
#
# on an idle cluster (job ids from 1). The scenario: an array of 3 (%1) whose first task runs a
# named step, with a comment holding '|'; a job held by a dependency on it, whose name holds '|';
# a job that exits 3. The formats are jobgen.slurm's own (read from it, not copied here).
set -euo pipefail
series=$1
out=$(cd "$(dirname "$0")/.." && pwd)/unit/slurm_captured/$series
py=$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python
fmt() { "$py" -c "from jobgen.slurm import client as c; print(c.$1)"; }
mkdir -p "$out"
work=$(mktemp -d)
cat >"$work/job.sh" <<'JOB'
#!/bin/bash
srun --overlap --job-name=jobgen-launch-1 sleep 120 &
sleep 120
JOB
cd "$work"
sbatch --version >"$out/sbatch_version.txt"
array=$(sbatch --parsable --array=1-3%1 --time=3 --job-name=arr --comment="jobgen: task 1|done" -N1 --output=/dev/null job.sh)
held=$(sbatch --parsable --dependency="afterany:$array" --time=3 --job-name="dep name|bar" -N1 --output=/dev/null job.sh)
failed=$(sbatch --parsable --time=1 --job-name=fail -N1 --output=/dev/null --wrap "exit 3")
# The running task's step has started, the failed job has ended.
for _ in $(seq 60); do
  if squeue --steps --noheader --jobs="${array}_1" --format=%j | grep -q jobgen-launch-1 &&
    [[ -z $(squeue --noheader --jobs="$failed" --format=%i 2>/dev/null) ]]; then break; fi
  sleep 1
done
squeue --noheader --array --format="$(fmt SQUEUE_FORMAT)" >"$out/squeue_queue.txt"
squeue --steps --noheader --jobs="${array}_1" --format="$(fmt STEPS_FORMAT)" >"$out/squeue_steps.txt"
squeue --noheader --array --jobs="$array" --states=PENDING --format=%i >"$out/squeue_pending.txt"
squeue --noheader --me --format="$(fmt MY_JOBS_FORMAT)" >"$out/squeue_mine.txt"
squeue --noheader --me --name=arr --format="$(fmt NAMED_FORMAT)" >"$out/squeue_named.txt"
sinfo -h -N --format="$(fmt NODE_STATES_FORMAT)" >"$out/sinfo_nodes.txt"
scontrol show job --oneliner "$array" >"$out/scontrol_job.txt"
scontrol show node --oneliner >"$out/scontrol_nodes.txt"
scontrol show partition --oneliner >"$out/scontrol_partitions.txt"
scontrol show config | grep -E '^(AccountingStorageType|SlurmctldPort|SlurmdPort|SlurmdTimeout|MinJobAge|ClusterName) ' >"$out/scontrol_config.txt"
scancel "$array" "$held"
for _ in $(seq 30); do [[ -z $(squeue --noheader --me --format=%i) ]] && break; sleep 1; done
sleep 2
sacct --noheader --parsable2 --delimiter="$(fmt SEP)" --duplicates --jobs="$array,$held,$failed" \
  --format="$(fmt SACCT_FIELDS)" >"$out/sacct.txt"
rm -rf "$work"
echo "captured into $out: array $array, held $held, failed $failed"
