#!/bin/bash
# Slurm TaskProlog: lines "export NAME=value" on stdout become the task's environment.
# The hook then writes multiprocess files (no per-rank HTTP port) and uses the job id as `run`.
echo "export ROBUST_METRICS_DIR=${ROBUST_METRICS_DIR:-/run/robust-metrics}"
echo "export ROBUST_METRICS_RUN=${SLURM_JOB_ID}"
echo "export ROBUST_METRICS_NODE=$(hostname -s)"
