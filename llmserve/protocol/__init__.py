"""What crosses between services: Redis key names, the queue's wire format and cells, fencing
tokens, the prefix hash chain, latency targets, grammars, seeded picks.
"""
