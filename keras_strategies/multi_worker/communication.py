"""`ks.CommunicationOptions` / `ks.CommunicationImplementation`, as in `tf.distribute.experimental`."""

from __future__ import annotations

import enum
from typing import Optional

# A worker that stops answering is reported after this many seconds without a heartbeat.
DEFAULT_TIMEOUT_SECONDS = 300.0


class CommunicationImplementation(enum.Enum):
    """Which collective implementation cross-worker reductions use.

    As `tf.distribute.experimental.CommunicationImplementation`. `AUTO` lets
    the backend choose; `RING` is the ring algorithm over the network (gloo
    on JAX and PyTorch, gRPC collectives on TensorFlow); `NCCL` needs GPUs.

    Examples:
        >>> options = ks.CommunicationOptions(implementation=ks.CommunicationImplementation.RING)
        >>> options.implementation
        <CommunicationImplementation.RING: 'RING'>
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class CommunicationOptions:
    """How cross-worker collectives run, as `tf.distribute.experimental.CommunicationOptions`.

    Pass it to `ks.MultiWorkerMirroredStrategy(communication_options=...)`.

    Args:
        bytes_per_pack: Gradients are packed into chunks of about this size
            (0: one pack; TensorFlow honours it, other backends pack everything).
        timeout_seconds: A collective that has not completed after this long
            fails every worker with an error naming the missing worker (`None`:
            the default of 300 s; dead workers are detected sooner, by heartbeats).
        implementation: A `ks.CommunicationImplementation`, or its name.

    Examples:
        >>> options = ks.CommunicationOptions(timeout_seconds=120, implementation="ring")
        >>> options.implementation
        <CommunicationImplementation.RING: 'RING'>

        ```python
        strategy = ks.MultiWorkerMirroredStrategy(communication_options=options)
        ```
    """

    def __init__(
        self,
        bytes_per_pack: int = 0,
        timeout_seconds: Optional[float] = None,
        implementation: CommunicationImplementation = CommunicationImplementation.AUTO,
    ):
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int) or bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be non-negative, got {bytes_per_pack!r}.")
        if timeout_seconds is not None and (
            isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) or timeout_seconds <= 0
        ):
            raise ValueError(f"timeout_seconds must be a positive number or None, got {timeout_seconds!r}.")
        given = implementation
        if isinstance(implementation, str):
            implementation = CommunicationImplementation.__members__.get(implementation.upper())
        if not isinstance(implementation, CommunicationImplementation):
            raise ValueError(
                "implementation must be a ks.CommunicationImplementation (AUTO, RING or NCCL), "
                f"got {given!r}."
            )
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = implementation

    @property
    def effective_timeout(self) -> float:
        """`timeout_seconds`, or the default of 300 s when it is `None`."""
        return float(self.timeout_seconds) if self.timeout_seconds is not None else DEFAULT_TIMEOUT_SECONDS

    def merge(self, options: Optional[CommunicationOptions]) -> CommunicationOptions:
        """These options with the non-default fields of `options` on top (as TensorFlow's `Options.merge`).

        Examples:
            >>> base = ks.CommunicationOptions(timeout_seconds=60)
            >>> merged = base.merge(ks.CommunicationOptions(implementation="ring"))
            >>> merged.timeout_seconds, merged.implementation.name
            (60, 'RING')
        """
        if options is None:
            return self
        return CommunicationOptions(
            options.bytes_per_pack or self.bytes_per_pack,
            options.timeout_seconds if options.timeout_seconds is not None else self.timeout_seconds,
            options.implementation if options.implementation != CommunicationImplementation.AUTO else self.implementation,
        )

    def __repr__(self) -> str:
        return (
            f"ks.CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
            f"timeout_seconds={self.timeout_seconds}, implementation={self.implementation})"
        )
