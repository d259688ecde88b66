"""The DeepSeek-V4 router top-k on the GPU: device code, one CTA per token row.

Computes, for one row of fp32 router logits [E] (E a multiple of 32, at most
512), the same top_k (1..8) expert ids and fp32 weights as
`moebench.routing.route` with renormalization (docs/design.md, "Routing"), bit for
bit. The fused front (`front.py`) calls, per row, `row_scores` with a whole
CTA, then `row_rounds` and `row_weights` with its warp 0.

Arithmetic, op for op the reference's torch ops on the GPU:

    score = sqrt.rn( max(x, 0) + log1pf(expf(-|x|)) )   torch.sqrt / log1p / exp:
                                                        libdevice expf / log1pf (no
                                                        fast math, no flush to zero),
                                                        add.rn, sqrt.rn
    sel   = add.rn(score, bias[e])        (bias_vl[e] for an image row)
    c_k   = chosen score, NaN -> 0        (torch.nan_to_num; scores are never -inf)
    total = ((0 + c_0) + c_1) + ...       add.rn in top-k order, then max(total, 1e-20f)
    w_k   = div.rn(c_k, total)            or, if some c is +inf, 1/n_inf for the +inf
                                          ones (div.rn) and 0 for the others
    w_k   = mul.rn(w_k, scale)            scale rounded to fp32

Every add / multiply / divide / square root is a separately rounded inline-PTX
instruction, so the compiler can neither contract nor approximate them; expf
and log1pf are the non-fast-math libdevice functions (`cute.math.exp` /
`cute.math.log1p`), the ones torch's CUDA `exp` / `log1p` kernels call. The
square roots of a lane take ptxas's own fast path of sqrt.rn.f32, written
out (`sqrt_fast_path`: the same five instructions, exact in its range), for
all of its values together, and sqrt.rn for all of them when any value is
outside that range: the same bits, without a branch per value.

Selection order, the reference's stable sort: sel descending, ties to the
lower expert id, NaN below every number (-inf included; among NaNs the
lower id first). Method: sel maps to an unsigned key that orders like the
value (sign-magnitude flip; -0.0 cannot occur: scores are >= +0.0 and
+0.0 + -0.0 = +0.0), NaN to 1, a taken expert to 0. `row_scores` writes
every expert's unbiased score and key to shared memory (thread t: experts
t, t + threads, ...); in `row_rounds` lane l holds the keys of experts l,
l + 32, ... (n = E/32 of them). Each of the top_k rounds: every
lane finds its best key by a balanced tree over its n keys (the lower id of
equals), `redux.sync.max.u32` gives the warp's best key and
`redux.sync.min.u32` over the ids of the lanes holding it the winning id
(the lowest of equals), known to every lane; its holder clears that key
(`row_rounds`). Then every lane reads the top_k chosen scores back from
shared memory and renormalizes (`row_weights`: sum in top-k order, +inf
count) with no further exchange.
"""

from __future__ import annotations

import struct

from moebench.kernels.host import HAVE_DSL
from moebench.record import MAX_EXPERTS, MAX_TOP_K
from moebench.routing import IMAGE_SENTINELS, WEIGHT_SUM_FLOOR

#: Lanes of a warp: each holds E / 32 scores of its row.
WARP = 32
#: fp32 bits of the weight-sum floor, as torch rounds the Python float.
FLOOR_BITS = struct.unpack("<I", struct.pack("<f", WEIGHT_SUM_FLOOR))[0]
#: Inputs whose bits lie in [SQRT_FAST_LO, SQRT_FAST_LO + SQRT_FAST_SPAN]
#: (finite, >= 2^-101) take the fast path of ptxas's sqrt.rn.f32.
SQRT_FAST_LO = 0x0D000000
SQRT_FAST_SPAN = 0x727FFFFF
#: Keys: a taken expert, a NaN selection score; numbers map above both.
_TAKEN_KEY = 0
_NAN_KEY = 1
_F32_MAX_BITS = 0x7F7FFFFF
_F32_INF_BITS = 0x7F800000


def topk_reason(experts, top_k) -> str | None:
    """Why the warp top-k cannot take `experts` x `top_k`, or None when it can:
    experts an int multiple of 32 in [32, 512] (each lane holds experts/32
    scores, at most 16 registers; the route record keys hold ids < 512),
    top_k an int in [1, 8] (the route record's limit; top_k <= experts follows)."""
    for name, v in (("experts", experts), ("top_k", top_k)):
        if not isinstance(v, int) or isinstance(v, bool):
            return f"{name} must be an int, got {type(v).__name__}"
    if experts % WARP or not WARP <= experts <= MAX_EXPERTS:
        return (
            f"experts must be a multiple of {WARP} in [{WARP}, {MAX_EXPERTS}] (each lane of a"
            f" warp holds experts/{WARP} scores), got {experts}"
        )
    if not 1 <= top_k <= MAX_TOP_K:
        return f"top_k must be in [1, {MAX_TOP_K}] (the route record's limit), got {top_k}"
    return None


def scores_per_thread(experts: int, threads: int) -> int:
    """Scores each of a CTA's `threads` threads computes in `row_scores`."""
    return -(-experts // threads)


if HAVE_DSL:  # the device functions need the DSL's decorators at definition time
    import cutlass
    import cutlass.cute as cute
    from cutlass import Boolean, Float32, Int32, Uint32
    from cutlass.cutlass_dsl import dsl_user_op

    from moebench.kernels.ptx import asm_f32

    @dsl_user_op
    def add_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
        """a + b, IEEE round-to-nearest, no flush to zero, never fused."""
        return asm_f32("add.rn.f32 $0, $1, $2;", "=f,f,f", Float32(a), Float32(b), loc=loc, ip=ip)

    @dsl_user_op
    def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
        """a * b, IEEE round-to-nearest, no flush to zero, never fused."""
        return asm_f32("mul.rn.f32 $0, $1, $2;", "=f,f,f", Float32(a), Float32(b), loc=loc, ip=ip)

    @dsl_user_op
    def div_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
        """a / b, IEEE round-to-nearest (correctly rounded), no flush to zero."""
        return asm_f32("div.rn.f32 $0, $1, $2;", "=f,f,f", Float32(a), Float32(b), loc=loc, ip=ip)

    @dsl_user_op
    def sqrt_rn(a: Float32, *, loc=None, ip=None) -> Float32:
        """sqrt(a), IEEE round-to-nearest (correctly rounded), no flush to zero."""
        return asm_f32("sqrt.rn.f32 $0, $1;", "=f,f", Float32(a), loc=loc, ip=ip)

    @dsl_user_op
    def sqrt_fast_path(a: Float32, *, loc=None, ip=None) -> Float32:
        """The fast path of ptxas's own sqrt.rn.f32 expansion, instruction for
        instruction (MUFU.RSQ, two FMUL.FTZ, two FFMA): correctly rounded,
        equal to sqrt.rn, for a in [SQRT_FAST_LO bits, FLT_MAX]
        (`sqrt_fast_path_applies`); unspecified elsewhere. Unlike sqrt.rn it
        has no slow-path branch, so several of them schedule together."""
        return asm_f32(
            "{ .reg .f32 r, s, h, e;\n"
            " rsqrt.approx.ftz.f32 r, $1;\n"
            " mul.rn.ftz.f32 s, $1, r;\n"
            " mul.rn.ftz.f32 h, r, 0f3F000000;\n"
            " neg.f32 e, s;\n"
            " fma.rn.f32 e, e, s, $1;\n"
            " fma.rn.f32 $0, e, h, s; }",
            "=f,f",
            Float32(a),
            loc=loc,
            ip=ip,
        )

    @cute.jit
    def sqrt_fast_path_applies(a: Float32) -> Boolean:
        """Whether `sqrt_fast_path(a)` is sqrt.rn(a): a's bits in
        [0x0D000000, 0x7F7FFFFF] (finite, >= 2^-101), the range ptxas's
        expansion sends down that path."""
        return (a.bitcast(Uint32) - Uint32(SQRT_FAST_LO)) <= Uint32(SQRT_FAST_SPAN)

    @cute.jit
    def sqrtsoftplus(xs: list) -> list:
        """sqrt(softplus(x)) of every Float32 in `xs`, as `routing.sqrtsoftplus`
        computes it with torch's CUDA kernels: sqrt.rn(max(x, 0) +
        log1pf(expf(-|x|))). NaN in, NaN out (payload unspecified); -inf ->
        +0.0; +inf -> +inf.

        Stage by stage over all values (every expf, then every log1pf and
        sum, then the square roots: log1pf and sqrt.rn branch to slow paths,
        so the straight-line work goes first); the square roots take ptxas's
        fast path for all values (`sqrt_fast_path`), or sqrt.rn for all when
        any value is outside its range (tiny, zero, inf, NaN). `xs` is in the
        order its loads were issued, so that the first uses come early."""
        n = len(xs)
        exps = [cute.math.exp(-cute.math.abs(xs[j])) for j in range(n)]
        soft = [add_rn(xs[j] if xs[j] > Float32(0.0) else Float32(0.0), cute.math.log1p(exps[j]))
                for j in range(n)]  # fmt: skip
        roots = [sqrt_fast_path(soft[j]) for j in range(n)]
        slow = Int32(0)
        for j in cutlass.range_constexpr(n):
            slow = slow | Int32(not sqrt_fast_path_applies(soft[j]))
        if slow != 0:
            roots = [sqrt_rn(soft[j]) for j in range(n)]
        return roots

    @cute.jit
    def order_key(sel: Float32) -> Uint32:
        """An unsigned key that orders like the selection score (larger key =
        chosen first): numbers, -inf included, map to keys >= 0x007FFFFF by a
        sign-magnitude flip; NaN maps to 1 (below every number)."""
        bits = sel.bitcast(Uint32)
        key = (~bits) if (bits >> Uint32(31)) == Uint32(1) else (bits | Uint32(0x80000000))
        if (bits & Uint32(0x7FFFFFFF)) > Uint32(_F32_INF_BITS):
            key = Uint32(_NAN_KEY)
        return key

    @cute.jit
    def _best_of(keys: list, lane: Int32, n: cutlass.Constexpr[int]):
        """This lane's best key and the expert id holding it (the lower id of
        equal keys; lane l holds experts l, l + 32, ..., so a lower j is a
        lower id): a balanced tree over its n keys, log2(n) deep."""
        items = []
        for j in cutlass.range_constexpr(n):
            items.append((keys[j], Int32(j)))
        while cutlass.const_expr(len(items) > 1):
            merged = []
            for i in cutlass.range_constexpr(0, len(items) - 1, 2):
                ka, ja = items[i]  # a holds the lower ids
                kb, jb = items[i + 1]
                take_b = kb > ka
                merged.append((kb if take_b else ka, jb if take_b else ja))
            if cutlass.const_expr(len(items) % 2 == 1):
                merged.append(items[-1])
            items = merged
        best, best_j = items[0]
        return best, best_j, lane + WARP * best_j

    @cute.jit
    def row_scores(
        logits: cute.Pointer,
        bias: cute.Pointer,
        bias_vl: cute.Pointer,
        input_ids: cute.Pointer,
        ids64: Int32,
        sentinel_lo: Int32,
        s_scores: cute.Tensor,
        s_keys: cute.Tensor,
        row: Int32,
        tid: Int32,
        experts: cutlass.Constexpr[int],
        threads: cutlass.Constexpr[int],
        image: cutlass.Constexpr[bool],
        pdl_wait: cutlass.Constexpr[bool],
    ):
        """Stage 1 of one row's top-k, spread over a whole CTA (device code
        for all `threads` threads; a CTA barrier must follow before
        `row_rounds`): thread t computes the scores of experts t, t +
        threads, ... (scores_per_thread(experts, threads) of them, 4-byte
        coalesced loads; a thread past the end recomputes expert E-1 and
        stores nothing) and writes the unbiased score to s_scores[e] (fp32
        [experts], shared) and the selection key (`order_key` of score +
        bias[e], or bias_vl[e] for an image row) to s_keys[e] (uint32
        [experts], shared).

        logits: Uint32 view of the row's fp32 logits [experts]; bias /
        bias_vl: Uint32 views of the fp32 biases (bias_vl read only when
        `image`; input_ids / ids64 / sentinel_lo say whether the row is an
        image row). pdl_wait: wait on griddepcontrol after issuing the bias
        loads (the biases are bound with the layer; the logits are written
        by an earlier kernel) and before the logits loads."""
        per = scores_per_thread(experts, threads)
        es = []
        for i in cutlass.range_constexpr(per):
            if cutlass.const_expr((i + 1) * threads <= experts):
                es.append(tid + i * threads)
            else:
                es.append(cutlass.min(tid + i * threads, experts - 1))
        b_raw, bvl_raw, raw = [], [], []
        for i in cutlass.range_constexpr(per):
            b_raw.append(cute.arch.load(bias + es[i], Uint32))
            if cutlass.const_expr(image):
                bvl_raw.append(cute.arch.load(bias_vl + es[i], Uint32))
        if cutlass.const_expr(pdl_wait):
            cute.arch.griddepcontrol_wait()
        for i in cutlass.range_constexpr(per):
            raw.append(cute.arch.load(logits + es[i], Uint32))
        image_row = Boolean(False)
        if cutlass.const_expr(image):
            image_row = is_image_row(input_ids, ids64, row, sentinel_lo)
        roots = sqrtsoftplus([raw[i].bitcast(Float32) for i in range(per)])
        for i in cutlass.range_constexpr(per):
            s = roots[i]
            b = b_raw[i]
            if cutlass.const_expr(image):
                b = bvl_raw[i] if image_row else b
            key = order_key(add_rn(s, b.bitcast(Float32)))
            if cutlass.const_expr((i + 1) * threads <= experts):
                s_scores[es[i]] = s
                s_keys[es[i]] = key
            else:
                if tid + i * threads < experts:
                    s_scores[es[i]] = s
                    s_keys[es[i]] = key

    @cute.jit
    def row_rounds(
        s_keys: cute.Tensor,
        lane: Int32,
        experts: cutlass.Constexpr[int],
        top_k: cutlass.Constexpr[int],
    ):
        """Stage 2 of one row's top-k (device code for one full warp, after
        `row_scores` and a CTA barrier): lane l takes the keys of experts
        l, l + 32, ... (E/32 of them, conflict-free shared loads), then the
        top_k rounds (tree, `redux.sync.max`, `redux.sync.min` over the ids
        holding the best key). Returns (the id of round `lane` for lanes <
        top_k, unspecified for the others; the list of the top_k ids, the
        same in every lane)."""
        n = experts // WARP
        keys = [s_keys[lane + WARP * j] for j in range(n)]
        my_id = Int32(0)
        ids = []
        for r in cutlass.range_constexpr(top_k):
            best, best_j, best_id = _best_of(keys, lane, n)
            top = cute.arch.warp_redux_sync(best, "umax")
            cand = Uint32(best_id) if best == top else Uint32(0xFFFFFFFF)
            win = Int32(cute.arch.warp_redux_sync(cand, "umin"))
            ids.append(win)
            my_id = win if lane == r else my_id
            taken = best_id == win
            for j in cutlass.range_constexpr(n):
                keys[j] = Uint32(_TAKEN_KEY) if (taken and best_j == j) else keys[j]
        return my_id, ids

    @cute.jit
    def row_weights(
        s_scores: cute.Tensor,
        ids: list,
        lane: Int32,
        scale: Float32,
        top_k: cutlass.Constexpr[int],
    ):
        """Stage 3 (one full warp, with `row_rounds`' ids): the
        renormalization (routing._renormalize) of the chosen scores in every
        lane: NaN -> 0, the sum in top-k order, the floor; +inf scores share
        the weight equally; times `scale`. Returns the fp32 weight of round
        `lane` for lanes < top_k (unspecified for the others). The route
        record does not need it, so the front runs it after the ids are
        handed on."""
        c = []
        n_inf = Int32(0)
        for r in cutlass.range_constexpr(top_k):
            v_r = s_scores[ids[r]]
            bits = v_r.bitcast(Uint32)
            if (bits & Uint32(0x7FFFFFFF)) > Uint32(_F32_INF_BITS):
                v_r = Float32(0.0)
            if bits == Uint32(0xFF800000):  # -inf (cannot occur)
                v_r = Uint32(0x80000000 | _F32_MAX_BITS).bitcast(Float32)
            n_inf = n_inf + Int32(v_r.bitcast(Uint32) == Uint32(_F32_INF_BITS))
            c.append(v_r)
        total = Float32(0.0)
        for r in cutlass.range_constexpr(top_k):
            total = add_rn(total, c[r])
        floor = Uint32(FLOOR_BITS).bitcast(Float32)
        if total < floor:
            total = floor
        mine = c[0]
        for r in cutlass.range_constexpr(1, top_k):
            mine = c[r] if lane == r else mine
        w = div_rn(mine, total)
        if n_inf > 0:
            one = Float32(1.0) if mine.bitcast(Uint32) == Uint32(_F32_INF_BITS) else Float32(0.0)
            w = div_rn(one, Float32(n_inf))
        return mul_rn(w, scale)

    @cute.jit
    def is_image_row(input_ids: cute.Pointer, ids64: Int32, row: Int32, sentinel_lo: Int32) -> Boolean:
        """Whether token `row` is an image row: its input id (int32, or int64
        when ids64 != 0, read as two int32 words) lies in
        [sentinel_lo, sentinel_lo + 5), sentinel_lo in [1, 2^31 - 6]."""
        ids = input_ids
        lo_word = Int32(0)
        hi_word = Int32(0)
        if ids64 != 0:
            lo_word = cute.arch.load(ids + 2 * row, Int32)
            hi_word = cute.arch.load(ids + (2 * row + 1), Int32)
        else:
            lo_word = cute.arch.load(ids + row, Int32)
        return hi_word == 0 and lo_word >= sentinel_lo and lo_word < sentinel_lo + IMAGE_SENTINELS
