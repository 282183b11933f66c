"""Exceptions and the stage table that names where a bounded wait gave up."""

from __future__ import annotations

# Stage codes written by kernels into a world's error buffer. One table, so a record read back
# from the device always has a name. Append only: codes are part of the device protocol.
STAGES = {
    1: "ready handshake (producer waits for the destination to finish its previous op)",
    2: "toy.push_allreduce consumer",
    3: "count exchange",
    4: "moe layer0 dispatch (GEMM tile waits for token rows)",
    5: "moe layer1 combine (reduction waits for expert rows)",
    6: "tp all_gather_matmul (GEMM tile waits for a gathered chunk)",
    7: "tp matmul_reduce_scatter (owner waits for partial tiles)",
    8: "test: wait on a flag nobody sets",
    9: "moe backward dispatch",
    10: "moe backward combine",
}

# Layout of the int64 error record a kernel writes (see kernels/signals.py).
ERR_FIELDS = ("code", "rank", "stage", "index", "expected", "seen")
ERR_WORDS = 8


class CommTimeoutError(RuntimeError):
    """A bounded wait inside a fused kernel ran out of budget.

    Attributes name the rank whose kernel waited, the stage, the flag index, and the values
    expected and seen, so a stuck peer can be found without a debugger.
    """

    def __init__(self, rank: int, stage: int, index: int, expected: int, seen: int):
        self.rank, self.stage, self.index = rank, stage, index
        self.expected, self.seen = expected, seen
        name = STAGES.get(stage, f"stage {stage}")
        # The handshake's flag is the peer's own ready word, so its index is the peer's rank;
        # other stages' indices are per-op flag numbers (tiles, slices), named as such.
        what = f"rank {index}'s ready flag" if stage == 1 else f"flag {index}"
        super().__init__(
            f"rank {rank}: wait timed out in {name}: {what} expected >= {expected}, "
            f"saw {seen}. A peer did not produce in time (crashed, hung, or launched a different "
            f"op); if the peer is merely slow (JIT compile), raise the budget: "
            f"MOE_OVERLAP_WAIT_TIMEOUT_S on the GPU, MOE_OVERLAP_WAIT_ITERS in the interpreter."
        )

    def __reduce__(self):
        # Rebuilt from its fields, so it crosses process boundaries (multiprocessing, a
        # ProcessPoolExecutor) as itself; the default would call __init__ with the message.
        return type(self), (self.rank, self.stage, self.index, self.expected, self.seen)


class MissingBackendError(ImportError):
    """A named world backend's package is not installed."""
