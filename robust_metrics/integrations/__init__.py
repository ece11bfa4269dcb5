"""Thin framework adapters: each only starts `robust_metrics.watch()` and closes it.

- `robust_metrics.integrations.lightning.RobustMetricsCallback` for PyTorch Lightning;
- `robust_metrics.integrations.huggingface.RobustMetricsCallback` for the Hugging Face Trainer
  (and Accelerate through it).
"""
