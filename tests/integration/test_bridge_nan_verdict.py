"""What the bridge does with a non-finite value's verdict, against a real sidecar: a `persistent`
one is notified (the restarts stop), a `transient` one has its node's sidecar run a compute
self-test. The verdict itself and the ledger: tests/test_bridge_nan_verdict.py."""

from __future__ import annotations

from pathlib import Path

from robust_metrics.bridge.config import parse
from robust_metrics.bridge.ledger import Entry

T0 = 1767225600.0


# ---------------------------------------------------------------- what the bridge does with it
def _entry(verdict: str) -> Entry:
    return Entry(7, "r1", "NonFiniteLoss", ["0"], [], None, T0, T0 + 3, T0 + 9, 121, 100, 21,
                 "recovered", numerics={"verdict": verdict, "step": 120.0, "rank": "1",
                                        "node": "n2", "recurred_step": None})


def test_the_bridge_notifies_a_persistent_value_and_tests_a_transient_ones_node(
        tmp_path: Path) -> None:
    from robust_metrics.bridge.service import Bridge
    from tests.bridge_fakes import Receiver
    from tests.support import SidecarProcess

    (tmp_path / "token").write_text("side-token")
    with SidecarProcess(tmp_path / "n2", ["--node", "n2", "--token-file", str(tmp_path / "token"),
                                          "--no-collector.nvml", "--no-collector.nic",
                                          "--no-collector.nccl", "--selftest-arg=--size=64"],
                        log_path=tmp_path / "n2.log") as side, Receiver() as receiver:
        bridge = Bridge(parse({
            "database": str(tmp_path / "bridge.db"), "auth": {"bearer_token": "t"},
            "sidecars": {"urls": {"n2": side.url}, "token": "side-token"},
            "notify": {"url": receiver.url + "/notify", "secret": "hook-secret"},
            "schedulers": {"ops": {"type": "webhook", "url": "http://127.0.0.1:1"}},
            "rules": [{"match": {"action": "restart"}, "actions": ["restart"]}]}))
        try:
            assert bridge.ledger.on_nan_verdict is not None
            told = bridge.ledger.on_nan_verdict(_entry("persistent"))
            assert "notified" in told and "HTTP 200" in told["notified"]
            (body,) = receiver.bodies("/notify")
            assert (body["step"], body["rank"], body["verdict"]) == (120.0, "1", "persistent")
            assert "stops restarting" in body["message"]
            tested = bridge.ledger.on_nan_verdict(_entry("transient"))
            assert tested["selftest"]["n2"]["verdict"] == "pass"
            assert tested["selftest"]["n2"]["digest"]  # the compute check ran
            assert len(receiver.bodies()) == 1  # no notification for a transient value
            assert bridge.engine.nan_finding is not None
            assert bridge.engine.nan_finding("r1") is None
        finally:
            bridge.close()
