"""What `watch()` needs to know of the training frameworks whose step, backward or clipping is not
torch's own: DeepSpeed and Hugging Face Accelerate.

- DeepSpeed's optimizers (ZeRO 1-3, bf16, fp16: `DeepSpeedOptimizer`) step their torch optimizer
  once per parameter group (ZeRO 1 and 2: a model with a no-decay group steps it twice) or per ZeRO-3
  sub-group, so the torch optimizer's step hooks would count one `engine.step()` several times. The
  wrapper's own `step()` is the optimizer step, and after it the wrapper holds the gradient norm
  DeepSpeed computed over every rank's partition and clipped by (`_global_grad_norm`), where the
  torch optimizer's parameters hold only this rank's flat partition.
- `Accelerator.backward(loss)` and `DeepSpeedEngine.backward(loss)` divide the loss by the
  gradient accumulation steps before `backward()` runs on it: the loss the user computed is the
  one they were given.
- `torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)` is the second half of a
  clip whose norm the caller computed (Accelerate computes it over the whole FSDP2 model with
  `get_total_norm` and `full_tensor()`): that norm is the step's.

Nothing here imports a framework: an object is recognised by its classes' names, and a class is
patched only when its module is already imported (it must be, to have built what is watched).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["patch_clip_with_norm", "patch_framework_step", "patch_given_loss", "steps_itself"]

Restore = Callable[[], None]


def _class_names(obj: Any) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def steps_itself(optimizer: Any) -> bool:
    """A DeepSpeed optimizer: its own `step()` is the optimizer step, with the step's norm."""
    return optimizer is not None and "DeepSpeedOptimizer" in _class_names(optimizer)


def patch_framework_step(optimizer: Any,
                         on_step: Callable[[Any, Any], None]) -> Restore | None:
    """When `optimizer` is a DeepSpeed optimizer, wrap its own `step()` (on the instance, which
    `engine.step()` calls): after each, `on_step(optimizer, norm)` with DeepSpeed's global gradient
    norm of the step (None where it kept none, or skipped the step on an fp16 overflow). Returns
    the restore function, or None for any other optimizer (its torch step hooks serve)."""
    if not steps_itself(optimizer):
        return None
    original = optimizer.step

    @functools.wraps(original)
    def step(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        norm = None if getattr(optimizer, "overflow", False) else \
            getattr(optimizer, "_global_grad_norm", None)
        on_step(optimizer, norm)
        return result

    optimizer.step = step
    return functools.partial(_restore_instance, optimizer, "step", step)


def patch_given_loss(model: Any, capture: Callable[[Any], None]) -> list[Restore]:
    """Call `capture(loss)` with the loss given to `Accelerator.backward` (the class, when
    Accelerate is imported) and to the watched `DeepSpeedEngine`'s `backward`."""
    restores: list[Restore] = []
    accelerate = sys.modules.get("accelerate.accelerator")
    accelerator = getattr(accelerate, "Accelerator", None)
    if accelerator is not None and callable(getattr(accelerator, "backward", None)):
        original = accelerator.backward
        accelerator.backward = _capturing(original, capture)
        restores.append(functools.partial(setattr, accelerator, "backward", original))
    if model is not None and "DeepSpeedEngine" in _class_names(model):
        wrapped = _capturing(model.backward, capture, bound=True)
        model.backward = wrapped
        restores.append(functools.partial(_restore_instance, model, "backward", wrapped))
    return restores


def patch_clip_with_norm(on_norm: Callable[[Any], None]) -> list[Restore]:
    """Call `on_norm(total_norm)` from `torch.nn.utils.clip_grads_with_norm_` (torch >= 2.6)."""
    import torch

    original = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if original is None:
        return []

    @functools.wraps(original)
    def clip_grads_with_norm_(parameters: Any, max_norm: Any, total_norm: Any = None,
                              *args: Any, **kwargs: Any) -> Any:
        if total_norm is not None:
            on_norm(total_norm)
        return original(parameters, max_norm, total_norm, *args, **kwargs)

    torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
    return [functools.partial(setattr, torch.nn.utils, "clip_grads_with_norm_", original)]


def _capturing(original: Callable[..., Any], capture: Callable[[Any], None],
               bound: bool = False) -> Callable[..., Any]:
    """`original` (a method; `bound`: already bound to its instance) that first hands its loss
    argument to `capture`."""
    if bound:
        @functools.wraps(original)
        def method(loss: Any, *args: Any, **kwargs: Any) -> Any:
            capture(loss)
            return original(loss, *args, **kwargs)

        return method

    @functools.wraps(original)
    def unbound(self: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
        capture(loss)
        return original(self, loss, *args, **kwargs)

    return unbound


def _restore_instance(obj: Any, name: str, patched: Any) -> None:
    """Drop the instance attribute `name` set to `patched`, so the class's method serves again."""
    if obj.__dict__.get(name) is patched:
        del obj.__dict__[name]
