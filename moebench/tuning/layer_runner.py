"""`moebench tune --fp8`'s last step: the pair against the fused layer.

`LayerRunner` is the tuner's runner for the FP8 family's per-rows choice
between its two GEMMs as the pair (GEMM1 then GEMM2, the tactics the table
holds for those rows) and as one fused launch (`kernels.fused`): its
candidates are `LayerChoice`s, the pair first (the tuner's `prefer`: it
stays unless a fused tactic is faster beyond the noise), then
`fused_candidates`. `check` refuses a fused candidate where the pair's
GEMM1 is two-plane (`margin_reason`: the fused GEMM1 is one-plane and would
give up the numerics margin), then runs it on the oracle's inputs
(`oracle_mismatch`: H judged as GEMM1's fp8 check, the rows as GEMM2's
against the oracle); `time` is the
layer as `GemmStageRunner.time` times it (the plan with the pair or the
fused launch at those rows, bound on every rotated weight set and called
at the layer boundary), so the pair and every fused candidate are timed
side by side on the same rotation, through the runtime's launches. The winners are a table's "fp8.fused" entries
(`kernels.table.LAYER`).
"""

from __future__ import annotations

import torch

from moebench.kernels.fused_tactic import LayerChoice, fused_candidates
from moebench.kernels.layer_plan import LayerPlan
from moebench.kernels.table import LAYER
from moebench.kernels.tactic import GemmTactic
from moebench.record import MAX_ROWS, max_ctas
from moebench.tuning.stage_runner import FP8_H_MARGIN, GemmStageRunner, candidate_plan, h_fp8_mismatch


class LayerRunner(GemmStageRunner):
    """The pair or the fused layer at one shape (module docstring). `tuned`:
    {(stage, rows): fp8 GemmTactic} picked by this tuning run; the pair's
    tactic of a (stage, rows) it lacks is the one the runtime takes
    (`load_tactic` along `search`, default the runtime's: the tuning
    tables, else the built-in fp8 default). The other arguments as
    GemmStageRunner's (the FP8 family's weights)."""

    def __init__(self, shape, device: torch.device, *, tuned: dict[tuple[int, int], GemmTactic] | None = None,
                 search=None, **kwargs) -> None:  # fmt: skip
        from moebench.env import device_info
        from moebench.kernels.fused import fused_workspace_bytes
        from moebench.kernels.gemm import alloc_workspace

        super().__init__(shape, 2, device, fp8=True, **kwargs)
        for key, t in (tuned or {}).items():
            if not (isinstance(t, GemmTactic) and t.fp8):
                raise TypeError(f"tuned[{key}] must be an fp8 GemmTactic, got {t!r}")
        self.tuned = dict(tuned or {})
        self.search = None if search is None else list(search)
        self.device_name = device_info(device).name
        most = max(max_ctas(r, shape.top_k, shape.experts) for r in range(1, MAX_ROWS + 1))
        self.workspace = alloc_workspace(fused_workspace_bytes(most), device)

    def valid_tactics(self, rows: int) -> tuple[LayerChoice, ...]:
        """The pair, then each fused candidate that runs the shape at `rows`."""
        ctas = max_ctas(rows, self.shape.top_k, self.shape.experts)
        return (LayerChoice(None), *(LayerChoice(ft) for ft in fused_candidates(self.gshape, ctas, self.num_sms)))

    def default(self, rows: int, stage: int | None = None) -> LayerChoice:
        """What the tuner prefers when tied: the pair."""
        return LayerChoice(None)

    def pair(self, rows: int) -> tuple[GemmTactic, GemmTactic]:
        """(GEMM1, GEMM2) of the pair at `rows`: this run's picks, else the runtime's."""
        from moebench.kernels.table import ShapeClass, load_tactic

        def one(stage: int) -> GemmTactic:
            if (stage, rows) in self.tuned:
                return self.tuned[stage, rows]
            return load_tactic(self.device_name, ShapeClass.of(self.shape), rows, stage, num_sms=self.num_sms,
                               wide_scales=self.wide, fp8=True, search=self.search)[0]  # fmt: skip

        return one(1), one(2)

    def _layer(self, kw, case: dict, choice: LayerChoice, x_q, x_s, record) -> None:
        """One layer's GEMMs as `choice` says, on the case's buffers."""
        from moebench.kernels.fused import fused_layer
        from moebench.kernels.gemm import gemm1, gemm2

        ctas = case["route"].ctas
        if choice.fused is not None:
            fused_layer(kw, x_q, x_s, record, ctas, case["h_q"], case["h_s"], case["out"], tactic=choice.fused,
                        workspace=self.workspace)  # fmt: skip
            return
        t1, t2 = self.pair(case["rows"])
        gemm1(kw, x_q, x_s, record, ctas, case["h_q"], case["h_s"], tactic=t1,
              topk_ids=case["ids"] if t1.spec else None)  # fmt: skip
        gemm2(kw, case["h_q"], case["h_s"], record, ctas, case["out"], tactic=t2)

    def _case(self, rows: int) -> dict:
        case = super()._case(rows)
        case["rows"] = rows
        return case

    def check(self, choice: LayerChoice, rows: int) -> str | None:
        """None when `choice` may replace the pair at `rows` (`margin_reason`)
        and its H and rows match the oracle's (`oracle_mismatch`), else why."""
        return self.margin_reason(choice, rows) or self.oracle_mismatch(choice, rows)

    def margin_reason(self, choice: LayerChoice, rows: int) -> str | None:
        """Why fused `choice` may not replace the pair at `rows`, or None: the
        fused kernels' GEMM1 is one-plane, and where the pair's GEMM1 is
        two-plane (the FP8 default, issue 36 item 4) the fused layer would give
        up the numerics margin the pair keeps."""
        t1 = self.pair(rows)[0]
        if choice.fused is not None and t1.planes == 2:
            return (f"its GEMM1 is one-plane where the pair's ({t1.name}) is two-plane: it would give up"
                    " the numerics margin (issue 36 item 4)")  # fmt: skip
        return None

    def oracle_mismatch(self, choice: LayerChoice, rows: int) -> str | None:
        """None when `choice`'s H and rows at `rows` match the oracle's, else why."""
        case = self._case(rows)
        used = case["used"]
        case["h_q"].fill_(0xFF)
        case["h_s"].fill_(0xFE)
        case["out"].fill_(float("nan"))
        self._layer(self.kws[0], case, choice, case["x_q"], case["x_s"], case["route"].record)
        self._sync()
        bad = h_fp8_mismatch(  # the tuner's floor (the fused layer's one-plane GEMM1 passed it on the H100, 2026-12-06)
            case["h_q"][:used], case["h_s"][:used], case["ref_q"][:used], case["ref_s"][:used], least=FP8_H_MARGIN
        )
        return f"H: {bad}" if bad else self.rows_mismatch(case)

    def plan(self, choice: LayerChoice, rows: int) -> LayerPlan:
        """The layer plan `time` binds for `choice` at `rows`: the pair's
        tactics (`pair`) at `rows`, run as the pair or as `choice`'s fused
        launch (`GemmStageRunner.time` times it: the runtime's launches, at
        the layer boundary, on every rotated weight set)."""
        t1, t2 = self.pair(rows)
        pair = self.base_plan.with_tactic(1, rows, t1, "pair").with_tactic(2, rows, t2, "pair")
        return candidate_plan(pair, LAYER, rows, choice)


__all__ = ["LayerRunner"]
