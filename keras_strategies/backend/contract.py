"""The engines' contract: what each `backend/<name>/` package gives the backend-neutral code.

Shared code reads an engine only as `keras_strategies.backend.engine`, an `Engine`
whose fields are typed by the protocols here, one per engine module (the same
module names on every backend, as in Keras' own `keras/src/backend/<name>/`),
and whose `capabilities` say how the engine differs where the shared code must
know. A name only some engines have belongs to an optional protocol, required
exactly where a capability says so (`OPTIONAL`). `problems` checks an engine
against all of it: the engine is checked when it loads, and the tests check
every engine.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

from keras_strategies.backend.common.capabilities import Capabilities


@runtime_checkable
class Devices(Protocol):
    """The backend's devices, by the names `tf.distribute` uses ("/job:localhost/replica:0/task:0/device:CPU:0")."""

    def list_devices(self) -> list: ...
    def has_gpu(self) -> bool: ...
    def set_virtual_cpu_devices(self, count: int) -> None: ...
    def device_of(self, value: Any) -> str: ...
    def device_scope(self, name: str) -> contextlib.AbstractContextManager: ...
    def copy_to(self, value: Any, name: str) -> Any: ...
    def place_each(self, values: list, names: list) -> list: ...


@runtime_checkable
class Compiler(Protocol):
    """Compiled steps: a whole step, a stateful function, a step replicated over devices."""

    def compile_step(self, fn: Callable) -> Callable: ...
    def compile_stateful(self, fn: Callable, state_variables: Sequence[Any]) -> Callable: ...
    def compile_replicated_step(self, fn: Callable, variables: Sequence[Any], devices: Sequence[str],
                                keep_copies: bool, finish: Optional[Callable[[list], None]],
                                any_batch_size: bool = False) -> Callable: ...
    def step_group(self, compiled_step: Callable) -> Optional[Callable]: ...
    def settle(self, variables: Sequence[Any], device: str) -> None: ...
    def with_rows(self, value: Any, rows: int) -> Any: ...
    def outside_compiled(self) -> contextlib.AbstractContextManager: ...
    def outside_replicas(self) -> contextlib.AbstractContextManager: ...


@runtime_checkable
class InProgramExchange(Protocol):
    """`Capabilities.exchanges_in_program`: a branch of a compiled program taken on a traced condition."""

    def run_if(self, condition: Any, fn: Callable[[], Any]) -> Any: ...


@runtime_checkable
class InProgramCustomSteps(Protocol):
    """`Capabilities.traces_custom_steps`: the program `ks.function` traces a custom step into."""

    def custom_step_program(self, devices: Sequence[str]) -> Any: ...


@runtime_checkable
class Gradients(Protocol):
    """Loss values and gradients of the backend's autodiff."""

    def value_and_grad(self, fn: Callable[..., tuple], hooks: Any = None) -> Callable[..., tuple]: ...
    def variables_value_and_grad(self, fn: Callable[..., Any], variables: list, args: tuple,
                                 kwargs: dict) -> tuple: ...
    def add(self, x: Any, y: Any) -> Any: ...
    def is_sliced(self, value: Any) -> bool: ...
    def sliced_pieces(self, value: Any, shape: tuple, num_pieces: int, length: int) -> list: ...


@runtime_checkable
class Replicas(Protocol):
    """Running one function per replica, and the collectives among a process's replicas."""

    def make_replicated(self, fn: Callable, devices: Sequence[str], compiled: bool,
                        variables: Sequence[Any] = ()) -> Callable: ...
    def replica_device_scope(self, replica_id: Any, devices: Sequence[str]) -> contextlib.AbstractContextManager: ...
    def replica_view(self, value: Any, device: str) -> Any: ...
    def split_rows(self, value: Any, sizes: Sequence[int]) -> list: ...
    def batch_leaf(self, value: Any) -> Any: ...
    def onto(self, value: Any, like: Any) -> Any: ...
    def merge_call(self, fn: Callable[[list], Any], value: Any) -> Any: ...
    def all_reduce_sum(self, value: Any) -> Any: ...
    def all_reduce_sums(self, values: list) -> list: ...
    def all_gather(self, value: Any, axis: int) -> Any: ...
    def global_sum(self, values: list, across_workers: Callable[[list], list],
                   over_all_replicas: Callable[[list], list]) -> list: ...


@runtime_checkable
class InProgramReplicas(Protocol):
    """`Capabilities.traces_custom_steps`: the replicas of a traced custom step as one program."""

    StackedShards: type
    def combine_writes_in_program(self, items: list) -> list: ...


@runtime_checkable
class Optimizer(Protocol):
    """Applying summed gradients with a Keras optimizer."""

    def apply_gradients(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None: ...


@runtime_checkable
class Trainer(Protocol):
    """Keras' trainer of the backend: its steps and its input pipeline."""

    def call_step(self, model: Any, kind: str, data: Any, device: Optional[str]) -> tuple: ...
    def state_parts(self, model: Any, kind: str) -> list: ...
    def epoch_batches(self, data_adapter: Any) -> Callable[[], Iterable]: ...
    def build_batch(self, data_adapter: Any, batches: Optional[Callable[[], Iterable]]) -> Optional[Any]: ...
    def as_keras_reads(self, batches: Iterable) -> Iterable: ...
    def pipeline_order_seed(self) -> Optional[int]: ...


@runtime_checkable
class StatelessSteps(Protocol):
    """Where `Capabilities.stateful_steps` is False: the state a step is given, and takes back."""

    def step_state(self, model: Any, kind: str) -> tuple: ...


@runtime_checkable
class Collectives(Protocol):
    """The processes of a multi-worker cluster: joining it, summing and gathering across it, its
    key-value store. `all_gather` stacks each value of every worker (same shape and dtype on every
    worker) along a new first axis, in worker order: `(num_workers, *shape)`, eagerly.
    `reduce_scatter_sum` is its transpose: each value is `(num_workers, *shape)` on every worker,
    and worker w receives the sum over the workers of their row w, `shape`, eagerly."""

    def initialize(self, cluster: Any, options: Any) -> None: ...
    def all_reduce_sum(self, values: list, donated: Any = False) -> list: ...
    def all_gather(self, values: list) -> list: ...
    def reduce_scatter_sum(self, values: list) -> list: ...
    def start_all_reduce_sum(self, values: list, donated: Any = False) -> Any: ...
    def tracing(self) -> bool: ...
    def kv_set(self, key: str, value: str) -> None: ...
    def kv_try_get(self, key: str) -> Optional[str]: ...


@runtime_checkable
class KerasHooks(Protocol):
    """The engine's own replacements of Keras functions (through `backend/common/patches.py`)."""

    def install(self, strategy_context: Any) -> None: ...


@runtime_checkable
class Nccl(Protocol):
    """`NcclAllReduce`: the backend's own NCCL sum over local GPUs."""

    def all_reduce_sum(self, per_value: Sequence[Sequence[Any]], devices: Sequence[str]) -> list: ...


@runtime_checkable
class ParameterServer(Protocol):
    """`ParameterServerStrategy`'s runtime: serving `worker` and `ps` tasks, and the chief's connection."""

    def serve(self, cluster_spec: Any, job_name: Optional[str], task_index: Optional[int],
              protocol: Optional[str], config: Any, start: bool) -> Any: ...
    def connect(self, cluster_spec: Any, task_type: Optional[str], task_id: Optional[int],
                partitioner: Optional[Callable[..., Any]] = None, rpc_layer: Optional[str] = None) -> Any: ...
    def current_worker_index(self) -> Any: ...


@runtime_checkable
class Tpu(Protocol):
    """`TPUStrategy`'s runtime (an engine without one raises one clear error from every function)."""

    def check_runtime(self) -> None: ...
    def resolve(self, tpu: Optional[str]) -> Any: ...
    def master(self, handle: Any) -> str: ...
    def cluster_spec(self, handle: Any) -> dict: ...
    def num_accelerators(self, handle: Any) -> dict: ...
    def connect_to_cluster(self, handle: Any) -> None: ...
    def initialize_tpu_system(self, handle: Any) -> Any: ...
    def replica_devices(self, handle: Any, device_assignment: Any, spmd: bool) -> list: ...
    def hosts(self, handle: Any) -> tuple: ...


MODULES = {
    "devices": Devices,
    "compiler": Compiler,
    "gradients": Gradients,
    "replicas": Replicas,
    "optimizer": Optimizer,
    "trainer": Trainer,
    "collectives": Collectives,
    "keras_hooks": KerasHooks,
    "nccl": Nccl,
    "parameter_server": ParameterServer,
    "tpu": Tpu,
}
"""Each engine module, by its name in every `backend/<name>/` package, and its protocol."""

OPTIONAL = (
    ("compiler", InProgramExchange, lambda capabilities: capabilities.exchanges_in_program),
    ("compiler", InProgramCustomSteps, lambda capabilities: capabilities.traces_custom_steps),
    ("replicas", InProgramReplicas, lambda capabilities: capabilities.traces_custom_steps),
    ("trainer", StatelessSteps, lambda capabilities: not capabilities.stateful_steps),
)
"""(module, protocol, where it is required): the names only some engines have."""


def members(protocol: type) -> list:
    """The names a protocol asks for, in the order it declares them."""
    names = [name for name in vars(protocol) if not name.startswith("_")]
    names += [name for name in getattr(protocol, "__annotations__", {}) if name not in names]
    return names


def names(module: str, capabilities: Optional[Capabilities] = None) -> set:
    """Every name of `module` the contract knows (its protocol's and its optional protocols'),
    or, given an engine's capabilities, the names that engine must have."""
    known = set(members(MODULES[module]))
    for name, protocol, required in OPTIONAL:
        if name == module and (capabilities is None or required(capabilities)):
            known |= set(members(protocol))
    return known


def _parameters(function: Callable) -> Optional[list]:
    try:
        return list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return None


def _accepts(function: Callable, declared: Callable) -> bool:
    """Whether `function` takes the declared positional parameters, any more having defaults. Names
    must match too where the package defines the function (Keras' own ops keep theirs)."""
    have = _parameters(function)
    if have is None or any(p.kind == p.VAR_POSITIONAL for p in have):
        return True
    want = [p for p in _parameters(declared)[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [p for p in have if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < len(want) or any(p.default is p.empty for p in positional[len(want):]):
        return False
    ours = getattr(function, "__module__", "") or ""
    return not ours.startswith("keras_strategies.") or [p.name for p in positional[:len(want)]] == [
        p.name for p in want]


def problems(engine: Any) -> list:
    """What `engine` (an `Engine`, or any object with the modules and `capabilities` as attributes)
    lacks of the contract, one sentence each; empty where it satisfies it."""
    found = []
    capabilities = getattr(engine, "capabilities", None)
    if not isinstance(capabilities, Capabilities):
        found.append(f"capabilities is {capabilities!r}, not a {Capabilities.__qualname__}")
        capabilities = None
    required = [(module, protocol) for module, protocol in MODULES.items()]
    required += [(module, protocol) for module, protocol, when in OPTIONAL
                 if capabilities is not None and when(capabilities)]
    for module_name, protocol in required:
        module = getattr(engine, module_name, None)
        if module is None:
            found.append(f"it has no module {module_name!r} ({protocol.__name__})")
            continue
        for name in members(protocol):
            if not hasattr(module, name):
                found.append(f"{module_name}.{name} is missing ({protocol.__name__})")
                continue
            declared = vars(protocol).get(name)
            value = getattr(module, name)
            if callable(declared) and not inspect.isclass(value) and not _accepts(value, declared):
                found.append(f"{module_name}.{name}{inspect.signature(value)} does not take the parameters of "
                             f"{protocol.__name__}.{name}{inspect.signature(declared)}")
    return found


class Engine:
    """One backend's engine: its modules, typed by the contract, and its capabilities."""

    name: str
    capabilities: Capabilities
    devices: Devices
    compiler: Compiler
    gradients: Gradients
    replicas: Replicas
    optimizer: Optimizer
    trainer: Trainer
    collectives: Collectives
    keras_hooks: KerasHooks
    nccl: Nccl
    parameter_server: ParameterServer
    tpu: Tpu

    def __init__(self, name: str, package: Any):
        self.name = name
        self.capabilities = getattr(package, "CAPABILITIES", None)
        for module in MODULES:
            setattr(self, module, getattr(package, module, None))
        missing = problems(self)
        if missing:
            raise RuntimeError(f"The {name} engine (keras_strategies.backend.{name}) breaks its contract "
                               f"(keras_strategies/backend/contract.py): " + "; ".join(missing) + ".")

    def __repr__(self) -> str:
        return f"<Engine {self.name}>"

