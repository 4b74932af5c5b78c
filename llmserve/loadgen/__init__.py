"""Load generator for the public gRPC API (`llmserve bench`, `bench/load.py`).

    from llmserve.loadgen import main
    main(["--target", "127.0.0.1:50051", "--concurrency", "1,8,32", "--output", "out.json"])

Modules: `workload` (seeded requests, length distributions, Poisson arrivals),
`runner` (closed/open loop over grpc.aio), `stats` (percentiles, summaries),
`report` (table, JSON, PNG), `cli` (flags).
"""

from llmserve.loadgen.cli import main

__all__ = ["main"]
