"""The route kernel: top-k ids -> route record + permute map, on the GPU.

One CTA builds, from top-k ids int32 [rows, top_k] (0 <= rows <= 8,
1 <= top_k <= 8) and the number of local experts (1..512), the route record
int32 [route_words(max_ctas(rows, top_k, experts))] and the permute map int32
[rows, top_k] that GEMM1 and GEMM2 read. Both are bit-exact with
`moebench.record.build_route_record`, every word included (unused tiles:
tile_expert -1, tile_valid_rows 0, tile_slots -1). rows, top_k and experts
are runtime values: one compiled kernel serves every shape.

Method (slots s = t*top_k + k, at most 64): slot s of a local expert e gets
the key e*64 + s, a non-local slot a sentinel above every key. Keys are
distinct and order the slots as the record does (expert first, then slot),
so with one thread per slot and the keys in shared memory:
  * rank of s within its expert  r = #{keys < e*64 + s} - #{keys < e*64},
    the expert's slot count       n = #{keys < (e+1)*64} - #{keys < e*64};
  * s starts a tile iff r % 8 == 0; its tile index is the number of tile
    starters whose key is <= s's key, minus one (tiles ascend by expert, then
    by chunk, exactly the order of the starters' keys);
  * s sits in permuted row tile*8 + r%8; a starter writes its tile's expert
    and min(8, n - r) valid rows.
All threads first fill the unused-word defaults; two barriers later the used
words are scattered over them. That method is the device function
`build_record`, which the fused front (`front.py`) shares.

Fast path (the fused front always takes it: its rows are top-k rows; the
route kernel tries it where the scans would take more than one step, slots >
keys_per_step, and keeps it unless a row names a local expert twice;
non-local slots are skipped as above). With no repeats every expert has at
most rows <= 8 slots, so one tile, and its slots ascend by row. Each slot ORs its
row bit into its expert's 8-bit row mask and its expert's bit into a
512-bit used-expert map (shared-memory atomics; the old row mask shows a
repeated expert, and a barrier with an OR reduction sends the whole CTA to
the method above if any slot saw one). Then, with no scan over the keys:
  rank  = popcount(row mask & rows below mine),  n = popcount(row mask),
  tile  = used experts below mine (popcounts of the map's words),
the same words as the scans give, in constant time per slot.

Fused with the MXFP8 quantization of x (`quantize=True`, `launch_route_quantize`):
CTA 0 builds the record as above while CTAs 1.. quantize x, one thread per
32-element block (`quantize.quantize_block`, the quantize kernel's device
function), so the route binding's two launches become one (as the fused
front does with the top-k too). Same bytes as the two kernels.

Programmatic dependent launch (`pdl=True`): the kernel lets its dependents
launch on entry (the GEMM that follows may prefetch weights; it waits on
griddepcontrol before reading the record, i.e. for this grid to complete and
flush) and waits on griddepcontrol before touching global memory (the ids
come from the previous kernel, and the record buffer may still be read by an
earlier kernel). With `inputs_ready` (the caller's promise that topk_ids and
x were complete when this kernel launched: the kernel before it does not
write them, or releases its dependents only at its end, as every torch
kernel does) it reads the ids and x and quantizes before the wait and lets
its dependents launch on entry; after the wait it only builds and writes.
GEMM1's `spec` producer may then read the ids before its own wait, too.
"""

from __future__ import annotations

import functools

import torch

from moebench.kernels.host import HAVE_DSL, check_bool, check_tensor, cu_stream, gmem_ptr, require_dsl
from moebench.record import (
    MAX_EXPERTS,
    MAX_ROWS,
    MAX_TOP_K,
    TILE,
    RouteRecord,
    check_topk_ids,
    max_ctas,
    route_words,
)

#: Most (row, k) slots the kernel routes: one thread each.
MAX_SLOTS = MAX_ROWS * MAX_TOP_K
#: Slot bits of a sort key (key = expert * 64 + slot).
_SLOT_BITS = 6
#: Key of a non-local slot: above every local key (at most 512 * 64 - 1).
_SENTINEL = 1 << 30
#: Words of the fast path's used-expert bitmap (one bit per local expert).
_USED_WORDS = MAX_EXPERTS // 32
#: Words of the fast path's shared map: the bitmap, then an 8-bit row mask per expert.
MAP_WORDS = _USED_WORDS + MAX_EXPERTS // 4

assert MAX_SLOTS <= 1 << _SLOT_BITS and MAX_EXPERTS << _SLOT_BITS < _SENTINEL
#: Allowed keys per scan step (tactic) and the default.
KEYS_PER_STEP = (4, 8, 16, 32)
DEFAULT_KEYS_PER_STEP = 16


def _check_keys_per_step(keys_per_step) -> None:
    if not isinstance(keys_per_step, int) or isinstance(keys_per_step, bool) or keys_per_step not in KEYS_PER_STEP:
        raise ValueError(f"keys_per_step must be one of {KEYS_PER_STEP}, got {keys_per_step!r}")


def _check_static(pdl, keys_per_step, quantize, deq, release_after_wait=False, inputs_ready=False,
                  launch_pdl=True) -> None:  # fmt: skip
    """The route kernel's compile-time switches (RouteKernel and
    compile_route_kernel): TypeError for a non-bool flag, ValueError for a
    keys_per_step not in KEYS_PER_STEP or deq without quantize."""
    for name, flag in (
        ("pdl", pdl),
        ("quantize", quantize),
        ("deq", deq),
        ("release_after_wait", release_after_wait),
        ("inputs_ready", inputs_ready),
        ("launch_pdl", launch_pdl),
    ):
        check_bool(name, flag)
    _check_keys_per_step(keys_per_step)
    if deq and not quantize:
        raise ValueError("deq=True needs quantize=True (x_deq is written by the quantizing CTAs)")


if HAVE_DSL:  # the kernel class needs the DSL's decorators at definition time
    import cuda.bindings.driver as _cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Int32, Uint8, Uint32

    from moebench.kernels.ptx import sync_threads_or
    from moebench.kernels.quantize import load_block, quantize_block, quantize_words, store_block

    def record_smem(smem):
        """The shared memory `build_record` works in, from a SmemAllocator:
        (keys int32 [64], tile starters int32 [64], per-warp counts int32 [4],
        the fast path's map uint32 [MAP_WORDS]: used-expert bits, then the
        experts' 8-bit row masks, four per word)."""
        s_key = smem.allocate_tensor(Int32, cute.make_layout(MAX_SLOTS), byte_alignment=16)
        s_start = smem.allocate_tensor(Int32, cute.make_layout(MAX_SLOTS), byte_alignment=16)
        s_count = smem.allocate_tensor(Int32, cute.make_layout(MAX_SLOTS // 16), byte_alignment=16)
        s_map = smem.allocate_tensor(Uint32, cute.make_layout(MAP_WORDS), byte_alignment=16)
        return s_key, s_start, s_count, s_map

    @cute.jit
    def _scatter(tid, slots, local, e, tile, pos, valid_rows, starts, w, g_rec, g_perm):
        """Slot `tid`'s words: its permute-map entry and permuted row, and
        for a tile starter the tile's expert and valid rows."""
        if tid < slots:
            if local:
                row = tile * TILE + pos
                g_perm[tid] = row
                g_rec[4 + 2 * w + row] = tid
                if starts:
                    g_rec[4 + tile] = e
                    g_rec[4 + w + tile] = valid_rows
            else:
                g_perm[tid] = Int32(-1)

    @cute.jit
    def _geometry(rows, top_k, experts):
        """(slots, w, body) of the record (record.max_ctas / cta_words /
        route_words): slot count, words per tile table, words after the header."""
        slots = rows * top_k
        filled = cutlass.min(experts, slots)
        ctas = filled + (slots - filled) // TILE
        w = (ctas + 3) // 4 * 4
        return slots, w, 2 * w + TILE * ctas

    @cute.jit
    def _row_bit(tid, top_k):
        """1 << (tid // top_k) for tid < 8 * top_k (every slot thread): slot
        tid's row bit, by compares (top_k is a runtime value in the route
        kernel; no division on the path)."""
        row = Int32(0)
        for j in cutlass.range_constexpr(1, MAX_ROWS):
            row = row + Int32(tid >= j * top_k)
        return Uint32(1) << Uint32(row)

    @cute.jit
    def record_prologue(tid, s_map, record, rows, top_k, experts, threads: cutlass.Constexpr[int], zero_map=True):
        """What `build_record` does before it needs the ids: every body word
        of the record gets its unused default (tile_expert -1,
        tile_valid_rows 0, tile_slots -1) and, with `zero_map` (a runtime or
        Python bool), the fast path's map is zeroed. Called by every thread
        of the CTA; a CTA barrier must separate it from
        `build_record(distinct=True)`."""
        slots, w, body = _geometry(rows, top_k, experts)
        g_rec = cute.make_tensor(record, cute.make_layout(4 + 2 * MAX_SLOTS + TILE * MAX_SLOTS))
        for i in cutlass.range(tid, body, threads, unroll=1):
            g_rec[4 + i] = Int32(0) if (i >= w and i < 2 * w) else Int32(-1)
        if zero_map:
            for i in cutlass.range_constexpr(0, MAP_WORDS, threads):
                if tid + i < MAP_WORDS:
                    s_map[tid + i] = Uint32(0)

    @cute.jit
    def build_record(
        tid: Int32,
        e: Int32,
        s_key: cute.Tensor,
        s_start: cute.Tensor,
        s_count: cute.Tensor,
        s_map: cute.Tensor,
        record: cute.Pointer,
        permuted: cute.Pointer,
        rows: Int32,
        top_k: Int32,
        experts: Int32,
        threads: cutlass.Constexpr[int],
        keys_per_step: cutlass.Constexpr[int],
        distinct: cutlass.Constexpr[bool],
    ):
        """Write the route record and permute map (device code, shared by
        RouteKernel and the fused front; method in the module docstring).

        Called by every one of the CTA's `threads` threads (>= 64) with its
        thread index `tid` and, for tid < rows*top_k, the expert id `e` of
        slot tid (any value for the other threads); `s_key` / `s_start` /
        `s_count` / `s_map` from `record_smem`; record / permuted: int32 global
        pointers; rows / top_k / experts as in `RouteKernel`.
        `distinct=False` (the route kernel: any ids): runs `record_prologue`
        itself, then the scans when they take one step (slots <=
        keys_per_step), else the fast path, which falls back to the scans
        when a row repeats an expert; two or three CTA barriers.
        `distinct=True` (the fused front): the caller guarantees that every
        id is local and no row repeats one, and has run `record_prologue`
        and a CTA barrier since; the fast path without the check, one CTA
        barrier. The caller must have made `e` readable (no barrier is
        needed before the call)."""
        slots, w, body = _geometry(rows, top_k, experts)
        g_rec = cute.make_tensor(record, cute.make_layout(4 + 2 * MAX_SLOTS + TILE * MAX_SLOTS))
        g_perm = cute.make_tensor(permuted, cute.make_layout(MAX_SLOTS))
        shift = Uint32((e & 3) * 8)
        if cutlass.const_expr(distinct):
            local = tid < slots
            row_bit = _row_bit(tid, top_k)
            if local:
                _mark_slot(s_map, e, row_bit, shift)
            cute.arch.sync_threads()
            _fast(tid, e, local, row_bit, shift, s_map, slots, w, g_rec, g_perm, slots, rows, top_k)
        else:
            record_prologue(tid, s_map, record, rows, top_k, experts, threads, slots > keys_per_step)
            key = Int32(_SENTINEL)
            if tid < slots and e >= 0 and e < experts:
                key = (e << _SLOT_BITS) + tid
            if tid < MAX_SLOTS:
                s_key[tid] = key  # slots .. 63 hold the sentinel
            local = key != _SENTINEL
            warp = tid // 32
            n_local = cute.arch.popc(cute.arch.vote_ballot_sync(local))
            if tid % 32 == 0 and warp < MAX_SLOTS // 32:
                s_count[warp] = n_local
            cute.arch.sync_threads()
            scan = Int32(1)
            if slots > keys_per_step:  # the scans take more than one step: try the fast path
                row_bit = _row_bit(tid, top_k)
                repeated = Int32(0)
                if local:
                    repeated = _mark_slot(s_map, e, row_bit, shift)
                scan = sync_threads_or(repeated)
                if scan == Int32(0):
                    _fast(
                        tid,
                        e,
                        local,
                        row_bit,
                        shift,
                        s_map,
                        slots,
                        w,
                        g_rec,
                        g_perm,
                        s_count[0] + s_count[1],
                        rows,
                        top_k,
                    )
            if scan != Int32(0):
                _scans(tid, e, key, local, s_key, s_start, s_count, slots, w, g_rec, g_perm, rows, top_k, keys_per_step)

    @cute.jit
    def _mark_slot(s_map, e, row_bit, shift):
        """The fast path's map entries of a local slot of expert `e`: its row
        bit into the expert's row mask, the expert's bit into the used-expert
        bitmap (shared-memory atomics). Returns Int32 1 if the row bit was
        already set (the row names `e` twice), else 0."""
        old = cute.arch.atomic_or(s_map.iterator + (_USED_WORDS + (e >> 2)), row_bit << shift, scope="cta")
        cute.arch.atomic_or(s_map.iterator + (e >> 5), Uint32(1) << Uint32(e & 31), scope="cta")
        return Int32(((old >> shift) & row_bit) != Uint32(0))

    @cute.jit
    def _fast(tid, e, local, row_bit, shift, s_map, slots, w, g_rec, g_perm, valid, rows, top_k):
        """The fast path after the map is complete (module docstring): rank,
        slot count and tile of slot `tid` from the map, its words, and (tid 0)
        the header with `valid` local slots."""
        tile, rank, count = Int32(0), Int32(0), Int32(0)
        if local:
            mask = (s_map[_USED_WORDS + (e >> 2)] >> shift) & Uint32(0xFF)
            rank = Int32(cute.arch.popc(mask & (row_bit - Uint32(1))))
            count = Int32(cute.arch.popc(mask))
            word = e >> 5
            tile = Int32(cute.arch.popc(s_map[word] & ((Uint32(1) << Uint32(e & 31)) - Uint32(1))))
            for j in cutlass.range_constexpr(_USED_WORDS):
                tile = tile + (Int32(cute.arch.popc(s_map[j])) if j < word else Int32(0))
        _scatter(tid, slots, local, e, tile, rank, count, rank == 0, w, g_rec, g_perm)
        if tid == 0:
            tiles = Int32(0)
            for j in cutlass.range_constexpr(_USED_WORDS):
                tiles = tiles + Int32(cute.arch.popc(s_map[j]))
            _header(g_rec, tiles, valid, rows, top_k)

    @cute.jit
    def _scans(
        tid,
        e,
        key,
        local,
        s_key,
        s_start,
        s_count,
        slots,
        w,
        g_rec,
        g_perm,
        rows,
        top_k,
        keys_per_step: cutlass.Constexpr[int],
    ):
        """The method of the module docstring over the keys in `s_key`: two
        scans (keys_per_step keys a step, up to the step holding the last
        slot), one CTA barrier between them, then the words and the header."""
        step = keys_per_step
        steps = (slots + step - 1) // step
        lo = (key >> _SLOT_BITS) << _SLOT_BITS
        hi = lo + (1 << _SLOT_BITS)
        c_lo, c_me, c_hi = Int32(0), Int32(0), Int32(0)
        for g in cutlass.range(steps, unroll=1):
            for q in cutlass.range_constexpr(step):
                kj = s_key[g * step + q]
                c_lo = c_lo + Int32(kj < lo)
                c_me = c_me + Int32(kj < key)
                c_hi = c_hi + Int32(kj < hi)
        rank = c_me - c_lo  # rank within the expert
        count = c_hi - c_lo  # the expert's slot count
        pos = rank % TILE
        starts = local and pos == 0
        if tid < MAX_SLOTS:
            s_start[tid] = key if starts else Int32(_SENTINEL)
        warp = tid // 32
        n_starts = cute.arch.popc(cute.arch.vote_ballot_sync(starts))
        if tid % 32 == 0 and warp < MAX_SLOTS // 32:
            s_count[MAX_SLOTS // 32 + warp] = n_starts
        cute.arch.sync_threads()
        c_tile = Int32(0)  # tile starters with a key <= mine
        for g in cutlass.range(steps, unroll=1):
            for q in cutlass.range_constexpr(step):
                c_tile = c_tile + Int32(s_start[g * step + q] <= key)
        _scatter(tid, slots, local, e, c_tile - 1, pos, cutlass.min(count - rank, TILE), starts, w, g_rec, g_perm)
        if tid == 0:
            tiles, valid = Int32(0), Int32(0)
            for w_ in cutlass.range_constexpr(MAX_SLOTS // 32):
                valid = valid + s_count[w_]
                tiles = tiles + s_count[MAX_SLOTS // 32 + w_]
            _header(g_rec, tiles, valid, rows, top_k)

    @cute.jit
    def _header(g_rec, tiles, valid, rows, top_k):
        """The record's four header words."""
        g_rec[0] = tiles
        g_rec[1] = valid
        g_rec[2] = rows
        g_rec[3] = top_k

    class RouteKernel:
        """The route kernel (CuTe DSL, sm_90a): one CTA, or with `quantize`
        that CTA plus ceil(blocks / threads) CTAs quantizing x.

        Static configuration: `pdl` (bool, launch with programmatic dependent
        launch: trigger dependents on entry, griddepcontrol.wait before the
        first global access), `threads` (CTA size, a multiple of 32 with at
        least MAX_SLOTS = 64 threads: one per slot; all of them fill the
        record's unused words), `keys_per_step` (keys each thread compares
        per step of its two scans over the shared keys, one of KEYS_PER_STEP:
        a step's loads go out together; the scans stop at the step holding
        the last slot; more slots than keys_per_step try the fast path
        first), `quantize` (bool: also MXFP8-quantize x) and `deq`
        (bool, with `quantize`: also write x_deq, the BF16 operand of act_bf16
        GEMM tactics). Runtime: the ids / record / permuted int32 pointers,
        rows, top_k, experts (Int32), and x (bf16) / x_q / x_scale (uint8) /
        x_deq (bf16) pointers with blocks = rows*H/32 (read only with
        `quantize`). `inputs_ready` (with pdl): read and quantize before
        griddepcontrol.wait, release the dependents on entry (module
        docstring). `launch_pdl` False (with pdl): the launch itself drops the
        programmatic attribute, so the kernel starts only once the kernel
        before it has completed, as a plain launch does; its body is pdl's
        (griddepcontrol.wait is then a no-op, the dependents still launch
        early): the route timed the way a peer's first kernel is.
        """

        def __init__(
            self,
            pdl: bool = True,
            threads: int = 128,
            keys_per_step: int = DEFAULT_KEYS_PER_STEP,
            quantize: bool = False,
            deq: bool = False,
            release_after_wait: bool = False,
            inputs_ready: bool = False,
            launch_pdl: bool = True,
        ):
            _check_static(pdl, keys_per_step, quantize, deq, release_after_wait, inputs_ready, launch_pdl)
            self.launch_pdl = launch_pdl
            self.release_after_wait = release_after_wait
            self.inputs_ready = inputs_ready
            self.quantize = quantize
            self.deq = deq
            if (
                not isinstance(threads, int)
                or isinstance(threads, bool)
                or threads < MAX_SLOTS
                or threads % 32
                or threads > 1024
            ):
                raise ValueError(f"threads must be a multiple of 32 in [{MAX_SLOTS}, 1024], got {threads!r}")
            self.pdl = pdl
            self.threads = threads
            self.keys_per_step = keys_per_step

        @staticmethod
        def can_implement(rows: int, top_k: int, experts: int) -> tuple[bool, str]:
            """Whether the kernel can route `rows` x `top_k` slots over `experts`
            local experts: (True, "") or (False, the reason)."""
            for name, v, lo, hi in (
                ("rows", rows, 0, MAX_ROWS),
                ("top_k", top_k, 1, MAX_TOP_K),
                ("experts", experts, 1, MAX_EXPERTS),
            ):
                if not isinstance(v, int) or isinstance(v, bool):
                    return False, f"{name} must be an int, got {type(v).__name__}"
                if not lo <= v <= hi:
                    return False, f"{name} must be in [{lo}, {hi}], got {v}"
            return True, ""

        @cute.jit
        def __call__(
            self,
            ids: cute.Pointer,
            record: cute.Pointer,
            permuted: cute.Pointer,
            rows: Int32,
            top_k: Int32,
            experts: Int32,
            x: cute.Pointer,
            x_q: cute.Pointer,
            x_scale: cute.Pointer,
            x_deq: cute.Pointer,
            blocks: Int32,
            stream: _cuda.CUstream,
        ):
            """Launch one CTA of `threads` threads (with `quantize`: 1 +
            ceil(blocks / threads)) on `stream`."""
            ctas = 1
            if cutlass.const_expr(self.quantize):
                ctas = 1 + (blocks + (self.threads - 1)) // self.threads
            self.kernel(ids, record, permuted, rows, top_k, experts, x, x_q, x_scale, x_deq, blocks).launch(
                grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl and self.launch_pdl
            )

        @cute.kernel
        def kernel(
            self,
            ids: cute.Pointer,
            record: cute.Pointer,
            permuted: cute.Pointer,
            rows: Int32,
            top_k: Int32,
            experts: Int32,
            x: cute.Pointer,
            x_q: cute.Pointer,
            x_scale: cute.Pointer,
            x_deq: cute.Pointer,
            blocks: Int32,
        ):
            tid = cute.arch.thread_idx()[0]
            cta = cute.arch.block_idx()[0]
            s_key, s_start, s_count, s_map = record_smem(cutlass.memory.SmemAllocator())
            g_ids = cute.make_tensor(ids, cute.make_layout(MAX_SLOTS))

            early = self.pdl and self.inputs_ready  # reads before the wait (module docstring)
            if cutlass.const_expr(self.pdl):
                if cutlass.const_expr(early):
                    cute.arch.griddepcontrol_launch_dependents()
                elif cutlass.const_expr(self.release_after_wait):
                    # the ids (from the kernel before) are complete once the wait returns: a
                    # dependent may then read them before its own wait (GEMM1's `spec` tactics)
                    cute.arch.griddepcontrol_wait()
                    cute.arch.griddepcontrol_launch_dependents()
                else:
                    cute.arch.griddepcontrol_launch_dependents()
                    cute.arch.griddepcontrol_wait()

            if cta == 0:
                e = Int32(-1)
                if tid < rows * top_k:
                    e = g_ids[tid]  # issued before the fill's stores
                if cutlass.const_expr(early):
                    cute.arch.griddepcontrol_wait()  # the record buffers may still be read before
                build_record(
                    tid,
                    e,
                    s_key,
                    s_start,
                    s_count,
                    s_map,
                    record,
                    permuted,
                    rows,
                    top_k,
                    experts,
                    self.threads,
                    self.keys_per_step,
                    False,
                )
            else:  # only launched with quantize
                if cutlass.const_expr(self.quantize):
                    b = (cta - 1) * self.threads + tid
                    px, pq = cute.recast_ptr(x, dtype=Uint32), cute.recast_ptr(x_q, dtype=Uint32)
                    pd = cute.recast_ptr(x_deq, dtype=Uint32)
                    if cutlass.const_expr(early):  # load and quantize now, store after the wait
                        bb = cutlass.min(b, blocks - 1)  # a thread past the end quantizes the last block, unstored
                        out, code = quantize_words(load_block(px, bb))
                        cute.arch.griddepcontrol_wait()
                        if b < blocks:
                            store_block(pq, x_scale, b, out, code, pd, self.deq)
                    else:
                        if b < blocks:
                            quantize_block(px, pq, x_scale, b, pd, self.deq)


_KERNEL = "the route kernel"


def compile_route_kernel(
    pdl: bool = True,
    keys_per_step: int = DEFAULT_KEYS_PER_STEP,
    quantize: bool = False,
    deq: bool = False,
    release_after_wait: bool = False,
    inputs_ready: bool = False,
    launch_pdl: bool = True,
):
    """Compile the route kernel once per process and (pdl, keys_per_step,
    quantize, deq, release_after_wait, inputs_ready, launch_pdl) (cached;
    see RouteKernel).

    Without a GPU set CUTE_DSL_ARCH=sm_90a to cross-compile for the H200.
    Returns the compiled function, called as
    `f(ids_ptr, record_ptr, permuted_ptr, rows, top_k, experts, x_ptr,
    x_q_ptr, x_scale_ptr, x_deq_ptr, blocks, stream)` with int32 (ids,
    record, permuted), bf16 (x, x_deq; 16-byte aligned) and uint8 (x_q,
    x_scale; 16-byte aligned) global-memory pointers
    (cutlass.cute.runtime.make_ptr; the x pointers are read only with
    `quantize`, x_deq only with `deq`), Int32 counts and a cuda.bindings
    CUstream; `launch_route` / `launch_route_quantize` do this for torch
    tensors. Raises RuntimeError without nvidia-cutlass-dsl, TypeError for a
    non-bool pdl / quantize / deq, ValueError for a `keys_per_step` not in
    KEYS_PER_STEP or deq without quantize."""
    _check_static(pdl, keys_per_step, quantize, deq, release_after_wait, inputs_ready, launch_pdl)  # before the cache
    return _compile(pdl, keys_per_step, quantize, deq, release_after_wait, inputs_ready, launch_pdl)


@functools.lru_cache(maxsize=None)
def _compile(
    pdl: bool,
    keys_per_step: int,
    quantize: bool,
    deq: bool,
    release_after_wait: bool = False,
    inputs_ready: bool = False,
    launch_pdl: bool = True,
):
    require_dsl(_KERNEL)

    def fake(dtype=Int32, align=4):
        return gmem_ptr(dtype, 16, align)

    return cute.compile(RouteKernel(pdl=pdl, keys_per_step=keys_per_step, quantize=quantize, deq=deq,
                                    release_after_wait=release_after_wait, inputs_ready=inputs_ready,
                                    launch_pdl=launch_pdl),
                        fake(), fake(), fake(), Int32(1), Int32(1), Int32(1),
                        fake(BFloat16, 16), fake(Uint8, 16), fake(Uint8, 16), fake(BFloat16, 16), Int32(4),
                        _cuda.CUstream(0))  # fmt: skip


def _check_ids(topk_ids, experts) -> tuple[int, int]:
    """`topk_ids` as the route kernel reads it (int32, contiguous; and
    `check_topk_ids`); returns (rows, top_k)."""
    check_topk_ids(topk_ids, experts)
    if topk_ids.dtype != torch.int32:
        raise TypeError(f"topk_ids must be int32, got {topk_ids.dtype}")
    if not topk_ids.is_contiguous():
        raise ValueError("topk_ids must be contiguous")
    return topk_ids.shape[0], topk_ids.shape[1]


def _check_outs(record_out, permuted_out, rows: int, top_k: int, experts: int, device: torch.device) -> None:
    """The record and permute-map buffers, int32 on topk_ids' `device`."""
    for name, t, shape in (
        ("record_out", record_out, (route_words(max_ctas(rows, top_k, experts)),)),
        ("permuted_out", permuted_out, (rows, top_k)),
    ):
        check_tensor(name, t, torch.int32, shape, device, device_of="topk_ids")


def _run(
    compiled, topk_ids, record_out, permuted_out, experts: int, x, x_q, x_scale, x_deq, blocks: int, stream, device
) -> None:
    """Launch a compiled route kernel; x / x_q / x_scale / x_deq: its
    quantization operands (tensors, or one 16-byte aligned address that a
    kernel without `quantize` never reads)."""
    rows, top_k = topk_ids.shape
    compiled(
        gmem_ptr(Int32, topk_ids, 4),
        gmem_ptr(Int32, record_out, 4),
        gmem_ptr(Int32, permuted_out, 4),
        Int32(rows),
        Int32(top_k),
        Int32(experts),
        gmem_ptr(BFloat16, x, 16),
        gmem_ptr(Uint8, x_q, 16),
        gmem_ptr(Uint8, x_scale, 16),
        gmem_ptr(BFloat16, x_deq, 16),
        Int32(blocks),
        cu_stream(stream, device),
    )


def launch_route(
    topk_ids: torch.Tensor,
    record_out: torch.Tensor,
    permuted_out: torch.Tensor,
    experts: int,
    *,
    stream=None,
    pdl: bool = True,
    keys_per_step: int = DEFAULT_KEYS_PER_STEP,
) -> None:
    """Launch the route kernel: write the route record and permute map of
    `topk_ids` into the given buffers, on `stream` (torch's current stream
    when None). No host sync, no allocation: CUDA-graph capturable (call it
    once before capture: the first call loads the kernel).

    topk_ids: int32 [rows, top_k], contiguous, CUDA; 0 <= rows <= 8,
      1 <= top_k <= 8; ids outside [0, experts) are non-local.
    record_out: int32 [route_words(max_ctas(rows, top_k, experts))], contiguous,
      on topk_ids' device; every word is written.
    permuted_out: int32 [rows, top_k], contiguous, same device; every entry
      is written (-1 for non-local slots).
    experts: local experts, int in [1, 512].
    stream: None, a torch.cuda.Stream or a cuda.bindings CUstream.
    pdl: launch with programmatic dependent launch (see the module docstring).
    keys_per_step: scan step of the kernel, one of KEYS_PER_STEP (a tactic;
      every value gives the same bits).

    Raises TypeError for a wrong type or dtype, ValueError for a wrong shape,
    range, layout or device (each naming the argument), RuntimeError without
    nvidia-cutlass-dsl.
    """
    rows, top_k = _check_ids(topk_ids, experts)
    device = topk_ids.device
    _check_outs(record_out, permuted_out, rows, top_k, experts, device)
    check_bool("pdl", pdl)
    _check_keys_per_step(keys_per_step)
    if device.type != "cuda":
        raise ValueError(f"topk_ids, record_out and permuted_out must be CUDA tensors, got {device}")
    require_dsl(_KERNEL)
    unused = record_out.data_ptr() // 16 * 16  # x stand-ins, never read without quantize
    _run(
        compile_route_kernel(pdl, keys_per_step),
        topk_ids,
        record_out,
        permuted_out,
        experts,
        unused,
        unused,
        unused,
        unused,
        0,
        stream,
        device,
    )


def launch_route_quantize(
    x: torch.Tensor,
    x_q_out: torch.Tensor,
    x_scale_out: torch.Tensor,
    topk_ids: torch.Tensor,
    record_out: torch.Tensor,
    permuted_out: torch.Tensor,
    experts: int,
    *,
    stream=None,
    pdl: bool = True,
    x_deq_out: torch.Tensor | None = None,
    release_after_wait: bool = False,
    inputs_ready: bool = False,
    launch_pdl: bool = True,
) -> None:
    """One launch for the route binding: the route record and permute map
    of `topk_ids` (as `launch_route`) and the MXFP8 quantization of `x` (as
    `quantize.launch_quantize_mxfp8`: e4m3 bytes + E8M0 scales, and with
    `x_deq_out` the BF16 operand of act_bf16 GEMM tactics), the same bytes
    as those two kernels. No host sync, no allocation: CUDA-graph capturable
    (call it once before capture: the first call loads the kernel).

    x: bfloat16 [rows, H], contiguous, 16-byte aligned, CUDA; 1 <= rows <= 8,
      H a positive multiple of 128. x_q_out: uint8 (or float8_e4m3fn) [rows,
      H]; x_scale_out: uint8 [rows, H/32]; x_deq_out: None or bfloat16 [rows,
      H]; each contiguous, 16-byte aligned, on x's device.
    topk_ids, record_out, permuted_out, experts, stream, pdl: as `launch_route`
      (topk_ids' rows must be x's).
    release_after_wait: with pdl, let the next kernel launch only after this
      one's griddepcontrol.wait (not on entry), so that it may read topk_ids
      before its own wait (GEMM1's `spec` tactics).
    inputs_ready: with pdl, the caller promises that x and topk_ids were
      complete when this kernel launches (the kernel launched before it does
      not write them, or releases its dependents only at its end, as every
      torch kernel does); the kernel then reads and quantizes them before
      its griddepcontrol.wait and lets the next kernel launch on entry, which
      may read topk_ids at any time (a `spec` GEMM1; release_after_wait is
      then not needed). A broken promise gives stale results, so it is off
      by default.
    launch_pdl: False launches it without the programmatic attribute (a
      plain launch; RouteKernel), for timing the route as the peers' first
      kernels are timed.

    Raises TypeError for a wrong type or dtype, ValueError for a wrong shape,
    range, layout, alignment or device (each naming the argument),
    RuntimeError without nvidia-cutlass-dsl.
    """
    from moebench.kernels.quantize import check_quantize_args

    rows, h = check_quantize_args(x, x_q_out, x_scale_out, x_deq_out)
    ids_rows, top_k = _check_ids(topk_ids, experts)
    if ids_rows != rows:
        raise ValueError(f"topk_ids must have x's {rows} rows, got {tuple(topk_ids.shape)}")
    device = x.device
    if topk_ids.device != device:
        raise ValueError(f"topk_ids must be on {device} (the device of x), got {topk_ids.device}")
    _check_outs(record_out, permuted_out, rows, top_k, experts, device)
    check_bool("pdl", pdl)
    check_bool("release_after_wait", release_after_wait)
    check_bool("inputs_ready", inputs_ready)
    check_bool("launch_pdl", launch_pdl)
    if device.type != "cuda":
        raise ValueError(f"x, topk_ids and the outputs must be CUDA tensors, got {device}")
    require_dsl(_KERNEL)
    deq = x_deq_out is not None
    release = release_after_wait and not inputs_ready  # inputs_ready releases on entry (one compiled kernel)
    _run(
        compile_route_kernel(pdl, DEFAULT_KEYS_PER_STEP, True, deq, release, inputs_ready, launch_pdl),
        topk_ids,
        record_out,
        permuted_out,
        experts,
        x,
        x_q_out,
        x_scale_out,
        x_deq_out if deq else x,
        rows * h // 32,
        stream,
        device,
    )


def route(topk_ids: torch.Tensor, experts: int, *, stream=None, pdl: bool = True) -> RouteRecord:
    """Allocate the record and permute map on topk_ids' device and launch the
    route kernel (see `launch_route`); returns a RouteRecord equal, bit for
    bit, to `record.build_route_record(topk_ids, experts)` once the stream
    has run the kernel.

    topk_ids: int32 or int64 [rows, top_k] on a CUDA device (int64 ids are
      mapped to int32 with every non-local id as -1; that costs two small
      kernels). Raises as `launch_route`."""
    check_topk_ids(topk_ids, experts)
    if topk_ids.dtype == torch.int64:
        local = (topk_ids >= 0) & (topk_ids < experts)
        topk_ids = torch.where(local, topk_ids, -1).to(torch.int32)
    topk_ids = topk_ids.contiguous()
    rows, top_k = topk_ids.shape
    ctas = max_ctas(rows, top_k, experts)
    record = torch.empty(route_words(ctas), dtype=torch.int32, device=topk_ids.device)
    permuted = torch.empty(rows, top_k, dtype=torch.int32, device=topk_ids.device)
    launch_route(topk_ids, record, permuted, experts, stream=stream, pdl=pdl)
    return RouteRecord(record, permuted, ctas)
