#!/bin/bash
# Slurm prolog (root, on every node of the job): make the job's ranks write their metrics where
# the node sidecar reads them. Set in slurm.conf:  Prolog=/etc/slurm/robust-metrics-prolog.sh
# and TaskProlog=/etc/slurm/robust-metrics-task-prolog.sh (the task prolog exports the variables).
# The sidecar itself runs as the systemd unit in exporters/systemd.
#
# Layout and modes (docs/security.md): the folder and ranks/ are root's, mode 1733: every job may
# create its own files, no job may list the folder or remove or replace another job's files
# (sticky bit). control/ (0755) and archive/ (0700) are the sidecar's alone. Anything else found
# at these paths (a link, a folder made by a user) is moved aside, never followed or trusted.
set -euo pipefail
DIR=${ROBUST_METRICS_DIR:-/run/robust-metrics}

# a real directory owned by root, or moved aside and made again
ensure_dir() {
    local path=$1 mode=$2
    if [ -L "$path" ] || { [ -e "$path" ] && [ "$(stat -c %u "$path")" != 0 ]; } \
            || { [ -e "$path" ] && [ ! -d "$path" ]; }; then
        mv -T -- "$path" "$path.untrusted.$(date +%s).$$"
        logger -t robust-metrics-prolog "moved aside $path: not a root-owned directory" || true
    fi
    install -d -o root -g root -m "$mode" -- "$path"
    chmod "$mode" -- "$path"   # install -d leaves an existing directory's mode alone
}

ensure_dir "$DIR" 1733
ensure_dir "$DIR/ranks" 1733
ensure_dir "$DIR/control" 0755
# a job id is the run label; remember which jobs this node ran (the epilog removes it)
touch -- "$DIR/ranks/.job-${SLURM_JOB_ID}"

# Optional node self-test (docs/selftest.md): ROBUST_METRICS_SELFTEST holds the command, e.g.
# "/opt/robust-metrics/bin/robust-metrics selftest --quick". A failed check (exit 1) fails the
# prolog, so Slurm drains the node and requeues the job elsewhere; a self-test that cannot run
# (bad options, timeout) is logged and the job goes ahead: only evidence drains a node.
if [ -n "${ROBUST_METRICS_SELFTEST:-}" ]; then
    rc=0
    # shellcheck disable=SC2086  # the variable is a command line
    out=$(timeout "${ROBUST_METRICS_SELFTEST_TIMEOUT:-60}" $ROBUST_METRICS_SELFTEST 2>&1) || rc=$?
    if [ "$rc" = 1 ]; then
        logger -t robust-metrics-prolog "self-test failed: ${out//$'\n'/ | }" || true
        echo "robust-metrics: node self-test failed on $(hostname -s)" >&2
        exit 1
    elif [ "$rc" != 0 ]; then
        logger -t robust-metrics-prolog "self-test could not run (exit $rc)" || true
    fi
fi
exit 0
