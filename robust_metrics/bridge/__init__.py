"""The action bridge: Alertmanager webhooks to checkpoint, stack dump, restart and drain, once.

Run it with ``robust-metrics bridge --config bridge.yaml`` (docs/bridge.md). Modules:

- `config`: the policy file and its validation;      - `payload`: Alertmanager v4 validation;
- `policy`: `decide()`, what to do for an alert: match, guard, cooldown, restart budget;
- `plan`: the decided plan's steps (`PlanStep`), typed values the store keeps as JSON;
- `store`: the SQLite (WAL) action log, persists decisions;
- `actions`: what each action does, dispatched through `actions.HANDLERS`;
- `engine`: worker threads that claim and run decided plans;
- `sidecars`: the sidecars' client;  `prometheus`: the Prometheus client;
- `signing`: HMAC-SHA256 for webhooks;
- `service`: the `Bridge` object;  `app`: HTTP routes;  `cli`: the CLI;
- `job_cli`: `robust-metrics job`, runs under the `local` scheduler the bridge can restart;
- `schedulers/`: adapters chosen by name (`local`, `webhook`, `slurm`, `kubernetes`).

Nothing here imports torch.
"""

from __future__ import annotations

__all__: list[str] = []
