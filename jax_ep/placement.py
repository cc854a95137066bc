"""Where the "cuda" backend runs an op's kernels: `Placement`, one static value per op call
built from its `num_sms`, `stream` and low-latency `buffer`. It imports nothing from the
package, so that the structs, the checks and the custom calls can all name it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the "cuda" backend runs an op's kernels (static and hashable).

    Attributes:
      num_sms: the SMs each kernel launch may take; None: every SM.
      stream: None: XLA's compute stream, in program order with the computation. N: GPU
        stream N (`gpu_stream:N` of `jax.experimental.compute_on`), where the kernels run
        beside the computation that does not depend on them.
      buffer: which of the two low-latency regions of the symmetric buffer a low-latency
        exchange uses (0 or 1); exchanges on different regions may be in flight at once.
    """

    num_sms: int | None = None
    stream: int | None = None
    buffer: int = 0


ANYWHERE = Placement()  # every SM, on XLA's compute stream, low-latency region 0
