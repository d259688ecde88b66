"""Timing harness, sweep and decode-step benchmarks. This package module
stays free of torch so that the CLI can read its constants at start-up."""

#: Timing counts cap for eager timing (backends that cannot be graph-captured, or the CPU).
EAGER_REPLAYS_CAP = 20
EAGER_WARMUP_CAP = 2
