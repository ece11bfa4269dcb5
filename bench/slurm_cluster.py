"""A real single-node Slurm for tests and benchmarks: munged, slurmctld, slurmd, slurmrestd.

Everything lives under one folder (config, keys, state, spool, logs, the munge socket) and every
daemon listens on a free loopback port, so it cannot clash with a site Slurm or another test run.
The daemons run in the foreground as children of the test process (no systemd); settings that are
known to work in containers as root: `SlurmUser=root`, `ProctrackType=proctrack/linuxproc`,
`TaskPlugin=task/none`, `munged --force`, `AuthAltTypes=auth/jwt`, and slurmrestd with
`SLURMRESTD_SECURITY=disable_user_check` and `SLURM_JWT=daemon`.

`cred_expire=5` shortens how long a requeued job waits before it may start again (120 s by
default) and `sched_interval=1` makes the scheduler notice that at once.

It lives in bench/, beside the benchmark that runs it (`bench/schedulers.py`), and not in the
product package, on purpose: it runs the daemons as root with their security turned off
(`disable_user_check`, `munged --force`), which nobody should deploy. The Slurm tests import it
from here (`tests/slurm/fixture.py`). It is built on the one harness (`robust_metrics.processes`:
ports, spawning, stopping, waiting), so the tests and the benchmark start the same thing the same
way, and a daemon left running fails the test session like any other process.

Teardown cancels every job, stops the daemons, and then kills any process still carrying this
cluster's SLURM_CONF in its environment (job steps outlive slurmd under proctrack/linuxproc).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from robust_metrics.processes import free_port, spawn, stop_process_group, wait_for

__all__ = ["SlurmCluster", "SlurmUnavailable", "missing_binaries"]

BINARIES = ("munged", "slurmctld", "slurmd", "slurmrestd", "scontrol", "sbatch", "squeue",
            "scancel")
API_VERSION = "v0.0.38"


class SlurmUnavailable(RuntimeError):
    """The daemons could not be started here (the test skips with this message)."""


def missing_binaries() -> list[str]:
    """Binaries (and the JWT auth plugin) this fixture needs that are not installed."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if not glob.glob("/usr/lib/*/slurm-wlm/auth_jwt.so") and not glob.glob(
            "/usr/lib*/slurm/auth_jwt.so"):
        missing.append("auth_jwt.so (slurm-wlm-jwt-plugin)")
    return missing


class SlurmCluster:
    """munged + slurmctld + slurmd + slurmrestd on this machine, one partition `debug`."""

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus
        self.ctld_port, self.slurmd_port, self.rest_port = free_port(), free_port(), free_port()
        self.conf = root / "slurm.conf"
        self.log_dir = root / "log"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.env.pop("SLURM_JWT", None)

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 60.0) -> SlurmCluster:
        missing = missing_binaries()
        if missing:
            raise SlurmUnavailable(f"Slurm binaries missing: {', '.join(missing)} (install "
                                   "slurm-wlm slurmrestd slurm-wlm-jwt-plugin munge)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test Slurm runs its daemons as root (SlurmUser=root)")
        self._write_files()
        try:
            self._spawn("munged", ["munged", "--force", "-F", f"--socket={self.root}/munge.sock",
                                   f"--key-file={self.root}/munge.key",
                                   f"--log-file={self.log_dir}/munged.log",
                                   f"--pid-file={self.root}/run/munged.pid",
                                   f"--seed-file={self.root}/run/munged.seed"])
            wait_for(lambda: (self.root / "munge.sock").exists(), 10, message="munged socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
            wait_for(self._node_ready, timeout, interval=0.2,
                       message=f"node {self.node} idle in sinfo")
            self._spawn("slurmrestd", [
                "slurmrestd", "-f", str(self.conf), "-s", f"openapi/{API_VERSION}",
                "-a", "rest_auth/jwt", f"127.0.0.1:{self.rest_port}"],
                extra_env={"SLURMRESTD_SECURITY": "disable_user_check", "SLURM_JWT": "daemon"})
            wait_for(self._rest_up, timeout, interval=0.2, message="slurmrestd ping")
        except BaseException as exc:
            logs = self.logs()
            self.stop()
            if isinstance(exc, TimeoutError):
                raise SlurmUnavailable(f"{exc}\n{logs}") from exc
            raise
        return self

    def _write_files(self) -> None:
        for sub in ("state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        for name, size in (("munge.key", 1024), ("jwt.key", 32)):
            path = self.root / name
            path.write_bytes(os.urandom(size))
            os.chmod(path, 0o400 if name == "munge.key" else 0o600)
        r = self.root
        self.conf.write_text(f"""\
ClusterName=rmtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge.sock,cred_expire=5
AuthAltTypes=auth/jwt
AuthAltParameters=jwt_key={r}/jwt.key
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobRequeue=1
ReturnToService=2
MessageTimeout=5
KillWait=2
MinJobAge=300
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> None:
        self.procs[name] = spawn(argv, env={**self.env, **(extra_env or {})}, inherit_env=False,
                                 log_path=self.log_dir / f"{name}.out", append=False)
        time.sleep(0.05)
        code = self.procs[name].poll()
        if code is not None:
            raise SlurmUnavailable(f"{name} exited with {code} at start\n{self.logs()}")

    def _node_ready(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{name} exited with {proc.returncode}\n{self.logs()}")
        out = self.cli("sinfo", "-h", "-N", "-o", "%T", check=False)
        return out.strip() in ("idle", "mixed", "allocated")

    def _rest_up(self) -> bool:
        import httpx

        proc = self.procs["slurmrestd"]
        if proc.poll() is not None:
            raise SlurmUnavailable(f"slurmrestd exited with {proc.returncode}\n{self.logs()}")
        r = httpx.get(f"{self.rest_url}/slurm/{API_VERSION}/ping", timeout=2,
                      headers={"X-SLURM-USER-NAME": "root", "X-SLURM-USER-TOKEN": self.token()})
        return r.status_code == 200

    # ------------------------------------------------------------------ use
    def cli(self, *argv: str, check: bool = True, timeout: float = 20) -> str:
        """Run a Slurm command against this cluster; its stdout."""
        proc = subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def token(self, lifespan: int = 3600) -> str:
        """A JWT for root from `scontrol token` (signed with this cluster's key)."""
        out = self.cli("scontrol", "token", f"lifespan={lifespan}").strip()
        if not out.startswith("SLURM_JWT="):
            raise AssertionError(f"unexpected scontrol token output: {out!r}")
        return out.split("=", 1)[1]

    def sbatch(self, script: Path, *args: str, env: dict[str, str] | None = None) -> str:
        """Submit a batch script; the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *args, str(script)],
                              env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=20)
        if proc.returncode != 0:
            raise AssertionError(f"sbatch failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job_field(self, job_id: str, name: str) -> str:
        """One `Key=Value` field of `scontrol show job` (e.g. JobState, Restarts)."""
        return _field(self.cli("scontrol", "-o", "show", "job", job_id), name)

    def node_state(self) -> tuple[str, str]:
        """The node's long state (e.g. `drained`, `draining`, `idle`) and its reason."""
        out = self.cli("sinfo", "-h", "-N", "-n", self.node, "-o", "%T|%E").strip()
        state, _, reason = out.partition("|")
        return state, reason

    def logs(self) -> str:
        parts = []
        for path in sorted(self.log_dir.glob("*")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Cancel all jobs, stop every daemon and kill leftover job processes of this cluster."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self.cli("scancel", "--partition=debug", check=False, timeout=10)
                wait_for(lambda: not self.cli("squeue", "-h", check=False, timeout=5).strip(),
                           15, interval=0.3, message="jobs to end")
        for name in ("slurmrestd", "slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            stop_process_group(proc, timeout=10)
        for pid in self._leftover_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _leftover_pids(self) -> list[int]:
        """Processes whose environment names this cluster's config: slurmstepd and job tasks."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                pids.append(int(entry.name))
        return pids

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _field(line: str, name: str) -> str:
    for part in line.split():
        key, _, value = part.partition("=")
        if key == name:
            return value
    raise AssertionError(f"no {name}= in {line!r}")
