"""Our kernels' weight layout: canonical `ExpertWeights` <-> `KernelWeights`.

The GEMMs stream MXFP4 weights as the 16-row A operand of mma.sync m16n8k16
(BF16), the <= 8 token rows being N = 8. The converter runs once per layer
and drops the intermediate padding entirely (the kernels never read it).

Units. A weight matrix [M rows, K] (M, K multiples of 32) is cut into
32-row *row pairs* (two 16-row m-tiles) x 32-K *chunks* (one MX block).
One (pair, chunk) unit is 512 bytes: lane L = 4g + c of a warp owns 16
contiguous bytes = four 32-bit words w = 2t + j (m-tile t, k-step j), and
word w holds the eight e2m1 codes of that lane's A fragment:
    R0 = rows 16t+g   k k0, k0+1      R1 = rows 16t+g+8  k k0, k0+1
    R2 = rows 16t+g   k k0+2, k0+3    R3 = rows 16t+g+8  k k0+2, k0+3
with k0 = 32*chunk + 8c + 4j. (The MMA's 16 k of one step are a permutation
of real k; the sum is the same.) So a lane's activations for one chunk are the
8 contiguous K elements [32*chunk + 8c, +8) of token row g: no permutation
of x or H is needed. Inside a word, the 4 bits (m, e0, e1, s) of each code
sit where `decode_word` (one rotate + mask per distinct rotation, see
`fp4.py`) moves them to bf16 bits (6, 7, 8, 15): the decoded bf16 is the
e2m1 value times 2^-126, exact (subnormal for 0.5).

The e4m3 operand (`operand="e4m3"`, for the fp8 tactics: wgmma m64n8k32
e4m3 with A from registers, whose per-warp A fragment is mma.sync
m16n8k32's): the same words hold the same codes, word w = 2t + j being
the A register pair (row 16t+g, row 16t+g+8) of k k0 .. k0+3, k0 = 32*chunk
+ 8c + 4j: byte i of each register = k k0 + i (the MMA's 32 k of a chunk are
again a permutation of real k: A registers a0..a3 = words (t,0) row g, (t,0)
row g+8, (t,1) row g, (t,1) row g+8; B = the 8 e4m3 bytes [32*chunk + 8c, +8)
of token g, as stored). An e2m1 code (s, e1, e0, m) at e4m3 bits (7; 4, 3; 2)
is exactly the e2m1 value x 2^-6 (normal 2^(E-7)(1 + m/2) vs 2^(E-1)(1 + m/2),
subnormal m x 2^-7 vs m x 2^-1). Row g's codes sit in place (bits
E4M3_BITS of byte i); row g+8's at E4M3_STORED of byte i, so that
    Ra = w & E4M3_IN_PLACE,  x = w & ~E4M3_IN_PLACE,
    Rb = ((x << 2) & E4M3_LEFT) | ((x >> 2) & E4M3_RIGHT)
(`fp4.decode_e2m1_word_e4m3`: 5 integer instructions per 8 codes; no
rotation pair can do it in fewer: no translate of {2,3,4,7} tiles Z_8).

Scales: per unit 32 bytes, [g][4] with byte 2t + rh = row 16t + 8rh + g: a
lane loads one 32-bit word at offset 4g.

w13 rows are interleaved per 32 intermediate columns (one H quantization
block): kernel row 64q + r is gate column 32q + r for r < 32 and up column
32q + r - 32 otherwise, so one 64-row work item sees matching gate and up
rows. w2 rows are the H output rows in order; its K is the logical I.

Shapes (E experts, H hidden, I logical intermediate):
    w13        uint8 [E, 2I/32, H/32, 32, 16]   w13_scale uint8 [E, 2I/32, H/32, 8, 4]
    w2         uint8 [E, H/32,  I/32, 32, 16]   w2_scale  uint8 [E, H/32,  I/32, 8, 4]
    clamp      float32 [E]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebench.formats import ExpertWeights
from moebench.models import MX_BLOCK

#: bf16 bit receiving e2m1 bit b (0 = m, 1 = e0, 2 = e1, 3 = s): value x 2^-126.
BF16_BITS = (6, 7, 8, 15)
#: Left-rotation (bits) that moves bit b of the codes in register Ri into place.
ROTATIONS = ((0, 0, 0, 0), (4, 4, 4, 4), (10, 10, 10, 10), (6, 6, 14, 6))
#: Codes converted per step (bounds the converter's temporary memory, ~40 B per code).
_CODES_PER_STEP = 1 << 25
#: Largest E8M0 weight scale a single bf16x2 multiply by 2^(s-1) handles exactly.
NARROW_SCALE_MAX = 128
#: Weight operands the kernels' layout can hold (module docstring).
OPERANDS = ("bf16", "e4m3")
#: e4m3 bit receiving e2m1 bit b (m, e0, e1, s): value x 2^-6.
E4M3_BITS = (2, 3, 4, 7)
#: Byte bit where the e4m3 operand stores bit b of a row-g+8 code (moved by
#: << 2 for m, e0, s and >> 2 for e1).
E4M3_STORED = (0, 1, 6, 5)
#: Decoder masks of the e4m3 operand (module docstring).
E4M3_IN_PLACE = 0x9C9C9C9C
E4M3_LEFT = 0xEEEEEEEE
E4M3_RIGHT = 0x11111111


def bit_position(i: int, h: int, b: int) -> int:
    """Bit of a packed word holding bit b of the code in A register Ri, half h
    (0 = low = even k)."""
    return (BF16_BITS[b] + 16 * h - ROTATIONS[i][b]) % 32


def decode_terms(i: int) -> list[tuple[int, int]]:
    """Decoder of A register Ri: [(left rotation d, mask)], Ri = OR of
    rotl(word, d) & mask."""
    return [
        (d, sum(0x00010001 << BF16_BITS[b] for b in range(4) if ROTATIONS[i][b] == d))
        for d in sorted(set(ROTATIONS[i]))
    ]


def code_bit_position(operand: str, rh: int, hh: int, h: int, b: int) -> int:
    """Bit of a packed word holding bit b of the code of row half rh (0 = row
    16t+g, 1 = row 16t+g+8), k k0 + 2*hh + h, for weight operand `operand`."""
    if operand == "bf16":
        return bit_position(rh + 2 * hh, h, b)
    byte = 2 * hh + h
    return 8 * byte + (E4M3_BITS if rh == 0 else E4M3_STORED)[b]


def _check_operand(operand) -> str:
    if operand not in OPERANDS:
        raise ValueError(f"operand must be one of {OPERANDS}, got {operand!r}")
    return operand


for _op in OPERANDS:
    _POSITIONS = [
        code_bit_position(_op, rh, hh, h, b) for rh in range(2) for hh in range(2) for h in range(2) for b in range(4)
    ]
    assert sorted(_POSITIONS) == list(range(32)), f"{_op} packed word bit layout is not a permutation"


@dataclass(frozen=True)
class KernelWeights:
    """One rank's routed-expert MXFP4 weights in our kernels' layout (module
    docstring). `max_scale_code` is the largest E8M0 weight scale (the GEMMs
    pick their two-multiply decode when it exceeds NARROW_SCALE_MAX),
    `min_scale_code` the smallest (0 also where unknown, e.g. older positional
    callers: treated as special, the safe and slower fp8 variant); `operand`
    the A operand the words are laid out for ("bf16": the BF16 tactics,
    "e4m3": the fp8 tactics)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    clamp: torch.Tensor
    hidden: int
    intermediate: int
    padded_intermediate: int
    max_scale_code: int
    min_scale_code: int = 0
    operand: str = "bf16"

    def __post_init__(self) -> None:
        _check_operand(self.operand)

    @property
    def experts(self) -> int:
        return self.w13.shape[0]

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @property
    def wide_scales(self) -> bool:
        """Whether some weight scale code exceeds NARROW_SCALE_MAX."""
        return self.max_scale_code > NARROW_SCALE_MAX

    @property
    def special_scales(self) -> bool:
        """Whether some weight scale code is 0 (2^-127, subnormal in fp32) or
        255 (NaN): the fp8 tactics then build the fp32 scale with both cases."""
        return self.min_scale_code == 0 or self.max_scale_code == 255

    def scale_variant(self, fp8: bool) -> bool:
        """The GEMMs' compile-time scale flag for these weights: `special_scales`
        for an fp8 tactic, else `wide_scales`."""
        return self.special_scales if fp8 else self.wide_scales

    def expert_bytes(self) -> int:
        """Bytes of one expert the GEMMs stream (values + scales, no padding)."""
        return sum(t[0].numel() for t in (self.w13, self.w13_scale, self.w2, self.w2_scale))


def pack_rows(
    codes_packed: torch.Tensor, scales: torch.Tensor, operand: str = "bf16"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack canonical MXFP4 rows into the kernel unit layout.

    codes_packed: uint8 [E, M, K/2] (even k in the low nibble); scales: uint8
    [E, M, K/32]; M and K multiples of 32; operand: "bf16" or "e4m3" (the bit
    order inside a word, module docstring). Returns (uint8 [E, M/32, K/32, 32, 16],
    uint8 [E, M/32, K/32, 8, 4]) on the input's device. Raises ValueError on
    bad shapes or an unknown operand."""
    _check_operand(operand)
    if codes_packed.dim() != 3 or scales.dim() != 3:
        raise ValueError("codes_packed and scales must be [E, M, K/2] and [E, M, K/32]")
    e, m, k2 = codes_packed.shape
    k = 2 * k2
    if m % 32 or k % MX_BLOCK or tuple(scales.shape) != (e, m, k // MX_BLOCK):
        raise ValueError(
            f"rows {m} and K {k} must be multiples of 32 and scales [E, M, K/32]; got "
            f"codes {tuple(codes_packed.shape)}, scales {tuple(scales.shape)}"
        )
    p, ch = m // 32, k // 32
    out_w = torch.empty(e, p, ch, 32, 16, dtype=torch.uint8, device=codes_packed.device)
    step = max(1, _CODES_PER_STEP // (m * k))
    for e0 in range(0, e, step):
        q = codes_packed[e0 : e0 + step].to(torch.int32)
        n = q.shape[0]
        nib = torch.stack((q & 0xF, q >> 4), dim=-1)  # [n, M, K/2, 2] -> codes along k
        # row = 32p + 16t + 8rh + g ; k = 32ch + 8c + 4j + 2hh + e
        v = nib.view(n, p, 2, 2, 8, ch, 4, 2, 2, 2)  # n p t rh g ch c j hh e
        v = v.permute(0, 1, 5, 4, 6, 2, 7, 3, 8, 9)  # n p ch g c t j rh hh e
        word = torch.zeros(v.shape[:7], dtype=torch.int64, device=q.device)
        for rh in range(2):
            for hh in range(2):
                for h in range(2):
                    code = v[..., rh, hh, h].to(torch.int64)
                    for b in range(4):
                        word |= ((code >> b) & 1) << code_bit_position(operand, rh, hh, h, b)
        word = word.reshape(n, p, ch, 32, 4)
        as_bytes = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
        out_w[e0 : e0 + n] = as_bytes.reshape(n, p, ch, 32, 16).to(torch.uint8)
    s = scales.view(e, p, 2, 2, 8, ch).permute(0, 1, 5, 4, 2, 3).contiguous()
    return out_w, s.view(e, p, ch, 8, 4)


def _interleave_w13(t: torch.Tensor, i: int, ip: int) -> torch.Tensor:
    """[E, 2Ip, X] gate|up (padded) -> [E, 2I, X], 32 gate rows then 32 up rows per block."""
    e, x = t.shape[0], t.shape[2]
    gate = t[:, :i].reshape(e, i // 32, 32, x)
    up = t[:, ip : ip + i].reshape(e, i // 32, 32, x)
    return torch.stack((gate, up), dim=2).reshape(e, 2 * i, x)


def _check_padding(weights: ExpertWeights) -> None:
    i, ip = weights.intermediate, weights.padded_intermediate
    if i == ip:
        return
    pads = (
        ("w13", weights.w13[:, i:ip]), ("w13", weights.w13[:, ip + i :]),
        ("w13_scale", weights.w13_scale[:, i:ip]), ("w13_scale", weights.w13_scale[:, ip + i :]),
        ("w2", weights.w2[:, :, i // 2 :]), ("w2_scale", weights.w2_scale[:, :, i // MX_BLOCK :]),
    )  # fmt: skip
    for name, pad in pads:
        if int(torch.count_nonzero(pad)) != 0:
            raise ValueError(
                f"{name}: the intermediate padding (columns {i}..{ip}) must be zero; "
                f"{int(torch.count_nonzero(pad))} nonzero bytes found"
            )


def to_kernel_layout(weights: ExpertWeights, operand: str = "bf16") -> KernelWeights:
    """Convert canonical weights (any device) to `KernelWeights` on the same
    device, laid out for the A operand `operand` ("bf16": the BF16 tactics,
    "e4m3": the fp8 tactics; module docstring).

    Raises TypeError if `weights` is not an ExpertWeights, ValueError naming the
    tensor when its intermediate padding is not zero, or when H or the logical
    I is not a multiple of 32 (H of 128 for the kernels, checked by the
    tactic), or for an unknown operand (ValueError naming `operand`).
    """
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be an ExpertWeights, got {type(weights).__name__}")
    _check_padding(weights)
    h, i, ip = weights.hidden, weights.intermediate, weights.padded_intermediate
    if h % 32 or i % 32:
        raise ValueError(f"weights: hidden {h} and intermediate {i} must be multiples of 32")
    w13, w13_s = pack_rows(_interleave_w13(weights.w13, i, ip), _interleave_w13(weights.w13_scale, i, ip), operand)
    w2, w2_s = pack_rows(
        weights.w2[:, :, : i // 2].contiguous(), weights.w2_scale[:, :, : i // MX_BLOCK].contiguous(), operand
    )
    max_code = max(int(w13_s.max()), int(w2_s.max())) if w13_s.numel() else 0
    min_code = min(int(w13_s.min()), int(w2_s.min())) if w13_s.numel() else 0
    return KernelWeights(
        w13.contiguous(), w13_s.contiguous(), w2.contiguous(), w2_s.contiguous(),
        weights.clamp.to(torch.float32).contiguous(), h, i, ip, max_code, min_code, operand,
    )  # fmt: skip
