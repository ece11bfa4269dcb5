"""The Lightning and Hugging Face adapters only start and stop the hook; both really train."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _steps(handle_store: object) -> float:
    return next(s.value for s in handle_store.samples()  # type: ignore[attr-defined]
                if s.name == "robust_steps_total")


def test_lightning_callback_watches_a_fit(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning", reason="the lightning extra is not installed")
    from robust_metrics.integrations.lightning import RobustMetricsCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
            return self.net(batch).pow(2).mean()

        def validation_step(self, batch: torch.Tensor, idx: int) -> None:
            self.net(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.randn(12, 4), batch_size=4)
    callback = RobustMetricsCallback(backend="null", run="lightning")
    seen = {}
    original_teardown = callback.teardown

    def teardown(trainer, module, stage):  # type: ignore[no-untyped-def]
        seen["steps"] = _steps(callback.handle.store)
        seen["phase_train"] = next(s.value for s in callback.handle.store.samples()
                                   if s.name == "robust_phase" and "train" in s.series.labels)
        original_teardown(trainer, module, stage)

    callback.teardown = teardown  # type: ignore[method-assign]
    trainer = pl.Trainer(max_epochs=2, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=str(tmp_path), accelerator="cpu")
    trainer.fit(Module(), data, data)
    assert seen == {"steps": 6.0, "phase_train": 1.0}
    assert callback.handle is None  # closed


def test_huggingface_callback_watches_trainer_train(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the huggingface extra is not installed")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from robust_metrics.integrations.huggingface import RobustMetricsCallback

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
            out = self.net(x)
            return {"loss": (out.squeeze(-1) - labels).pow(2).mean(), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.randn(4), "labels": torch.tensor(1.0)}

    callback = RobustMetricsCallback(backend="null", run="hf")
    seen = {}
    original_end = callback.on_train_end

    def on_train_end(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen["steps"] = _steps(callback.handle.store)
        original_end(*args, **kwargs)

    callback.on_train_end = on_train_end  # type: ignore[method-assign]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                          num_train_epochs=1, report_to=[], use_cpu=True,
                                          save_strategy="no", logging_strategy="no")
    transformers.Trainer(model=Model(), args=args, train_dataset=Data(),
                         callbacks=[callback]).train()
    assert seen == {"steps": 4.0}
    assert callback.handle is None
