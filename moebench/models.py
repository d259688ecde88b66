"""Geometry presets of the DeepSeek-V4 family and tensor-parallel slicing.

A preset is data (one `MoEConfig`); a sweep over TP degrees is a sweep over one
rank's shape (`RankShape`): every rank holds all experts at intermediate I/tp,
zero-padded up to a multiple of 128.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

#: Multiple the per-rank intermediate size is padded to (zeros).
INTERMEDIATE_ALIGN = 128
#: MX block size along K (OCP MX v1.0).
MX_BLOCK = 32


#: Most routed experts per token (top_k) and routed experts that the routing,
#: the route record and the kernels support (`moebench.record` re-exports them).
MAX_TOP_K = 8
MAX_EXPERTS = 512
#: The moebench GPU kernels also need the routed experts a multiple of this (and at least it):
#: `kernels.binding.check_weights` refuses others; the torch backends and the oracle take any E.
KERNEL_EXPERTS_MULTIPLE = 32
#: What `--experts` takes, for its help and `moebench check`.
KERNEL_EXPERTS_NOTE = (
    f"at most {MAX_EXPERTS}, and a multiple of {KERNEL_EXPERTS_MULTIPLE} for the moebench GPU"
    " kernels (e.g. 256, 384); the other backends and CPU runs take any E"
)


@dataclass(frozen=True)
class MoEConfig:
    """Full (unsliced) routed-expert geometry of one MoE layer.

    Attributes: hidden H, moe intermediate I, routed experts E, top_k, shared
    experts, routed_scaling_factor (folded into the router weights), and the
    SwiGLU clamp limit.
    """

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 10.0

    def __post_init__(self) -> None:
        for field in ("hidden", "intermediate", "experts", "top_k"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.hidden % 128:
            raise ValueError(f"hidden must be a multiple of 128, got {self.hidden}")
        if self.intermediate % MX_BLOCK:
            raise ValueError(f"intermediate must be a multiple of {MX_BLOCK}, got {self.intermediate}")
        if self.experts > MAX_EXPERTS:
            raise ValueError(
                f"experts must be at most {MAX_EXPERTS} (the routing and the route record), got {self.experts}"
            )
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k must be at most {MAX_TOP_K} (the routing and the route record), got {self.top_k}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds experts ({self.experts})")
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        if not isinstance(self.shared_experts, int) or isinstance(self.shared_experts, bool) or self.shared_experts < 0:
            raise ValueError(f"shared_experts must be an int >= 0, got {self.shared_experts!r}")
        for field in ("routed_scaling_factor", "swiglu_limit"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{field} must be a real number, got {type(value).__name__}")
        # an infinite scale makes every routed output inf/NaN; an infinite
        # SwiGLU limit is allowed (no clamp)
        if not (self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor)):
            raise ValueError(f"routed_scaling_factor must be finite and > 0, got {self.routed_scaling_factor}")
        if not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0, got {self.swiglu_limit}")

    def shard(self, tp: int) -> RankShape:
        """One rank's shape at tensor-parallel degree `tp`.

        Raises ValueError when `tp` is not a positive int, or I/tp is not a whole
        multiple of the MX block (32).
        """
        if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
            raise ValueError(f"tp must be a positive int, got {tp!r}")
        sizes = _slice(self.intermediate, tp)
        if sizes is None:
            raise ValueError(f"tp={tp}: intermediate {self.intermediate} does not split into multiples of {MX_BLOCK}")
        return RankShape(self, tp, *sizes)


def _slice(intermediate: int, tp: int) -> tuple[int, int] | None:
    """(intermediate / tp, that padded up to INTERMEDIATE_ALIGN): one rank's
    sizes, or None when intermediate does not split `tp` ways into whole
    MX blocks."""
    if intermediate % tp or (intermediate // tp) % MX_BLOCK:
        return None
    sliced = intermediate // tp
    return sliced, -(-sliced // INTERMEDIATE_ALIGN) * INTERMEDIATE_ALIGN


@dataclass(frozen=True)
class RankShape:
    """One rank's routed-expert shape: all E experts at `intermediate` = I/tp,
    stored padded with zeros to `padded_intermediate` (a multiple of 128).
    Made by `MoEConfig.shard`; a direct construction is checked to be what
    `config.shard(tp)` returns (ValueError / TypeError otherwise)."""

    config: MoEConfig
    tp: int
    intermediate: int
    padded_intermediate: int

    def __post_init__(self) -> None:
        if not isinstance(self.config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(self.config).__name__}")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp <= 0:
            raise ValueError(f"tp must be a positive int, got {self.tp!r}")
        sizes = _slice(self.config.intermediate, self.tp)
        if sizes != (self.intermediate, self.padded_intermediate):
            want = (f"intermediate {sizes[0]} padded to {sizes[1]} (a multiple of {INTERMEDIATE_ALIGN})" if sizes
                    else f"a config intermediate ({self.config.intermediate}) that splits {self.tp} ways into"
                         f" multiples of {MX_BLOCK}")  # fmt: skip
            raise ValueError(
                f"RankShape of {self.config.name} at tp={self.tp} must have {want}, got {self.intermediate} /"
                f" {self.padded_intermediate}; use config.shard(tp)"
            )

    @property
    def hidden(self) -> int:
        return self.config.hidden

    @property
    def experts(self) -> int:
        return self.config.experts

    @property
    def top_k(self) -> int:
        return self.config.top_k

    @property
    def swiglu_limit(self) -> float:
        return self.config.swiglu_limit

    @property
    def routed_scaling_factor(self) -> float:
        return self.config.routed_scaling_factor

    def expert_bytes(self) -> int:
        """Logical (unpadded) bytes of one expert: MXFP4 w13 + w2 and their
        E8M0 scales."""
        h, i = self.hidden, self.intermediate
        return 2 * i * h // 2 + 2 * i * h // MX_BLOCK + h * i // 2 + h * i // MX_BLOCK

    def describe(self) -> str:
        return (
            f"{self.config.name} TP{self.tp}: H={self.hidden} I={self.intermediate}"
            f" (padded {self.padded_intermediate}) E={self.experts} top_k={self.top_k}"
        )


PRESETS: dict[str, MoEConfig] = {
    c.name: c
    for c in (
        MoEConfig("dsv41-flash", 5120, 2304, 384, 6, 1, 1.5, 10.0),
        MoEConfig("dsv4-flash", 4096, 2048, 256, 6, 1, 1.5, 10.0),
        MoEConfig("dsv4-pro", 7168, 3072, 384, 6, 1, 2.5, 10.0),
    )
}


def get_preset(
    name: str,
    *,
    hidden: int | None = None,
    intermediate: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
) -> MoEConfig:
    """The preset `name`, with any of hidden / intermediate / experts / top_k
    overridden (the overridden config is renamed `name+custom`; an override
    equal to the preset's own value changes nothing, the name included).

    Raises ValueError for an unknown preset or an invalid override.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    overrides = {
        k: v
        for k, v in dict(hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k).items()
        if v is not None
    }
    config = PRESETS[name]
    overrides = {
        k: v
        for k, v in overrides.items()
        if isinstance(v, bool) or type(v) is not type(getattr(config, k)) or v != getattr(config, k)
    }
    if not overrides:
        return config
    return replace(config, name=f"{name}+custom", **overrides)
