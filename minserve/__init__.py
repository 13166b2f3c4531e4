"""minserve: a teaching-grade LLM serving engine you can step through and see.

Public surface (SPEC §10): `Engine`, `EngineConfig`, `SamplingParams`, and the
request/output types. Everything else is importable but internal: read it, step
it, draw it — its shape may change.

The modules at this level (and `backends/`) are the engine core, which imports
nothing outside itself, and its front: this file, `engine.py` (which builds an engine
from a config), `streaming.py`, `models.py`, `explain.py` and the command line. The
outer layers are subpackages that import the core and the front, never the other way
round: `fast/` (faster parts the engine hands the backends), `server/` (OpenAI HTTP
API), `inspection/` (traces, figures, stepper), `chat/` (the Gradio demo's logic),
`bench/`, `labs/`. SPEC ids (Q1, T5, G3, ...) are explained in docs/spec.md.
"""

from .config import EngineConfig, PrefillMode
from .engine import Engine
from .request import FinishReason, Rejection, RequestOutput, RequestStatus
from .sampling import SamplingParams
from .streaming import RequestHandle, StreamEvent

__all__ = ["Engine", "EngineConfig", "FinishReason", "PrefillMode", "Rejection", "RequestHandle",
           "RequestOutput", "RequestStatus", "SamplingParams", "StreamEvent"]
__version__ = "0.1.0"
