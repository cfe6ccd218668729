"""The HTTP gateway: an OpenAI-compatible images API, /health, /metrics and /stats in front of one
orchestrator. It is an ordinary client of the orchestrator (client.aio); it never touches tensors.
`python -m disagg.gateway` runs it; `disagg serve-http` and `disagg launch --http-port` start it."""
