"""What `watch()` was given, read as a parallelism: the modules to hook and the rank's topology.

`watch(model, optimizer)` takes a module (plain, DDP, FSDP2, tensor parallel, or a mix), a
`PipelineStage`, or the list of stages a rank runs under an interleaved schedule. The topology
labels of `robust_rank_info` (`dp_rank`, `pp_rank`, `tp_rank`) come from what PyTorch already
knows when the user gives none: the DeviceMesh that FSDP2 and tensor parallelism put on the
parameters (its dimension names: `pp`, `dp`/`dp_shard`/`dp_replicate`/`fsdp`/`hsdp`, `tp`), and
the stage's rank in its pipeline group. Nothing here communicates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Parallelism", "resolve"]

_DP_NAMES = ("dp", "fsdp", "hsdp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp_cp", "ddp")
_TP_NAMES = ("tp",)
_PP_NAMES = ("pp",)


@dataclass
class Parallelism:
    """The modules whose forward marks a step's compute, and the topology found."""

    modules: list[Any]
    topology: dict[str, int] = field(default_factory=dict)
    pipeline: bool = False


def resolve(model: Any) -> Parallelism:
    """Read a watched object; never raises for an object it does not know (it is hooked as is)."""
    if model is None:
        return Parallelism([])
    stages = [model] if _is_stage(model) else (
        list(model) if isinstance(model, list | tuple) and model and all(map(_is_stage, model))
        else [])
    if stages:
        modules = [stage.submod for stage in stages]
        topology = _mesh_topology(modules)
        topology.setdefault("pp_rank", int(stages[0].group_rank))
        topology.setdefault("dp_rank", 0)
        return Parallelism(modules, topology, pipeline=True)
    return Parallelism([model], _mesh_topology([model]))


def _is_stage(obj: Any) -> bool:
    return hasattr(obj, "submod") and hasattr(obj, "stage_index") and hasattr(obj, "group_rank")


def _mesh_topology(modules: list[Any]) -> dict[str, int]:
    """Coordinates of this rank in the root DeviceMesh of the first DTensor parameter."""
    mesh = None
    for module in modules:
        for param in _parameters(module):
            mesh = getattr(param, "device_mesh", None)
            if mesh is not None:
                break
        if mesh is not None:
            break
    if mesh is None:
        return {}
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    coordinate = root.get_coordinate()
    if coordinate is None:
        return {}
    names = root.mesh_dim_names or _guess_names(modules, root.ndim)
    shape = tuple(root.mesh.shape)
    found: dict[str, int] = {}
    dp_index, dp_stride = 0, 1
    for dim in reversed(range(root.ndim)):
        name = names[dim] if dim < len(names) else ""
        if name in _PP_NAMES:
            found["pp_rank"] = int(coordinate[dim])
        elif name in _TP_NAMES:
            found["tp_rank"] = int(coordinate[dim])
        elif name in _DP_NAMES:  # several data-parallel dimensions flatten into one dp_rank
            dp_index += int(coordinate[dim]) * dp_stride
            dp_stride *= shape[dim]
            found["dp_rank"] = dp_index
    return found


def _guess_names(modules: list[Any], ndim: int) -> tuple[str, ...]:
    """An unnamed 1-D mesh: data parallel under FSDP2, else tensor parallel."""
    if ndim != 1:
        return ()
    sharded = any(type(m).__name__.startswith("FSDP") for module in modules
                  for m in module.modules())
    return ("dp",) if sharded else ("tp",)


def _parameters(module: Any) -> list[Any]:
    try:
        return list(module.parameters())
    except Exception:
        return []
