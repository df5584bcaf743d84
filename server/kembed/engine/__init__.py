"""The engine: one process that owns the GPU (final admission, buckets, batcher, worker, pooling, responder)."""
