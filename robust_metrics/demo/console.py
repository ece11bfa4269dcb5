"""What the demo shows while it runs: a live view on a terminal (rich), plain lines otherwise.

Both poll the same snapshot every few seconds (the run's global step, firing alerts, the bridge's
incidents) and show the fault script's events as they happen.
"""

from __future__ import annotations

import datetime
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from robust_metrics.demo.stack import RUN, DemoStack

__all__ = ["LiveConsole", "PlainConsole", "Snapshot", "make_console"]


@dataclass
class Snapshot:
    step: int = 0
    alerts: list[str] = field(default_factory=list)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    @classmethod
    def take(cls, stack: DemoStack) -> Snapshot:
        try:
            steps = stack.query(f'max(robust_global_step{{run="{RUN}"}})')
            alerts = sorted({a["labels"]["alertname"]
                             + (f" (rank {a['labels']['rank']})" if "rank" in a["labels"] else "")
                             for a in stack.firing_alerts()})
            return cls(int(float(steps[0]["value"][1])) if steps else 0, alerts, stack.actions())
        except Exception as exc:  # a service restarting: say so and go on
            return cls(error=str(exc))


def _clock() -> str:
    return f"{datetime.datetime.now():%H:%M:%S}"


class PlainConsole:
    """A status line every `interval` seconds and one line per event: for logs and CI."""

    def __init__(self, stack: DemoStack, interval: float = 5.0) -> None:
        self.stack = stack
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def event(self, text: str) -> None:
        print(f"[{_clock()}] {text}", flush=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            s = Snapshot.take(self.stack)
            if s.error:
                self.event(f"status unavailable: {s.error}")
                continue
            done = sum(1 for i in s.incidents if i.get("status") == "done")
            self.event(f"step {s.step:5d} | firing: {', '.join(s.alerts) or 'none'} | "
                       f"bridge incidents: {len(s.incidents)} ({done} done)")


class LiveConsole(PlainConsole):
    """A full-screen view refreshed every second: steps, alerts, the bridge's actions, events."""

    def __init__(self, stack: DemoStack, interval: float = 1.0) -> None:
        super().__init__(stack, interval)
        self._events: deque[str] = deque(maxlen=12)
        self._snapshot = Snapshot()
        self._live: Any = None

    def event(self, text: str) -> None:
        self._events.append(f"[{_clock()}] {text}")
        if self._live is None:
            super().event(text)

    def start(self) -> None:
        from rich.live import Live

        self._live = Live(self._render(), refresh_per_second=2, transient=False)
        self._live.start()
        super().start()

    def stop(self) -> None:
        super().stop()
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()
            self._live = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._snapshot = Snapshot.take(self.stack)
            if self._live is not None:
                self._live.update(self._render())

    def _render(self) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        s = self._snapshot
        urls = "  ".join(f"{name} {url}" for name, url in self.stack.url.items()
                         if name != "master")
        status = f"step [bold]{s.step}[/]   firing: [bold red]{', '.join(s.alerts) or 'none'}[/]"
        if s.error:
            status += f"   [yellow](status unavailable: {s.error})[/]"
        actions = Table("alert", "rank", "status", "actions", expand=True)
        for incident in s.incidents[:6]:
            steps = ", ".join(f"{step['action']}:{step['status']}"
                              for step in incident.get("steps", []))
            actions.add_row(incident.get("alertname", ""),
                            incident.get("labels", {}).get("rank", "-"),
                            incident.get("status", ""), steps or "-")
        return Group(Panel(urls, title="robust-metrics demo"), Panel(status, title="training"),
                     Panel(actions, title="bridge actions"),
                     Panel("\n".join(self._events) or "-", title="events"))


def make_console(stack: DemoStack, *, live: bool) -> PlainConsole:
    """The live view when asked for and rich is installed; plain lines otherwise."""
    if live:
        try:
            import rich  # noqa: F401

            return LiveConsole(stack)
        except ImportError:
            pass
    return PlainConsole(stack)
