"""What a client may send, validated, and how it becomes engine arguments (SPEC H1, H2).

The request bodies follow OpenAI's `/v1/completions` and `/v1/chat/completions`.
Validation is *strict* (pydantic strict mode): `"max_tokens": "5"`, `3.0` or
`true` is a 400, not silently coerced, because a client that sends the wrong
type has a bug it should hear about. Unknown fields are ignored (clients send
many optional ones), but known OpenAI fields whose non-default values minserve
cannot honour (`n > 1`, `logprobs`, `tools`, penalties, ...) are a 400 naming
the field: never silently answered as if they had been applied.

Fields OpenAI has that minserve does not act on, decided one by one (the
table is in docs/http_api.md): accepted when they ask for nothing minserve
would have to do (`modalities: ["text"]`, `service_tier: "auto"/"default"`,
`store: false`, `metadata`, `parallel_tool_calls` without tools); a 400 naming
the field otherwise (`prediction`, `reasoning_effort`, `store: true`, ...).

Limits (`ServerLimits`, checked by `check_limits` before tokenising): at most
4 stop strings of 200 characters, a `user` of 256 characters, a prompt of
200,000 characters; `temperature` in [0, 2] as in OpenAI's API; no lone UTF-16
surrogate in any string (it cannot be encoded, so it would fail later, deep in
the tokenizer or the response writer).

minserve extension fields (accepted in the body; the OpenAI SDK passes them
with `extra_body={...}`):

    priority    int   higher runs first, under either policy (P1, P2)
    top_k       int   keep the k most likely tokens (0 = off)
    ignore_eos  bool  run to max_tokens even past EOS (benchmarks, load tests)

The fair policy's session (H2) comes from `user`, else the `X-Session-Id`
header, else "default" (see server.py).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict

from ..sampling import SamplingParams
from .errors import OpenAIError, bad_request

OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """Fields shared by both endpoints."""

    model: str | None = None  # optional here (curl-friendly); the SDKs always send it
    max_tokens: int | None = None
    temperature: float | None = None  # None -> 1.0, OpenAI's default
    top_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None  # accepted and not used (it goes with `store`)
    # --- minserve extensions
    priority: int = 0
    top_k: int | None = None
    ignore_eos: bool = False

    # field -> the values that mean "not used" (anything else is refused, not ignored)
    UNSUPPORTED: ClassVar[dict[str, list[Any]]] = {
        "n": [None, 1], "presence_penalty": [None, 0], "frequency_penalty": [None, 0],
        "logit_bias": [None, {}], "service_tier": [None, "default", "auto"],
        "store": [None, False]}

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check_supported(self) -> None:
        """400 for an OpenAI option minserve cannot honour (instead of ignoring it)."""
        for name, neutral in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value not in neutral:
                hint = ("; send n separate requests" if name == "n" else "")
                allowed = " or ".join(repr(v) for v in neutral if v is not None)
                allowed = f"only {allowed} or omitted" if allowed else "omit it"
                raise bad_request(f"'{name}'={value!r} is not supported by minserve "
                                  f"({allowed}){hint}", name, code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true",
                              "stream_options")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise bad_request(f"temperature={self.temperature!r}; use a number in [0, 2] "
                              "(0 = greedy)", "temperature")

    def check_limits(self, limits) -> None:
        """400s for what one request may not cost everyone else (`ServerLimits`)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > limits.max_stop_strings:
            raise bad_request(f"'stop' holds {len(stops)} strings; at most "
                              f"{limits.max_stop_strings} are allowed", "stop")
        if any(len(s) > limits.max_stop_chars for s in stops):
            raise bad_request(f"a stop string is longer than {limits.max_stop_chars} characters",
                              "stop")
        if self.user is not None and len(self.user) > limits.max_user_chars:
            raise bad_request(f"'user' is {len(self.user)} characters; at most "
                              f"{limits.max_user_chars} are allowed", "user")
        if self.prompt_chars() > limits.max_prompt_chars:
            raise bad_request(f"the prompt is {self.prompt_chars()} characters; at most "
                              f"{limits.max_prompt_chars} are allowed", self.PROMPT_PARAM,
                              code="prompt_too_long")
        for path, text in self.strings():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(f"'{path}' holds a lone UTF-16 surrogate, which is not valid "
                                  "Unicode text", path.split("[")[0].split(".")[0],
                                  code="invalid_encoding") from None

    PROMPT_PARAM: ClassVar[str] = "prompt"

    def prompt_chars(self) -> int:
        return 0

    def strings(self):
        """(JSON path, string) for every string field a client sent."""
        for name in ("model", "user"):
            if getattr(self, name) is not None:
                yield name, getattr(self, name)
        if isinstance(self.stop, str):
            yield "stop", self.stop
        for i, s in enumerate(self.stop if isinstance(self.stop, list) else []):
            yield f"stop[{i}]", s


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. `prompt`: text, token ids, or a one-element list of either."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict[str, list[Any]]] = {
        **GenerationRequest.UNSUPPORTED, "echo": [None, False], "logprobs": [None],
        "best_of": [None, 1], "suffix": [None, ""]}

    def prompt_chars(self) -> int:
        p = self.prompt
        if isinstance(p, str):
            return len(p)
        if p and all(isinstance(x, int) for x in p):  # one list of token ids: one each
            return len(p)
        return sum(len(x) for x in p if isinstance(x, (str, list)))  # ids count as one each

    def strings(self):
        yield from super().strings()
        if isinstance(self.prompt, str):
            yield "prompt", self.prompt
        elif self.prompt and isinstance(self.prompt[0], str):
            for i, s in enumerate(self.prompt):
                yield f"prompt[{i}]", s

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or ids). Batched prompts are refused: one request, one row."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request(f"'prompt' holds {len(p)} prompts; minserve takes one prompt "
                                  "per request (send them as separate requests)", "prompt",
                                  code="unsupported_value")
            p = p[0]
        if len(p) == 0:
            raise bad_request("'prompt' must not be empty", "prompt")
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def as_template_dict(self) -> dict[str, str]:
        """What the tokenizer's chat template reads. Text parts are joined; OpenAI's newer
        `developer` role is the old `system` role, which every chat template knows."""
        text = self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions. The prompt is `messages` through the chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # accepted and not used: no tools here
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    audio: dict[str, Any] | None = None

    UNSUPPORTED: ClassVar[dict[str, list[Any]]] = {
        **GenerationRequest.UNSUPPORTED, "logprobs": [None, False], "top_logprobs": [None, 0],
        "tools": [None, []], "tool_choice": [None, "none"],
        "response_format": [None, {"type": "text"}], "modalities": [None, ["text"]],
        "prediction": [None], "reasoning_effort": [None], "audio": [None]}
    PROMPT_PARAM: ClassVar[str] = "messages"

    def prompt_chars(self) -> int:
        return sum(len(t) for _, t in self._message_texts())

    def _message_texts(self):
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                yield f"messages[{i}].content", m.content
            else:
                for j, part in enumerate(m.content):
                    yield f"messages[{i}].content[{j}].text", part.text

    def strings(self):
        yield from super().strings()
        yield from self._message_texts()

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        if not self.messages:
            raise bad_request("'messages' must hold at least one message", "messages")
        return [m.as_template_dict() for m in self.messages]


class ExplainRequest(_Strict):
    """POST /scheduler/explain/{id}: the session, named as a generation body names it."""

    user: str | None = None

    def check_limits(self, limits) -> None:
        if self.user is not None and len(self.user) > limits.max_user_chars:
            raise bad_request(f"'user' is {len(self.user)} characters; at most "
                              f"{limits.max_user_chars} are allowed", "user")


# ------------------------------------------------------------------ -> SamplingParams
def sampling_params(body: GenerationRequest, prompt_len: int, max_model_len: int,
                    default_max_tokens: int) -> SamplingParams:
    """The body's sampling fields -> validated SamplingParams (400 on a bad value).

    max_tokens omitted -> `default_max_tokens`, shrunk to the room the context
    leaves. A finite default matters: G2 reserves prompt_len + max_tokens of KV
    at admit, so "as much as the context allows" would reserve the whole context
    for every request and starve the batch.
    """
    asked = body.requested_max_tokens()
    room = max_model_len - prompt_len
    max_tokens = asked if asked is not None else max(1, min(default_max_tokens, room))
    name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None \
        else "max_tokens"
    prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    limit = f"This model's maximum context length is {max_model_len} tokens."
    if room < 1:  # the prompt alone fills the context: nothing could be generated
        raise OpenAIError(400, f"{limit} However, the prompt is {prompt_len} tokens, which "
                               f"leaves no room for a completion. Please shorten the prompt.",
                          param=prompt_param, code="context_length_exceeded")
    if max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise OpenAIError(
            400, f"{limit} However, you requested {prompt_len + max_tokens} tokens ({prompt_len} "
                 f"in the prompt, {max_tokens} for the completion). Please reduce the prompt "
                 f"or {name}.", param=name, code="context_length_exceeded")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0, seed=body.seed,
            stop=[] if body.stop is None else body.stop,
            ignore_eos=body.ignore_eos)
    except ValueError as e:  # "SamplingParams: top_p=0; use a number in (0, 1]"
        msg = str(e).removeprefix("SamplingParams: ")
        m = re.match(r"(\w+)=", msg)
        param = m.group(1) if m else ("stop" if "stop" in msg else None)
        if param == "max_tokens" and name != param:  # say it in the client's own words
            param, msg = name, msg.replace("max_tokens=", f"{name}=", 1)
        raise bad_request(msg, param) from None
