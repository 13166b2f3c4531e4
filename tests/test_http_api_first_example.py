"""docs/http_api.md's first Python example, run as written against a default server.

It is the snippet a reader copies first, so it must run on what `minserve serve` starts
with no flags: no grants (it once set `priority`, which such a server refuses with 403).
The server is `create_app`'s defaults over a tiny random Llama named as the embedded
model, with SmolLM2's real tokenizer; only the address differs (a free port, not 8000).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "http_api.md"


def first_python_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "docs/http_api.md has no Python example"
    return blocks[0]


def test_the_first_python_example_runs_against_a_server_started_with_no_flags():
    from transformers import AutoTokenizer

    from minserve import Engine, EngineConfig
    from minserve.models import embedded_model_dir, tiny_llama
    from minserve.server.api import create_app
    from minserve.server.cli import BackgroundServer

    code = first_python_block()
    assert "http://127.0.0.1:8000" in code and "stream=True" in code, code
    model = tiny_llama(vocab_size=49152)
    model.config.name_or_path = "SmolLM2-135M-Instruct"  # what the embedded model is called
    engine = Engine(EngineConfig(device="cpu", max_batch_size=2, num_blocks=16),
                    model=model, tokenizer=AutoTokenizer.from_pretrained(embedded_model_dir()))
    out = io.StringIO()
    with BackgroundServer(create_app(engine)) as srv, contextlib.redirect_stdout(out):
        exec(compile(code.replace("http://127.0.0.1:8000", srv.url), str(DOC), "exec"), {})
    assert out.getvalue().strip(), "the example printed no streamed text"
    assert engine.stats()["tokens_generated"] > 0
