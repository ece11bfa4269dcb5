"""Stack grouping (`robust_metrics.analysis.stacks.analyse`) on hand-built dumps.

The real-process scenarios live in integration/test_stacks_ranks.py; these pin down the rules:
normalisation, thread roles, the healthy-group rule, samples, input forms and the mapping to nodes
and groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from robust_metrics.analysis.stacks import (
    PROGRESSING,
    analyse,
    normalise_file,
    normalise_frame,
    normalise_rank_info,
    thread_role,
)

SITE = "/opt/venv{n}/lib/python3.11/site-packages"
ALL_REDUCE = [("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 3252),
              ("sync_gradients", "/job/train.py", 57), ("main", "/job/train.py", 94)]
LOAD = [("_read_from_slow_storage", "/job/train.py", 30), ("load_batch", "/job/train.py", 35),
        ("main", "/job/train.py", 88)]
SAVE = [("_flush", "/job/train.py", 44), ("save_checkpoint", "/job/train.py", 48),
        ("main", "/job/train.py", 99)]


def thread(frames: list[tuple[str, str, int]], name: str = "MainThread", *, node: int = 0,
           locals_: dict[str, str] | None = None, idle: bool = True) -> dict:
    return {"thread_id": 1, "os_thread_id": None, "thread_name": name, "idle": idle,
            "frames": [{"function": f, "file": path.format(n=node), "line": line,
                        **({"locals": locals_} if locals_ is not None else {})}
                       for f, path, line in frames]}


def dump(rank: int, *threads: dict, node: str | None = None, error: str | None = None) -> dict:
    return {"run": "r1", "rank": rank, "pid": 1000 + rank, "node": node,
            "threads": list(threads), "error": error}


def info(n: int, per_node: int = 2, **topo: object) -> dict[int, dict]:
    return {r: {"node": f"node{r // per_node}", "pid": str(1000 + r), "world_size": str(n),
                "local_rank": str(r % per_node), **{k: str(f(r)) for k, f in topo.items()}}
            for r in range(n)}


def test_frames_normalise_without_lines_addresses_or_venv_paths() -> None:
    assert normalise_file("/opt/venv1/lib/python3.11/site-packages/torch/nn/modules/module.py") \
        == "torch/nn/modules/module.py"
    assert normalise_file("/usr/lib/python3.12/threading.py") == "threading.py"
    assert normalise_file("/home/alice/job/train.py") == "train.py"
    assert normalise_frame("0x7fa35124524a", "/usr/lib/x86_64-linux-gnu/libc.so.6") \
        == "0x? (libc.so.6)"
    a = normalise_frame("all_reduce", SITE.format(n=1) + "/torch/distributed/distributed_c10d.py")
    b = normalise_frame("all_reduce", SITE.format(n=2) + "/torch/distributed/distributed_c10d.py")
    assert a == b


def test_thread_roles() -> None:
    assert thread_role({"thread_name": "MainThread"}, []) == "main"
    assert thread_role({"thread_name": "Thread-7", "os_thread_id": 42}, [], pid=42) == "main"
    pin = ["_pin_memory_loop (torch/utils/data/_utils/pin_memory.py)"]
    assert thread_role({"thread_name": "Thread-3 (_pin_memory_loop)"}, pin) == "dataloader"
    dcp = ["save (torch/distributed/checkpoint/state_dict_saver.py)"]
    assert thread_role({"thread_name": "Thread-9"}, dcp) == "checkpoint"
    assert thread_role({"thread_name": "AsyncCkptWriter"}, []) == "checkpoint"
    assert thread_role({"thread_name": "Thread-12 (flush)"}, []) == "other:Thread-N (flush)"


def test_one_rank_elsewhere_is_named_with_its_node_and_groups() -> None:
    dumps = [dump(r, thread(LOAD if r == 5 else ALL_REDUCE, node=r)) for r in range(8)]
    topo = info(8, per_node=4, dp_rank=lambda r: r // 2, tp_rank=lambda r: r % 2,
                pp_rank=lambda r: 0)
    report = analyse(dumps, topo)
    assert report["suspect_ranks"] == [5]
    assert report["nodes"] == ["node1"]
    (s,) = report["suspects"]
    assert (s["rank"], s["node"], s["pid"], s["dp_rank"], s["tp_rank"]) == (5, "node1", 1005, 2, 1)
    assert s["roles"] == ["main"]
    assert "_read_from_slow_storage (train.py)" in s["reasons"][0]
    assert report["hung"] is None  # one sample: the caller asserts the hang
    main = {tuple(g["ranks"]): g for g in report["groups"] if g["role"] == "main"}
    assert main[(0, 1, 2, 3, 4, 6, 7)]["healthy"] and not main[(5,)]["healthy"]
    assert main[(5,)]["signature"][0] == "_read_from_slow_storage (train.py)"
    # the tensor-parallel group of rank 5 is dp 2 (ranks 4, 5); its data-parallel group is tp 1
    tp = report["topology"]["tp"]
    assert tp == [{"key": {"dp_rank": 2, "pp_rank": 0}, "ranks": [4, 5], "suspects": [5]}]
    assert report["topology"]["dp"][0]["ranks"] == [1, 3, 5, 7]


def test_everyone_in_the_same_collective_names_nobody() -> None:
    report = analyse([dump(r, thread(ALL_REDUCE, node=r)) for r in range(4)], info(4))
    assert report["suspects"] == [] and report["nodes"] == []
    assert [g["count"] for g in report["groups"]] == [4]


def test_two_ranks_in_two_places_are_both_named() -> None:
    stacks = {1: LOAD, 2: SAVE}
    dumps = [dump(r, thread(stacks.get(r, ALL_REDUCE))) for r in range(4)]
    report = analyse(dumps, info(4))
    assert report["suspect_ranks"] == [1, 2]
    assert report["nodes"] == ["node0", "node1"]


def test_two_ranks_waiting_beat_two_ranks_elsewhere_when_nobody_dominates() -> None:
    # 2 ranks: no majority; the one waiting in torch.distributed is taken as healthy
    report = analyse([dump(0, thread(ALL_REDUCE)), dump(1, thread(LOAD))], info(2))
    assert report["suspect_ranks"] == [1]
    # 3 ranks in 3 places, none waiting: no basis to name anyone
    report = analyse([dump(0, thread(LOAD)), dump(1, thread(SAVE)),
                      dump(2, thread([("spin", "/job/train.py", 1)]))], info(3))
    assert report["suspects"] == []


def test_large_minority_groups_count_as_healthy() -> None:
    # half the ranks legitimately run other code (e.g. an eval branch): not outliers
    dumps = [dump(r, thread(ALL_REDUCE if r % 2 else SAVE)) for r in range(8)]
    assert analyse(dumps, info(8))["suspects"] == []


def test_helper_threads_do_not_decide_unless_asked() -> None:
    helper = [("wait", "/usr/lib/python3.11/threading.py", 1), ("run", "/job/flush.py", 3)]
    odd = [("write", "/job/flush.py", 9), ("run", "/job/flush.py", 3)]
    dumps = [dump(r, thread(ALL_REDUCE), thread(odd if r == 3 else helper, "Thread-2 (flush)"))
             for r in range(4)]
    assert analyse(dumps, info(4))["suspects"] == []
    report = analyse(dumps, info(4), all_threads=True)
    assert report["suspect_ranks"] == [3]
    assert report["suspects"][0]["roles"] == ["other:Thread-N (flush)"]


def test_samples_tell_a_progressing_job_from_a_hung_one() -> None:
    # healthy: every rank enters the same all_reduce each step, but its step counter moves
    healthy = [dump(r, thread(ALL_REDUCE, locals_={"step": str(step)}))
               for step in range(3) for r in range(4)]
    report = analyse(healthy, info(4))
    assert report["hung"] is False and report["suspects"] == []
    assert {g["state"] for g in report["groups"]} == {"busy"}
    # a healthy job with one rank caught in data loading in one sample: still not hung
    moving = [dump(r, thread(LOAD if (r, step) == (2, 1) else ALL_REDUCE,
                             locals_={"step": str(step)}))
              for step in range(3) for r in range(4)]
    assert analyse(moving, info(4))["suspects"] == []
    # hung: identical stacks; the culprit is the one elsewhere
    hung = [dump(r, thread(LOAD if r == 2 else ALL_REDUCE, locals_={"step": "7"}))
            for _ in range(3) for r in range(4)]
    report = analyse(hung, info(4))
    assert report["hung"] is True and report["suspect_ranks"] == [2]
    assert report["stable_ranks"] == [0, 1, 2, 3]


def test_a_checkpoint_thread_that_comes_and_goes_names_nobody() -> None:
    ckpt = [("write", f"{SITE}/torch/distributed/checkpoint/filesystem.py", 5)]
    # ranks 0, 2, 3 have a checkpoint writer in every sample; rank 1's finished after sample 0
    dumps = [dump(r, thread(ALL_REDUCE, locals_={}),
                  *([thread(ckpt, "Thread-4", locals_={})] if r != 1 or s == 0 else []))
             for s in range(3) for r in range(4)]
    report = analyse(dumps, info(4))
    assert report["hung"] is True and report["suspects"] == []
    groups = {tuple(g["ranks"]): g for g in report["groups"] if g["role"] == "checkpoint"}
    assert groups[(1,)]["state"] == "progressing" and not groups[(1,)]["healthy"]
    assert groups[(0, 2, 3)]["state"] == "stuck" and groups[(0, 2, 3)]["healthy"]


def test_a_rank_still_running_other_code_in_a_hung_job_is_named() -> None:
    spin = [[("compute_a", "/job/x.py", 1)], [("compute_b", "/job/x.py", 2)],
            [("compute_a", "/job/x.py", 1)]]
    dumps = [dump(r, thread(spin[s] if r == 3 else ALL_REDUCE, locals_={}))
             for s in range(3) for r in range(4)]
    report = analyse(dumps, info(4))
    assert report["hung"] is True and report["suspect_ranks"] == [3]
    assert report["suspects"][0]["signatures"]["main"] == [PROGRESSING]


def test_pipeline_stages_are_compared_within_their_stage() -> None:
    # stage 0 waits in all_reduce, stage 1 in load_batch (legitimately); rank 6 is the outlier
    def stack(r: int) -> list:
        if r == 6:
            return SAVE
        return ALL_REDUCE if r < 4 else LOAD

    topo = info(8, pp_rank=lambda r: r // 4, dp_rank=lambda r: r % 4, tp_rank=lambda r: 0)
    report = analyse([dump(r, thread(stack(r))) for r in range(8)], topo)
    assert report["suspect_ranks"] == [6]
    assert {g["pp_rank"] for g in report["groups"]} == {0, 1}
    assert report["topology"]["pp"] == [{"key": {"dp_rank": 2, "tp_rank": 0}, "ranks": [2, 6],
                                         "suspects": [6]}]


def test_sidecar_answers_pid_only_dumps_and_list_rank_info() -> None:
    answers = [
        {"node": "a", "ranks": [{"run": "r1", "rank": str(r), "pid": 1000 + r, "error": None,
                                 "threads": [thread(LOAD if r == 1 else ALL_REDUCE)]}
                                for r in (0, 1)]},
        {"node": "b", "ranks": [{"run": "r1", "rank": str(r), "pid": 1000 + r, "error": None,
                                 "threads": [thread(ALL_REDUCE)]} for r in (2, 3)]},
    ]
    # the bridge passes rank info as a list of label dicts
    listed = [{"run": "r1", "rank": str(r), "pid": 1000 + r, "node": "ab"[r // 2]}
              for r in range(4)]
    report = analyse(answers, listed)
    assert report["suspect_ranks"] == [1] and report["nodes"] == ["a"]
    # pid-only dumps (local py-spy) are named through rank_info's pid
    pid_only = [{"pid": 1000 + r, "threads": [thread(LOAD if r == 3 else ALL_REDUCE)],
                 "error": None} for r in range(4)]
    report = analyse(pid_only, info(4))
    assert report["suspect_ranks"] == [3] and report["nodes"] == ["node1"]
    # without any rank info the suspect is named by pid
    report = analyse(pid_only)
    assert report["suspect_ranks"] == ["pid:1003@?"]


def test_failed_dumps_and_silent_ranks_are_reported_and_the_rest_analysed() -> None:
    dumps = [dump(r, thread(LOAD if r == 2 else ALL_REDUCE)) for r in range(4)]
    dumps[0] = dump(0, error="no such process 1000")
    dumps.append({"pid": None, "threads": [], "error": "sidecar: cannot reach http://x:1",
                  "source": "http://x:1/debug/stacks"})
    dumps = dumps + dumps  # two samples: each failure is reported once
    report = analyse(dumps, info(6))
    assert report["suspect_ranks"] == [2]
    assert report["ranks_analysed"] == 3
    assert [e["error"] for e in report["errors"]] == ["no such process 1000",
                                                     "sidecar: cannot reach http://x:1"]
    assert report["missing_ranks"] == [4, 5]
    assert any("could not be dumped" in n for n in report["notes"])


def test_bad_input_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="several runs"):
        analyse([{**dump(0, thread(LOAD)), "run": "a"}, {**dump(1, thread(LOAD)), "run": "b"}])
    with pytest.raises(ValueError, match="not a dict"):
        analyse(["nonsense"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="min_share"):
        analyse([], min_share=0)
    with pytest.raises(ValueError, match="rank_info"):
        normalise_rank_info("rank 0 is on node a")  # type: ignore[arg-type]
    assert analyse([])["suspects"] == []


# -- 2-rank hangs -----------------------------------------------------------------------------
# Real py-spy dumps (3 rounds, with locals) of tests/stacks_train.py run as 2 gloo ranks with
# --ddp: rank 1 blocked sleeping in load_batch (ddp-2-sleep) or computing forever there
# (ddp-2-compute); rank 0 waits for DDP's gradient all-reduce, which happens in C++ at the end of
# backward(), so its Python stack shows backward and no torch.distributed frame.
RECORDED = Path(__file__).parent / "fixtures" / "stacks"
BACKWARD = [("_engine_run_backward", f"{SITE}/torch/autograd/graph.py", 769),
            ("backward", f"{SITE}/torch/autograd/__init__.py", 289),
            ("Tensor.backward", f"{SITE}/torch/_tensor.py", 525), ("main", "/job/train.py", 90)]


def recorded(name: str) -> list[dict]:
    return json.loads((RECORDED / f"{name}.json").read_text())


@pytest.mark.parametrize("name", ["ddp-2-sleep", "ddp-2-compute"])
def test_two_rank_ddp_hang_names_the_rank_outside_backward(name: str) -> None:
    dumps = recorded(name)
    report = analyse(dumps)
    assert report["hung"] is True, report["notes"]
    assert report["suspect_ranks"] == [1]
    assert report["suspects"][0]["signatures"]["main"][0] in (
        "_read_from_slow_storage (stacks_train.py)", "_retry_bad_batch (stacks_train.py)")
    assert any("rank(s) 0 taken as waiting" in n for n in report["notes"])
    main = {tuple(g["ranks"]): g for g in report["groups"] if g["role"] == "main"}
    assert main[(0,)]["healthy"] and main[(0,)]["signature"][0] == (
        "_engine_run_backward (torch/autograd/graph.py)")
    # the bridge dumps once, after a hang alert: the same verdict from one round
    report = analyse(dumps[:2])
    assert report["hung"] is None and report["suspect_ranks"] == [1]


def test_a_computing_culprit_needs_locals_to_call_a_two_rank_job_hung() -> None:
    dumps = recorded("ddp-2-compute")
    report = analyse(dumps)
    assert report["hung"] is True
    assert any("every rank but 1 kept the same stack" in n for n in report["notes"])
    # without locals a healthy rank that enters the same backward every step looks stuck too:
    # one moving rank is then no evidence of a hang
    for d in dumps:
        for t in d["threads"] if d["rank"] == "0" else []:
            for f in t["frames"]:
                f.pop("locals", None)
    report = analyse(dumps)
    assert report["hung"] is False and report["suspects"] == []


def test_native_c10d_frames_count_as_waiting() -> None:
    native = [("pthread_cond_wait", "/lib/libc.so.6", 0),
              ("c10d::Reducer::finalize_backward", f"{SITE}/torch/lib/libtorch_cpu.so", 0),
              *BACKWARD]
    report = analyse([dump(0, thread(native)), dump(1, thread(LOAD))], info(2))
    assert report["suspect_ranks"] == [1]
    assert not any("taken as waiting" in n for n in report["notes"])  # seen, not inferred


def test_when_nobody_can_be_named_the_report_says_why() -> None:
    # both ranks inside backward: the one stuck in a kernel looks like the one waiting for it
    report = analyse([dump(r, thread(BACKWARD)) for r in range(2)], info(2))
    assert report["suspects"] == []
    assert any(n.startswith("no suspect: all 2 ranks are in _engine_run_backward") and
               "--native" in n for n in report["notes"])
    # all in the same collective: invisible in stacks, the flight recorder may tell
    report = analyse([dump(r, thread(ALL_REDUCE)) for r in range(2)], info(2))
    assert any("all 2 ranks wait in the same place" in n and "--flight-recorder" in n
               for n in report["notes"])
    # three places, none waiting
    report = analyse([dump(0, thread(LOAD)), dump(1, thread(SAVE)),
                      dump(2, thread([("spin", "/job/train.py", 1)]))], info(3))
    assert report["suspects"] == []
    assert any("in 3 places" in n and "none of them waiting in a collective" in n
               for n in report["notes"])
    # a user frame below backward (a Python hook) is the rank's own code, not DDP's wait
    hook = [("_sleep_in_backward", "/job/train.py", 12), *BACKWARD]
    report = analyse([dump(0, thread(BACKWARD)), dump(1, thread(hook))], info(2))
    assert report["suspect_ranks"] == [1]
