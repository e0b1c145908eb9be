"""Past one process: engine replicas on Ray Serve (`--data-parallel-size N`) with cache-aware
routing, and multi-host tensor parallelism launched as Ray actors
(`--distributed-executor-backend ray`). Ray is an optional extra (`pip install jaxserve[ray]`);
nothing here is imported by the single-process engine or server."""
