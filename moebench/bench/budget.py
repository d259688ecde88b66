"""How many weight sets a replay rotates through: the sweep's and the
decode step's one rule (torch-free).

A group (a sweep's (preset, tp), a step's preset) generates `layers`
distinct weight sets: enough that one replay's working set is >= L2_MULTIPLE
x L2 for the routing that touches the fewest bytes (`layer_count`), at most
MAX_LAYERS and what the memory budget holds; 1 with warm_l2; exactly
config.layers when forced (`--layers`; `forced_layers_error` says when that
does not fit). Each (backend, tactic) pair then walks all of them, or fewer
where its prepared copies do not fit the budget beside them
(`LayerBudget.for_pair`; a forced count is kept: a copy that does not fit
fails its prepare).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moebench.bench import L2_MULTIPLE, MAX_LAYERS


def layer_count(
    min_touched_bytes: int, l2_bytes: int | None, per_layer_bytes: int, budget_bytes: int | None
) -> tuple[int, bool]:
    """(layers, capped): max(1, ceil(4 * L2 / min_touched_bytes)) weight sets,
    at most MAX_LAYERS and what `budget_bytes` holds at `per_layer_bytes` each
    (never below 1). Without a known L2 (CPU) one layer. `capped` when the
    budget or MAX_LAYERS cut it (tiny shapes cannot reach 4x L2 sensibly)."""
    if min_touched_bytes <= 0 or per_layer_bytes <= 0:
        raise ValueError("min_touched_bytes and per_layer_bytes must be positive")
    want = 1 if not l2_bytes else max(1, math.ceil(L2_MULTIPLE * l2_bytes / min_touched_bytes))
    fit = MAX_LAYERS if budget_bytes is None else max(1, min(MAX_LAYERS, budget_bytes // per_layer_bytes))
    return min(want, fit), fit < want


def forced_layers_error(
    layers: int, per_layer_bytes: int, budget_bytes: int | None, memory_fraction: float
) -> str | None:
    """Why `layers` weight sets of `per_layer_bytes` each do not fit
    `budget_bytes` (None: no budget, the CPU), naming --layers, or None. Only
    a forced --layers can exceed it: `layer_count` caps its own count."""
    if budget_bytes is None or layers * per_layer_bytes <= budget_bytes:
        return None
    return (
        f"layers (--layers) {layers} need {layers * per_layer_bytes / 1e9:.1f} GB of weights, more than the"
        f" {budget_bytes / 1e9:.1f} GB budget (memory_fraction {memory_fraction} of the free device memory)"
    )


@dataclass(frozen=True)
class LayerBudget:
    """A group's rotation: `layers` weight sets of `per_layer_bytes` each
    (`capped`: the budget or MAX_LAYERS cut the count; `forced`: warm_l2 or
    --layers fixed it) within `budget_bytes` (None: no budget, the CPU)."""

    layers: int
    capped: bool
    forced: bool
    per_layer_bytes: int
    budget_bytes: int | None

    @classmethod
    def plan(
        cls, config, min_touched_bytes: int, l2_bytes: int | None, per_layer_bytes: int, budget_bytes: int | None
    ) -> LayerBudget:
        """The rotation of a group under `config` (its warm_l2 and layers):
        1 with warm_l2, config.layers when given, else `layer_count`."""
        if config.warm_l2:
            return cls(1, False, True, per_layer_bytes, budget_bytes)
        if config.layers is not None:
            return cls(config.layers, False, True, per_layer_bytes, budget_bytes)
        layers, capped = layer_count(min_touched_bytes, l2_bytes, per_layer_bytes, budget_bytes)
        return cls(layers, capped, False, per_layer_bytes, budget_bytes)

    def for_pair(self, prepared_bytes: int, layers: int | None = None) -> int:
        """The weight sets a pair walks whose prepared copy takes
        `prepared_bytes` per set: all `layers` (default: the group's), fewer
        where the copies do not fit the budget beside the canonical sets; a
        forced count is kept."""
        n = self.layers if layers is None else layers
        if self.budget_bytes is None or prepared_bytes <= 0 or self.forced:
            return n
        return max(1, min(n, (self.budget_bytes - n * self.per_layer_bytes) // prepared_bytes))

    def forced_error(self, memory_fraction: float, layers: int | None = None) -> str | None:
        """`forced_layers_error` of this budget (at `layers`, default the group's)."""
        return forced_layers_error(
            self.layers if layers is None else layers, self.per_layer_bytes, self.budget_bytes, memory_fraction
        )
