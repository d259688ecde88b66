"""Checks the baseline backends' GPU tests share (not a test module)."""

import torch

from moebench.reference import reference_moe, relative_error


def tiny_expert_alone_error(backend, prepared, shape, weights, x: torch.Tensor, expert: int) -> float:
    """Relative error (scale-free) of `backend` vs its oracle when every row
    of `x` (bf16 [rows, H]) goes to `expert` alone with weight 1; prints it.
    Raises AssertionError if the oracle's output is all zero (no signal)."""
    rows = x.shape[0]
    only = torch.full((rows, 1), expert, dtype=torch.int32, device=x.device)
    ones = torch.ones(rows, 1, dtype=torch.float32, device=x.device)
    out = backend.forward(prepared, x, only, ones).clone()
    ref = reference_moe(x, only, ones, weights, activation=backend.oracle).output
    assert ref.abs().max() > 0
    err = relative_error(out, ref)
    print(f"{backend.name} {shape.describe()} rows={rows} tiny expert alone: rel err {err:.3e}")
    return err
