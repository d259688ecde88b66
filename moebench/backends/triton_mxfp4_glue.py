"""The glue vLLM 0.26.0 runs around triton_kernels' `matmul_ogs` for its
unfused gpt-oss-style MoE experts (`UnfusedOAITritonExperts`), as our own
Triton kernels (read from vLLM's gpt_oss_triton_kernels_moe.py for what they
do; written here, not copied):

- `local_ids`: ids outside [0, E) -> -1, int64 (what vLLM's
  `remap_topk_to_local` makes of non-local ids with an expert map: one launch);
- `make_routing_data`: vLLM's `make_routing_data` on the triton_kernels API it
  vendors (v3.5.1, "legacy"): ids to int16, weights to bf16, the bitmatrix
  packed by one kernel, invalid weights set to -1, then the token sort of
  `routing_from_bitmatrix` with the kernel vLLM patches in for a top_k that is
  not a power of two (DeepSeek-V4's 6: `tl.arange(0, 6 * 32)` does not
  compile, so the slot range is padded to 256 and the tail masked);
- `masked_topk_sum`: vLLM's `masked_moe_sum`, the top-k reduction that skips
  slots whose id is -1 (matmul_ogs leaves their rows unwritten).

This module imports triton and triton_kernels at import: import it only where
both are installed (triton_mxfp4.py does so lazily). Nothing here syncs with
the host; every call launches a fixed number of kernels for a given shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton_kernels.routing import ExptData, GatherIndx, RoutingData, ScatterIndx, _compute_expt_data_internal
from triton_kernels.routing_details._expt_data import _expt_data_compute
from triton_kernels.routing_details._routing_compute import _combined_routing_memset, _keyed_add
from triton_kernels.tensor import Bitmatrix

#: Rows per partial histogram (triton_kernels' HIST_BLOCK_M) and the other
#: block sizes of its token sort.
HIST_BLOCK_M = 32
INDX_OFFS_BLOCK_M = 512
MEMSET_BLOCK = 1024
#: vLLM's pack_bitmatrix tile (rows per program, id columns padded to 32).
PACK_BLOCK_M = 512
PACK_BLOCK_K = 32
#: vLLM's masked_moe_sum tile along H.
SUM_BLOCK = 1024
LOCAL_BLOCK = 1024


@triton.jit
def _local_ids_kernel(ids_ptr, out_ptr, n, experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1).to(tl.int64)
    local = (ids >= 0) & (ids < experts)
    tl.store(out_ptr + offs, tl.where(local, ids, -1), mask=inside)


def local_ids(topk_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """int64 copy of `topk_ids` [rows, top_k] with every id outside [0,
    experts) set to -1 (one kernel)."""
    out = torch.empty(topk_ids.shape, dtype=torch.int64, device=topk_ids.device)
    n = topk_ids.numel()
    _local_ids_kernel[(triton.cdiv(n, LOCAL_BLOCK),)](topk_ids, out, n, experts, BLOCK=LOCAL_BLOCK)
    return out


@triton.jit
def _pack_bitmatrix_kernel(bits_ptr, ids_ptr, rows, top_k, WORDS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """bits[r, w] bit b set <=> some slot of row r holds id 32*w + b (ids < 0
    skipped). The op sequence of vLLM's `pack_bitmatrix` (a 3-D select over
    [BLOCK_M, BLOCK_K, BLOCK_K // 32] reduced along the slots, a runtime
    loop over the words, ids kept in their own dtype): its codegen is what
    is being measured. A 2-D select in a `static_range` over the 12 words
    (this kernel before) compiled on sm_90 to ~17.6k SASS instructions with
    3 KB of stack per thread at rows > 1 (vLLM's: ~6.5k, 2.7 KB)."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    slot = r[:, None] * top_k + k[None, :]
    live = (r < rows)[:, None] & (k < top_k)[None, :]
    ids = tl.load(ids_ptr + slot, mask=live, other=-1)
    valid = ids >= 0
    word = ids // 32
    shift = ids % 32
    one = tl.cast(1, tl.uint32)
    for w in range(WORDS):
        cols = tl.arange(0, BLOCK_K // 32) + w * (BLOCK_K // 32)
        packed = tl.reduce_or(tl.where(valid[:, :, None] & (word[:, :, None] == cols[None, None, :]),
                                       (one << shift)[:, :, None], 0), axis=1)  # fmt: skip
        tl.store(bits_ptr + r[:, None] * WORDS + cols[None, :], packed, mask=r[:, None] < rows)


def pack_bitmatrix(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """uint32 [rows, ceil(experts / 32)] bitmatrix of `ids` [rows, top_k]
    (int16/int32/int64; -1 skipped), zero-initialized then packed, as vLLM's
    make_routing_data does (two launches)."""
    rows, top_k = ids.shape
    if top_k > PACK_BLOCK_K:
        raise ValueError(f"top_k must be at most {PACK_BLOCK_K}, got {top_k}")
    words = triton.cdiv(experts, 32)
    bits = torch.zeros((rows, words), dtype=torch.uint32, device=ids.device)
    _pack_bitmatrix_kernel[(triton.cdiv(rows, PACK_BLOCK_M),)](
        bits, ids, rows, top_k, WORDS=words, BLOCK_M=PACK_BLOCK_M, BLOCK_K=PACK_BLOCK_K
    )
    return bits


@triton.jit
def _sort_slots(pid_m, GatherIndx, ScatterIndx, GateScal, ExptScal, ExptIndx, PartialOffs, stride_pm, stride_pn,
                TokensStart, n_tokens, BLOCK_M: tl.constexpr, TOP_K: tl.constexpr, SPAN: tl.constexpr):  # fmt: skip
    """Slots of rows [pid_m * BLOCK_M, +BLOCK_M) to their expert-sorted
    positions (stable: ascending slot within an expert). SPAN is TOP_K *
    BLOCK_M rounded up to a power of two; lanes past TOP_K * BLOCK_M are dead."""
    CHUNK: tl.constexpr = TOP_K * BLOCK_M
    tl.static_assert(SPAN >= CHUNK)
    tl.static_assert(SPAN <= 32768)
    lane = tl.arange(0, SPAN)
    slot = pid_m * CHUNK + lane
    live = (lane < CHUNK) & (slot < n_tokens * TOP_K)
    expert = tl.load(ExptIndx + slot, mask=live, other=-1).to(tl.uint32)
    key = tl.sort(((expert << 16) | lane).to(tl.uint32), 0)
    expert = key >> 16
    slot = pid_m * CHUNK + (key & 0xFFFF)
    valid = expert != 0xFFFF
    scal = tl.load(ExptScal + slot, mask=valid)
    rank = (tl.associative_scan((key & 0xFFFF0000) | 1, 0, _keyed_add) - 1) & 0xFFFF
    pos = tl.load(PartialOffs + pid_m * stride_pm + expert * stride_pn, mask=valid)
    pos += tl.load(TokensStart + expert, mask=valid)
    pos += rank
    tl.store(ScatterIndx + slot, pos, mask=valid)
    tl.store(GatherIndx + pos, slot, mask=valid)
    tl.store(GateScal + pos, scal, mask=valid)


@triton.jit
def _routing_compute_kernel(GatherIndx, ScatterIndx, GateScal, ExptScal, ExptIndx, PartialOffs, stride_pm, stride_pn,
                            TokensStart, n_tokens, BLOCK_M: tl.constexpr, TOP_K: tl.constexpr, Hist, MDTileStarts,
                            tile_starts_stridem, MDTileInfo, tile_info_stridem, first_tile_dim_log2,
                            SIZES: tl.constexpr, BLOCK: tl.constexpr, blocks2a, SPAN: tl.constexpr):  # fmt: skip
    """triton_kernels' _combined_routing_compute with `_sort_slots` for its
    slot sort: programs [0, blocks2a) fill the per-block_m tile maps, the
    rest sort one HIST_BLOCK_M-row chunk each."""
    pid = tl.program_id(0)
    if pid < blocks2a:
        _expt_data_compute(Hist, MDTileStarts, tile_starts_stridem, MDTileInfo, tile_info_stridem,
                           first_tile_dim_log2, SIZES, BLOCK)  # fmt: skip
    else:
        _sort_slots(pid - blocks2a, GatherIndx, ScatterIndx, GateScal, ExptScal, ExptIndx, PartialOffs, stride_pm,
                    stride_pn, TokensStart, n_tokens, BLOCK_M, TOP_K, SPAN)  # fmt: skip


def sort_tokens(expt_scal: torch.Tensor, expt_indx: torch.Tensor, n_expts_tot: int, bitmatrix: Bitmatrix):
    """triton_kernels.routing.sort_tokens (v3.5.1) for any top_k, as vLLM
    patches it in: the histogram (`Bitmatrix.sum`), one memset/offsets launch,
    one tile-map/slot-sort launch. Returns (hist, topk_indx, gate_indx,
    gate_scal, token_offs_raw, token_offs_pad, block_pid_map)."""
    device, dtype = expt_scal.device, expt_scal.dtype
    n_tokens_raw = bitmatrix.shape[0]
    n_tokens_pad, top_k = expt_scal.shape
    n_gates_pad = n_tokens_pad * top_k
    span = triton.next_power_of_2(HIST_BLOCK_M * top_k)
    hist, partial_hist = bitmatrix.sum(partials_block_size=HIST_BLOCK_M)
    hist = hist[:n_expts_tot]
    expt_offs = torch.empty(n_expts_tot, dtype=torch.int32, device=device)
    combined_indx = torch.empty(n_gates_pad * 2, dtype=torch.int32, device=device)
    topk_indx, gate_indx = combined_indx[:n_gates_pad], combined_indx[n_gates_pad:]
    gate_scal = torch.empty(n_gates_pad, dtype=dtype, device=device)
    (token_offs_combined, token_offs_raw, token_offs_pad, block_pid_map, blocks1a, blocks2a, memset_block_a,
     hist2_block_m, block_m_log2_start, block_m_num) = _compute_expt_data_internal(
        hist, n_expts_tot, n_gates_pad)  # fmt: skip
    blocks1b = triton.cdiv(n_gates_pad * 2, MEMSET_BLOCK) + n_expts_tot + 1
    blocks2b = triton.cdiv(n_tokens_pad, HIST_BLOCK_M)
    _combined_routing_memset[(blocks1a + blocks1b,)](
        combined_indx, n_gates_pad * 2, -1, MEMSET_BLOCK, hist, expt_offs, hist.shape[0], n_expts_tot,
        partial_hist, partial_hist.shape[0], partial_hist.stride(0), partial_hist.stride(1),
        token_offs_combined, token_offs_combined.stride(0), blocks1a, block_pid_map, block_m_log2_start,
        SIZES=block_m_num, BLOCK_A=memset_block_a, BLOCK_N=512, BLOCK_M=INDX_OFFS_BLOCK_M,
    )  # fmt: skip
    _routing_compute_kernel[(blocks2a + blocks2b,)](
        topk_indx, gate_indx, gate_scal, expt_scal, expt_indx, partial_hist, partial_hist.stride(0),
        partial_hist.stride(1), expt_offs, n_tokens_raw, HIST_BLOCK_M, top_k, hist, token_offs_pad,
        token_offs_pad.stride(0), block_pid_map, block_pid_map.stride(0), block_m_log2_start, block_m_num,
        hist2_block_m, blocks2a, span,
    )  # fmt: skip
    return hist, topk_indx, gate_indx, gate_scal, token_offs_raw, token_offs_pad, block_pid_map


def _by_block_m(table: torch.Tensor, log2_start: int) -> dict[int, torch.Tensor]:
    """triton_kernels.routing._unpack_into_dict: row i of `table` is block_m 2^(log2_start+i)."""
    return {2 ** (log2_start + i): table[i, :] for i in range(table.shape[0])}


def make_routing_data(topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: int):
    """vLLM's make_routing_data (legacy triton_kernels API) for `topk_ids`
    [rows, top_k] (local ids or -1) and `topk_weights` [rows, top_k]:
    returns (RoutingData, GatherIndx, ScatterIndx). gate_scal holds the
    bf16-rounded weights in expert-sorted order."""
    from triton_kernels.routing import block_m_log2_start

    ids = topk_ids.to(torch.int16)
    weights = topk_weights.to(torch.bfloat16)
    rows, top_k = ids.shape
    bits = pack_bitmatrix(ids, experts)
    bitmatrix = Bitmatrix(bits, shape=[rows, bits.shape[1] * 32], shape_max=[rows, None], scratchpad=None)
    weights = torch.where(ids == -1, -1.0, weights)  # matmul_ogs' convention for invalid slots
    hist, topk_indx, gate_indx, gate_scal, offs_raw, offs_pad, pid_map = sort_tokens(weights, ids, experts, bitmatrix)
    expt_data = ExptData(hist, offs_raw, _by_block_m(offs_pad, block_m_log2_start),
                         _by_block_m(pid_map, block_m_log2_start))  # fmt: skip
    routing = RoutingData(gate_scal, hist, experts, top_k, expt_data)
    gather = GatherIndx(src_indx=topk_indx, dst_indx=gate_indx)
    return routing, gather, ScatterIndx(src_indx=gate_indx, dst_indx=topk_indx)


@triton.jit
def _masked_topk_sum_kernel(rows_ptr, ids_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        if tl.load(ids_ptr + t * TOP_K + k) >= 0:  # a -1 slot's row was never written: not read
            acc += tl.load(rows_ptr + (t * TOP_K + k) * hidden + cols, mask=inside).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=inside)


def masked_topk_sum(rows: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over k with ids[t, k] >= 0 of rows[t, k] (fp32 sum, stored
    in out's dtype); rows [T, top_k, H] contiguous, ids [T, top_k], out [T, H]."""
    t, top_k, hidden = rows.shape
    _masked_topk_sum_kernel[(t, triton.cdiv(hidden, SUM_BLOCK))](rows, ids, out, hidden, TOP_K=top_k, BLOCK=SUM_BLOCK)
    return out
