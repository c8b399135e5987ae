"""Beyond one device: tensor-parallel sharding (`sharding`), several hosts driven by one
(`multihost`), and KV handed between processes (`kv_transfer`).

Import the module you need: `multihost` is imported before jax starts its backends, so
this package imports none of them eagerly."""

__all__ = ["devices", "kv_transfer", "multihost", "sharding"]
