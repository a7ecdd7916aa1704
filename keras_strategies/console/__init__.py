"""What reaches the user's console from the libraries underneath: `quiet_tensorflow` keeps
TensorFlow's start-up lines out. Imports nothing that loads Keras or a backend."""
