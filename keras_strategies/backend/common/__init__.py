"""Backend-neutral pieces the engines build on (and the only package they import besides their own).

- `replica_threads`: replicas as Python threads taking turns.
- `replica_variables`: what replicas write to variables, and how writes are combined.
- `keras_state`: Keras' thread-local settings carried into replica threads.
- `partition`, `packing`: how lists of tensors are split and laid out for collectives.
- `pending`: a collective's result where the engine runs it at once (`start_all_reduce_sum`).
- `keras_compat`: what differs between the supported Keras releases.
- `patches`: the one registry of replaced Keras functions, with their reasons and fingerprints.
- `capabilities`: how an engine differs where the shared code must know (`backend/contract.py`).
"""
