"""Where each variable created in the strategy's scope lives: its pieces on the parameter servers.

A variable goes whole to one parameter server (round-robin in creation
order), or, with a partitioner, split along its first axis into pieces of
TensorFlow's sizes (13 rows over 5 shards: 3, 3, 3, 2, 2) placed round-robin.
An optimizer's slot variables follow the pieces of the variable they belong
to; its other variables (`iterations`, the learning rate) live on every
server that holds part of its variables (each server's optimizer counts its
own steps; reads use the first). Pieces are named by (key, index), where key
is the variable's creation number.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np


def shard_sizes(rows: int, shards: int) -> list:
    """TensorFlow's split of `rows` over `shards`: the first `rows % shards` get one more."""
    shards = max(1, min(shards, rows))
    return [rows // shards + (1 if i < rows % shards else 0) for i in range(shards)]


class Registry:
    """The chief's table of variables on the parameter servers."""

    def __init__(self, num_ps: int, partitioner: Optional[Callable[..., Any]]):
        self.num_ps = num_ps
        self.partitioner = partitioner
        self.variables: list = []
        self.keys: dict = {}
        self.optimizers: list = []
        self.placed_optimizers: set = set()
        self.layout: dict = {}  # key -> [(shard, start, stop, piece id)]
        self.writes: dict = {}  # key -> pieces written when the chief changes the value (all copies)
        self.optimizer_layout: dict = {}  # iterations key -> {"variables": [keys], "shards": [indices]}
        self.snapshot: dict = {}
        self.version = 0
        self._next_shard = 0

    # -- tracking (inside the scope) ---------------------------------------------------------

    def track_variable(self, variable: Any) -> None:
        if id(variable) not in self.keys:
            self.keys[id(variable)] = len(self.variables)
            self.variables.append(variable)

    def track_optimizer(self, optimizer: Any) -> None:
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)

    # -- placement ---------------------------------------------------------------------------

    def place(self, class_bytes: Callable[[Any], bytes]) -> tuple:
        """Places every variable not yet placed; returns ({shard: {piece: value}}, {shard: {optimizer: spec}})."""
        pieces: dict = {}
        optimizers: dict = {}
        placed_any = False
        for optimizer in self.optimizers:
            if id(optimizer) in self.placed_optimizers or not optimizer.built:
                continue
            iterations = self.keys.get(id(optimizer._iterations))
            if iterations is None:
                continue
            self._place_optimizer(optimizer, iterations, class_bytes, optimizers)
            self.placed_optimizers.add(id(optimizer))
            placed_any = True
        for key, variable in enumerate(self.variables):
            if key in self.layout:
                continue
            value = _value(variable)
            self.layout[key] = self._split(key, value.shape)
            for shard, start, stop, pid in self.layout[key]:
                pieces.setdefault(shard, {})[pid] = value if start is None else value[start:stop]
            self.snapshot[key] = value
            placed_any = True
        if placed_any:
            self.version += 1
        return pieces, optimizers

    def _split(self, key: int, shape: tuple) -> list:
        count = 1
        if self.partitioner is not None and len(shape) >= 1 and shape[0] > 1:
            parts = self.partitioner(tuple(shape), "float32")
            count = int(parts if isinstance(parts, int) else list(parts)[0])
        sizes = shard_sizes(shape[0], count) if count > 1 else [None]
        result, start = [], 0
        for index, size in enumerate(sizes):
            shard = self._next_shard % self.num_ps
            self._next_shard += 1
            if size is None:
                result.append((shard, None, None, (key, index)))
            else:
                result.append((shard, start, start + size, (key, index)))
                start += size
        return result

    def _place_optimizer(self, optimizer: Any, iterations: int, class_bytes: Callable[[Any], bytes],
                         specs: dict) -> None:
        name = type(optimizer).__name__
        trainable = []
        for variable in optimizer._trainable_variables:
            key = self.keys.get(id(variable))
            if key is None:
                raise ValueError(
                    f"The {name} optimizer was built on variable {variable.path}, which was created outside "
                    "strategy.scope(): create the model in the scope so its variables live on the parameter servers.")
            trainable.append(key)
            if key not in self.layout:
                self.layout[key] = self._split(key, tuple(variable.shape))
        shards = sorted({piece[0] for key in trainable for piece in self.layout[key]}) or [0]
        prefixes = sorted(((self.variables[k].path.replace("/", "_") + "_", k) for k in trainable),
                          key=lambda item: -len(item[0]))
        slots, others = {}, []
        for variable in optimizer.variables:
            key = self.keys.get(id(variable))
            if key is None:
                raise ValueError(
                    f"The {name} optimizer's variable {variable.path} was created outside strategy.scope(): build "
                    "the optimizer in the scope (`optimizer.build(model.trainable_variables)`).")
            for prefix, reference in prefixes:
                if variable.name.startswith(prefix):
                    slots[key] = (reference, variable.name[len(prefix):])
                    break
            else:
                others.append(key)
        for key, (reference, _) in slots.items():
            self.layout[key] = [(shard, start, stop, (key, index))
                                for index, (shard, start, stop, _) in enumerate(self.layout[reference])]
        for key in others:
            self.layout[key] = [(shards[0], None, None, (key, 0))]
            self.writes[key] = [(shard, None, None, (key, 0)) for shard in shards]
        config = optimizer.get_config()
        cls = class_bytes(type(optimizer))
        for shard in shards:
            spec = {"class": cls, "config": config, "trainable": [], "slots": {}, "others": {}, "values": {}}
            for key in trainable:
                for piece_shard, start, stop, pid in self.layout[key]:
                    if piece_shard == shard:
                        spec["trainable"].append(pid)
            for key, (reference, slot_name) in slots.items():
                for (piece_shard, _, _, pid), (_, _, _, ref_pid) in zip(self.layout[key], self.layout[reference]):
                    if piece_shard == shard:
                        spec["slots"][pid] = (ref_pid, slot_name)
            for position, key in enumerate(others):
                spec["others"][(key, 0)] = position
            specs.setdefault(shard, {})[iterations] = spec
        for key in trainable + list(slots) + others:
            value = _value(self.variables[key])
            self.snapshot[key] = value
            for shard, start, stop, pid in self.writes.get(key, self.layout[key]):
                if shard in specs and iterations in specs[shard]:
                    specs[shard][iterations]["values"][pid] = value if start is None else value[start:stop]
        self.optimizer_layout[iterations] = {"variables": trainable + list(slots) + others, "shards": shards}

    # -- the chief's values ------------------------------------------------------------------

    def changed(self) -> dict:
        """{shard: {piece: value}} for every placed variable the chief changed since the last sync."""
        writes: dict = {}
        for key, before in self.snapshot.items():
            value = _value(self.variables[key])
            if value.shape == before.shape and np.array_equal(value, before):
                continue
            self.snapshot[key] = value
            for shard, start, stop, pid in self.writes.get(key, self.layout[key]):
                writes.setdefault(shard, {})[pid] = value if start is None else value[start:stop]
        return writes

    def reads(self, keys: Optional[list] = None) -> dict:
        """{shard: [piece ids]} to read the variables `keys` (default: every placed one)."""
        reads: dict = {}
        for key in self.snapshot if keys is None else keys:
            for shard, _, _, pid in self.layout[key]:
                reads.setdefault(shard, []).append(pid)
        return reads

    def assign(self, pieces: dict, keys: Optional[list] = None) -> None:
        """Gives the chief's variables (`keys`; default: every placed one) the values read from the
        shards ({piece id: value})."""
        for key in self.snapshot if keys is None else keys:
            parts = [pieces[pid] for _, _, _, pid in self.layout[key]]
            value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            self.variables[key].assign(value)
            self.snapshot[key] = value


def _value(variable: Any) -> np.ndarray:
    import keras

    return np.array(keras.ops.convert_to_numpy(variable.value))
