"""Pieces of the local multi-worker launcher (`python -m keras_strategies.launch`).

Standard library only (no Keras/backend imports of its own), so it works the
same whatever backend the workers use:

- `cluster`: free loopback ports and the per-worker `TF_CONFIG`.
- `processes`: one worker process group with line-prefixed output.
- `supervisor`: runs all workers, stops them all on the first failure, a
  signal or a timeout, and picks the exit code (in a parameter-server job,
  `--ps`, the chief's exit ends the job).
"""
