"""What one sm_90 (H100 / H200) SM holds: the limits the kernels and the
tactic spaces size themselves by. The one source of these numbers: kernels,
tactics, the tuning space and the tests import them from here."""

#: Shared memory of one SM (bytes; 228 KB on sm_90), what the carveout divides.
SMEM_PER_SM = 228 * 1024
#: Shared memory one CTA may use (bytes; 227 KB on sm_90).
SMEM_PER_CTA = 227 * 1024
#: Shared memory the system reserves per resident CTA (bytes; 1 KB on sm_90).
SMEM_RESERVED_PER_CTA = 1024
#: Resident warps (and threads) per SM.
MAX_WARPS_PER_SM = 64
MAX_THREADS_PER_SM = 32 * MAX_WARPS_PER_SM
#: 32-bit registers of one SM, and the most one thread may hold.
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255
