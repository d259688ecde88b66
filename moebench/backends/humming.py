"""humming-kernels 0.1.19 baselines (the kernels behind vLLM's `humming` MoE
backend): "humming-w4a16" and "humming-w4a8".

humming is a GEMM library (kernels compiled at run time with NVRTC and cached
under $HUMMING_CACHE_DIR); the MoE around it is the caller's. Per layer call
this backend runs vLLM's HummingIndexedExperts sequence on its TP path,
launch for launch (`LAUNCHES`; docs/baselines.md has the table with vLLM's
file:line):

  align       vLLM's own moe_align_block_size op (vllm_align, the vllm-moe
              bundle) at w13's block_m, once: both GEMMs read it, as in vLLM;
              without the op our one-kernel Triton aligner, without Triton
              ~15 torch ops (`last_tactic` says which ran)
  quantize    [w4a8] may_quant_input(x): humming kernel, per-token e4m3 x
  gemm1       forward_layer(w13, top_k): humming indexed MoE GEMM1 [M*k, 2I]
  activation  swiglu_limit (vllm_triton: vLLM's torch.compile'd
              `_swiglu_limit_torch`, one kernel) silu(min(g,L))*clamp(u,-L,L)
              [w4a8] then may_quant_input(H): humming kernel, per-token e4m3 H
              (vLLM runs the two apart)
  gemm2       forward_layer(w2, top_k=1) on the same align [M*k, H]
  reduce      moe_fused_mul_sum (vllm_triton): the fp32 top-k weights times the
              rows, summed in fp32
  finalize    output.copy_(fused_out): the modular kernel's finalize
              (TopKWeightAndReduceNoOP) copies the experts' output into the
              layer's output tensor

prepare: the logical (unpadded) [gate; up] checkpoint tensors
(layouts.to_humming_logical) go through humming's own schema conversion and
`transform_humming_layer` with vLLM's padding (N to 256, K to 128); tuning
configs are humming's heuristics (`get_default_tuning_configs`, indexed GEMM),
no autotuning: the config chosen for a row count is recorded in
`backend.last_tactic` ("w13=<mma> <block>,w2=...,align=vllm|triton|torch"),
and `stage_calls` splits a call into align, [quantize (w4a8)], gemm1,
activation, gemm2, reduce and finalize.

Oracle: "bf16" for w4a16, "fp8_token" for w4a8. The SwiGLU limit is one
float per layer in vLLM (`gemm1_clamp_limit`): prepare requires one clamp
value for all experts (true for every preset).

The alignment is sync-free (top-k ids stay on the device; fixed-size buffers
per row count), so forward is graph-capturable once every kernel has been
compiled: call forward once per row count outside capture first. Every id
must be local on the TP path. Tactic "ep" (`base.EP_TACTIC`, never the
default) admits ids outside [0, E) (other ranks' experts): five elementwise
launches ahead of the align route them to expert 0 with weight 0 (our
stand-in for vLLM's expert-map path, which passes the map to the align and
the mul-sum instead).

Nothing here imports humming at module import.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from moebench.backends import vllm_align, vllm_ops, vllm_triton
from moebench.backends.base import DEFAULT_TACTIC, EP_TACTIC, Backend, check_forward_inputs, one_clamp
from moebench.backends.peer import FINALIZE_LAUNCH, package_reason, prepare_prologue
from moebench.backends.layouts import to_humming_logical
from moebench.traffic import mxfp4_bytes, touched_bytes
from moebench.formats import ExpertWeights
from moebench.models import RankShape

HUMMING_VERSION = "0.1.19"
MAX_ROWS = 8
#: vLLM's padding of the humming MoE weights.
PAD_N, PAD_K = 256, 128
#: Stream-K lock words per layer (vLLM allocates 1024; the probe used 8192).
LOCK_WORDS = 8192
COMPUTE_CONFIG = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"})
INPUT_SCHEMAS = {"w4a16": {}, "w4a8": {"a_dtype": "float8e4m3"}}


#: One layer call's launches on vLLM's TP path, per mode: (stage, launch, where vLLM 0.26.0
#: runs it, in vllm/model_executor/layers/fused_moe/); the names are what
#: tests/backends/test_launches.py records. W4A16's may_quant_input launches nothing.
_H = "experts/fused_humming_moe.py"
LAUNCHES = {
    "w4a16": (
        ("align", "moe_align_block_size", f"{_H}:546 -> moe_align_block_size.py:90"),
        ("gemm1", "humming.forward_layer (w13)", f"{_H}:621"),
        ("activation", "swiglu_limit", f"{_H}:630 -> {_H}:506 -> utils.py:572 (torch.compile'd)"),
        ("gemm2", "humming.forward_layer (w2)", f"{_H}:643"),
        ("reduce", "moe_fused_mul_sum", f"{_H}:652 -> moe_fused_mul_sum.py:185"),
        FINALIZE_LAUNCH,
    ),
}
LAUNCHES["w4a8"] = (
    LAUNCHES["w4a16"][0],
    ("quantize", "humming.may_quant_input (x)", f"{_H}:614"),
    LAUNCHES["w4a16"][1],
    LAUNCHES["w4a16"][2],
    ("activation", "humming.may_quant_input (H)", f"{_H}:636"),
    *LAUNCHES["w4a16"][3:],
)
#: The "ep" tactic adds, ahead of the align: ids -> local mask (ge, lt, and), expert, weight.
EP_REMAP = tuple(("align", f"aten.{op} (remap)", "- (our stand-in for the expert map)")
                 for op in ("ge", "lt", "bitwise_and", "where", "where"))  # fmt: skip


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moebench", "humming")


def _import_humming():
    """Import humming with its cache set (first import only) and the NVRTC
    driver's exec bit restored (a zip-unpacked wheel loses it)."""
    os.environ.setdefault("HUMMING_CACHE_DIR", _default_cache_dir())
    os.environ.setdefault("HUMMING_TMP_DIR", os.path.join(os.environ["HUMMING_CACHE_DIR"], "tmp"))
    import glob

    import humming

    for path in glob.glob(os.path.join(os.path.dirname(humming.__file__), "_native", "*", "nvrtc_compile")):
        try:
            if not os.access(path, os.X_OK):
                os.chmod(path, os.stat(path).st_mode | 0o111)
        except OSError:
            pass
    return humming


# --- routing alignment (moe_align_block_size), on the device, no host sync ------------------


def align_capacity(slots: int, experts: int, block: int) -> int:
    """Length of the sorted-ids buffer: every slot plus the padding of at most
    min(slots, experts) partly filled blocks, rounded up to whole blocks."""
    padded = slots + min(slots, experts) * (block - 1)
    return -(-padded // block) * block


def align_block_size(
    expert_of_slot: torch.Tensor, experts: int, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Marlin/vLLM `moe_align_block_size` for humming's indexed GEMM.

    expert_of_slot: int [S] expert of each slot (t * top_k + k), all in [0, E).
    Returns (sorted_ids int32 [cap], expert_ids int32 [cap / block],
    num_tokens_padded int32 [1]): slots grouped by expert (ascending; slots
    ascending within an expert), each expert's group padded with the sentinel S
    to a multiple of `block`; expert_ids[b] = expert of block b (blocks past
    num_tokens_padded / block are never read; they hold E - 1). Device ops only.
    """
    s = expert_of_slot.numel()
    dev = expert_of_slot.device
    key = expert_of_slot.reshape(s).to(torch.int64)
    cap = align_capacity(s, experts, block)
    onehot = (key.unsqueeze(1) == torch.arange(experts, device=dev)).to(torch.int32)  # [S, E]
    running = torch.cumsum(onehot, 0)  # [S, E]
    counts = running[-1]  # [E]
    blocks = (counts + (block - 1)) // block
    block_end = torch.cumsum(blocks, 0)
    rank = running.gather(1, key.unsqueeze(1)).squeeze(1) - 1  # [S]
    dest = (block_end - blocks)[key] * block + rank
    sorted_ids = torch.full((cap,), s, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, torch.arange(s, dtype=torch.int32, device=dev))
    block_index = torch.arange(cap // block, device=dev)
    expert_ids = torch.searchsorted(block_end, block_index, right=True).clamp_max(experts - 1).to(torch.int32)
    num_tokens_padded = (block_end[-1:] * block).to(torch.int32)
    return sorted_ids, expert_ids, num_tokens_padded


@functools.lru_cache(maxsize=1)
def _triton_align_kernel():
    """The single-kernel align (Triton), or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton: the torch ops are used
        return None

    @triton.jit
    def align_kernel(
        ids_ptr,
        sorted_ptr,
        expert_ids_ptr,
        padded_ptr,
        slots,
        experts,
        cap,
        BM: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_E: tl.constexpr,
        FILL: tl.constexpr,
        MAX_BLOCKS_PER_EXPERT: tl.constexpr,
    ):
        s_off = tl.arange(0, BLOCK_S)
        s_mask = s_off < slots
        key = tl.load(ids_ptr + s_off, mask=s_mask, other=0)
        e_off = tl.arange(0, BLOCK_E)
        onehot = ((key[:, None] == e_off[None, :]) & s_mask[:, None]).to(tl.int32)  # [S, E]
        counts = tl.sum(onehot, axis=0)
        blocks = (counts + (BM - 1)) // BM
        block_end = tl.cumsum(blocks, axis=0)
        block_start = block_end - blocks
        earlier = (key[:, None] == key[None, :]) & (s_off[None, :] < s_off[:, None]) & s_mask[None, :]
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        start = tl.sum(onehot * block_start[None, :], axis=1)
        # sentinel fill, then (after the barrier) the scatters
        for base in range(0, cap, FILL):
            p = base + tl.arange(0, FILL)
            tl.store(sorted_ptr + p, tl.full((FILL,), 0, tl.int32) + slots, mask=p < cap)
            tl.store(expert_ids_ptr + p, tl.full((FILL,), 0, tl.int32) + (experts - 1), mask=p < cap // BM)
        tl.debug_barrier()
        tl.store(sorted_ptr + start * BM + rank, s_off.to(tl.int32), mask=s_mask)
        e_mask = e_off < experts
        for j in range(MAX_BLOCKS_PER_EXPERT):
            tl.store(expert_ids_ptr + block_start + j, e_off.to(tl.int32), mask=e_mask & (j < blocks))
        total = tl.sum(blocks, axis=0) * BM
        tl.store(padded_ptr + tl.arange(0, 1), tl.full((1,), 0, tl.int32) + total)

    return align_kernel


def align_block_size_triton(expert_of_slot: torch.Tensor, experts: int, block: int):
    """`align_block_size` as one Triton kernel (what vLLM's moe_align_block_size
    costs: one launch). Same outputs; raises RuntimeError without Triton."""
    kernel = _triton_align_kernel()
    if kernel is None:
        raise RuntimeError("Triton is not installed")
    s = expert_of_slot.numel()
    dev = expert_of_slot.device
    cap = align_capacity(s, experts, block)
    ids = expert_of_slot.reshape(s).to(torch.int32).contiguous()
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(cap // block, dtype=torch.int32, device=dev)
    padded = torch.empty(1, dtype=torch.int32, device=dev)
    block_s = max(16, 1 << (s - 1).bit_length())
    block_e = max(16, 1 << (experts - 1).bit_length())
    kernel[(1,)](
        ids,
        sorted_ids,
        expert_ids,
        padded,
        s,
        experts,
        cap,
        BM=block,
        BLOCK_S=block_s,
        BLOCK_E=block_e,
        FILL=256,
        MAX_BLOCKS_PER_EXPERT=-(-s // block),
        num_warps=8 if block_e > 128 else 4,
    )
    return sorted_ids, expert_ids, padded


def align_block_size_vllm(expert_of_slot: torch.Tensor, experts: int, block: int):
    """vLLM's own `moe_align_block_size` op (vllm_align; what vLLM's humming
    experts call, with `ignore_invalid_experts=True` and no expert map):
    (sorted_ids int32 [vLLM's max_num_tokens_padded], expert_ids int32
    [its block count], num_tokens_padded int32 [1]). Same used prefix as
    `align_block_size` except that slots of one expert may come in another
    order (the op places them with atomics); past the used blocks expert_ids
    holds -1 and sorted_ids the sentinel S. Buffers are allocated per call,
    as vLLM's wrapper does. Raises RuntimeError without vLLM's library."""
    ids = expert_of_slot.to(torch.int32).contiguous()
    return vllm_align.moe_align_block_size(ids, experts, block).as_tuple()


#: Which aligner humming's forward uses: "vllm" (vLLM's op, the default: what vLLM runs),
#: "triton" (our one-kernel Triton aligner) or "torch" (~15 small torch ops). An aligner that
#: cannot run falls back to the next: vllm -> triton -> torch.
ALIGN_ENV = "MOEBENCH_HUMMING_ALIGN"
ALIGNERS = ("vllm", "triton", "torch")


def _aligner(device: torch.device):
    """(align function, its name) for `device`: the first runnable of
    ALIGNERS from $MOEBENCH_HUMMING_ALIGN (default "vllm") on. Raises
    ValueError for an unknown $MOEBENCH_HUMMING_ALIGN."""
    choice = os.environ.get(ALIGN_ENV, "vllm")
    if choice not in ALIGNERS:
        raise ValueError(f"${ALIGN_ENV} must be one of {ALIGNERS}, got {choice!r}")
    on_gpu = torch.device(device).type == "cuda"
    for name in ALIGNERS[ALIGNERS.index(choice) :]:
        if name == "vllm" and on_gpu and vllm_ops.reason("moe") is None:
            return align_block_size_vllm, "vllm"
        if name == "triton" and on_gpu and _triton_align_kernel() is not None:
            return align_block_size_triton, "triton"
        if name == "torch":
            return align_block_size, "torch"
    raise AssertionError("unreachable: torch is always available")


def humming_expert_bytes(shape: RankShape) -> int:
    """Bytes of one expert as humming stores and streams it with vLLM's padding:
    w13 [2I to a multiple of PAD_N, H to PAD_K] and w2 [H to PAD_N, I to PAD_K],
    MXFP4 values and E8M0 scales (humming's `prepare_layer_meta` pads N and K
    of each sublayer as a whole)."""
    up = lambda v, m: -(-v // m) * m  # noqa: E731
    h, i = shape.hidden, shape.intermediate
    return mxfp4_bytes(up(2 * i, PAD_N), up(h, PAD_K)) + mxfp4_bytes(up(h, PAD_N), up(i, PAD_K))


# --- prepared state ---------------------------------------------------------------------------


@dataclass
class HummingPrepared:
    """humming layer (nn.Module holding w13_*/w2_* params and locks), its
    tuning configs per sublayer, geometry, and per-row-count buffers."""

    layer: torch.nn.Module
    tuning: dict  # sub -> (configs list, json string)
    limit: float  # the SwiGLU clamp L
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    mode: str
    buffers: dict = field(default_factory=dict)  # rows -> dict of tensors
    ep: bool = False  # tactic "ep": non-local ids remapped (module docstring)

    @property
    def device(self) -> torch.device:
        return self.layer.locks.device

    def _config(self, sub: str, m: int) -> dict:
        for entry in self.tuning[sub][0]:  # [lo, hi, config]: used for lo < M <= hi
            if entry[0] < m <= entry[1]:
                return entry[2]
        raise ValueError(f"no humming tuning config covers M={m} for {sub}")

    def block_m(self, sub: str, m: int) -> int:
        return int(self._config(sub, m)["block_shape"][0])

    def config_name(self, sub: str, m: int) -> str:
        cfg = self._config(sub, m)
        return f"{cfg.get('mma_type', '?')} {list(cfg['block_shape'])}"


class _HummingBackend(Backend):
    mode: ClassVar[str]
    capturable = True

    def __init__(self) -> None:
        self.last_tactic: str | None = None

    def unavailable_reason(self, device: torch.device | str) -> str | None:
        reason = package_reason(
            device, "humming", imports=lambda: (_import_humming(), importlib.import_module("humming.layer")),
            missing="package humming-kernels is not installed (see docs/baselines.md: .bundles/humming.tar.xz)",
        )  # fmt: skip
        if reason:
            return reason
        version = getattr(_import_humming(), "__version__", "?")
        if not str(version).startswith("0.1."):
            return f"humming {version} is untested here (written for {HUMMING_VERSION})"
        return None

    def valid_tactics(self, shape: RankShape) -> tuple[str, ...]:
        """The default (vLLM's TP path) and "ep" (non-local ids admitted)."""
        return (DEFAULT_TACTIC, EP_TACTIC)

    def read_bytes(self, shape: RankShape, topk_ids: torch.Tensor) -> int:
        """The touched experts in humming's padded layout (`humming_expert_bytes`)
        + x in and the output."""
        return touched_bytes(shape, topk_ids, humming_expert_bytes(shape))

    def prepared_bytes(self, shape: RankShape) -> int:
        i_pad = -(-shape.intermediate // PAD_K) * PAD_K
        n13 = -(-2 * shape.intermediate // PAD_N) * PAD_N
        h = shape.hidden
        per_expert = n13 * h * (0.5 + 1 / 32) + h * i_pad * (0.5 + 1 / 32)
        return int(shape.experts * per_expert)

    def prepare(self, weights: ExpertWeights, shape: RankShape, tactic: str = DEFAULT_TACTIC) -> HummingPrepared:
        """humming layer of `shape` on the weights' (CUDA) device. Raises
        ValueError for a bad tactic/shape or per-expert clamps that differ,
        RuntimeError when unavailable there."""
        dev = prepare_prologue(self, weights, shape, tactic)
        limit = one_clamp(weights, "vLLM's SwiGLU limit is one float of the quant config")
        _import_humming()
        from humming.config import GemmType
        from humming.layer import HummingMethod
        from humming.schema import BaseWeightSchema, HummingInputSchema

        logical = to_humming_logical(weights)
        e, h, i = shape.experts, shape.hidden, shape.intermediate
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        layer = torch.nn.Module()
        layer.register_buffer("locks", torch.zeros(LOCK_WORDS, dtype=torch.int32, device=dev))
        input_schema = HummingInputSchema(**INPUT_SCHEMAS[self.mode])
        subs = (("w13", logical.w13, logical.w13_scale, 2 * i, h, [i, i]),
                ("w2", logical.w2, logical.w2_scale, h, i, [h]))  # fmt: skip
        for sub, w, s, n, k, n_stacks in subs:
            schema, tensors = BaseWeightSchema.from_config({"quant_method": "mxfp4"}).convert_humming(
                {"weight": w, "weight_scale": s}, shape_n_stacks=n_stacks, shape_k_stacks=[k],
                param_dtype=torch.bfloat16, num_experts=e, device=index,
            )  # fmt: skip
            for name, tensor in tensors.items():
                setattr(layer, f"{sub}_{name}", torch.nn.Parameter(tensor, requires_grad=False))
            HummingMethod.prepare_layer_meta(
                layer, shape_n=n, shape_k=k, weight_schema=schema, input_schema=input_schema,
                num_experts=e, pad_n_to_multiple=PAD_N, pad_k_to_multiple=PAD_K, has_bias=False,
                torch_dtype=torch.bfloat16, sublayer_name=sub,
            )  # fmt: skip
            HummingMethod.transform_humming_layer(layer, sublayer_name=sub)
            del tensors
        del logical
        max_m = MAX_ROWS * shape.top_k
        tuning = {}
        for sub in ("w13", "w2"):
            full = HummingMethod.get_default_tuning_configs(layer, gemm_type=GemmType.INDEXED, sublayer_name=sub)
            kept = [list(c) for c in full if c[0] < max_m]
            tuning[sub] = (kept, json.dumps(kept))
        return HummingPrepared(
            layer=layer, tuning=tuning, limit=limit, hidden=h, intermediate=i, experts=e,
            top_k=shape.top_k, mode=self.mode, ep=tactic == EP_TACTIC,
        )  # fmt: skip

    def _buffers(self, p: HummingPrepared, rows: int, top_k: int) -> dict:
        key = (rows, top_k)
        buf = p.buffers.get(key)
        if buf is None:
            m = rows * top_k
            buf = p.buffers[key] = dict(
                gu=torch.empty(m, 2 * p.intermediate, dtype=torch.bfloat16, device=p.device),
                act=torch.empty(m, p.intermediate, dtype=torch.bfloat16, device=p.device),
                down=torch.empty(m, p.hidden, dtype=torch.bfloat16, device=p.device),
                fused=torch.empty(rows, p.hidden, dtype=torch.bfloat16, device=p.device),
                out=torch.empty(rows, p.hidden, dtype=torch.bfloat16, device=p.device),
                block=p.block_m("w13", m),  # vLLM aligns once, at w13's block_m, for both GEMMs
            )
        return buf

    def _stages(self, prepared, x, topk_ids, topk_weights) -> list:
        """[(stage name, fn)] of one layer call in launch order; fn(state) runs
        the stage on the outputs of the earlier ones (in `state`) and returns
        its own. Validates the inputs; raises ValueError for rows > 8."""
        if not isinstance(prepared, HummingPrepared) or prepared.mode != self.mode:
            raise TypeError(f"prepared must come from {type(self).__name__}.prepare, got {type(prepared).__name__}")
        from humming.layer import HummingMethod

        p = prepared
        check_forward_inputs(x, topk_ids, topk_weights, p.hidden, p.device)
        rows, top_k = topk_ids.shape
        if not 1 <= rows <= MAX_ROWS or top_k > p.top_k:
            raise ValueError(f"rows must be in 1..{MAX_ROWS} and top_k <= {p.top_k}, got {tuple(topk_ids.shape)}")
        m = rows * top_k
        buf = self._buffers(p, rows, top_k)
        block = buf["block"]
        align, how = _aligner(p.device)
        path = ",path=ep (remap)" if p.ep else ""
        self.last_tactic = f"w13={p.config_name('w13', m)},w2={p.config_name('w2', m)},align={how}{path}"
        layer, tc = p.layer, p.tuning

        def align_stage(st):
            if not p.ep:  # vLLM's TP path: the ids and weights as they come
                return dict(weights=topk_weights, align=align(topk_ids, p.experts, block))
            local = (topk_ids >= 0) & (topk_ids < p.experts)
            expert = torch.where(local, topk_ids, 0)
            return dict(weights=torch.where(local, topk_weights, 0.0), align=align(expert, p.experts, block))

        def quantize(st):
            a, a_scale = HummingMethod.may_quant_input(layer, x, sublayer_name="w13")
            return dict(a=a, a_scale=a_scale)

        def gemm(sub, a, scale, out, top, al):
            HummingMethod.forward_layer(
                layer, a, outputs=out, input_scale=scale, top_k=top, valid_shape_m=m,
                compute_config=COMPUTE_CONFIG, tuning_config=tc[sub][1], sublayer_name=sub,
                sorted_ids=al[0], expert_ids=al[1], num_tokens_padded=al[2],
            )  # fmt: skip

        def gemm1(st):
            gemm("w13", st["a"], st["a_scale"], buf["gu"], top_k, st["align"])
            return {}

        def activation(st):
            vllm_triton.swiglu_limit(buf["act"], buf["gu"], p.limit)
            h, h_scale = HummingMethod.may_quant_input(layer, buf["act"], sublayer_name="w2")
            return dict(h=h, h_scale=h_scale)

        def gemm2(st):
            gemm("w2", st["h"], st["h_scale"], buf["down"], 1, st["align"])
            return {}

        def reduce(st):
            vllm_triton.moe_fused_mul_sum(buf["down"].view(rows, top_k, p.hidden), st["weights"], buf["fused"])
            return {}

        def finalize(st):
            buf["out"].copy_(buf["fused"])
            return {}

        # W4A16's may_quant_input hands x back untouched (no kernel): not a stage of its own ("")
        return [("align", align_stage), ("quantize" if self.mode == "w4a8" else "", quantize), ("gemm1", gemm1),
                ("activation", activation), ("gemm2", gemm2), ("reduce", reduce), ("finalize", finalize)]  # fmt: skip

    def forward(self, prepared, x, topk_ids, topk_weights):
        """bf16 [rows, H] (a buffer owned by `prepared`, reused by the next call
        with the same row count): the stages of the module docstring. Raises
        ValueError for rows > 8."""
        state: dict = {}
        for _, fn in self._stages(prepared, x, topk_ids, topk_weights):
            state.update(fn(state))
        return prepared.buffers[tuple(topk_ids.shape)]["out"]

    def stage_calls(self, prepared, x, topk_ids, topk_weights):
        """align, [quantize (w4a8)], gemm1, activation, gemm2, reduce, finalize:
        one eager run, then each call re-runs its stage on that run's outputs."""
        stages = self._stages(prepared, x, topk_ids, topk_weights)
        state: dict = {}
        for _, fn in stages:
            state.update(fn(state))
        return [(name, lambda fn=fn: fn(state)) for name, fn in stages if name]


class HummingW4A16Backend(_HummingBackend):
    """humming-kernels MXFP4 x BF16 (vLLM's default humming mode)."""

    name = "humming-w4a16"
    oracle = "bf16"
    mode = "w4a16"


class HummingW4A8Backend(_HummingBackend):
    """humming-kernels MXFP4 x per-token e4m3 activations."""

    name = "humming-w4a8"
    oracle = "fp8_token"
    mode = "w4a8"
