"""Hang localisation: group rank stacks by signature, name the ranks that are elsewhere.

When a synchronous job hangs, every healthy rank waits in the same collective; the rank that
caused it is somewhere else (reading data, writing a checkpoint, spinning in a kernel launch loop).
ByteRobust finds it by dumping every rank's stack, grouping ranks by stack signature and evicting
the machines of the outlier groups. This module is that grouping, and nothing else: it takes the
dumps (from the sidecars' `/debug/stacks`, or `robust_metrics.sidecar.stacks.dump_stacks`) and an
optional rank topology, and returns a plain dict report. It does no I/O, so the CLI, the bridge's
`dump_stacks` action and the tests share it.

Steps:

1. **Normalise** each frame to `function (file)`: no line numbers (ranks stopped on different lines
   of the same loop are in the same place), no addresses, no locals; files are cut to their path
   below `site-packages/` or `lib/pythonX.Y/` (venvs differ between nodes) or to their base name.
2. **Thread roles.** The main thread, data-loader threads, checkpoint threads and other threads are
   compared only with the same role of other ranks; a rank's signature for a role is the multiset
   of its threads' signatures in that role.
3. **Samples.** Several dumps of the same rank are successive samples. A role whose exact stack
   (with line numbers, and locals where dumped) is the same in every sample is *stuck*; one whose
   signature stayed but whose lines or locals changed is *busy* (a healthy rank enters the same
   all_reduce every step, with a new tensor and step counter each time); one whose signature
   changed is *progressing*. With several samples the job counts as hung only when at least
   `hang_fraction` of the ranks have a stuck main thread (or every rank but one is stuck, locals
   included, in a collective while that one moves: a small job's computing culprit), so a
   healthy job gives no suspects. Dump
   with locals for this check: without them, healthy ranks that sit in the same collective at every
   sample look stuck (they still form one group, so they are not named). With one sample the
   caller asserts the hang (the bridge calls after a hang alert) and `hung` is None.
4. **Groups.** Within each role (and each pipeline stage, when `pp_rank` is known, since stages
   legitimately run different code) ranks are grouped by signature. A group is healthy when it
   holds at least `min_share` of the ranks (and two or more), or is the single largest; when none
   is, the groups waiting inside `torch.distributed` are taken as healthy, and failing those the
   groups inside `backward()` or DDP's forward (DDP waits for its gradient all-reduce in C++
   there, with no Python frame of torch.distributed). Every other group of the
   main, data-loader or checkpoint role is an outlier, and its ranks are the suspects. Other
   threads (metrics flushers, user helpers) are reported but only decide with `all_threads=True`;
   a progressing helper thread never does.
5. **Map** suspects to nodes and to their data-, pipeline- and tensor-parallel groups.

Usage::

    from robust_metrics.analysis.stacks import analyse
    report = analyse(dumps, rank_info)   # dumps: [{rank, pid, node?, threads, error}, ...]
    report["suspect_ranks"], report["nodes"], report["groups"]
    for s in report["suspects"]: s["rank"], s["node"], s["reasons"]
"""

from __future__ import annotations

import gc
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ABSENT",
    "CORE_ROLES",
    "PROGRESSING",
    "analyse",
    "normalise_file",
    "normalise_frame",
    "normalise_rank_info",
    "thread_role",
]

PROGRESSING = "(progressing: stack changed between samples)"
ABSENT = "(no such thread in some samples)"
CORE_ROLES = ("main", "dataloader", "checkpoint")
"""Roles whose outliers make suspects by default."""

_TOPO_KEYS = ("dp_rank", "pp_rank", "tp_rank")
# a parallel group is the set of ranks that share the other two coordinates
_GROUP_KINDS = {"dp": ("pp_rank", "tp_rank"), "pp": ("dp_rank", "tp_rank"),
                "tp": ("dp_rank", "pp_rank")}
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_STDLIB = re.compile(r"/lib/python\d+(?:\.\d+)?t?/")
_DIGITS = re.compile(r"\d+")
_COLLECTIVE_FUNCTIONS = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "barrier", "monitored_barrier", "all_to_all",
    "all_to_all_single", "send", "recv", "isend", "irecv", "gather", "scatter", "reduce", "wait",
})


_NATIVE_COLLECTIVE = ("c10d::", "gloo::")
_IMPLICIT_WAIT_FRAMES = frozenset({
    "_engine_run_backward (torch/autograd/graph.py)",  # torch >= 2.3
    "backward (torch/autograd/__init__.py)",  # older releases call the engine from here
})
_DDP_FILE = "(torch/nn/parallel/distributed.py)"
_HOOK_FILES = re.compile(r"robust_metrics[/\\]hooks[/\\]")


def normalise_file(path: str) -> str:
    """A file name that is the same on every node: below site-packages, the stdlib, or the base."""
    if not path:
        return "?"
    p = path.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        i = p.rfind(marker)
        if i >= 0:
            return p[i + len(marker):]
    ends = [m.end() for m in _STDLIB.finditer(p)]
    if ends:
        return p[ends[-1]:]
    return p.rsplit("/", 1)[-1]


def normalise_frame(function: str, file: str) -> str:
    """`function (file)` without line numbers or addresses."""
    return f"{_ADDRESS.sub('0x?', function or '?')} ({normalise_file(file)})"


class _FrameCache:
    """Normalising a frame is the hot path for 16k ranks; most frames repeat across ranks."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, Any], str] = {}
        self._signatures: dict[tuple[str, ...], tuple[str, ...]] = {}

    def signature(self, frames: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
        """The normalised frames of a thread, one shared tuple per distinct signature. The
        hook's own wrappers (around collectives and `Work.wait`) are left out: every rank runs
        them, and a rank waits in the torch function they wrap."""
        cache = self._cache
        out = []
        for f in frames:
            key = (f.get("function"), f.get("file"))
            found = cache.get(key)
            if found is None:
                found = cache[key] = ("" if _HOOK_FILES.search(str(key[1] or "")) else
                                      normalise_frame(str(key[0] or "?"), str(key[1] or "")))
            if found:
                out.append(found)
        sig = tuple(out)
        return self._signatures.setdefault(sig, sig)


def thread_role(thread: Mapping[str, Any], frames: Iterable[str], pid: int | None = None) -> str:
    """`main`, `dataloader`, `checkpoint` or `other:<thread name without digits>`.

    `frames` are the normalised frames; roles come from what a thread runs where that is
    recognisable (torch's data loader and distributed checkpoint), else from its name.
    """
    name = str(thread.get("thread_name") or "")
    if name == "MainThread" or (pid is not None and thread.get("os_thread_id") == pid):
        return "main"
    for frame in frames:
        if ("(torch/utils/data/" in frame or frame.startswith("_pin_memory_loop ")
                or frame.startswith("_worker_loop ")):
            return "dataloader"
        if "(torch/distributed/checkpoint/" in frame:
            return "checkpoint"
    lowered = name.lower()
    if "checkpoint" in lowered or "ckpt" in lowered:
        return "checkpoint"
    if "dataloader" in lowered or "pin_memory" in lowered:
        return "dataloader"
    return "other:" + (_DIGITS.sub("N", name) or "?")


def _is_waiting(signature: tuple[str, ...]) -> bool:
    """Whether a stack waits in torch.distributed (what healthy ranks of a hung job do): a
    Python frame of torch.distributed or a collective, or with `--native` a C++ frame of c10d or
    gloo (DDP's `c10d::Reducer::finalize_backward` waiting for its gradient all-reduce)."""
    for frame in signature:
        if "(torch/distributed/" in frame:
            return True
        function = frame.split(" (", 1)[0]
        if function in _COLLECTIVE_FUNCTIONS or function.startswith(_NATIVE_COLLECTIVE):
            return True
    return False


def _may_wait(signature: tuple[str, ...]) -> bool:
    """Whether a stack's innermost Python frame is a torch entry point below which a rank can
    wait for a collective in C++ with no Python frame of torch.distributed: DDP reduces
    gradients from autograd hooks and waits for them at the end of `backward()`, and syncs
    buffers from its forward. A rank running kernels there looks the same, so this only breaks
    a tie where no group dominates and none visibly waits."""
    for frame in signature:
        if frame.endswith(".py)"):
            return frame in _IMPLICIT_WAIT_FRAMES or frame.endswith(_DDP_FILE)
    return False


def _int_or_none(value: Any) -> int | None:
    """A rank or pid from an untrusted answer: an integer, or None for anything else (a bool, a
    fraction, an infinity or NaN, text that is not a whole number)."""
    if value is None or value == "" or isinstance(value, bool):
        return None
    if isinstance(value, float) and not value.is_integer():  # infinities and NaN included
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def normalise_rank_info(rank_info: Mapping[Any, Mapping[str, Any]] | list[Mapping[str, Any]]
                        | None) -> dict[int, dict]:
    """Rank topology keyed by int rank: `{node, local_rank, pid, world_size, dp/pp/tp_rank}`.

    Accepts the labels of `robust_rank_info` (strings, empty for unknown) or the `ranks/<pid>.json`
    identity (with a nested `topology`); keys may be ints or numeric strings.
    """
    out: dict[int, dict] = {}
    if isinstance(rank_info, list):
        items: Iterable[tuple[Any, Any]] = ((r.get("rank") if isinstance(r, Mapping) else None, r)
                                            for r in rank_info)
    elif isinstance(rank_info, Mapping) or rank_info is None:
        items = (rank_info or {}).items()
    else:
        raise ValueError("rank_info must be a dict keyed by rank or a list of label dicts")
    for key, raw in items:
        if isinstance(raw, Mapping) and key in (None, "") and raw.get("rank") in (None, ""):
            continue  # an entry of a rank the sidecar could not name: nothing to learn
        rank = _int_or_none(raw.get("rank", key) if isinstance(raw, Mapping) else key)
        if rank is None or not isinstance(raw, Mapping):
            raise ValueError(f"rank_info entry {key!r}: needs an integer rank and a dict of labels")
        topo = raw.get("topology") if isinstance(raw.get("topology"), Mapping) else {}
        entry: dict[str, Any] = {"node": str(raw["node"]) if raw.get("node") else None}
        for name in ("local_rank", "pid", "world_size"):
            entry[name] = _int_or_none(raw.get(name))
        for name in _TOPO_KEYS:
            entry[name] = _int_or_none(raw.get(name, topo.get(name)))
        if raw.get("run"):
            entry["run"] = str(raw["run"])
        out[rank] = entry
    return out


@dataclass
class _Rank:
    key: str
    rank: int | None
    pid: int | None
    node: str | None
    info: dict[str, Any]
    # one dict per sample: role -> (sorted thread signatures, the threads' raw frame lists, from
    # which the exact fingerprint is computed only when a rank has several samples)
    samples: list[dict[str, tuple[tuple[tuple[str, ...], ...], list[Any]]]] = field(
        default_factory=list)
    idle_main: list[bool] = field(default_factory=list)
    first_frames: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    verdicts: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)

    def ident(self) -> int | str:
        return self.rank if self.rank is not None else f"pid:{self.pid}@{self.node or '?'}"


def analyse(dumps: list[dict[str, Any]],
            rank_info: Mapping[Any, Mapping[str, Any]] | list[Mapping[str, Any]] | None = None,
            *, min_share: float = 0.25, hang_fraction: float = 0.75,
            all_threads: bool = False) -> dict[str, Any]:
    """Group rank stacks and name the outliers of a hung job; see the module docstring.

    `dumps`: one dict per rank per sample, `{pid, threads, error}` plus, where known, `rank`,
    `run`, `node` and `source` (where it came from); or whole `/debug/stacks` answers of sidecars,
    `{node, ranks: [...]}`, whose entries take the answer's node. Several dicts for the same rank
    are successive samples, in list order. `rank_info`: `{rank: {node, local_rank, pid, world_size,
    dp_rank, pp_rank, tp_rank}}` (labels of `robust_rank_info`), or a list of such dicts with a
    `rank` each; it names the ranks of pid-only dumps, maps suspects to nodes and parallel groups
    and lists the ranks that sent nothing.

    Returns a JSON-ready dict: `suspects` (one dict per suspect rank: `rank`, `node`, `pid`,
    `local_rank`, `dp_rank`, `pp_rank`, `tp_rank`, `roles`, `reasons`, `signatures`, `ident`),
    `suspect_ranks` (their ranks; `pid:P@node` where the rank is unknown), `nodes` (nodes of the
    suspects), `groups` (`role`, `signature` innermost frame first, `ranks`, `count`, `healthy`,
    `state`), `hung`, `topology`, `missing_ranks`, `errors` and `notes`.
    """
    if not 0 < min_share <= 1:
        raise ValueError(f"min_share={min_share!r}: must be in (0, 1]")
    if not 0 < hang_fraction <= 1:
        raise ValueError(f"hang_fraction={hang_fraction!r}: must be in (0, 1]")
    if not isinstance(dumps, list):
        raise ValueError("dumps must be a list of {pid, threads, error} dicts")
    # millions of small tuples for a large job: the cyclic GC would rescan them all repeatedly
    # and there are no cycles to find, so it is paused for the call (as torch's FR loader does)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _analyse(dumps, rank_info, min_share, hang_fraction, all_threads)
    finally:
        if was_enabled:
            gc.enable()


def _analyse(dumps: list[Any], rank_info: Any, min_share: float, hang_fraction: float,
             all_threads: bool) -> dict[str, Any]:
    dumps = _flatten_sidecar_answers(dumps)
    info = normalise_rank_info(rank_info)
    by_pid: dict[tuple[str | None, int], int] = {}
    for rank, entry in info.items():
        if entry["pid"] is not None:
            by_pid[(entry["node"], entry["pid"])] = rank
            by_pid.setdefault((None, entry["pid"]), rank)
    runs = {str(d["run"]) for d in dumps if isinstance(d, Mapping) and d.get("run")}
    if len(runs) > 1:
        raise ValueError(f"dumps of several runs ({', '.join(sorted(runs))}): analyse one run")
    frame = _FrameCache()
    ranks: dict[str, _Rank] = {}
    errors: list[dict[str, Any]] = []
    seen_errors: set[tuple[Any, ...]] = set()
    for i, dump in enumerate(dumps):
        if not isinstance(dump, Mapping):
            raise ValueError(f"dumps[{i}] is {type(dump).__name__}, not a dict")
        state = _rank_of(dump, info, by_pid, ranks)
        problem = dump.get("error") or (_malformed_threads(dump.get("threads"))
                                        if dump.get("threads") else "no Python threads in the dump")
        if problem:
            error = {"rank": state.rank, "pid": state.pid, "node": state.node,
                     "source": dump.get("source"), "error": str(problem)}
            seen = tuple(error.values())
            if seen not in seen_errors:  # the same failure in every sample is one error
                seen_errors.add(seen)
                errors.append(error)
            continue
        _add_sample(state, dump, frame)
    analysed = [r for r in ranks.values() if r.samples]
    report = _group(analysed, info, min_share, hang_fraction, all_threads)
    report["run"] = next(iter(runs), None) or next(
        (e["run"] for e in info.values() if e.get("run")), None)
    seen = {r.rank for r in ranks.values() if r.rank is not None}
    world = max((e["world_size"] or 0 for e in info.values()), default=0)
    expected = set(range(world)) if world else set(info)
    report["missing_ranks"] = sorted(expected - seen)
    failed = {e["rank"] for e in errors if e["rank"] is not None} - {
        r.rank for r in analysed if r.rank is not None}
    report["errors"] = errors
    if report["missing_ranks"]:
        report["notes"].append(f"{len(report['missing_ranks'])} rank(s) sent no dump: "
                               f"{_short(report['missing_ranks'])}")
    if failed:
        report["notes"].append(f"{len(failed)} rank(s) could not be dumped (see errors): "
                               f"{_short(sorted(failed))}; a rank that died can be the cause")
    return report


def _flatten_sidecar_answers(dumps: list[Any]) -> list[Any]:
    """`{node, ranks: [...]}` answers of `/debug/stacks` into per-rank dicts carrying the node."""
    if not any(isinstance(d, Mapping) and "ranks" in d and "threads" not in d for d in dumps):
        return dumps
    out: list[Any] = []
    for i, d in enumerate(dumps):
        if not (isinstance(d, Mapping) and "ranks" in d and "threads" not in d):
            out.append(d)
            continue
        if not isinstance(d["ranks"], list):
            raise ValueError(f"dumps[{i}]: `ranks` must be a list")
        for entry in d["ranks"]:
            if isinstance(entry, Mapping):
                entry = dict(entry)
                entry.setdefault("node", d.get("node"))
                if not entry.get("node"):
                    entry["node"] = d.get("node")
            out.append(entry)
    return out


def _rank_of(dump: Mapping[str, Any], info: dict[int, dict],
             by_pid: dict[tuple[str | None, int], int], ranks: dict[str, _Rank]) -> _Rank:
    pid = _int_or_none(dump.get("pid"))
    node = str(dump["node"]) if dump.get("node") else None
    rank = _int_or_none(dump.get("rank"))
    if rank is None and pid is not None:
        rank = by_pid.get((node, pid))
        if rank is None:
            candidate = by_pid.get((None, pid))
            if candidate is not None and info[candidate]["node"] in (None, node):
                rank = candidate
    entry = info.get(rank, {}) if rank is not None else {}
    node = node or entry.get("node")
    key = f"rank:{rank}" if rank is not None else f"pid:{pid}@{node}"
    state = ranks.get(key)
    if state is None:
        state = ranks[key] = _Rank(key, rank, pid if pid is not None else entry.get("pid"), node,
                                   entry)
    return state


def _malformed_threads(threads: Any) -> str | None:
    """Why a dump's `threads` is not py-spy's shape, or None. A sidecar answer is data from
    another machine: one malformed rank is that rank's error, not the end of the analysis."""
    if not isinstance(threads, list):
        return f"malformed dump: threads is {type(threads).__name__}, not a list"
    for thread in threads:
        if not isinstance(thread, Mapping):
            return "malformed dump: a thread is not an object"
        frames = thread.get("frames") or []
        if not isinstance(frames, list) or not all(
                isinstance(f, Mapping) and isinstance(f.get("function"), str | None)
                and isinstance(f.get("file"), str | None) for f in frames):
            return "malformed dump: a thread's frames are not [{function, file, line}]"
    return None


def _add_sample(state: _Rank, dump: Mapping[str, Any], frame: _FrameCache) -> None:
    by_role: dict[str, list[tuple[str, ...]]] = {}
    raw: dict[str, list[Any]] = {}
    idle_main = True
    for thread in dump["threads"]:
        frames = thread.get("frames") or []
        sig = frame.signature(frames)
        role = thread_role(thread, sig, state.pid)
        if role in by_role:
            by_role[role].append(sig)
            raw[role].append(frames)
        else:
            by_role[role] = [sig]
            raw[role] = [frames]
        if role == "main":
            idle_main = idle_main and bool(thread.get("idle"))
        if role not in state.first_frames:
            state.first_frames[role] = frames
    state.samples.append({role: (tuple(sorted(sigs)) if len(sigs) > 1 else (sigs[0],),
                                 raw[role]) for role, sigs in by_role.items()})
    state.idle_main.append(idle_main)


def _fingerprint(threads: list[Any]) -> tuple[Any, ...]:
    """What changes while a rank makes progress in the same code: lines and locals."""
    out = []
    for frames in threads:
        lines = tuple([f.get("line") for f in frames])
        found = [f.get("locals") for f in frames]
        if any(found):
            out.append((lines, tuple(
                tuple(sorted((str(k), str(v)) for k, v in loc.items()))
                if isinstance(loc, dict) else None for loc in found)))
        else:
            out.append((lines,))
    return tuple(sorted(out, key=repr)) if len(out) > 1 else tuple(out)


def _role_signature(state: _Rank, role: str) -> tuple[tuple[str, ...], str]:
    """The rank's signature for a role over its samples, and its state: `single` (one sample),
    `stuck` (identical), `busy` (same functions, other lines or locals), `progressing`."""
    found = state.verdicts.get(role)
    if found is None:
        found = state.verdicts[role] = _verdict(state, role)
    return found


def _verdict(state: _Rank, role: str) -> tuple[tuple[str, ...], str]:
    values = [s.get(role) for s in state.samples]
    first = values[0]
    if len(values) == 1 and first is not None:
        return _flatten(first[0]), "single"
    if first is None or any(v is None for v in values):
        return (ABSENT,), "progressing"
    if any(v[0] != first[0] for v in values[1:]):
        return (PROGRESSING,), "progressing"
    exact = _fingerprint(first[1])
    if all(_fingerprint(v[1]) == exact for v in values[1:]):
        return _flatten(first[0]), "stuck"
    return _flatten(first[0]), "busy"


def _flatten(sigs: tuple[tuple[str, ...], ...] | None) -> tuple[str, ...]:
    """One thread: its frames. Several threads in one role: their stacks, separated."""
    if not sigs:
        return (ABSENT,)
    if len(sigs) == 1:
        return sigs[0]
    out: list[str] = []
    for i, sig in enumerate(sigs):
        out.append(f"--- thread {i + 1} of {len(sigs)} ---")
        out.extend(sig)
    return tuple(out)


def _group(analysed: list[_Rank], info: dict[int, dict], min_share: float, hang_fraction: float,
           all_threads: bool) -> dict[str, Any]:
    notes: list[str] = []
    multi = [r for r in analysed if len(r.samples) > 1]
    stuck_main = [r for r in multi if _role_signature(r, "main")[1] == "stuck"]
    hung: bool | None = None
    if multi:
        hung = len(stuck_main) >= hang_fraction * len(multi)
        lone = None if hung else _lone_mover(multi, stuck_main)
        if lone is not None:
            hung = True
            notes.append(f"job hung: every rank but {lone.ident()} kept the same stack in a "
                         f"collective over all samples while {lone.ident()} moved")
        elif not hung:
            notes.append(f"job is progressing: only {len(stuck_main)} of {len(multi)} ranks kept "
                         f"the same main-thread stack over their samples; no suspects named")
    elif analysed:
        notes.append("one sample per rank: the caller asserts the job is hung")
    pp_values = {e["pp_rank"] for e in info.values() if e.get("pp_rank") is not None}
    partition_by_pp = len(pp_values) > 1

    # (partition, role) -> signature -> [ranks]
    table: dict[tuple[int | None, str], dict[tuple[str, ...], list[_Rank]]] = defaultdict(
        lambda: defaultdict(list))
    states: dict[tuple[int | None, str, tuple[str, ...]], set[str]] = defaultdict(set)
    for r in analysed:
        part = r.info.get("pp_rank") if partition_by_pp else None
        roles = {role for s in r.samples for role in s}
        for role in roles:
            sig, state = _role_signature(r, role)
            table[(part, role)][sig].append(r)
            states[(part, role, sig)].add(state)

    groups: list[dict[str, Any]] = []
    suspects: dict[str, dict[str, Any]] = {}
    for (part, role), by_sig in table.items():
        n = sum(len(v) for v in by_sig.values())
        healthy, how = _healthy_signatures(by_sig, n, min_share)
        explained = _explain(role, how, by_sig, healthy, hung)
        if explained:
            notes.append(explained if part is None else f"pp {part}: {explained}")
        decides = role in CORE_ROLES or all_threads
        for sig, members in by_sig.items():
            is_healthy = sig in healthy
            state = "/".join(sorted(states[(part, role, sig)]))
            group = {"role": role, "signature": list(sig), "ranks": _idents(members),
                     "count": len(members), "healthy": is_healthy, "state": state}
            if part is not None:
                group["pp_rank"] = part
            groups.append(group)
            if is_healthy or not decides or hung is False:
                continue
            if role != "main" and sig in ((PROGRESSING,), (ABSENT,)):
                continue  # a helper thread that moves or comes and goes does not hold the job
            for r in members:
                entry = suspects.setdefault(r.key, _suspect(r))
                entry["roles"].append(role)
                entry["signatures"][role] = list(sig)
                entry["reasons"].append(_reason(role, sig, by_sig, healthy))
    groups.sort(key=lambda g: (g.get("pp_rank") or 0, _role_order(g["role"]), -g["count"]))
    details = sorted(suspects.values(), key=lambda s: (s["rank"] is None, s["rank"] or 0,
                                                       str(s["pid"])))
    nodes = sorted({s["node"] for s in details if s["node"]})
    return {
        "hung": hung,
        "samples": max((len(r.samples) for r in analysed), default=0),
        "ranks_analysed": len(analysed),
        "stable_ranks": sorted(_idents(stuck_main), key=str),
        "suspects": details,
        "suspect_ranks": [s["ident"] for s in details],
        "nodes": nodes,
        "groups": groups,
        "topology": _topology(details, info),
        "notes": notes,
    }


def _healthy_signatures(by_sig: Mapping[tuple[str, ...], list[_Rank]], n: int,
                        min_share: float) -> tuple[set[tuple[str, ...]], str]:
    """The healthy signatures of one role, and by which rule: `share` (enough ranks, or the
    single largest group), `waiting` (nobody dominates; the groups in torch.distributed),
    `implicit` (nobody dominates or visibly waits; the groups inside backward or DDP's forward,
    where DDP waits in C++), `tie` (several groups, none of which can be told to wait: all are
    healthy, nobody is named) or `alone` (one group)."""
    sizes = {sig: len(members) for sig, members in by_sig.items()}
    if len(sizes) == 1:
        return set(sizes), "alone"
    floor = max(2, math.ceil(min_share * n))
    healthy = {sig for sig, size in sizes.items() if size >= floor}
    largest = max(sizes.values())
    top = [sig for sig, size in sizes.items() if size == largest]
    if len(top) == 1:
        healthy.add(top[0])
    if healthy:
        return healthy, "share"
    for test, how in ((_is_waiting, "waiting"), (_may_wait, "implicit")):
        healthy = {sig for sig in sizes if test(sig)}
        if healthy:  # the first rule that finds waiting ranks decides
            return (healthy, how) if len(healthy) < len(sizes) else (set(sizes), "tie")
    # nobody dominates and nobody (or everybody) waits: every rank looks alike, name none
    return set(sizes), "tie"


def _lone_mover(multi: list[_Rank], stuck_main: list[_Rank]) -> _Rank | None:
    """The one rank whose main stack moved while every other rank kept the same stack, locals
    included, inside a collective (visibly, or inside backward where DDP waits), or None. In a
    job of 2 or 3 ranks a culprit that computes keeps the stuck share under `hang_fraction`;
    this is that case."""
    moving = [r for r in multi if r not in stuck_main]
    if len(multi) < 2 or len(moving) != 1:
        return None
    if _is_waiting(_role_signature(moving[0], "main")[0]):
        return None  # it moves through collectives: the others are not waiting for it
    if not all(any(f.get("locals") for f in r.first_frames.get("main", [])) for r in stuck_main):
        return None  # without locals a healthy rank in the same collective each step looks stuck
    if all(_is_waiting(sig) or _may_wait(sig)
           for sig in (_role_signature(r, "main")[0] for r in stuck_main)):
        return moving[0]
    return None


def _explain(role: str, how: str, by_sig: Mapping[tuple[str, ...], list[_Rank]],
             healthy: set[tuple[str, ...]], hung: bool | None) -> str | None:
    """A note on a main-thread verdict that the groups alone do not explain: a culprit named
    on weaker evidence (`implicit`), or why nobody could be named in a hung job."""
    if role != "main" or hung is False:
        return None
    if how == "implicit":
        ranks = _short([i for sig in healthy for i in _idents(by_sig[sig])])
        return (f"rank(s) {ranks} taken as waiting for the others: their main thread is inside "
                "backward() or DDP's forward, where DistributedDataParallel waits for its "
                "collectives in C++ with no Python frame of torch.distributed; a rank stuck in a "
                "kernel there looks the same (--native shows c10d frames of the waiting ranks)")
    if how == "tie":
        if all(map(_is_waiting, by_sig)):
            which = "every one of them waiting in a collective"
        elif all(map(_may_wait, by_sig)):
            which = "every one of them inside backward() or DDP's forward"
        else:
            which = "none of them waiting in a collective"
        return (f"no suspect: the main threads are in {len(by_sig)} places, none shared by "
                f"enough ranks and {which}, so the stacks cannot tell the culprit from the "
                "ranks waiting for it (--native shows C/C++ frames)")
    if how == "alone":
        (sig,) = by_sig
        n = len(by_sig[sig])
        where = sig[0] if sig else "?"
        if n < 2:
            return None
        if _is_waiting(sig):
            return (f"no suspect: all {n} ranks wait in the same place ({where}); a culprit "
                    "that waits where the others wait (a network fault, a collective one rank "
                    "never issued) is not visible in stacks: see --flight-recorder and the "
                    "sidecar's NCCL RAS metrics")
        if _may_wait(sig):
            return (f"no suspect: all {n} ranks are in {where}, where DDP waits for its gradient "
                    "all-reduce in C++; a rank stuck in a kernel there looks the same as the "
                    "ranks waiting for it (--native shows c10d frames of the waiting ranks)")
        return f"no suspect: all {n} ranks are in the same place ({where}); nobody is elsewhere"
    return None


def _reason(role: str, sig: tuple[str, ...], by_sig: Mapping[tuple[str, ...], list[_Rank]],
            healthy: set[tuple[str, ...]]) -> str:
    where = sig[0] if sig else "?"
    others = max(healthy, key=lambda s: len(by_sig[s]), default=None)
    if sig == (PROGRESSING,):
        text = f"{role} thread still moving while the others are stuck"
    else:
        text = f"{role} thread in {where}"
    if others is not None and others != sig:
        text += f"; {len(by_sig[others])} rank(s) are in {others[0] if others else '?'}"
    return text


def _suspect(r: _Rank) -> dict[str, Any]:
    entry: dict[str, Any] = {"ident": r.ident(), "rank": r.rank, "pid": r.pid, "node": r.node,
                             "roles": [], "reasons": [], "signatures": {},
                             "main_idle": all(r.idle_main) if r.idle_main else None}
    for name in ("local_rank", *_TOPO_KEYS):
        entry[name] = r.info.get(name)
    if r.samples and "main" in r.first_frames:
        entry["main_frames"] = [{"function": f.get("function"), "file": f.get("file"),
                                 "line": f.get("line")} for f in r.first_frames["main"][:12]]
    return entry


def _topology(details: list[dict[str, Any]], info: dict[int, dict]) -> dict[str, list[dict]]:
    """For each parallel dimension, the groups that hold a suspect: their ranks and suspects."""
    out: dict[str, list[dict]] = {}
    for kind, shared in _GROUP_KINDS.items():
        wanted: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for s in details:
            if s["rank"] is None or s.get(kind + "_rank") is None:
                continue
            key = tuple(s.get(k) for k in shared)
            if None not in key:
                wanted[key].append(s["rank"])  # type: ignore[arg-type]
        if not wanted:
            continue
        members: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for rank, e in info.items():
            key = tuple(e.get(k) for k in shared)
            if key in wanted:
                members[key].append(rank)
        out[kind] = [{"key": dict(zip(shared, key, strict=True)), "ranks": sorted(members[key]),
                      "suspects": sorted(sus)} for key, sus in sorted(wanted.items())]
    return out


def _idents(members: Iterable[_Rank]) -> list[int | str]:
    known = sorted(r.rank for r in members if r.rank is not None)
    unknown = sorted(str(r.ident()) for r in members if r.rank is None)
    return [*known, *unknown]


def _role_order(role: str) -> tuple[int, str]:
    return (CORE_ROLES.index(role) if role in CORE_ROLES else len(CORE_ROLES), role)


def _short(values: list[Any], limit: int = 20) -> str:
    text = ", ".join(str(v) for v in values[:limit])
    return text + (f" and {len(values) - limit} more" if len(values) > limit else "")
