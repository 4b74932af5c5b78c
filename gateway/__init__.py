"""The gateway: the public `llmserve.v1.Inference` service (`python -m gateway`).

Per request: auth (API key → tenant) → model allowed → validation (cheap) → shed
check (queue depth) → quota admit (rate + concurrency) → response_format compile and
tokenize (tokenizer_svc) → token reservation → XADD the WorkItem → stream the
request's token events back.

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

Modules: config (settings), core (the `Gateway` both fronts share: built by __main__),
grpc_front (the Inference service), openai_http + openai_wire + http_server (the OpenAI
endpoint), calls (opening, counting and answering one call, for both fronts), tenants (file,
auth), validation, response_format (format size check and off-loop compile), wire (naming the
field of unparsable bytes), quota (Lua), shedding, tokenizer_client (tokenizer_svc client and
model infos), model_router (alias → NAME@VERSION), flow (one request end to end), watch
(deadline, queue wait, lease renewal, timings), streams (per-tenant stream slots, viewer
leases), output (events → chunks), detokenizer, stops, request_state, metrics.
"""
