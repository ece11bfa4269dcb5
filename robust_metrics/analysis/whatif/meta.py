"""Job metadata of a trace: parallel sizes, from YAML, options, or the trace itself.

The simulator only needs what the trace shows (DP ranks, stages), but a metadata file that
disagrees with the trace usually means the wrong file was passed, so it is checked, not trusted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["JobMeta", "MetaError", "load_meta"]

_SIZES = ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size", "world_size")


class MetaError(ValueError):
    """Metadata that is malformed or does not match the trace."""


@dataclass(frozen=True)
class JobMeta:
    """Parallel layout of the traced job (Megatron naming)."""

    dp_size: int = 1
    pp_size: int = 1
    tp_size: int = 1
    dsp_size: int = 1
    vpp_size: int = 1
    world_size: int = 1
    trial_name: str = "trace"

    def __post_init__(self) -> None:
        for name in _SIZES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MetaError(f"metadata {name}={value!r}: must be an integer >= 1")
        expected = self.dp_size * self.pp_size * self.tp_size * self.dsp_size
        if self.world_size != expected:
            raise MetaError(f"metadata world_size={self.world_size} but dp_size*pp_size*tp_size*"
                            f"dsp_size = {expected}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "metadata") -> JobMeta:
        """Build from a YAML mapping; unknown keys other than bookkeeping ones are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        odd = [k for k in data if not isinstance(k, str)]
        if odd:
            raise MetaError(f"{source}: key(s) {', '.join(map(repr, odd[:5]))} are not names; "
                            f"expected {', '.join(sorted(known))}")
        ignored = {"run_id"}
        unknown = set(data) - known - ignored
        if unknown:
            raise MetaError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}; "
                            f"expected {', '.join(sorted(known))}")
        kwargs = {k: v for k, v in data.items() if k in known}
        if "trial_name" in kwargs:
            kwargs["trial_name"] = str(kwargs["trial_name"])
        if "world_size" not in kwargs:
            kwargs["world_size"] = (kwargs.get("dp_size", 1) * kwargs.get("pp_size", 1)
                                    * kwargs.get("tp_size", 1) * kwargs.get("dsp_size", 1))
        return cls(**kwargs)

    def check_trace(self, dp_ranks: int, stages: int, model_chunks: int) -> None:
        """Raise MetaError when the trace's DP ranks, stages or model chunks contradict this."""
        if dp_ranks != self.dp_size:
            raise MetaError(f"metadata dp_size={self.dp_size} but the trace has {dp_ranks} "
                            "DP ranks (dp_rank 0..N-1)")
        if stages != self.pp_size:
            raise MetaError(f"metadata pp_size={self.pp_size} but the trace has {stages} "
                            "pipeline stages (stage 0..N-1)")
        if model_chunks > self.vpp_size:
            raise MetaError(f"metadata vpp_size={self.vpp_size} but the trace has model chunk "
                            f"(mc) up to {model_chunks - 1}")


def load_meta(path: str | Path | None = None, overrides: Mapping[str, int | None] | None = None,
              *, inferred: Mapping[str, int] | None = None) -> JobMeta:
    """Metadata from a YAML file, then `overrides` (CLI options), else `inferred` from the trace."""
    data: dict[str, Any] = dict(inferred or {})
    source = "metadata"
    if path is not None:
        import yaml

        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise MetaError(f"metadata file {path} does not exist") from None
        except IsADirectoryError:
            raise MetaError(f"metadata file {path} is a folder; give the YAML file") from None
        except UnicodeDecodeError:
            raise MetaError(f"metadata file {path} is not text (UTF-8 YAML)") from None
        except OSError as exc:
            raise MetaError(f"metadata file {path} cannot be read: {exc.strerror or exc}"
                            ) from None
        except (yaml.YAMLError, ValueError, TypeError) as exc:
            raise MetaError(f"metadata file {path} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise MetaError(f"metadata file {path} must hold a mapping of sizes")
        data.update(loaded)
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return JobMeta.from_mapping(data, source=source)
