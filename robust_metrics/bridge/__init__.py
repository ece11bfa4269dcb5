"""The action bridge: Alertmanager webhooks to checkpoint, stack dump, restart and drain, once.

Run it with ``robust-metrics bridge --config bridge.yaml`` (docs/bridge.md). Modules:

- `config`: the policy file and its validation;      - `payload`: Alertmanager v4 validation;
- `policy`: `decide()`, what to do for an alert: match, guard, cooldown, restart budget;
- `store`: the SQLite (WAL) action log, persists decisions;  - `actions`: what each action does;
- `engine`: worker threads that claim and run decided plans;
- `sidecars`: sidecar and Prometheus client;            - `signing`: HMAC-SHA256 for webhooks;
- `service`: the `Bridge` object;  `app`: HTTP routes;  `cli`: the CLI;
- `schedulers/`: adapters chosen by name (`local`, `webhook`, `slurm`, `kubernetes`).

Nothing here imports torch.
"""

from __future__ import annotations

__all__: list[str] = []
