"""One module per strategy, each built on `keras_strategies.distribute` and the backend engine."""
