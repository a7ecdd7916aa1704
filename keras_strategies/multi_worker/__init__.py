"""Multi-worker support shared by every backend: cluster roles, options, health, chief-only writes."""
