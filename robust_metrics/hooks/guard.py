"""Hook errors never reach the training loop: each is counted in
`robust_hook_errors_total{where}`, logged once per `where`, and the hook body returns None."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from robust_metrics import schema
from robust_metrics.hooks.metric_store import MetricStore

__all__ = ["ErrorHandler", "HookErrors", "guard"]

log = logging.getLogger("robust_metrics")
F = TypeVar("F", bound=Callable[..., Any])
ErrorHandler = Callable[[str, BaseException], None]


class HookErrors:
    """The one error handler of a watch, given to every part of it as `on_error(where, exc)`."""

    def __init__(self, store: MetricStore) -> None:
        self._store = store
        self._logged: set[str] = set()

    def __call__(self, where: str, exc: BaseException) -> None:
        try:
            self._store.series(schema.HOOK_ERRORS, where=where).inc()
            if where not in self._logged:
                self._logged.add(where)
                log.warning("robust-metrics: error in %s hook (training continues): %r",
                            where, exc, exc_info=exc)
        except Exception:
            pass


def guard(where: str) -> Callable[[F], F]:
    """Run a method as a hook body: on any exception call `self.on_error(where, exc)` and return
    None."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                self.on_error(where, exc)
                return None

        return guarded  # type: ignore[return-value]

    return decorate
