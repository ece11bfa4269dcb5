#!/usr/bin/env bash
# Install the Debian packages the tests and the demo start for real, when their binaries are
# missing and apt is usable (root, Debian-like). Prints what it did; never fails the build on a
# machine without apt, where the tests that need a package skip with a reason.
set -u
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || command -v alertmanager >/dev/null 2>&1 || need+=(prometheus-alertmanager)
command -v amtool >/dev/null 2>&1 || need+=(prometheus-alertmanager)
# The second backend: VictoriaMetrics with vmagent (sharded scraping) and vmalert (rules).
command -v victoria-metrics >/dev/null 2>&1 || need+=(victoria-metrics)
command -v vmagent >/dev/null 2>&1 || need+=(victoria-metrics)
command -v vmalert >/dev/null 2>&1 || need+=(victoria-metrics)
# A real single-node Slurm for the slurm scheduler adapter tests and bench/schedulers.py (bench/slurm_cluster.py).
command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 || need+=(slurm-wlm)
command -v slurmrestd >/dev/null 2>&1 || need+=(slurmrestd)
ls /usr/lib/*/slurm-wlm/auth_jwt.so >/dev/null 2>&1 || need+=(slurm-wlm-jwt-plugin)
command -v munged >/dev/null 2>&1 || need+=(munge)
# openssl makes the self-signed certificate of the sidecar TLS test (tests/integration/test_sidecar_app.py).
command -v openssl >/dev/null 2>&1 || need+=(openssl)
for pkg in ${EXTRA_DEBIAN_PACKAGES:-}; do need+=("$pkg"); done
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
  echo "install-system-deps: cannot install ${need[*]} (no apt-get or not root); tests needing them will skip" >&2
  exit 0
fi
echo "install-system-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
# Debian's packages try to start their services; there is no init system here, which is fine.
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null || {
  echo "install-system-deps: apt-get install ${need[*]} failed" >&2
  exit 1
}
