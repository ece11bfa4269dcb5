"""The `slurm` scheduler: slurmrestd where its API has the operation, `scontrol`/`scancel` elsewhere.

The run label of a Slurm job is its job id (the hook takes it from SLURM_JOB_ID), so every
operation addresses the job by that id. What goes where, and why:

| operation  | slurmrestd (v0.0.36-38)                     | CLI fallback                              |
|------------|---------------------------------------------|-------------------------------------------|
| signal     | DELETE /slurm/{v}/job/{id}?signal=SIGUSR1   | scancel --signal=USR1 --full ID           |
| cancel     | DELETE /slurm/{v}/job/{id}                  | scancel ID                                |
| restart    | none: 22.05 has no requeue endpoint         | scontrol requeue ID                       |
| drain_node | none: node updates arrive with v0.0.39      | scontrol update NodeName=N State=DRAIN .. |

Without `url` everything goes through the CLI. slurmrestd signals the whole job, batch shell
included (KILL_FULL_JOB): a batch script must `exec` the training process or `trap` SIGUSR1,
since bash dies of an untrapped SIGUSR1. With `signal_scope: steps` the adapter signals job
steps only (`scancel --signal`, what `srun`-launched jobs want) and never the batch shell.

Authentication to slurmrestd is a JWT (`scontrol token`, AuthAltTypes=auth/jwt) sent as
`X-SLURM-USER-NAME`/`X-SLURM-USER-TOKEN`. `token_file` is read on every request, so a cron job
that rotates the token needs no bridge restart. The CLI authenticates with munge as the bridge's
user; `slurm_conf` points it at a cluster's slurm.conf (SLURM_CONF).

Config::

    schedulers:
      cluster:
        type: slurm
        url: http://slurmrestd:6820     # optional; without it, CLI only
        api_version: v0.0.38
        user: robust-bridge              # X-SLURM-USER-NAME (default: this process's user)
        token_file: /run/secrets/slurm-jwt   # or `token:` inline, or `token_env:` (SLURM_JWT)
        signal_scope: full               # full (batch shell + steps) | steps
        slurm_conf: /etc/slurm/slurm.conf
"""

from __future__ import annotations

import getpass
import os
import re
import signal as signal_module
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from robust_metrics.bridge.schedulers.base import ActionResult, SchedulerError, check_keys, register
from robust_metrics.configuration import ConfigError, Secret, secret_ref

__all__ = ["SlurmScheduler"]

_KEYS = {"url", "api_version", "user", "token", "token_file", "token_env", "timeout_s",
         "verify_tls", "signal_scope", "scontrol", "scancel", "slurm_conf", "cli_timeout_s"}
_JOB_ID = re.compile(r"^\d+(_\d+)?(\+\d+)?$")
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_API_VERSION = re.compile(r"^v0\.0\.\d+$")
_REASON_MAX = 250


class SlurmScheduler:
    """Signal, requeue, cancel Slurm jobs and drain nodes for the bridge."""

    name = "slurm"

    def __init__(self, config: Mapping[str, Any], *, base_dir: str | Path = ".") -> None:
        """`base_dir`: the folder relative paths (`token_file`) are read from (the policy
        file's)."""
        check_keys(config, _KEYS, "slurm")
        base = Path(base_dir)
        url = config.get("url")
        if url is not None and (not isinstance(url, str) or not re.match(r"^https?://", url)):
            raise ConfigError(f"slurm scheduler: `url` must be an http(s) URL, got {url!r}")
        self.url: str | None = url.rstrip("/") if url else None
        self.api_version = str(config.get("api_version", "v0.0.38"))
        if not _API_VERSION.match(self.api_version):
            raise ConfigError(f"slurm scheduler: `api_version` must look like v0.0.38, got "
                              f"{self.api_version!r}")
        self.user = str(config.get("user") or getpass.getuser())
        # Read at each request, so a cron job that rotates the JWT needs no bridge restart.
        self._token = secret_ref(config, "token", "slurm scheduler", base) or Secret(
            "slurm scheduler", "token_env", "env", "SLURM_JWT")
        self.timeout_s = _positive(config, "timeout_s", 10.0)
        self.cli_timeout_s = _positive(config, "cli_timeout_s", 30.0)
        verify = config.get("verify_tls", True)
        if not isinstance(verify, bool | str):
            raise ConfigError("slurm scheduler: `verify_tls` is true, false or a CA bundle path")
        self.verify_tls: bool | str = str(base / verify) if isinstance(verify, str) else verify
        self.signal_scope = str(config.get("signal_scope", "full"))
        if self.signal_scope not in ("full", "steps"):
            raise ConfigError(f"slurm scheduler: `signal_scope` is `full` or `steps`, got "
                              f"{self.signal_scope!r}")
        self.scontrol = str(config.get("scontrol", "scontrol"))
        self.scancel = str(config.get("scancel", "scancel"))
        conf = config.get("slurm_conf")
        self._cli_env = {**os.environ, **({"SLURM_CONF": str(base / str(conf))} if conf else {})}

    # ------------------------------------------------------------------ operations
    def signal(self, run: str, signum: int, *, key: str | None = None) -> ActionResult:
        job = _job_id(run)
        try:
            name = signal_module.Signals(signum).name
        except ValueError:
            raise SchedulerError(f"slurm: {signum} is not a signal number") from None
        if self.url and self.signal_scope == "full":
            self._rest("DELETE", f"/job/{job}", params={"signal": name})
            how = "slurmrestd"
        else:
            scope = ["--full"] if self.signal_scope == "full" else []
            self._cli([self.scancel, f"--signal={name.removeprefix('SIG')}", *scope, job])
            how = "scancel"
        return ActionResult(True, f"sent {name} to job {job} ({self.signal_scope}) via {how}",
                            {"job_id": job, "signal": name})

    def restart(self, run: str, reason: str, *, key: str | None = None) -> ActionResult:
        """Requeue: Slurm stops the job and starts it again; it resumes from its checkpoint."""
        job = _job_id(run)
        self._cli([self.scontrol, "requeue", job])
        state = self._job_state(job)
        return ActionResult(True, f"requeued job {job} ({_clean(reason)})",
                            {"job_id": job, **({"job_state": state} if state else {})})

    def cancel(self, run: str, reason: str, *, key: str | None = None) -> ActionResult:
        job = _job_id(run)
        if self.url:
            self._rest("DELETE", f"/job/{job}")
        else:
            self._cli([self.scancel, job])
        return ActionResult(True, f"cancelled job {job} ({_clean(reason)})", {"job_id": job})

    def drain_node(self, node: str, reason: str, *, key: str | None = None) -> ActionResult:
        """Drain: running jobs finish (state DRAINING), nothing new starts (then DRAINED)."""
        if not isinstance(node, str) or not _NODE.match(node):
            raise SchedulerError(f"slurm: {node!r} is not a node name")
        text = _clean(reason) or "robust-metrics"
        self._cli([self.scontrol, "update", f"NodeName={node}", "State=DRAIN", f"Reason={text}"])
        return ActionResult(True, f"drained node {node}: {text}", {"node": node, "reason": text})

    def completed(self, run: str, key: str) -> bool | None:
        """Slurm keeps no operation keys: whether a requeue went through cannot be told apart
        from an earlier one, so an interrupted restart is failed, never repeated."""
        return None

    def close(self) -> None:
        """Nothing to release: every request opens and closes its own connection."""

    def job(self, run: str) -> dict[str, Any]:
        """The job as slurmrestd describes it (job_state, restart_cnt, nodes, ...)."""
        job = _job_id(run)
        if not self.url:
            raise SchedulerError("slurm: reading a job needs `url` (slurmrestd)")
        jobs = self._rest("GET", f"/job/{job}").get("jobs") or []
        if not jobs:
            raise SchedulerError(f"slurm: slurmrestd returned no job {job}")
        return dict(jobs[0])

    # ------------------------------------------------------------------ transport
    def token(self) -> str:
        try:
            return self._token.read().removeprefix("SLURM_JWT=")
        except ConfigError as exc:
            if self._token.kind == "env":
                raise SchedulerError(f"slurm: no JWT for slurmrestd: set `token`, `token_file` "
                                     f"or the environment variable {self._token.ref} "
                                     "(`scontrol token`)") from None
            raise SchedulerError(f"slurm: {exc}") from None

    def _rest(self, method: str, path: str, params: Mapping[str, str] | None = None
              ) -> dict[str, Any]:
        import httpx

        url = f"{self.url}/slurm/{self.api_version}{path}"
        headers = {"X-SLURM-USER-NAME": self.user, "X-SLURM-USER-TOKEN": self.token(),
                   "Accept": "application/json"}
        try:
            response = httpx.request(method, url, params=params, headers=headers,
                                     timeout=self.timeout_s, verify=self.verify_tls)
        except httpx.HTTPError as exc:
            raise SchedulerError(f"slurm: cannot reach slurmrestd at {self.url}: {exc}") from None
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise SchedulerError(f"slurm: slurmrestd {method} {path} answered "
                                 f"{response.status_code}: {response.text.strip()[:200]!r}"
                                 + (" (check the JWT and user)" if response.status_code in (
                                     401, 403) else ""))
        errors = [e for e in body.get("errors") or [] if isinstance(e, dict)]
        if errors or response.status_code >= 400:
            text = "; ".join(str(e.get("description") or e.get("error") or e) for e in errors)
            raise SchedulerError(f"slurm: slurmrestd {method} {path} failed "
                                 f"({response.status_code}): {text or 'no error text'}")
        return body

    def _cli(self, argv: list[str]) -> str:
        try:
            proc = subprocess.run(argv, env=self._cli_env, capture_output=True, text=True,
                                  timeout=self.cli_timeout_s, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise SchedulerError(f"slurm: {argv[0]} not found; install the Slurm client "
                                 "commands or set `scontrol`/`scancel` to their paths") from None
        except subprocess.TimeoutExpired:
            raise SchedulerError(f"slurm: {' '.join(argv)} did not finish in "
                                 f"{self.cli_timeout_s:g}s (is slurmctld up?)") from None
        if proc.returncode != 0:
            message = (proc.stderr.strip() or proc.stdout.strip() or "no output")[:300]
            raise SchedulerError(f"slurm: {' '.join(argv)} failed ({proc.returncode}): {message}")
        return proc.stdout

    def _job_state(self, job: str) -> str | None:
        """The job state after an operation, for the audit row; None without slurmrestd."""
        if not self.url:
            return None
        try:
            state = self.job(job).get("job_state")
        except SchedulerError:
            return None
        return str(state) if state else None


def _job_id(run: str) -> str:
    if not isinstance(run, str) or not _JOB_ID.match(run):
        raise SchedulerError(f"slurm: run {run!r} is not a Slurm job id (the run label of a "
                             "Slurm job is SLURM_JOB_ID, e.g. 12345 or 12345_7)")
    return run


def _clean(reason: str) -> str:
    """One line, printable, bounded: Slurm shows node reasons in sinfo's fixed-width output."""
    text = " ".join(str(reason).split())
    return text[:_REASON_MAX]


def _positive(config: Mapping[str, Any], key: str, default: float) -> float:
    try:
        value = float(config.get(key, default))
    except (TypeError, ValueError):
        raise ConfigError(f"slurm scheduler: `{key}` must be a number") from None
    if value <= 0:
        raise ConfigError(f"slurm scheduler: `{key}` must be positive")
    return value


@register("slurm")
def _factory(config: Mapping[str, Any], base_dir: Path) -> SlurmScheduler:
    return SlurmScheduler(config, base_dir=base_dir)
