"""Timeouts the engines and the front end must agree on."""

# The engines' own timeouts for forming the cluster and for a silent peer are this much longer
# than `timeout_seconds`, so that the front end's clear errors about missing, dead or stopped
# workers (`multi_worker/joining.py`, `multi_worker/health.py`) come first.
ENGINE_MARGIN_SECONDS = 30.0
