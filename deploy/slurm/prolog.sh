#!/bin/bash
# Slurm prolog (root, on every node of the job): make the job's ranks write their metrics where
# the node sidecar reads them. Set in slurm.conf:  Prolog=/etc/slurm/robust-metrics-prolog.sh
# and TaskProlog=/etc/slurm/robust-metrics-task-prolog.sh (the task prolog exports the variables).
# The sidecar itself runs as the systemd unit in deploy/systemd.
set -euo pipefail
DIR=${ROBUST_METRICS_DIR:-/run/robust-metrics}
install -d -m 1777 "$DIR" "$DIR/ranks"
# a job id is the run label; remember which jobs this node ran (the epilog removes it)
touch "$DIR/ranks/.job-${SLURM_JOB_ID}"
exit 0
