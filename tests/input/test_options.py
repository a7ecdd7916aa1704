"""`InputContext`, `ValueContext`, `InputOptions`."""

import pytest

import keras_strategies as ks


def test_input_context_defaults_and_per_replica_batch_size():
    context = ks.InputContext()
    assert (context.num_input_pipelines, context.input_pipeline_id, context.num_replicas_in_sync) == (1, 0, 1)
    context = ks.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert context.get_per_replica_batch_size(8) == 2
    assert "input pipeline id 1, total: 2" in repr(context)


def test_indivisible_global_batch_size_raises_the_tf_message():
    context = ks.InputContext(num_replicas_in_sync=4)
    with pytest.raises(ValueError, match="The `global_batch_size` 10 is not divisible by `num_replicas_in_sync` 4"):
        context.get_per_replica_batch_size(10)


def test_value_context_and_input_options_keep_their_arguments_and_defaults():
    context = ks.ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
    assert (context.replica_id_in_sync_group, context.num_replicas_in_sync) == (1, 2)
    options = ks.InputOptions()
    assert options.experimental_fetch_to_device is None
    assert options.experimental_replication_mode is ks.InputReplicationMode.PER_WORKER
    assert ks.InputOptions(experimental_per_replica_buffer_size=3).experimental_per_replica_buffer_size == 3


def test_distribute_values_from_function_gives_one_value_per_replica():
    strategy = ks.OneDeviceStrategy("cpu:0")
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)
    )
    assert value == (0, 1)
