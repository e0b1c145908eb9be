"""Everything that builds or runs device arrays: runner (the one entry point for device work),
sampler, attention and linear backends, kv_cache, buckets, sharding (tensor parallel) and
multihost."""
