"""The fused front kernel: router logits and x -> top-k, MXFP8 x, route record.

One launch replaces the chain router top-k (`moebench.routing.route`) ->
MXFP8 quantization (`quantize.py`) -> route kernel (`route.py`) for 1-8 token
rows, with outputs equal to the chain's bit for bit:

    logits fp32 [rows, E], x bf16 [rows, H]  (+ input ids [rows] for image routing)
      -> topk_ids int32 [rows, top_k], topk_weights fp32 [rows, top_k]
         x_q uint8 (e4m3) [rows, H], x_scale uint8 (E8M0) [rows, H/32]
         record int32 [route_words(max_ctas(rows, top_k, E))], permuted int32 [rows, top_k]

Roles by CTA index, 256 threads each:
  * CTAs 0..7 (cluster 0; the grid launches in clusters of 8): CTA r < rows
    computes row r's DeepSeek-V4 selection keys with all 256 threads
    (`topk.row_scores`: sqrtsoftplus, plus bias or, for an image row,
    bias_vl), then its warp 0 the top-k rounds (`topk.row_rounds`: ties to
    the lower id, NaN last) and sends the ids to CTA 0's shared memory with
    st.async, completing bytes on CTA 0's handoff mbarrier (no second
    cluster barrier, no fence on the sending side); only then does it
    renormalize (`topk.row_weights`: the 1e-20 floor, times the routed
    scale) and write its ids and weights. CTA 0 does the same for row 0,
    waits on the mbarrier (acquire at cluster scope) and runs its copy of
    the route kernel's record builder (`route.build_record`'s fast path
    without the repeat check: a top-k row names each expert at most once;
    the record's defaults and the zeroed map were written before the wait).
  * CTAs 8..: one thread per 32-element block of x, as the quantize kernel
    (`quantize.quantize_block`): ceil(rows*H/32 / 256) CTAs.
Every slot is local (the front routes over all E experts of the rank).

E (a multiple of 32, at most 512) and top_k (1..8) are compile-time values
(a lane holds E/32 scores in registers; the rounds of the top-k unroll),
and image routing (reading bias_vl and the input ids) is a compile-time
switch; rows and H are runtime values. Compiled once per (E, top_k, image,
pdl) and cached.

Programmatic dependent launch (`pdl=True`): the kernel lets its dependents
launch on entry (GEMM1 may prefetch weights; it waits on griddepcontrol
before reading what the front wrote, i.e. for this grid to complete and
flush) and waits on griddepcontrol before any other global access than the
bias loads (the logits, input ids and x come from earlier kernels, and the
outputs may still be read by an earlier kernel; the biases are bound with
the layer and no kernel of a step writes them, so the top-k warps issue
their loads first and the wait hides their latency).
"""

from __future__ import annotations

import functools
from typing import NamedTuple
from dataclasses import dataclass

import torch

from moebench.kernels.host import HAVE_DSL, check_bool, check_tensor, cu_stream, kernel_args, require_dsl
from moebench.kernels.topk import WARP, topk_reason
from moebench.models import MX_BLOCK
from moebench.record import MAX_ROWS, RouteRecord, max_ctas, route_words
from moebench.routing import IMAGE_SENTINELS

#: CTA size: the threads that score one row (and 256 blocks of x per quantize CTA).
THREADS = MAX_ROWS * WARP
#: Cluster size: CTAs 0..7 (cluster 0) compute one row each; all CTAs are
#: launched in clusters of this size (the grid is rounded up to it).
CLUSTER = MAX_ROWS
#: H granularity (the quantize kernel's).
H_MULTIPLE = 128
#: Largest image sentinel: the five ids must fit an int32.
MAX_SENTINEL = 2**31 - 1 - IMAGE_SENTINELS


def to_fp32(value: float) -> float:
    """`value` rounded to fp32 (round to nearest even), as torch rounds a
    Python float into a float32 tensor."""
    return float(torch.tensor(float(value), dtype=torch.float32))


@dataclass(frozen=True)
class FrontConfig:
    """The router's DeepSeek-V4 top-k parameters the fused front applies.

    bias: fp32 [E] score-correction bias (selection only), contiguous, CUDA,
      16-byte aligned; E a multiple of 32 in [32, 512].
    bias_vl: fp32 [E] bias of image rows (same layout and device), or None
      for a router without image routing.
    image_sentinel_lo: first of the five image sentinel token ids, in
      [1, 2^31 - 6] with bias_vl; 0 without.
    scale: the routed scaling factor folded into the weights (finite, > 0;
      applied rounded to fp32, as `routing.route` does).

    The kernel reads the tensors themselves at every call: the config binds
    them (a reload that replaces them must bind again; `front_applies` in
    `moebench.integration.step` refuses until then). Raises TypeError /
    ValueError naming the field.
    """

    bias: torch.Tensor
    bias_vl: torch.Tensor | None = None
    image_sentinel_lo: int = 0
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor, got {type(self.bias).__name__}")
        if self.bias.dim() != 1:
            raise ValueError(f"bias must be 1-D [experts], got shape {tuple(self.bias.shape)}")
        experts = self.bias.shape[0]
        reason = topk_reason(experts, 1)
        if reason:
            raise ValueError(f"bias: {reason}")
        check_tensor("bias", self.bias, torch.float32, (experts,), align=16)
        if self.bias_vl is not None:
            check_tensor(
                "bias_vl", self.bias_vl, torch.float32, (experts,), self.bias.device, device_of="bias", align=16
            )
        lo = self.image_sentinel_lo
        if not isinstance(lo, int) or isinstance(lo, bool):
            raise TypeError(f"image_sentinel_lo must be an int, got {type(lo).__name__}")
        if self.bias_vl is None and lo != 0:
            raise ValueError(f"image_sentinel_lo must be 0 without bias_vl, got {lo}")
        if self.bias_vl is not None and not 1 <= lo <= MAX_SENTINEL:
            raise ValueError(f"image_sentinel_lo must be in [1, {MAX_SENTINEL}] with bias_vl, got {lo}")
        s = self.scale
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < float(s) < float("inf"):
            raise ValueError(f"scale must be a finite number > 0, got {s!r}")
        if not 0 < self.scale_f32 < float("inf"):
            raise ValueError(f"scale must be a finite number > 0 in fp32, got {s!r}")

    @property
    def experts(self) -> int:
        """E, the bias length."""
        return int(self.bias.shape[0])

    @property
    def image(self) -> bool:
        """Whether the front applies image routing (bias_vl is set)."""
        return self.bias_vl is not None

    @property
    def scale_f32(self) -> float:
        """`scale` rounded to fp32 (the multiplier the weights get)."""
        return to_fp32(self.scale)


def _check_static(experts, top_k, image, pdl, deq) -> None:
    """The front's compile-time configuration (FrontKernel and
    compile_front_kernel): TypeError for a non-bool image / pdl / deq,
    ValueError for an experts / top_k `topk.topk_reason` refuses."""
    for name, flag in (("image", image), ("pdl", pdl), ("deq", deq)):
        check_bool(name, flag)
    reason = topk_reason(experts, top_k)
    if reason:
        raise ValueError(reason)


def front_reason(experts, top_k, rows=1, hidden=H_MULTIPLE) -> str | None:
    """Why the fused front cannot take this geometry, or None when it can:
    `topk.topk_reason(experts, top_k)`, rows an int in [1, 8] (one CTA of
    the 8-CTA cluster per row), hidden a positive int multiple of 128 (the quantize
    kernel's granularity)."""
    reason = topk_reason(experts, top_k)
    if reason:
        return reason
    for name, v in (("rows", rows), ("hidden", hidden)):
        if not isinstance(v, int) or isinstance(v, bool):
            return f"{name} must be an int, got {type(v).__name__}"
    if not 1 <= rows <= MAX_ROWS:
        return f"rows must be in [1, {MAX_ROWS}] (one CTA of the 8-CTA cluster per row), got {rows}"
    if hidden <= 0 or hidden % H_MULTIPLE:
        return f"hidden must be a positive multiple of {H_MULTIPLE}, got {hidden}"
    return None


if HAVE_DSL:  # the kernel class needs the DSL's decorators at definition time
    import cuda.bindings.driver as _cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32

    from moebench.kernels.quantize import quantize_block
    from moebench.kernels.route import DEFAULT_KEYS_PER_STEP, MAX_SLOTS, build_record, record_prologue, record_smem
    from moebench.kernels.ptx import mbarrier_try_wait_cluster, st_async_cluster
    from moebench.kernels.topk import row_rounds, row_scores, row_weights

    class FrontArgs(NamedTuple):
        """FrontKernel's run-time arguments, one struct (`host.kernel_args`
        builds it from `FRONT_ARG_SPECS`): see FrontKernel's docstring."""

        logits: cute.Pointer
        bias: cute.Pointer
        bias_vl: cute.Pointer
        input_ids: cute.Pointer
        ids64: Int32
        sentinel_lo: Int32
        scale: Float32
        x: cute.Pointer
        topk_ids: cute.Pointer
        topk_weights: cute.Pointer
        x_q: cute.Pointer
        x_scale: cute.Pointer
        x_deq: cute.Pointer
        permuted: cute.Pointer
        record: cute.Pointer
        rows: Int32
        blocks: Int32

    #: {FrontArgs field: spec} in field order: a pointer's (element type, alignment), a scalar's type.
    FRONT_ARG_SPECS = {
        "logits": (Float32, 16), "bias": (Float32, 16), "bias_vl": (Float32, 16), "input_ids": (Int32, 4),
        "ids64": Int32, "sentinel_lo": Int32, "scale": Float32, "x": (BFloat16, 16), "topk_ids": (Int32, 16),
        "topk_weights": (Float32, 16), "x_q": (Uint8, 16), "x_scale": (Uint8, 16), "x_deq": (BFloat16, 16),
        "permuted": (Int32, 16), "record": (Int32, 16), "rows": Int32, "blocks": Int32,
    }  # fmt: skip

    def stand_in_args() -> FrontArgs:
        """The FrontArgs the kernel is compiled with (any 16-byte aligned addresses)."""
        values = dict(ids64=0, sentinel_lo=0, scale=1.0, rows=1, blocks=H_MULTIPLE // MX_BLOCK)
        return kernel_args(FrontArgs, FRONT_ARG_SPECS, {**dict.fromkeys(FRONT_ARG_SPECS, 16), **values})

    class FrontKernel:
        """The fused front (CuTe DSL, sm_90a): top-k, MXFP8 x and route
        record in one launch of 8 + ceil(rows*H/32 / 256) CTAs of 256 threads
        (rounded up to whole 8-CTA clusters).

        Static configuration: `experts` (E) and `top_k` (the shape class:
        register arrays and unrolled rounds are sized by them), `image` (read
        bias_vl and the input ids) and `pdl` (trigger dependents on entry,
        griddepcontrol.wait before any global access but the bias loads).
        E and top_k are static because a lane holds E/32 scores in registers
        and the top_k rounds unroll. Runtime: the
        global pointers (see `compile_front_kernel`), ids64 (input ids are
        int64), sentinel_lo, scale (fp32), rows and blocks = rows*H/32.
        `deq` (static): also write x_deq, the BF16 operand of act_bf16 GEMM
        tactics (`quantize.quantize_block`).
        """

        def __init__(self, experts: int, top_k: int, image: bool = False, pdl: bool = True, deq: bool = False):
            _check_static(experts, top_k, image, pdl, deq)
            self.deq = deq
            self.experts = experts
            self.top_k = top_k
            self.image = image
            self.pdl = pdl

        @staticmethod
        def can_implement(experts, top_k, rows=1, hidden=H_MULTIPLE) -> tuple[bool, str]:
            """(True, "") or (False, why) for a geometry (`front_reason`)."""
            reason = front_reason(experts, top_k, rows, hidden)
            return (False, reason) if reason else (True, "")

        @cute.jit
        def __call__(self, args: FrontArgs, stream: _cuda.CUstream):
            """Launch 8 + ceil(blocks / 256) CTAs of 256 threads (whole 8-CTA clusters) on `stream`."""
            ctas = (CLUSTER + (args.blocks + (THREADS - 1)) // THREADS + (CLUSTER - 1)) // CLUSTER * CLUSTER
            self.kernel(args).launch(
                grid=[ctas, 1, 1],
                block=[THREADS, 1, 1],
                cluster=[CLUSTER, 1, 1],
                stream=stream,
                use_pdl=self.pdl,
                # one CTA per SM is all it needs: lets ptxas keep every load
                # in flight together rather than sink them to their first use
                min_blocks_per_mp=1,
            )

        @cute.kernel
        def kernel(self, kargs: FrontArgs):
            logits, bias, bias_vl, input_ids, ids64, sentinel_lo, scale, x, topk_ids = kargs[:9]
            topk_weights, x_q, x_scale, x_deq, permuted, record, rows, blocks = kargs[9:]
            tid = cute.arch.thread_idx()[0]
            cta = cute.arch.block_idx()[0]
            smem = cutlass.memory.SmemAllocator()
            s_ids = smem.allocate_tensor(Int32, cute.make_layout(MAX_SLOTS), byte_alignment=16)
            s_key, s_start, s_count, s_map = record_smem(smem)
            e, k = self.experts, self.top_k
            s_scores = smem.allocate_tensor(Float32, cute.make_layout(e), byte_alignment=16)
            s_keys = smem.allocate_tensor(Uint32, cute.make_layout(e), byte_alignment=16)
            handoff = smem.allocate_array(Int64, 1, byte_alignment=8)

            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()

            if cta < CLUSTER:
                # cluster 0: CTA r computes row r; CTA 0's `handoff` mbarrier
                # expects the rows' ids (rows * top_k words, st.async; rows is
                # at most CLUSTER, the host checks it, the min keeps a bad launch
                # from waiting forever) before any CTA of the cluster may write
                # them (init, fence, then the first cluster barrier)
                if cta == 0 and tid == 0:
                    cute.arch.mbarrier_init(handoff, 1)
                    cute.arch.mbarrier_arrive_and_expect_tx(handoff, cutlass.min(rows, CLUSTER) * k * 4)
                    cute.arch.mbarrier_init_fence()
                cute.arch.cluster_arrive_relaxed()
                expert = Int32(-1)
                ids = [Int32(0)] * k
                if cta < rows:
                    # waits on griddepcontrol inside, once the bias loads are out
                    row_scores(
                        cute.recast_ptr(logits, dtype=Uint32) + cta * e,
                        cute.recast_ptr(bias, dtype=Uint32),
                        cute.recast_ptr(bias_vl, dtype=Uint32),
                        input_ids,
                        ids64,
                        sentinel_lo,
                        s_scores,
                        s_keys,
                        cta,
                        tid,
                        e,
                        THREADS,
                        self.image,
                        self.pdl,
                    )
                    if cta == 0:  # the record's defaults and the zeroed map, before the ids exist
                        # (CTA 0 always gets here: the host admits rows 1..8 only)
                        record_prologue(tid, s_map, record, rows, Int32(k), Int32(e), THREADS)
                    cute.arch.sync_threads()
                    if tid < WARP:
                        expert, ids = row_rounds(s_keys, tid, e, k)
                cute.arch.cluster_wait()
                if cta < rows and tid < k:
                    # row `cta`'s ids into CTA 0's shared memory (DSMEM), completing
                    # bytes on its handoff mbarrier: no barrier, no fence on this
                    # side. A sender may exit before its store lands: the rule on
                    # distributed shared memory binds the CTA whose memory is
                    # written (CTA 0 cannot finish before every byte completed).
                    st_async_cluster(s_ids.iterator + (cta * k + tid), handoff, Int32(0), expert)
                # the weights (not needed by the record) while CTA 0 waits for the ids
                self.weights(s_scores, ids, topk_ids, topk_weights, expert, scale, cta, rows, tid)
                if cta == 0:
                    # acquire at cluster scope: st.async completes its bytes with a
                    # cluster-scope release
                    while mbarrier_try_wait_cluster(handoff, Int32(0)) == Uint32(0):
                        pass
                    expert_of_slot = Int32(-1)
                    if tid < rows * k:
                        expert_of_slot = s_ids[tid]
                    build_record(
                        tid,
                        expert_of_slot,
                        s_key,
                        s_start,
                        s_count,
                        s_map,
                        record,
                        permuted,
                        rows,
                        Int32(k),
                        Int32(e),
                        THREADS,
                        DEFAULT_KEYS_PER_STEP,
                        True,
                    )
            else:
                if cutlass.const_expr(self.pdl):
                    cute.arch.griddepcontrol_wait()
                b = (cta - CLUSTER) * THREADS + tid
                if b < blocks:
                    quantize_block(
                        cute.recast_ptr(x, dtype=Uint32),
                        cute.recast_ptr(x_q, dtype=Uint32),
                        x_scale,
                        b,
                        cute.recast_ptr(x_deq, dtype=Uint32),
                        self.deq,
                    )

        @cute.jit
        def weights(self, s_scores, ids, topk_ids, topk_weights, expert, scale, cta, rows, tid):
            """Row `cta`'s renormalized weights (`topk.row_weights`, warp 0)
            and its ids and weights to global memory."""
            if cta < rows and tid < WARP:
                weight = row_weights(s_scores, ids, tid, scale, self.top_k)
                if tid < self.top_k:
                    slot = cta * self.top_k + tid
                    cute.arch.store(topk_ids + slot, expert)
                    cute.arch.store(topk_weights + slot, weight)


_KERNEL = "the fused front kernel"


def compile_front_kernel(experts: int, top_k: int, image: bool = False, pdl: bool = True, deq: bool = False):
    """Compile the fused front once per process and (experts, top_k, image,
    pdl, deq) (cached; see FrontKernel).

    Without a GPU set CUTE_DSL_ARCH=sm_90a to cross-compile for the H200.
    Returns the compiled function, called as `f(args, stream)` with the
    launch's `FrontArgs` (`host.kernel_args` from `FRONT_ARG_SPECS`: 16-byte
    aligned global pointers (fp32 logits / bias / bias_vl, int32 input ids
    (4-byte aligned), bf16 x, int32 topk_ids, fp32 topk_weights, uint8 x_q /
    x_scale, bf16 x_deq (written only with `deq`), int32 permuted /
    record), Int32 ids64 / sentinel_lo / rows / blocks (= rows*H/32),
    Float32 scale) and a cuda.bindings CUstream; `launch_front` does this
    for torch tensors. Raises RuntimeError without
    nvidia-cutlass-dsl, TypeError for a non-bool `image` / `pdl`, ValueError
    for an experts / top_k the kernel cannot take (`topk.topk_reason`)."""
    _check_static(experts, top_k, image, pdl, deq)  # before the cache (1 == True would hit it)
    return _compile(experts, top_k, image, pdl, deq)


@functools.lru_cache(maxsize=None)
def _compile(experts: int, top_k: int, image: bool, pdl: bool, deq: bool = False):
    require_dsl(_KERNEL)

    return cute.compile(FrontKernel(experts, top_k, image, pdl, deq), stand_in_args(), _cuda.CUstream(0))


def _check_inputs(x, logits, config, top_k, input_ids) -> tuple[int, int]:
    """Validate the front's inputs; returns (rows, hidden)."""
    if not isinstance(config, FrontConfig):
        raise TypeError(f"config must be a FrontConfig, got {type(config).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, H], got shape {tuple(x.shape)}")
    rows, hidden = x.shape
    reason = front_reason(config.experts, top_k, rows, hidden)
    if reason:
        name = "x" if reason.startswith(("rows", "hidden")) else "config / top_k"
        raise ValueError(f"{name}: {reason}")
    device = x.device
    check_tensor("x", x, torch.bfloat16, (rows, hidden), align=16)
    check_tensor("logits", logits, torch.float32, (rows, config.experts), device, device_of="x", align=16)
    if config.bias.device != device or (config.image and config.bias_vl.device != device):
        raise ValueError(f"config.bias / bias_vl must be on {device} (the device of x), got {config.bias.device}")
    if config.image:
        if input_ids is None:
            raise ValueError("input_ids is required with image routing (config.bias_vl is set)")
        check_tensor("input_ids", input_ids, (torch.int32, torch.int64), (rows,), device, device_of="x", align=4)
    return rows, hidden


def launch_front(
    x: torch.Tensor,
    logits: torch.Tensor,
    config: FrontConfig,
    top_k: int,
    input_ids: torch.Tensor | None,
    topk_ids_out: torch.Tensor,
    topk_weights_out: torch.Tensor,
    x_q_out: torch.Tensor,
    x_scale_out: torch.Tensor,
    record_out: torch.Tensor,
    permuted_out: torch.Tensor,
    *,
    stream=None,
    pdl: bool = True,
    x_deq_out: torch.Tensor | None = None,
) -> None:
    """Launch the fused front into the given buffers on `stream` (torch's
    current stream when None). No host sync, no allocation: CUDA-graph
    capturable (call it once before capture: the first call loads the
    kernel). Once the stream has run it, the outputs equal the chain
    `routing.route` (router reference on the same device) ->
    `quantize.quantize_mxfp8` -> `route.route` bit for bit.

    x: bfloat16 [rows, H], 1 <= rows <= 8, H a positive multiple of 128,
      contiguous, CUDA, 16-byte aligned.
    logits: float32 [rows, E] router logits, contiguous, 16-byte aligned, on x's device.
    config: the router's FrontConfig (E = config.experts), tensors on x's device.
    top_k: experts per row, int in [1, 8].
    input_ids: int32 / int64 [rows] token ids on x's device, contiguous
      (read only with image routing, where it is required; else may be None).
    topk_ids_out: int32 [rows, top_k]; topk_weights_out: float32 [rows, top_k];
    x_q_out: uint8 or float8_e4m3fn [rows, H]; x_scale_out: uint8 [rows, H/32];
    record_out: int32 [route_words(max_ctas(rows, top_k, E))];
    permuted_out: int32 [rows, top_k] — all contiguous, 16-byte aligned, on
      x's device; every element is written.
    stream: None, a torch.cuda.Stream or a cuda.bindings CUstream.
    pdl: launch with programmatic dependent launch (see the module docstring).
    x_deq_out: None, or bfloat16 [rows, H] (contiguous, 16-byte aligned, on
      x's device) for the BF16 operand of act_bf16 GEMM tactics: the very
      bits `gemm.act_to_bf16(x_q, x_scale)` gives.

    Raises TypeError for a wrong type or dtype, ValueError for a wrong shape,
    range, layout, alignment or device (each naming the argument),
    RuntimeError without nvidia-cutlass-dsl.
    """
    rows, hidden = _check_inputs(x, logits, config, top_k, input_ids)
    device = x.device
    e = config.experts
    for name, t, dtypes, shape in (
        ("topk_ids_out", topk_ids_out, torch.int32, (rows, top_k)),
        ("topk_weights_out", topk_weights_out, torch.float32, (rows, top_k)),
        ("x_q_out", x_q_out, (torch.uint8, torch.float8_e4m3fn), (rows, hidden)),
        ("x_scale_out", x_scale_out, torch.uint8, (rows, hidden // MX_BLOCK)),
        ("record_out", record_out, torch.int32, (route_words(max_ctas(rows, top_k, e)),)),
        ("permuted_out", permuted_out, torch.int32, (rows, top_k)),
    ):
        check_tensor(name, t, dtypes, shape, device, device_of="x", align=16)
    if x_deq_out is not None:
        check_tensor("x_deq_out", x_deq_out, torch.bfloat16, (rows, hidden), device, device_of="x", align=16)
    check_bool("pdl", pdl)
    if device.type != "cuda":
        raise ValueError(f"x and every front tensor must be CUDA tensors, got {device}")
    require_dsl(_KERNEL)
    deq = x_deq_out is not None
    compiled = compile_front_kernel(e, top_k, config.image, pdl, deq)
    bias_vl = config.bias_vl if config.image else config.bias
    ids = input_ids if config.image else topk_ids_out
    sources = dict(
        logits=logits, bias=config.bias, bias_vl=bias_vl, input_ids=ids, ids64=int(ids.dtype == torch.int64),
        sentinel_lo=config.image_sentinel_lo, scale=config.scale_f32, x=x, topk_ids=topk_ids_out,
        topk_weights=topk_weights_out, x_q=x_q_out, x_scale=x_scale_out, x_deq=x_deq_out if deq else x,
        permuted=permuted_out, record=record_out, rows=rows, blocks=rows * hidden // MX_BLOCK,
    )  # fmt: skip
    compiled(kernel_args(FrontArgs, FRONT_ARG_SPECS, sources), cu_stream(stream, device))


@dataclass(frozen=True)
class FrontOutput:
    """What the fused front writes: topk_ids int32 [rows, top_k],
    topk_weights fp32 [rows, top_k], x_q uint8 (e4m3) [rows, H], x_scale
    uint8 (E8M0) [rows, H/32] and the route record with its permute map."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    x_q: torch.Tensor
    x_scale: torch.Tensor
    route: RouteRecord


def front(
    x: torch.Tensor,
    logits: torch.Tensor,
    config: FrontConfig,
    top_k: int,
    input_ids: torch.Tensor | None = None,
    *,
    stream=None,
    pdl: bool = True,
) -> FrontOutput:
    """Allocate the outputs on x's device and launch the fused front (see
    `launch_front`, which says what the arguments must be and what is
    raised). Returns a FrontOutput, equal bit for bit to the chain's once
    the stream has run the kernel."""
    _check_inputs(x, logits, config, top_k, input_ids)
    rows, hidden = x.shape
    device = x.device
    ctas = max_ctas(rows, top_k, config.experts)

    def empty(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device=device)

    out = FrontOutput(
        empty(rows, top_k, dtype=torch.int32), empty(rows, top_k, dtype=torch.float32),
        empty(rows, hidden, dtype=torch.uint8), empty(rows, hidden // MX_BLOCK, dtype=torch.uint8),
        RouteRecord(empty(route_words(ctas), dtype=torch.int32), empty(rows, top_k, dtype=torch.int32), ctas),
    )  # fmt: skip
    launch_front(
        x,
        logits,
        config,
        top_k,
        input_ids,
        out.topk_ids,
        out.topk_weights,
        out.x_q,
        out.x_scale,
        out.route.record,
        out.route.permuted,
        stream=stream,
        pdl=pdl,
    )
    return out
