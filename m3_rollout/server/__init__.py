"""The rollout server: OpenAI-compatible API, token-in/token-out generation and the RL control
plane over HTTP (``python -m m3_rollout.serve``).

protocol    request bodies (strict pydantic) and the OpenAI-shaped error
runner      EngineRunner: the backend on its own thread + event loop; one driver per engine, streams,
            abort, weight sync
control     Controller: admission gate, pause / resume, abort, weight updates, 409 rules
openai_api  /v1/chat/completions and /v1/completions (template, parsers, SSE)
metrics     /metrics in the Prometheus text format
app         the FastAPI application (every route)
cli         argument parsing, building the backend, uvicorn
client      RolloutServerClient (trainer side, httpx) and HTTPBackend (a GenerationBackend over HTTP)
"""
