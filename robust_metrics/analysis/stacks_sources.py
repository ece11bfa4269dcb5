"""Where rank stacks come from: sidecars' `/debug/stacks`, Prometheus service discovery, or local
processes. Kept apart from `stacks.py` (pure grouping) so that the grouping never does I/O.

Every collector returns per-rank dicts in the shape `analysis.stacks.analyse` takes
(`{run, rank, pid, node, threads, error, source}`); a sidecar that cannot be reached becomes one
entry with an `error` and no rank, so the rest of the job is still analysed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from robust_metrics.rankfolder.identity import read_identities
from robust_metrics.rankfolder.proof import prove_rank

__all__ = [
    "SourceError",
    "discover",
    "fetch_all",
    "fetch_sidecar",
    "identities_from_dir",
    "local_dumps",
    "stacks_url",
]

MAX_PARALLEL = 64
"""Sidecars asked at once; a 2,000-node job takes a few rounds."""


class SourceError(Exception):
    """A source that cannot be used at all (bad URL, Prometheus down, no such run)."""


def stacks_url(url: str) -> str:
    """`http://host:9741`, `.../metrics` or `.../debug/stacks` to the `/debug/stacks` URL."""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise SourceError(f"{url!r} is not an http(s) URL of a sidecar")
    path = parsed.path.rstrip("/")
    if path.endswith("/metrics"):
        path = path[: -len("/metrics")]
    if not path.endswith("/debug/stacks"):
        path += "/debug/stacks"
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def _get_json(url: str, timeout: float, token: str | None = None) -> Any:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode(errors="replace").strip()
        raise SourceError(f"HTTP {exc.code} from {url}: {detail or exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SourceError(f"cannot reach {url}: {reason}") from None
    try:
        return json.loads(body)
    except ValueError:
        raise SourceError(f"{url} did not answer JSON") from None


def fetch_sidecar(url: str, *, token: str | None = None, run: str | None = None,
                  locals_: bool = True, native: bool = False,
                  timeout: float = 15.0) -> list[dict[str, Any]]:
    """The rank entries of one sidecar's `/debug/stacks`, each with `node` and `source` set.

    Never raises for a sidecar that is down or refuses: that gives one error entry instead.
    """
    base = stacks_url(url)
    query = {"timeout": f"{max(timeout - 1.0, 1.0):g}"}
    if run:
        query["run"] = run
    if locals_:
        query["locals"] = "1"
    if native:
        query["native"] = "1"
    full = f"{base}?{urllib.parse.urlencode(query)}"
    try:
        answer = _get_json(full, timeout, token)
        if not isinstance(answer, dict) or not isinstance(answer.get("ranks"), list):
            raise SourceError(f"{base} answered without a `ranks` list")
    except SourceError as exc:
        return [{"pid": None, "threads": [], "error": f"sidecar: {exc}", "source": base}]
    node = answer.get("node")
    out = []
    for entry in answer["ranks"]:
        if not isinstance(entry, dict):
            continue
        if run and entry.get("run") not in (None, "", run):
            continue
        entry = dict(entry)
        entry.setdefault("node", node)
        entry["node"] = entry["node"] or node
        entry["source"] = base
        out.append(entry)
    return out


def fetch_all(urls: Iterable[str], **kwargs: Any) -> list[dict[str, Any]]:
    """`fetch_sidecar` for every URL concurrently; entries in URL order."""
    urls = list(urls)
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(urls))) as pool:
        results = list(pool.map(lambda u: fetch_sidecar(u, **kwargs), urls))
    return [entry for batch in results for entry in batch]


def _prom_query(prometheus: str, query: str, timeout: float) -> list[dict[str, Any]]:
    url = (f"{prometheus.rstrip('/')}/api/v1/query?"
           f"{urllib.parse.urlencode({'query': query})}")
    answer = _get_json(url, timeout)
    if not isinstance(answer, dict) or answer.get("status") != "success":
        raise SourceError(f"Prometheus query {query!r} failed: {answer}")
    return list(answer["data"]["result"])


def discover(prometheus: str, run: str | None, timeout: float = 15.0
             ) -> tuple[str, list[str], dict[int, dict[str, Any]]]:
    """Find a run's sidecars and topology through Prometheus.

    Ranks come from `robust_rank_info{run}`, which the sidecars serve; the targets that served
    them are the run's sidecars. Targets of the same scrape jobs that are down now are added too,
    so that a sidecar which stopped answering is reported rather than silently left out.
    Returns (run, stacks URLs, rank_info).
    """
    if not prometheus.startswith(("http://", "https://")):
        raise SourceError(f"--prometheus {prometheus!r}: give an http(s) URL")
    selector = f'robust_rank_info{{run="{_escape(run)}"}}' if run else "robust_rank_info"
    series = _prom_query(prometheus, selector, timeout)
    runs = sorted({s["metric"].get("run", "") for s in series})
    if not series:
        known = sorted({s["metric"].get("run", "")
                        for s in _prom_query(prometheus, "robust_rank_info", timeout)})
        raise SourceError(f"Prometheus has no robust_rank_info for run {run!r}; runs it knows: "
                          f"{', '.join(known) or 'none'}")
    if run is None:
        if len(runs) > 1:
            raise SourceError(f"Prometheus knows several runs ({', '.join(runs)}); pick one "
                              "with --run")
        run = runs[0]
    rank_info: dict[int, dict[str, Any]] = {}
    served: set[tuple[str, str]] = set()
    for s in series:
        labels = s["metric"]
        served.add((labels.get("job", ""), labels.get("instance", "")))
        try:
            rank = int(labels.get("rank", ""))
        except ValueError:
            continue
        rank_info[rank] = {k: v for k, v in labels.items() if k not in ("__name__", "job",
                                                                          "instance")}
    jobs = {job for job, _ in served}
    answer = _get_json(f"{prometheus.rstrip('/')}/api/v1/targets?state=active", timeout)
    urls: list[str] = []
    for target in answer.get("data", {}).get("activeTargets", []):
        labels = target.get("labels", {})
        key = (labels.get("job", ""), labels.get("instance", ""))
        if key in served or (key[0] in jobs and target.get("health") != "up"):
            url = stacks_url(target["scrapeUrl"])
            if url not in urls:
                urls.append(url)
    if not urls:
        raise SourceError(f"no Prometheus target serves run {run!r}; is the sidecar scraped?")
    return run, urls, rank_info


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def identities_from_dir(metrics_dir: str, run: str | None = None) -> dict[int, dict[str, Any]]:
    """`ranks/<pid>.json` files the hook writes in multiprocess mode, keyed by pid.

    Each value has the identity's label fields (as the sidecar sends them) plus `started`, and
    `refused`: None when the pid is proven a rank of the folder (see `rankfolder.proof`), else
    why it is not, in which case it must not be dumped.
    """
    try:
        found = read_identities(metrics_dir, run)
    except FileNotFoundError:
        raise SourceError(f"{metrics_dir!r} has no ranks/ folder: is it the ranks' "
                          "ROBUST_METRICS_DIR?") from None
    except OSError as exc:
        raise SourceError(f"cannot read {metrics_dir!r}/ranks: {exc}") from None
    return {pid: {**ident.labels(), "pid": pid, "started": ident.started,
                  "refused": prove_rank(metrics_dir, ident)}
            for pid, ident in found.items()}


def local_dumps(pids: list[int], identities: dict[int, dict[str, Any]] | None = None, *,
                locals_: bool = True, native: bool = False,
                timeout: float = 10.0) -> list[dict[str, Any]]:
    """Dump local processes with py-spy; label them with their identity where known.

    A pid whose identity says `refused` (not proven a rank of its folder) is not dumped: its
    entry carries the reason as its error.
    """
    from robust_metrics.sidecar.stacks import dump_stacks

    identities = identities or {}
    refused = {pid: identities.get(pid, {}).get("refused") for pid in pids}
    out = []
    dumps = {d["pid"]: d for d in dump_stacks([p for p in pids if not refused[p]], native=native,
                                              locals_=locals_, timeout=timeout)}
    for pid in pids:
        dump = dumps.get(pid) or {"pid": pid, "threads": [], "error": refused[pid]}
        ident = identities.get(pid, {})
        entry = {"run": ident.get("run"), "rank": ident.get("rank"), "node": ident.get("node"),
                 "source": f"pid {pid}", **dump}
        out.append(entry)
    return out
