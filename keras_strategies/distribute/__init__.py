"""The `tf.distribute` object model, shared by every strategy and backend.

- `strategy`: `Strategy`, `StrategyExtended` and the default strategy.
- `context`: the strategy stack (which strategy is current) and `ReplicaContext`.
- `values`: `PerReplica`, `Mirrored` and helpers over distributed values.
- `reduce_op`, `cross_device_ops`: how values of several replicas are combined.
- `devices`: device names and virtual CPU devices.
- `losses`: `compute_average_loss` and `scale_regularization_loss`.
- `functions`: `ks.function` and `ks.value_and_grad` for custom training loops.
- `missing_names`: clear errors for `tf.distribute` names this package lacks.
"""
