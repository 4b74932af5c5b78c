"""The gateway: the public `llmserve.v1.Inference` service (`python -m gateway`).

Per request: auth (API key → tenant) → model allowed → validation → tokenize
(tokenizer_svc) → shed check (queue depth) → quota admit (one Lua round trip)
→ XADD the WorkItem → stream the request's token events back.

Choices an operator or client author should know:

- Unknown model: INVALID_ARGUMENT naming `model` (NOT_FOUND is kept for unknown
  request ids); a model the tenant may not use: PERMISSION_DENIED.
- A request whose prompt + max_new_tokens exceeds the tenant's tokens_per_minute
  can never be admitted: INVALID_ARGUMENT on `sampling.max_new_tokens`, not a
  RESOURCE_EXHAUSTED the client would retry forever.
- Client disconnect: the request is cancelled (cancel key set, lease released)
  after `--detach-grace-s` (default 2 s) unless a resume re-attached meanwhile,
  so a client whose connection broke can resume. The Cancel RPC, a deadline, a
  stop string or the max queue wait cancel at once.
- Max queue wait and a full queue are UNAVAILABLE ("overloaded"), retryable.
- Unset seed: a random one (sampled output is reproducible only with a seed).

Modules: config (settings), tenants (file, auth), validation, wire (naming the
field of unparsable bytes), quota (Lua), shedding, models (tokenizer_svc
client), flow (one request end to end), watch (deadline, queue wait, lease
renewal, timings), output (events → chunks), detokenizer, stops, metrics,
service (the gRPC handlers).
"""
