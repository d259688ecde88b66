"""Timing harness, sweep and decode-step benchmarks. This package module
stays free of torch so that the CLI can read its constants at start-up."""

#: Timing counts cap for eager timing (backends that cannot be graph-captured, or the CPU).
EAGER_REPLAYS_CAP = 20
EAGER_WARMUP_CAP = 2
#: Largest seed of weights, routing and activations: 32 bits, so that two seeds
#: never name the same generator state (torch's manual_seed takes seeds modulo
#: 2**64, and the per-layer / per-case offsets added to a seed must stay in range).
MAX_SEED = 2**32 - 1


def check_seed(seed) -> None:
    """Raise ValueError (TypeError for a non-int) unless `seed` is an int in
    [0, MAX_SEED]; the message names `seed`."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an int in [0, {MAX_SEED}] (2**32 - 1), got {seed!r}")


#: Working set of one cold-L2 replay, in L2 sizes: the sweep, the decode step,
#: the tuner and the size-matched ceiling rotate through enough distinct
#: weight sets (buffers) to span this many L2s, so every launch starts cold.
L2_MULTIPLE = 4

#: Most weight sets a replay rotates through (a forced --layers included):
#: 4 x L2 of the smallest shapes is reached well below it.
MAX_LAYERS = 64


def check_layers(layers) -> None:
    """Raise ValueError unless `layers` (the rotated weight sets a replay walks)
    is None or an int in [1, MAX_LAYERS]; the message names `layers`."""
    if layers is not None and (
        not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= MAX_LAYERS
    ):
        raise ValueError(f"layers must be an int in [1, {MAX_LAYERS}], got {layers!r}")
