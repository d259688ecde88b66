"""The backend interface: one adapter per MoE path, prepare -> experts -> finalize.

A backend converts the canonical MXFP4 weights once (`prepare`) and then runs
the routed-expert MoE of a few token rows (`forward`: route/quantize, the
experts' GEMMs, the top-k weighted finalize) returning the finalized BF16
output. The bench times `forward` without knowing which backend it holds.

Contract of `forward` (what makes it timeable):
- no host synchronization and no host work that depends on the values of
  device tensors (topk_ids live on the device), so a `capturable` backend can
  be captured in a CUDA graph; buffers may be cached inside the prepared
  object per row count;
- inputs: x bf16 [rows, H], topk_ids int32 [rows, top_k] (ids outside [0, E)
  are non-local and contribute nothing; a peer's default tactic is vLLM's TP
  path, which takes every id as local: such ids need its EP_TACTIC),
  topk_weights fp32 [rows, top_k]
  (routed scale already folded in), all on the prepared weights' device;
- output: bf16 [rows, H].
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar

import torch

from moebench.formats import ExpertWeights
from moebench.models import RankShape

DEFAULT_TACTIC = "default"
#: A peer's tactic for vLLM's expert-parallel path (an `expert_map`, ids of other
#: ranks' experts in the routing), never its default: the default is vLLM's TP
#: path, which reads every id as local and runs no remap (docs/baselines.md,
#: "Launch for launch").
EP_TACTIC = "ep"
#: Relative Frobenius error vs its oracle a backend's finalized output may
#: have, per oracle family (docs/baselines.md "Tolerances"): 1e-2 for the
#: MXFP8 and BF16 oracles (docs/design.md, Numerics); 3e-2 for the per-token FP8
#: oracle, argued there before any measurement: below the ~4 % that BF16
#: (unquantized) activations show against it, so the gate still separates
#: "quantizes like the oracle" from "does not". Measured on the H200 for
#: humming W4A8: 1.2-3.0 % (2026-11-29-8e46759-sweep-baselines-x4.log), above
#: the < 1 % a faithful per-token kernel should show: see docs/baselines.md.
ORACLE_TOLERANCES = {"mxfp8": 1e-2, "bf16": 1e-2, "fp8_token": 3e-2}


class BackendUnavailable(RuntimeError):
    """A backend cannot run here; `reason` says why (missing package, wrong GPU)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"backend {name!r} is unavailable: {reason}")
        self.name = name
        self.reason = reason


#: Step capabilities (`Backend.step_capabilities`): DEFERRED_FINALIZE, the prepared layer is a
#: routed-expert runner `integration.MoEStep` drives (route, GEMM1, GEMM2; the finalize left
#: open for the step's finalize kernel, with the shared add fused); FUSED_FRONT, it can bind
#: the layer's router into one launch (top-k + MXFP8 x + route record).
DEFERRED_FINALIZE, FUSED_FRONT = "deferred_finalize", "fused_front"
STEP_CAPABILITIES = (DEFERRED_FINALIZE, FUSED_FRONT)


class Backend(abc.ABC):
    """One MoE path behind the common interface.

    Class attributes: `name` (registry name), `oracle` (the fp64 oracle family
    its numerics are held to: one of reference.ACTIVATIONS),
    `capturable` (whether `forward` may be captured in a CUDA graph; False
    makes the bench time eager calls between device events instead), `peer`
    (True, the default: a path of another project, measured beside ours; a
    peer's case off its oracle is stored failed but fails `moebench sweep` /
    `step` only with --strict. False: this project's own code, whose failure
    always fails the command).
    """

    name: ClassVar[str]
    oracle: ClassVar[str]
    capturable: ClassVar[bool] = True
    peer: ClassVar[bool] = True
    #: What a whole decode step may take from `prepare`'s result beyond `forward`
    #: (STEP_CAPABILITIES; `moebench step` asks these, never the name).
    step_capabilities: ClassVar[frozenset[str]] = frozenset()

    @property
    def tolerance(self) -> float:
        """The correctness gate: max relative Frobenius error vs its oracle
        (ORACLE_TOLERANCES of the backend's oracle family)."""
        return ORACLE_TOLERANCES[self.oracle]

    def unavailable_reason(self, device: torch.device | str) -> str | None:
        """Why this backend cannot run on `device` (a missing package, a GPU
        that is not sm_90), or None when it can. Never raises ImportError."""
        return None

    def valid_tactics(self, shape: RankShape) -> tuple[str, ...]:
        """Tactic names `prepare` accepts for `shape`; "default" is always one."""
        return (DEFAULT_TACTIC,)

    #: Parametrized tactics `prepare` also accepts, as "NAME=VALUE" forms (e.g.
    #: "tables=DIR"); `tactic_form_error` checks the value.
    tactic_forms: tuple[str, ...] = ()

    def tactic_form_error(self, tactic: str) -> str | None:
        """Why `tactic`, of one of `tactic_forms` (its "NAME=" prefix), cannot
        be run, or None when it can. Only called for such tactics."""
        return None

    def tactic_form(self, tactic: str) -> str | None:
        """The entry of `tactic_forms` whose "NAME=" prefix `tactic` has, or None."""
        return next((f for f in self.tactic_forms if tactic.startswith(f.split("=", 1)[0] + "=")), None)

    def accepts_tactic(self, shape: RankShape, tactic: str) -> bool:
        """Whether `prepare` takes `tactic` for `shape`: one of
        `valid_tactics(shape)` or a well-formed tactic of `tactic_forms`."""
        if tactic in self.valid_tactics(shape):
            return True
        return self.tactic_form(tactic) is not None and self.tactic_form_error(tactic) is None

    def default_alias(self, shape: RankShape) -> str | None:
        """The other offered tactic that "default" runs for `shape` (the same
        computation under its own name), or None when "default" is not one of
        them. `--tactics all` then times it once, as "default". Default: None."""
        return None

    def tactic_unavailable_reason(self, shape: RankShape, tactic: str, device: torch.device | str) -> str | None:
        """Why an offered `tactic` cannot run `shape` on `device` right now
        (e.g. it needs a tuning table there is none of), or None. The sweep
        skips such cases with the reason. Default: None."""
        return None

    def prepared_bytes(self, shape: RankShape) -> int:
        """Device bytes `prepare` adds per weight set (for the sweep's memory
        budget); default: none beyond the canonical weights it keeps."""
        return 0

    def read_bytes(self, shape: RankShape, topk_ids: torch.Tensor) -> int | None:
        """Bytes one layer call of this backend really reads and writes in
        device memory for the routing `topk_ids` [rows, top_k] (CPU or device
        ids): the touched experts' weights and scales in its own layout
        (padding, BF16 copies and all) plus x in and the output
        (`traffic.touched_bytes(shape, topk_ids, bytes_per_expert)`, with
        `traffic.mxfp4_bytes` for MXFP4 matrices). None (the default)
        when it is the normalized count (`bench.cases.unique_bytes`: the
        logical MXFP4 bytes), which every backend's `pct_copy_bw` uses; the
        sweep then stores that count as `read_bytes`."""
        return None

    @abc.abstractmethod
    def prepare(self, weights: ExpertWeights, shape: RankShape, tactic: str = DEFAULT_TACTIC) -> object:
        """One-time conversion of the canonical `weights` (on the target device)
        into whatever `forward` reads. Raises ValueError for an unknown tactic
        or weights that do not match `shape`."""

    @abc.abstractmethod
    def forward(
        self,
        prepared: object,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Finalized routed-expert output bf16 [rows, H] (module docstring)."""

    def stage_calls(
        self, prepared: object, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> list[tuple[str, Callable[[], object]]]:
        """`forward` cut into its stages, in order, for per-kernel timing: one
        (name, call) per stage, each call bound to inputs an eager run of the
        stages before it produced (so a stage can be timed alone). Names:
        distinct, from the sweep's `SWEEP_STAGES`, the same list for every
        weight set; the calls must be CUDA-graph capturable when the backend
        is `capturable`. Runs those earlier stages once, eagerly. Default: []
        (the backend is timed as a whole only). The sweep keeps a case whose
        split fails `ok`, with the reason in its note."""
        return []

    def routed_call(
        self, prepared: object, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> Callable[[], object] | None:
        """The routed-expert path of `forward` without the finalize (route +
        GEMM1 + GEMM2 for our kernels), as one call that launches each of its
        kernels as `forward` does; None (the default) when the backend has no
        such split."""
        return None

    def kernel_tactics(self, prepared: object, rows: int) -> str | None:
        """What `prepared` runs at `rows` token rows, in words (e.g. each
        kernel's tactic and where it came from), for the sweep's
        `kernel_tactics` column; None (the default) when there is nothing to say."""
        return None

    def check_tactic(self, shape: RankShape, tactic: str) -> None:
        """Raise ValueError unless `accepts_tactic(shape, tactic)`."""
        if not self.accepts_tactic(shape, tactic):
            if self.tactic_form(tactic) is not None:
                raise ValueError(f"tactic {tactic!r} of backend {self.name!r}: {self.tactic_form_error(tactic)}")
            forms = "".join(f" or {f!r}" for f in self.tactic_forms)
            raise ValueError(
                f"tactic {tactic!r} is not valid for backend {self.name!r}; expected one of"
                f" {self.valid_tactics(shape)}{forms}"
            )


def sm90_reason(device: torch.device | str) -> str | None:
    """Why `device` is not an sm_90 (Hopper) CUDA GPU, or None when it is."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"needs a CUDA device, got {dev}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 9:
        return f"needs an sm_90 (Hopper) GPU; {torch.cuda.get_device_name(dev)} is sm_{major}{minor}"
    return None


def check_weights(weights: ExpertWeights, shape: RankShape) -> None:
    """Raise TypeError/ValueError unless `weights` hold `shape`'s experts."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be ExpertWeights, got {type(weights).__name__}")
    got = (weights.experts, weights.hidden, weights.intermediate, weights.padded_intermediate)
    want = (shape.experts, shape.hidden, shape.intermediate, shape.padded_intermediate)
    if got != want:
        raise ValueError(f"weights (E, H, I, Ip) = {got} do not match shape {shape.describe()} {want}")


def check_forward_inputs(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, hidden: int, device: torch.device
) -> None:
    """Raise TypeError/ValueError naming the argument unless x is bf16 [rows,
    hidden], topk_ids int32 [rows, k], topk_weights fp32 [rows, k], all on
    `device`. Checks metadata only (no host sync)."""
    for name, t, dtype in (("x", x, torch.bfloat16), ("topk_ids", topk_ids, torch.int32),
                           ("topk_weights", topk_weights, torch.float32)):  # fmt: skip
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}; the prepared weights are on {device}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if x.shape[1] != hidden:
        raise ValueError(f"x must be [rows, {hidden}], got {tuple(x.shape)}")
    if topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)}"
            f" must both be [rows={x.shape[0]}, top_k]"
        )


def require_runnable(backend: Backend, device: torch.device | str) -> None:
    """Raise RuntimeError naming `backend` and the reason unless it can run on
    `device` (its `unavailable_reason`): what a prepare says before it
    touches the device."""
    reason = backend.unavailable_reason(device)
    if reason is not None:
        raise RuntimeError(f"backend {backend.name!r} cannot run on {device}: {reason}")


def one_clamp(weights: ExpertWeights, why: str) -> float:
    """The SwiGLU limit all experts of `weights` share, for a path that takes
    one per layer; ValueError (`why` says whose rule) when the clamps differ."""
    limits = torch.unique(weights.clamp)
    if limits.numel() != 1:
        raise ValueError(f"{why}; clamp must be equal for all experts, got {limits.numel()} values")
    return float(limits[0])
