"""The HTTP server: minserve's engine behind the OpenAI API (SPEC H1-H3). An outer layer.

    minserve serve                                 # cli.py: flags / MINSERVE_* env -> EngineConfig
    from minserve.server.api import create_app     # the FastAPI app over one Engine

One concept per file:

    api.py       the routes: /v1/models, /v1/completions, /v1/chat/completions (SSE),
                 /scheduler/stats, /health; one request -> one engine handle
    schemas.py   strict request models (pydantic) -> SamplingParams, 400s for bad input
    shapes.py    engine outputs -> OpenAI response / SSE chunk shapes
    errors.py    OpenAI-shaped errors; a gate's Rejection -> 429 with Retry-After (G6)
    access.py    the API key and the served model names
    keys.py      the keys file: strict at load, reloaded on SIGHUP, `minserve keys new`
    guard.py     before authentication: connections and failed keys per client address
    limits.py    what one client may cost everyone (sizes, deadlines, connection counts)
    tokenizing.py  prompts refused before tokenizing; tokenizer time per tenant
    usage.py     the usage ledger: real tokens and refusals per tenant
    accesslog.py the access log (address, tenant; never a key) that feeds the ledger
    teacher.py   /scheduler/usage.csv and /admin/reload-keys
    lifecycle.py uvicorn under minserve: the drain on SIGTERM, the reload on SIGHUP
    cli.py       `minserve serve`: engine knobs as flags and environment variables

May import: the core and its front (`minserve.engine`, `config`, `request`,
`sampling`, `streaming`) and its own modules. Never imported by the core; the chat demo
(`minserve.chat`) imports `errors` and `cli` so both front ends word refusals
and read knobs the same way. Needs the `server` extra (fastapi, uvicorn).
"""
