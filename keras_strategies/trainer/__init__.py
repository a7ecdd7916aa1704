"""Keras training under multi-replica strategies: one step runner and the fit/evaluate/predict loops."""
