"""`python -m torchrun_entry ARGS`: the moebench command line with two stand-in
backends registered, for the torchrun tests (test_torchrun.py): "die" (torch-bf16
whose prepare SIGKILLs its rank at TP-2, as an OOM kill would) and "slow"
(torch-bf16 whose forward at 2+ rows sleeps, after writing a marker file
$MOEBENCH_TEST_MARKERS/rank-<RANK>, so that a test can interrupt the run
once every rank has measured its 1-row cases)."""

import os
import signal
import time
from pathlib import Path

from moebench.backends.registry import register_backend
from moebench.backends.torch_bf16 import TorchBF16Backend


class Die(TorchBF16Backend):
    name = "die"

    def prepare(self, weights, shape, tactic="default"):
        if shape.tp == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().prepare(weights, shape, tactic)


class Slow(TorchBF16Backend):
    name = "slow"

    def forward(self, prepared, x, topk_ids, topk_weights):
        if x.shape[0] >= 2:
            Path(os.environ["MOEBENCH_TEST_MARKERS"], f"rank-{os.environ.get('RANK', '0')}").touch()
            time.sleep(0.5)
        return super().forward(prepared, x, topk_ids, topk_weights)


register_backend("die", Die)
register_backend("slow", Slow)

if __name__ == "__main__":
    from moebench.cli import main

    main()
