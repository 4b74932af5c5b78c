"""What every service process runs on: settings, logging, tracing, the gRPC server bootstrap,
supervised tasks, Redis connections, retries, domain errors and the clock.
"""
