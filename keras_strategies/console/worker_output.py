"""Lines of the engines that the launcher keeps out of the workers' relayed output.

JAX's gloo collectives print `[Gloo] Rank 0 is connected to 1 peer ranks. Expected
number of connected peer ranks is : 1` to stdout from C++ each time a worker opens
a communicator (several times per worker), with no setting to turn it off; it says
nothing a user can act on. A worker's communicators connect in threads of their
own, so two such lines can be written at once and interleave in pieces (`[Gloo]
Rank [Gloo] Rank 1 is connected to ...` then `0 is connected to ...`): a line made
only of those pieces is noise too. Started any other way (`torchrun`, `srun`), a
worker prints it unfiltered.
"""

from __future__ import annotations

import re

# The pieces gloo writes one `<<` at a time: its whole line `[Gloo] Rank 0 is connected to 1 peer
# ranks. Expected number of connected peer ranks is : 1`, or pieces of several written at once.
ENGINE_NOISE = re.compile(
    r"^\s*(?:\[Gloo\] Rank |\d+| is connected to | peer ranks\. |Expected number of connected peer ranks is : )+\s*$"
)
_GLOO_WORDS = re.compile(r"\[Gloo\] Rank|is connected to|peer ranks")  # a line of pieces holds one at least


def is_engine_noise(line: str) -> bool:
    """Whether a worker's output line (without its newline) is made of `ENGINE_NOISE`'s pieces:
    gloo's whole line, or pieces of several written at once."""
    return bool(ENGINE_NOISE.match(line) and _GLOO_WORDS.search(line))
