"""The inference engine: paged KV block manager, continuous-batching scheduler, sampler."""
