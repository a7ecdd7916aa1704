"""Sharded data parallelism: state split over the replicas' devices instead of copied to each."""
