"""The moebench backend: our CuTe DSL kernels (route with MXFP8 x, GEMM1, GEMM2)
through `kernels.binding.RoutedExpertGemm`, then the finalize kernel
(`kernels.finalize`: top-k weighted sum in fp32, top-k order, bf16 out).

Oracle "mxfp8" (MXFP8 x and H). Needs nvidia-cutlass-dsl and an sm_90 GPU.

Tactics (each a kernel family, `RoutedExpertGemm`'s `fp8`, and where its
GEMM tactics come from):
- "default" = what the runtime runs: per layer (shape class) the faster
  family by the tuning tables' µs of this device (`kernels.family`), its
  table entries else its built-in tactics; with no table the FP8 family
  where its built-in tactics fit the shape, else BF16; the FP8 family runs
  the fused layer at the row counts where the tables' "fp8.fused" entries
  choose it, else the pair;
- "builtin" = what runs with no tuning table at all: the family of that
  rule with its built-in tactics, tables ignored;
- "tuned" = "default", skipped (with the reason) when no usable table covers
  this device and shape class, so `sweep --tactics tuned,builtin` measures
  what tuning buys and never times the defaults twice under two names;
- "fp8" = the FP8 family's pair (e4m3 weights for wgmma, MXFP8 x / H as they are:
  the table's fp8 part, else the built-in fp8 tactics), skipped with the
  reason where no fp8 tactic fits the shape;
- "bf16" = the BF16 family (weights decoded to BF16 for mma.sync: the
  table's BF16 entries, else the built-in BF16 tactics), skipped where its
  built-in tactics do not fit; `sweep --tactics fp8,bf16` compares the two
  families per layer call;
- "fused" = "fp8" with GEMM1 and GEMM2 in one launch (the fused layer,
  `kernels.fused`, v24) at every row count where its built-in fused tactic
  fits; `sweep --tactics fp8,fused` compares it with the pair. Its stage
  columns are the route and the finalize (the fused launch has no GEMM1 or
  GEMM2 alone: routed_us holds route + the fused launch).
- "tables=DIR" = "default" with the tuning tables of the directory DIR
  alone (not $MOEBENCH_TUNING_DIR, not the package's: the family and every
  tactic from DIR's table, built-ins where it has no entry), skipped where
  DIR has no table for the device and shape; `sweep --tactics
  tuned,tables=old-tables` times a re-tuned table beside the one it
  replaces, side by side in one run.
The `kernel_tactics` column (sweep and step) names the family that ran and
how it was chosen, then each GEMM's tactic and its source.
"""

from __future__ import annotations

import importlib.util

import torch

from moebench.backends.base import (
    DEFAULT_TACTIC,
    DEFERRED_FINALIZE,
    FUSED_FRONT,
    Backend,
    check_forward_inputs,
    check_weights,
    sm90_reason,
)
from moebench.traffic import mxfp4_bytes, touched_bytes
from moebench.formats import ExpertWeights
from moebench.models import RankShape

#: Whether the route kernel may read x and the top-k ids before its
#: griddepcontrol.wait (`RoutedExpertGemm.route(inputs_ready=...)`): no. In a
#: decode step, and in the sweep's default layer-boundary timing, the kernel
#: launched just before the route kernel writes x, so the route kernel reads
#: it only after the wait. (The tuning runner times its route launch with
#: the same flag.)
INPUTS_READY = False


class MoebenchBackend(Backend):
    """Our kernels: prepare binds a RoutedExpertGemm (weights converted and
    kernels compiled once); forward = route -> GEMM1 -> GEMM2 -> finalize."""

    name = "moebench"
    step_capabilities = frozenset({DEFERRED_FINALIZE, FUSED_FRONT})
    oracle = "mxfp8"
    capturable = True
    peer = False  # ours: a failing case fails the command
    BUILTIN = "builtin"
    TUNED = "tuned"
    FP8 = "fp8"
    BF16 = "bf16"
    FUSED = "fused"

    TABLES = "tables="
    #: "nopdl=TACTIC": TACTIC with the route (the layer's first launch) launched without
    #: programmatic dependent launch, as the peers' first kernels are (`sweep --tactics
    #: default,nopdl=default` is the A/B of issue 37's fair timing).
    NOPDL = "nopdl="
    tactic_forms = ("tables=DIR", "nopdl=TACTIC")

    def valid_tactics(self, shape: RankShape) -> tuple[str, ...]:
        return (DEFAULT_TACTIC, self.BUILTIN, self.TUNED, self.FP8, self.BF16, self.FUSED)

    def tactic_form_error(self, tactic: str) -> str | None:
        """ "tables=DIR": DIR must be a directory holding tuning tables (*.json);
        "nopdl=TACTIC": TACTIC one this backend takes (not itself nopdl=)."""
        from pathlib import Path

        if tactic.startswith(self.NOPDL):
            inner = tactic[len(self.NOPDL) :]
            if inner.startswith(self.NOPDL) or not (inner in self.valid_tactics(None) or self.tactic_form(inner)):
                return f"needs one of this backend's tactics after 'nopdl=' (e.g. nopdl=default), got {inner!r}"
            return self.tactic_form_error(inner) if self.tactic_form(inner) else None
        folder = tactic[len(self.TABLES) :]
        if not folder:
            return "needs a directory after 'tables=' (tuning tables, as `moebench tune --out DIR` writes)"
        if not Path(folder).is_dir():
            return f"{folder} is not a directory (expected one of tuning tables, as `moebench tune --out DIR` writes)"
        if not any(Path(folder).glob("*.json")):
            return f"{folder} holds no tuning table (*.json; `moebench tune --out {folder}` writes them)"
        return None

    def tactic_unavailable_reason(self, shape: RankShape, tactic: str, device: torch.device | str) -> str | None:
        """For "tuned" ("tables=DIR"): why no tuning table (in DIR) covers
        `device` and `shape` (naming the file and where it was looked for); for "fp8" / "bf16":
        why that family's built-in tactics do not fit the shape (a row count
        without a table entry could not run); "nopdl=TACTIC": TACTIC's; else None."""
        if tactic.startswith(self.NOPDL):
            return self.tactic_unavailable_reason(shape, tactic[len(self.NOPDL) :], device)
        if tactic in (self.FP8, self.BF16, self.FUSED):
            from moebench.kernels.family import builtin_refusal

            return builtin_refusal(shape, shape.top_k, tactic != self.BF16)
        tables = self._tables_of(tactic)
        if tactic != self.TUNED and tables is None:
            return None
        from moebench.kernels.table import ShapeClass, default_search_dirs, find_table, table_file_name

        dev = torch.device(device)
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        sclass = ShapeClass.of(shape)
        table, _, problems = find_table(name, sclass, search=tables)
        if table is not None:
            return None
        where = ", ".join(str(d) for d in (tables or default_search_dirs()))
        why = f"; {problems[0]}" if problems else ""
        return f"no tuning table {table_file_name(sclass, name)} in {where}{why} (run `moebench tune`)"

    def prepared_bytes(self, shape: RankShape) -> int:
        """The kernel-layout copy of the weights and scales (padded), which
        RoutedExpertGemm keeps beside the canonical ones (one family's: the
        e4m3 and the BF16 layout take the same bytes)."""
        e, h, ip = shape.experts, shape.hidden, shape.padded_intermediate
        return e * (3 * ip * h // 2 + 3 * ip * h // 32) + 4 * e

    def read_bytes(self, shape: RankShape, topk_ids: torch.Tensor) -> int:
        """What our GEMMs stream: the touched experts at the logical I (the
        kernel layout, `kernels.layout`, drops the intermediate padding: w13
        [2I, H] and w2 [H, I], MXFP4 values and E8M0 scales) + x in and the
        output; equal to `bench.cases.unique_bytes`."""
        h, i = shape.hidden, shape.intermediate
        return touched_bytes(shape, topk_ids, mxfp4_bytes(2 * i, h) + mxfp4_bytes(h, i))

    def unavailable_reason(self, device: torch.device | str) -> str | None:
        if importlib.util.find_spec("cutlass") is None:
            return "needs nvidia-cutlass-dsl (pip install 'moebench[kernels]')"
        return sm90_reason(device)

    def prepare(self, weights: ExpertWeights, shape: RankShape, tactic: str = DEFAULT_TACTIC):
        """A RoutedExpertGemm bound to `weights` (raises ValueError for a bad
        tactic, shape or weight layout)."""
        from moebench.kernels.binding import RoutedExpertGemm
        from moebench.kernels.finalize import compile_finalize_kernel

        self.check_tactic(shape, tactic)
        if tactic.startswith(self.NOPDL):
            gemm = self.prepare(weights, shape, tactic[len(self.NOPDL) :])
            gemm.route_launch_pdl = False  # read by RoutedExpertGemm.route
            return gemm
        check_weights(weights, shape)
        compile_finalize_kernel(False)  # compile now, not inside a graph capture
        if tactic in (self.FP8, self.BF16, self.FUSED):  # tactics=None: the family's table entries, else built-ins
            # "fp8" / "bf16": the pair (what the tables' fp8.fused entries choose is "default"'s)
            return RoutedExpertGemm(weights, shape.top_k, None, fp8=tactic != self.BF16, fused=tactic == self.FUSED)
        if (tables := self._tables_of(tactic)) is not None:  # the family and tactics of DIR's tables alone
            return RoutedExpertGemm(weights, shape.top_k, None, tables=tables)
        # fp8=None: the family the tables choose ({}: the built-in rule and tactics, tables ignored)
        return RoutedExpertGemm(weights, shape.top_k, {} if tactic == self.BUILTIN else None)

    def _tables_of(self, tactic: str) -> list | None:
        """[DIR] for a "tables=DIR" tactic, else None."""
        from pathlib import Path

        return [Path(tactic[len(self.TABLES) :])] if tactic.startswith(self.TABLES) else None

    def kernel_tactics(self, prepared, rows: int) -> str:
        """'<family> family (<how chosen>); gemm1 <tactic> (<source>); gemm2
        <tactic> (<source>)' at `rows`: family "fp8" or "bf16" (the one that
        ran: its tactics' family), chosen by 'tables', 'built-in', 'asked'
        or 'tactics' (`FamilyChoice.source`); source 'table' (the tuning
        table's entry) or the binding's reason for another ('default ...',
        'explicit')."""
        family = "fp8" if prepared.tactics[1, rows].fp8 else "bf16"
        choice = getattr(prepared, "family_choice", None)
        parts = [f"{family} family" + (f" ({choice.source})" if choice is not None else "")]
        if not getattr(prepared, "route_launch_pdl", True):
            parts.append("route launched without PDL")
        fused = getattr(prepared, "fused_tactics", {}).get(rows)
        if fused is not None:
            source = prepared.fused_sources[rows]
            return "; ".join([*parts, f"fused {fused.name} ({'table' if source.startswith('table') else source})"])
        for stage in (1, 2):
            source = prepared.tactic_sources[stage, rows]
            parts.append(
                f"gemm{stage} {prepared.tactics[stage, rows].name}"
                f" ({'table' if source.startswith('table') else source})"
            )
        return "; ".join(parts)

    def forward(self, prepared, x, topk_ids, topk_weights):
        """bf16 [rows, H]: route (MXFP8 x + record), the GEMM pair, the finalize kernel."""
        from moebench.kernels.finalize import finalize

        check_forward_inputs(x, topk_ids, topk_weights, prepared.hidden, prepared.kw.device)
        return finalize(prepared.forward(x, topk_ids, topk_weights, inputs_ready=INPUTS_READY))

    def stage_calls(self, prepared, x, topk_ids, topk_weights):
        """route (MXFP8 x + route record, one launch), gemm1, gemm2,
        finalize; each bound to an eager run of the stages before it."""
        from moebench.kernels.finalize import finalize

        check_forward_inputs(x, topk_ids, topk_weights, prepared.hidden, prepared.kw.device)
        routing = prepared.route(x, topk_ids, topk_weights, inputs_ready=INPUTS_READY)
        if getattr(prepared, "fused_tactics", {}).get(x.shape[0]) is not None:  # one launch: no GEMM stages alone
            routed = prepared.gemms(routing)
            return [
                ("route", lambda: prepared.route(x, topk_ids, topk_weights, inputs_ready=INPUTS_READY)),
                ("finalize", lambda: finalize(routed)),
            ]
        # (an act_bf16 tactic's H lives in the layer's buffers, which the gemm1 call
        # below rewrites with the same bytes; a copy would make gemm2 dequantize H itself)
        h = prepared.gemm1(routing)
        routed = prepared.gemm2(routing, *h)
        return [
            ("route", lambda: prepared.route(x, topk_ids, topk_weights, inputs_ready=INPUTS_READY)),
            ("gemm1", lambda: prepared.gemm1(routing)),
            ("gemm2", lambda: prepared.gemm2(routing, *h)),
            ("finalize", lambda: finalize(routed)),
        ]

    def routed_call(self, prepared, x, topk_ids, topk_weights):
        """route -> GEMM1 -> GEMM2 (the unfinalized output), as `forward` launches them."""
        check_forward_inputs(x, topk_ids, topk_weights, prepared.hidden, prepared.kw.device)
        return lambda: prepared.forward(x, topk_ids, topk_weights, inputs_ready=INPUTS_READY)
