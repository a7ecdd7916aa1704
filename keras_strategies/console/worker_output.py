"""Lines of the engines that the launcher keeps out of the workers' relayed output.

JAX's gloo collectives print `[Gloo] Rank 0 is connected to 1 peer ranks. Expected
number of connected peer ranks is : 1` to stdout from C++ each time a worker opens
a communicator (several times per worker), with no setting to turn it off; it says
nothing a user can act on. Started any other way (`torchrun`, `srun`), a worker
prints it unfiltered.
"""

from __future__ import annotations

import re

ENGINE_NOISE = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+$")


def is_engine_noise(line: str) -> bool:
    """Whether a worker's output line (without its newline) is one of `ENGINE_NOISE`'s."""
    return bool(ENGINE_NOISE.match(line.strip()))
