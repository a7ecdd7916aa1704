"""What reaches the user's console from the libraries underneath: `quiet_tensorflow` keeps
TensorFlow's start-up lines out, `worker_output` the engine lines the launcher does not relay.
Imports nothing that loads Keras or a backend."""
