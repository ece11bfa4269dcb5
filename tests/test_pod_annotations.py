"""Checkpoint requests on Kubernetes: a pod annotation, projected into a file by a downward API
volume, read by the hook (robust_metrics/rankfolder/control.py, docs/schedulers.md).

The parser is tested on what the kubelet writes (Go-quoted values) and on what it never would;
the hook on a malformed, huge or odd file (counted, never raised). End to end, with the
`kubernetes` adapter and two real gloo ranks: tests/integration/test_pod_annotations.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import robust_metrics
from robust_metrics.hooks.watch import Watch
from robust_metrics.rankfolder.control import (
    CHECKPOINT_ANNOTATION,
    MAX_ANNOTATIONS_BYTES,
    annotation_request_id,
    parse_downward_annotations,
    read_annotation_request,
)
from tests.hook_models import make_model, train, value
from tests.kube_fakes import go_quote, kubelet_write


def kubelet_file(annotations: dict[str, str]) -> bytes:
    return "".join(f"{k}={go_quote(v)}\n" for k, v in sorted(annotations.items())).encode()


# ---------------------------------------------------------------------- parser
def test_parses_what_the_kubelet_writes() -> None:
    annotations = {
        CHECKPOINT_ANNOTATION: "1764745200123",
        "kubectl.kubernetes.io/last-applied-configuration": '{"a": "b\\\\c"}\n',
        "odd": 'tab\there "quoted" \\ bell\a nul\x00 del\x7f é 日本 \U0001F600 \u2028',
        "empty": "",
    }
    data = kubelet_file(annotations)
    assert b"\\t" in data and b'\\"' in data and b"\\x00" in data and b"\\u2028" in data
    assert parse_downward_annotations(data) == annotations
    assert annotation_request_id(parse_downward_annotations(data)) == 1764745200123
    assert annotation_request_id({"other": "1"}) is None


def test_parses_every_go_escape() -> None:
    text = rb'a="\a\b\f\n\r\t\v\\\"\x41\101\u00e9\U0001F600\'"' + b"\n"
    assert parse_downward_annotations(text) == {"a": "\a\b\f\n\r\t\v\\\"AAé\U0001F600'"}
    # \x bytes that are not UTF-8 do not raise: they become U+FFFD
    assert parse_downward_annotations(b'a="\\xff"') == {"a": "\ufffd"}


@pytest.mark.parametrize("data", [
    b"a=b\n",                          # value not quoted
    b'a="b\n',                         # no closing quote
    b'a="b"c"\n',                      # unescaped quote inside
    b'a="b\\"\n',                      # the closing quote escaped
    b'a="\\q"\n',                      # no such escape
    b'a="\\x4"\n',                     # short hex escape
    b'a="\\ud800"\n',                  # a surrogate
    b'a="\\U00110000"\n',              # beyond Unicode
    b'a="\\777"\n',                    # octal beyond a byte
    b'="x"\n',                         # no key
    b'a b="x"\n',                      # space in the key
    b'\xff\xfe="x"\n',                 # not UTF-8
    b"garbage without equals",
])
def test_malformed_files_raise_valueerror(data: bytes) -> None:
    with pytest.raises(ValueError):
        parse_downward_annotations(data)


@pytest.mark.parametrize("raw", ["", "abc", "-5", "0", "1.5", "١٢٣", str(2**60), " 12",
                                 "9" * 5000])  # int() refuses over 4,300 digits with its own error
def test_a_request_id_that_is_no_id_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match="is not a request id"):
        annotation_request_id({CHECKPOINT_ANNOTATION: raw})


def test_a_huge_file_is_refused_after_a_bounded_read(tmp_path: Path) -> None:
    path = tmp_path / "annotations"
    line = f'{CHECKPOINT_ANNOTATION}="5"\n'.encode()
    path.write_bytes(line + b'pad="' + b"x" * (8 * MAX_ANNOTATIONS_BYTES) + b'"\n')
    started = time.perf_counter()
    with pytest.raises(ValueError, match="more than the"):
        read_annotation_request(str(path))
    assert time.perf_counter() - started < 1.0
    path.write_bytes(line)
    assert read_annotation_request(str(path)).id == 5  # type: ignore[union-attr]


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "annotations"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_annotation_request(str(fifo))


# ---------------------------------------------------------------------- in one process
@pytest.fixture
def handles() -> Iterator[list[Watch]]:
    opened: list[Watch] = []
    yield opened
    for h in opened:
        h.close()


def watched(handles: list[Watch], path: Path, calls: list[int],
            **options: object) -> tuple[Watch, torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = make_model()
    handle = robust_metrics.watch(model, optimizer, backend="null", run="unit", rank=0,
                                  world_size=1, checkpoint=calls.append, checkpoint_signal=None,
                                  control_poll_interval=0, pod_annotations=str(path), **options)
    handles.append(handle)
    return handle, model, optimizer


def errors(handle: Watch) -> float:
    try:
        return value(handle, "robust_hook_errors_total", where="control")
    except KeyError:
        return 0.0


def test_a_new_request_id_checkpoints_once_and_a_bad_file_is_counted(
        tmp_path: Path, handles: list[Watch]) -> None:
    folder = tmp_path / "podinfo"
    kubelet_write(folder, "annotations", kubelet_file({CHECKPOINT_ANNOTATION: "1000"}))
    calls: list[int] = []
    handle, model, optimizer = watched(handles, folder / "annotations", calls)
    train(model, optimizer, 2)
    assert calls == []  # the id the pod had before this process started was for a former one
    kubelet_write(folder, "annotations", kubelet_file({CHECKPOINT_ANNOTATION: "2000"}))
    train(model, optimizer, 3)
    assert calls == [3]
    assert value(handle, "robust_checkpoint_request_id") == 2000
    # the kubelet rewrites the file with the same id (another annotation changed): no checkpoint
    kubelet_write(folder, "annotations", kubelet_file({CHECKPOINT_ANNOTATION: "2000", "x": "y"}))
    train(model, optimizer, 2)
    assert calls == [3] and errors(handle) == 0
    # malformed, then a wrong id, then gone: counted once each, training goes on
    for data in (b'broken="\n', kubelet_file({CHECKPOINT_ANNOTATION: "soon"})):
        kubelet_write(folder, "annotations", data)
        train(model, optimizer, 2)
    os.remove(folder / "annotations")
    train(model, optimizer, 2)
    assert errors(handle) == 3 and calls == [3]
    assert value(handle, "robust_steps_total") == 13
    kubelet_write(folder, "annotations", kubelet_file({CHECKPOINT_ANNOTATION: "3000"}))
    train(model, optimizer, 1)
    assert calls == [3, 14] and value(handle, "robust_checkpoint_request_id") == 3000


def test_the_environment_names_the_file(tmp_path: Path, handles: list[Watch],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "annotations"
    monkeypatch.setenv("ROBUST_METRICS_POD_ANNOTATIONS", str(path))
    calls: list[int] = []
    model, optimizer = make_model()
    handle = robust_metrics.watch(model, optimizer, backend="null", run="unit", rank=0,
                                  world_size=1, checkpoint=calls.append, checkpoint_signal=None,
                                  control_poll_interval=0)
    handles.append(handle)
    assert handle.options.pod_annotations == str(path)
    train(model, optimizer, 1)
    path.write_bytes(kubelet_file({CHECKPOINT_ANNOTATION: "42"}))
    train(model, optimizer, 1)
    assert calls == [2]
