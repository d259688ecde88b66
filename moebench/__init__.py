"""moebench: low-batch MXFP4 routed-expert MoE decode kernels, benchmarks and tuning.

Data flows routing -> record -> GEMM1 -> GEMM2 -> finalize; see docs/design.md.
"""

__version__ = "0.1.0"
