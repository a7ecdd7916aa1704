"""Stage 2's update: every replica's own gradients reduce-scattered into the devices' pieces.

Each replica cuts its gradients into the pieces of every replica (of every
worker), device i sums piece i of its worker's replicas (`gradient_pieces`),
and in a cluster the workers reduce-scatter those sums; no device holds a
whole summed gradient. Clipping norms come from each device's sums of
squares. A mixin of `optimizer_state.ShardedOptimizerState`, whose compiled
parts (`_part`), transfers (`_on_each`) and update of the pieces
(`_update`) it uses.
"""

from __future__ import annotations

import functools
from typing import Any

from keras import ops

from keras_strategies.backend import engine
from keras_strategies.sharding import flat_shards
from keras_strategies.sharding import gradient_pieces
from keras_strategies.sharding import loss_scaling


class ScatteredUpdate:
    """The update of a `ShardedOptimizerState` from the replicas' own gradients (stage 2)."""

    def apply_per_replica(self, per_replica: list) -> None:
        """One update with every replica's own gradients (`per_replica[r][j]`, on replica r's device),
        reduce-scattered (`gradient_pieces`): each device sums its piece of every replica's
        gradients, unscaled and clipped in pieces."""
        present = tuple(j for j, g in enumerate(per_replica[0]) if g is not None)
        n = self.layout.num_pieces
        self.gradient_bytes = [sum(flat_shards.piece_length(self.variables[j].shape, n)
                                   * flat_shards.itemsize(self.variables[j]) for j in present)] * len(self.devices)
        self._run(("replicas", present), self._apply_replicas, [[row[j] for j in present] for row in per_replica],
                  present)

    def _apply_replicas(self, grads: list, present: tuple) -> None:
        local, k = len(self.devices), len(present)
        n = self.layout.num_pieces
        workers = n // local
        shapes = [tuple(self.variables[j].shape) for j in present]  # also of sliced gradients, made dense
        # cut[r][i]: replica r's pieces for local device i, of every worker's device i (piece
        # w * local + i of worker w), worker-major, one per variable.
        cut = []
        for r, device in enumerate(self.devices):
            split = self._part(f"split-{r}", present, lambda values: [
                [pieces[w * local + i] for w in range(workers)
                 for pieces in (flat_shards.split(ops.reshape(ops.convert_to_tensor(g), shape), n)
                                for g, shape in zip(values, shapes))]
                for i in range(local)])
            with engine.devices.device_scope(device):
                cut.append(split(grads[r]))
        squares_needed = gradient_pieces.clipping(self.optimizer) in ("norm", "global")
        # In one process the pieces are whole after this worker's sums: their squares in the same program.
        squares_in_reduce = squares_needed and workers == 1
        width = workers * k  # the pieces device i sums over its worker's replicas
        # A LossScaleOptimizer's scale, which each device unscales its sums by: in a cluster after
        # the workers' sum, which may overflow where this worker's does not (as the whole sum would).
        scale = self._scale()
        incoming = self._on_each([[cut[r][i][position] for r in range(local) for position in range(width)] + scale
                                  for i in range(local)])
        sums, squares, flags = [], [], []
        for i, device in enumerate(self.devices):
            reduce = self._part(f"reduce-{i}", present, lambda values: self._reduce(
                values, local, width, squares_in_reduce, bool(scale), unscales=workers == 1))
            with engine.devices.device_scope(device):
                sums_i, squares_i, finite_i = reduce(incoming[i])
            sums.append(sums_i)
            squares.append(squares_i)
            flags.append(finite_i)
        pieces = sums if workers == 1 else self._scattered(sums, k)
        if scale and workers > 1:
            pieces, flags = self._unscaled(pieces, [values[-1] for values in incoming], present)
        finite = self._finite_everywhere(flags) if scale else None
        if squares_needed and not squares_in_reduce:  # of the pieces summed over the workers
            squares = []
            for i, device in enumerate(self.devices):
                square = self._part(f"squares-{i}", present, lambda values: [ops.sum(ops.square(p)) for p in values])
                with engine.devices.device_scope(device):
                    squares.append(square(pieces[i]))
        factors = self._clip_factors(squares, present) if squares_needed else None
        current = self._pieces_current(present)
        cut_variables, _, _ = self._part(f"cut-{current}", present, functools.partial(self._cut, present))(
            self._to_cut(present, current), None)
        self._update(cut_variables, pieces, present, factors, clip=not self._accumulates, finite=finite)

    def _unscaled(self, pieces: list, scales: list, present: tuple) -> tuple:
        """Each device's pieces (summed over every worker) divided by the loss scale (`scales[i]`,
        there), and whether they were finite."""
        unscaled, flags = [], []
        for i, device in enumerate(self.devices):
            unscale = self._part(f"unscale-{i}", present, lambda values, scale: (
                [value / scale for value in values], self.scaler.check_finite(values)))
            with engine.devices.device_scope(device):
                values, finite = unscale(pieces[i], scales[i])
            unscaled.append(values)
            flags.append(finite)
        return unscaled, flags

    def _finite_everywhere(self, flags: list) -> Any:
        """Whether every device's sums (of every worker) were finite, on the host device."""
        host = self.host
        on_host = engine.devices.place_each(flags, [host] * len(flags))
        with engine.devices.device_scope(host):
            return loss_scaling.finite_everywhere(on_host, self.layout.summed_across_workers)

    def _scattered(self, sums: list, k: int) -> list:
        """Each local device's own pieces summed over every worker (`sums[i]`: device i's sums over
        its worker's replicas of the pieces of every worker's device i, worker-major): one
        reduce-scatter across the workers, its results on their devices."""
        workers = len(sums[0]) // k
        with engine.devices.device_scope(self.host):
            stacked = [ops.stack([engine.devices.copy_to(sums[i][w * k + position], self.host) for w in range(workers)])
                       for i in range(len(self.devices)) for position in range(k)]
        own = self.layout.scattered_across_workers(stacked)
        return self._on_each([[own[i * k + position] for position in range(k)] for i in range(len(self.devices))])

    def _reduce(self, incoming: list, n: int, width: int, squares_needed: bool, scaled: bool,
                unscales: bool = True) -> tuple:
        """On device i: each of its `width` pieces summed over the `n` replicas (unscaled, unless
        not `unscales`: by the loss scale that ends `incoming` where `scaled`), the sums of their
        squared elements where clipping needs norms, and where `scaled` and unscaled here, whether
        the sums were finite."""
        scale, finite = self.optimizer.loss_scale_factor, None
        if scaled:
            incoming, scale = incoming[:-1], incoming[-1] if unscales else None
        totals = [gradient_pieces.summed([incoming[r * width + position] for r in range(n)]) for position in range(width)]
        if scaled and unscales:
            finite = self.scaler.check_finite(totals)
        pieces = [total if scale is None else total / scale for total in totals]
        squares = [ops.sum(ops.square(piece)) for piece in pieces] if squares_needed else []
        return pieces, squares, finite

    def _clip_factors(self, squares: list, present: tuple) -> Any:
        """The optimizer's clipping factors from each device's sums of its pieces' squares
        (`squares[i][position]`): summed over this worker's devices, then over the workers."""
        k, host = len(present), self.host
        on_host = engine.devices.place_each([s for row in squares for s in row], [host] * (len(squares) * k))
        if self.layout.summed_across_workers is not None:  # a collective: eagerly, between the parts
            with engine.devices.device_scope(host):
                local = [gradient_pieces.summed(on_host[position::k]) for position in range(k)]
            on_host = engine.devices.place_each(self.layout.summed_across_workers(local), [host] * k)
        combine = self._part(f"clip-factors-{len(on_host) // k}", present, lambda values: gradient_pieces.clip_factors(
            self.optimizer, [gradient_pieces.summed(values[position::k]) for position in range(k)]))
        with engine.devices.device_scope(host):
            return combine(on_host)
