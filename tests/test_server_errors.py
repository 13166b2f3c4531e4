"""Bad input -> 400/404/405 in OpenAI's error shape, never FastAPI's 422 (SPEC H1).

`BAD_INPUTS` is the single source of the bad-input table in docs/http_api.md:
`test_docs_bad_input_table_is_what_the_server_answers` renders the table from
the live server's responses and fails when the docs say anything else. To
refresh the docs after changing a message:

    MINSERVE_WRITE_DOCS=1 .venv/bin/python -m pytest -q tests/test_server_errors.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from .test_server import serving

C, CHAT = "POST /v1/completions", "POST /v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
LONG = "hello " * 300  # ~300 tokens > max_model_len 256

# (case, endpoint, body (dict, or str sent raw), status, a fragment of the message, how to show it)
BAD_INPUTS = [
    ("malformed JSON", C, '{"prompt": "Hi",', 400, "not valid JSON", None),
    ("body is not an object", C, "[1, 2]", 400, "must be a JSON object", None),
    ("missing prompt", C, {"max_tokens": 4}, 400, "'prompt' is a required property", None),
    ("missing messages", CHAT, {"max_tokens": 4}, 400, "'messages' is a required", None),
    ("empty prompt", C, {"prompt": ""}, 400, "must not be empty", None),
    ("empty token list", C, {"prompt": []}, 400, "must not be empty", None),
    ("empty messages", CHAT, {"messages": []}, 400, "at least one message", None),
    ("prompt of the wrong type", C, {"prompt": 5}, 400, "invalid type for 'prompt'", None),
    ("token id outside the vocabulary", C, {"prompt": [1, 99999]}, 400, "token ids must be",
     None),
    ("several prompts in one request", C, {"prompt": ["a", "b"]}, 400, "one prompt per request",
     None),
    ("unknown message role", CHAT, {"messages": [{"role": "robot", "content": "Hi"}]}, 400,
     "messages[0].role", None),
    ("non-text content part", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0].type", None),
    ("max_tokens as a string", C, {"prompt": "Hi", "max_tokens": "5"}, 400, "valid integer",
     None),
    ("max_tokens as a float", C, {"prompt": "Hi", "max_tokens": 2.5}, 400, "valid integer", None),
    ("max_tokens = 0", C, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens=0", None),
    ("max_completion_tokens < 0", CHAT, {"messages": HI, "max_completion_tokens": -3}, 400,
     "max_completion_tokens=-3", None),
    ("temperature < 0", C, {"prompt": "Hi", "temperature": -1}, 400, "temperature=-1", None),
    ("temperature as a string", C, {"prompt": "Hi", "temperature": "hot"}, 400, "valid number",
     None),
    ("top_p = 0", C, {"prompt": "Hi", "top_p": 0}, 400, "top_p=0", None),
    ("top_p > 1", C, {"prompt": "Hi", "top_p": 1.5}, 400, "top_p=1.5", None),
    ("negative seed", C, {"prompt": "Hi", "seed": -1}, 400, "seed=-1", None),
    ("empty stop string", C, {"prompt": "Hi", "stop": ""}, 400, "stop must be non-empty", None),
    ("stop of the wrong type", C, {"prompt": "Hi", "stop": [1]}, 400, "stop[0]", None),
    ("stream not a boolean", C, {"prompt": "Hi", "stream": "yes"}, 400, "valid boolean", None),
    ("priority not an integer", C, {"prompt": "Hi", "priority": "high"}, 400, "valid integer",
     None),
    ("n > 1", C, {"prompt": "Hi", "n": 2}, 400, "'n'=2 is not supported", None),
    ("logprobs", CHAT, {"messages": HI, "logprobs": True}, 400, "'logprobs'=True is not", None),
    ("tools", CHAT, {"messages": HI, "tools": [{"type": "function"}]}, 400, "'tools'", None),
    ("presence_penalty", C, {"prompt": "Hi", "presence_penalty": 0.5}, 400, "presence_penalty",
     None),
    ("stream_options without stream", C,
     {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400,
     "only allowed when 'stream' is true", None),
    ("prompt longer than the model allows", C, {"prompt": LONG}, 400,
     "leaves no room for a completion", '{"prompt": "hello " * 300}'),
    ("prompt + max_tokens over the context", C, {"prompt": "Hi", "max_tokens": 300}, 400,
     "maximum context length", None),
    ("temperature > 2 (OpenAI's range)", C, {"prompt": "Hi", "temperature": 3}, 400,
     "temperature=3", None),
    ("seed past int64", C, {"prompt": "Hi", "seed": 2**64}, 400, "seed=", None),
    ("more than 4 stop strings", C, {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400,
     "at most 4", None),
    ("a very long stop string", C, {"prompt": "Hi", "stop": "x" * 300}, 400,
     "longer than 200", '{"prompt": "Hi", "stop": "x" * 300}'),
    ("a very long user", C, {"prompt": "Hi", "user": "u" * 1000}, 400, "'user' is 1000",
     '{"prompt": "Hi", "user": "u" * 1000}'),
    ("lone surrogate in prompt", C, {"prompt": "Hi \ud800"}, 400, "lone UTF-16 surrogate",
     '{"prompt": "Hi \\ud800"}'),
    ("lone surrogate in a message", CHAT,
     {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages[0].content", None),
    ("lone surrogate in user", C, {"prompt": "Hi", "user": "\ud83d"}, 400, "'user' holds",
     None),
    ("prediction", CHAT, {"messages": HI, "prediction": {"type": "content", "content": "x"}},
     400, "'prediction'", None),
    ("reasoning_effort", CHAT, {"messages": HI, "reasoning_effort": "high"}, 400,
     "'reasoning_effort'", None),
    ("store = true", CHAT, {"messages": HI, "store": True}, 400, "'store'=True", None),
    ("audio output", CHAT, {"messages": HI, "modalities": ["text", "audio"]}, 400,
     "'modalities'", None),
    ("service_tier flex", CHAT, {"messages": HI, "service_tier": "flex"}, 400,
     "'service_tier'", None),
    ("unknown model", C, {"model": "gpt-4o", "prompt": "Hi"}, 404, "does not exist", None),
    ("unknown path", "POST /v1/embeddings", {"input": "Hi"}, 404, "Not Found", None),
    ("wrong method", "GET /v1/completions", None, 405, "Method Not Allowed", None),
]


@pytest.fixture(scope="module")
def server():
    with serving() as (url, engine):
        yield url, engine


def send(url: str, endpoint: str, body) -> httpx.Response:
    method, path = endpoint.split(" ", 1)
    content = body if isinstance(body, str) else None if body is None else json.dumps(body)
    return httpx.request(method, url + path, content=content, timeout=10,
                         headers={"content-type": "application/json"})


@pytest.mark.parametrize("case, endpoint, body, status, fragment, shown", BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_its_status_and_a_message_in_openai_shape(server, case, endpoint, body,
                                                                 status, fragment, shown):
    url, engine = server
    r = send(url, endpoint, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert fragment in err["message"]
    assert err["type"] == "invalid_request_error"
    assert engine.scheduler.is_drained()  # nothing was queued for a refused request


# ------------------------------------------------------------------ the docs table
DOC = Path(__file__).resolve().parents[1] / "docs" / "http_api.md"
BEGIN = "<!-- BEGIN bad-input-table: generated by tests/test_server_errors.py -->"
END = "<!-- END bad-input-table -->"


def render_table(url: str) -> str:
    rows = ["| bad input | request | status | `error.param` | `error.message` |",
            "|---|---|---|---|---|"]
    for case, endpoint, body, _, _, shown in BAD_INPUTS:
        r = send(url, endpoint, body)
        err = r.json()["error"]
        shown = shown or (body if isinstance(body, str) else json.dumps(body))
        request = f"`{endpoint}` `{shown}`" if body is not None else f"`{endpoint}`"
        cell = [case, request, str(r.status_code), f"`{err['param']}`" if err["param"] else "",
                err["message"]]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cell) + " |")
    return "\n".join(rows)


def test_docs_bad_input_table_is_what_the_server_answers(server):
    url, _ = server
    table = render_table(url)
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    fresh = f"{head}{BEGIN}\n{table}\n{END}{tail}"
    if os.environ.get("MINSERVE_WRITE_DOCS") == "1":
        DOC.write_text(fresh)
        text = fresh
    assert text == fresh, ("docs/http_api.md's bad-input table is stale; refresh it with "
                           "MINSERVE_WRITE_DOCS=1 pytest tests/test_server_errors.py")
