"""The serving runtime: coordinator, per-instance schedulers and pipeline engine nodes talking over ZeroMQ."""
