"""`TPUClusterResolver`: which TPU a `ks.TPUStrategy` runs on, as TensorFlow's.

The backend's TPU runtime answers (`engine.tpu`): on TensorFlow, TensorFlow's
own `TPUClusterResolver`; on JAX, the TPU chips of this host; on PyTorch, a
clear error (no TPU runtime matches its torch).
"""

from __future__ import annotations

from typing import Any, Optional

from keras_strategies.backend import engine
from keras_strategies.cluster_resolver.cluster_spec import ClusterSpec
from keras_strategies.cluster_resolver.resolvers import ClusterResolver


class TPUClusterResolver(ClusterResolver):
    """The TPU to train on, as `tf.distribute.cluster_resolver.TPUClusterResolver`.

    `tpu` names it: `None` (or `""`) for the TPU of this Cloud TPU VM (or the
    one `TPU_NAME` names), `"local"` for this host's chips; on TensorFlow also
    a TPU node's name or `grpc://` address. Pass the resolver to
    `ks.experimental_connect_to_cluster`, `ks.initialize_tpu_system` and
    `ks.TPUStrategy`.

    On TensorFlow this is TensorFlow's own resolver (`tf_resolver`); JAX runs
    on the chips of the TPU VM it runs on and refuses remote TPU names;
    PyTorch has no TPU runtime and raises a `RuntimeError` that says so.

    Raises:
        ValueError: No TPU name was given and this machine has no TPU
            ("Please provide a TPU Name to connect to."), or the name cannot
            be resolved.

    Examples:
        ```python
        resolver = ks.cluster_resolver.TPUClusterResolver(tpu="")  # this TPU VM
        ks.experimental_connect_to_cluster(resolver)
        ks.initialize_tpu_system(resolver)
        strategy = ks.TPUStrategy(resolver)
        ```
    """

    def __init__(self, tpu: Optional[str] = None, zone: Optional[str] = None, project: Optional[str] = None,
                 job_name: str = "worker", coordinator_name: Optional[str] = None,
                 coordinator_address: Optional[str] = None, credentials: Any = "default",
                 service: Any = None, discovery_url: Optional[str] = None):
        engine.tpu.check_runtime()
        options = dict(zone=zone, project=project, job_name=job_name, coordinator_name=coordinator_name,
                       coordinator_address=coordinator_address, credentials=credentials, service=service,
                       discovery_url=discovery_url)
        self._tpu = tpu
        self._handle = engine.tpu.resolve(tpu, **options)
        self._task_type, self._task_id, self._rpc_layer = job_name, 0, None

    @property
    def tf_resolver(self) -> Any:
        """On TensorFlow, TensorFlow's `TPUClusterResolver` behind this one; else `None`."""
        return None if isinstance(self._handle, dict) else self._handle

    def cluster_spec(self) -> ClusterSpec:
        """The TPU's hosts (`{"worker": [...]}` for a remote TPU; empty for this host's chips)."""
        return ClusterSpec(engine.tpu.cluster_spec(self._handle))

    def master(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
               rpc_layer: Optional[str] = None) -> str:
        """The TPU's address (`grpc://...`), or `""` for this host's chips."""
        return engine.tpu.master(self._handle)

    def get_master(self) -> str:
        """`master()`, as TensorFlow's resolver."""
        return self.master()

    def num_accelerators(self, task_type: Optional[str] = None, task_id: Optional[int] = None,
                         config_proto: Any = None) -> dict:
        """`{"TPU": cores}` per host, or `{}` when none are visible."""
        return engine.tpu.num_accelerators(self._handle)

    def __repr__(self) -> str:
        return f"TPUClusterResolver(tpu={self._tpu!r})"
