"""Turn a public ``GenerateRequest`` into a tokenized, validated request, or say what is wrong.

Every check names the field and its allowed range, so the gRPC error a client gets is
something a person can act on. Defaults for unset sampling fields follow vLLM and the OpenAI
API (temperature 1, top_p 1, top_k off); ``max_tokens`` defaults to 256, or less when the
context has less room (documented in docs/api.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2 as pb

DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
# Caps that bound the memory and CPU one request can claim before any check on its tokens. Each is
# far above what a request that can run needs; docs/api.md lists them.
MAX_REQUEST_ID_LEN = 256  # characters
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 1024  # characters, each stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096  # chat messages in one request
# Text input (the prompt, or the messages' roles and contents together), in UTF-8 bytes: at least
# MIN_PROMPT_BYTES, and PROMPT_BYTES_PER_TOKEN per token of context (no token of a usual
# vocabulary covers more bytes), so text over the cap could never fit the context anyway.
MIN_PROMPT_BYTES = 1 << 20
PROMPT_BYTES_PER_TOKEN = 128


def max_prompt_bytes(max_model_len: int) -> int:
    """The cap on a request's text input for a model with this context length."""
    return max(MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * max_model_len)


class InvalidRequest(ValueError):
    """The request cannot be served as sent. ``code`` names the gRPC status to answer with."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code


@dataclass
class PreparedRequest:
    """A request ready for a worker: prompt tokens, engine sampling params, router-side stops."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    client_request_id: str = ""


class Preprocessor:
    """Tokenize (once) and validate requests for one model."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_prompt_bytes = max_prompt_bytes(max_model_len)

    def prepare(self, request: pb.GenerateRequest) -> PreparedRequest:
        """Validate and tokenize ``request``; raise ``InvalidRequest`` on the first problem."""
        if len(request.request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequest(
                f"request_id must be at most {MAX_REQUEST_ID_LEN} characters, "
                f"got {len(request.request_id)} (MAX_REQUEST_ID_LEN)"
            )
        s = request.sampling
        stop = self._check_stop(list(s.stop))
        if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"sampling.stop_token_ids holds {len(s.stop_token_ids)} ids; at most "
                f"{MAX_STOP_TOKEN_IDS} are allowed (MAX_STOP_TOKEN_IDS)"
            )
        params = SamplingParams(
            max_tokens=DEFAULT_MAX_TOKENS,  # replaced below once the prompt length is known
            temperature=s.temperature if s.HasField("temperature") else DEFAULT_TEMPERATURE,
            top_p=s.top_p if s.HasField("top_p") else DEFAULT_TOP_P,
            top_k=s.top_k if s.HasField("top_k") else DEFAULT_TOP_K,
            seed=s.seed if s.HasField("seed") else None,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs,
        )
        if s.HasField("max_tokens"):
            params.max_tokens = s.max_tokens
        try:
            params.validate(vocab_size=self.vocab_size)
        except ValueError as exc:
            raise InvalidRequest(f"sampling.{exc}") from None

        prompt_ids = self._tokenize(request)
        n = len(prompt_ids)
        room = self._check_room(n)
        if s.HasField("max_tokens"):
            if s.max_tokens > room:
                raise InvalidRequest(
                    f"sampling.max_tokens is {s.max_tokens} but the prompt is {n} tokens and the "
                    f"model's context (max_model_len) is {self.max_model_len} tokens: "
                    f"max_tokens must be in [1, {room}] for this prompt"
                )
        else:
            params.max_tokens = min(DEFAULT_MAX_TOKENS, room)
        return PreparedRequest(
            prompt_token_ids=prompt_ids,
            params=params,
            stop=stop,
            client_request_id=request.request_id,
        )

    def _check_stop(self, stop: list[str]) -> list[str]:
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                f"sampling.stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed "
                f"(MAX_STOP_STRINGS)"
            )
        for i, s in enumerate(stop):
            if not s:
                raise InvalidRequest(f"sampling.stop[{i}] must not be empty")
            if len(s) > MAX_STOP_STRING_LEN:
                raise InvalidRequest(
                    f"sampling.stop[{i}] is {len(s)} characters; each stop string may be at most "
                    f"{MAX_STOP_STRING_LEN} (MAX_STOP_STRING_LEN)"
                )
        return stop

    def _tokenize(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidRequest("one of prompt, messages or token_ids must be set")
        if kind == "prompt":
            if not request.prompt:
                raise InvalidRequest("prompt must not be empty")
            self._check_text_size("prompt", len(request.prompt.encode("utf-8")))
            ids = list(self.tokenizer.encode(request.prompt))
            if not ids:
                raise InvalidRequest("prompt must not be empty (it tokenized to no tokens)")
            return ids
        if kind == "messages":
            return self._render_chat(request.messages.messages)
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequest("token_ids must not be empty")
        self._check_room(len(ids))  # before looking at each id: the list may be long
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise InvalidRequest(
                    f"token_ids[{i}] is {t}, outside the vocabulary [0, {self.vocab_size})"
                )
        return ids

    def _check_room(self, n: int) -> int:
        """The room a prompt of ``n`` tokens leaves for output; ``InvalidRequest`` when none."""
        room = self.max_model_len - n
        if room < 1:
            raise InvalidRequest(
                f"the prompt is {n} tokens but the model's context (max_model_len) is "
                f"{self.max_model_len} tokens and must also hold at least one output token: "
                f"shorten the prompt to at most {self.max_model_len - 1} tokens"
            )
        return room

    def _check_text_size(self, name: str, num_bytes: int) -> None:
        if num_bytes > self.max_prompt_bytes:
            raise InvalidRequest(
                f"{name} is {num_bytes} bytes of UTF-8; at most {self.max_prompt_bytes} are allowed "
                f"for this model (max_prompt_bytes: {PROMPT_BYTES_PER_TOKEN} per token of its "
                f"{self.max_model_len}-token context, at least {MIN_PROMPT_BYTES}); it could not fit the context"
            )

    def _render_chat(self, messages) -> list[int]:
        if not messages:
            raise InvalidRequest("messages must hold at least one message")
        if len(messages) > MAX_MESSAGES:
            raise InvalidRequest(
                f"messages holds {len(messages)} messages; at most {MAX_MESSAGES} are allowed (MAX_MESSAGES)"
            )
        for i, m in enumerate(messages):
            if not m.role:
                raise InvalidRequest(f"messages[{i}].role must not be empty (e.g. 'user')")
        self._check_text_size("messages", sum(len(m.role.encode("utf-8")) + len(m.content.encode("utf-8"))
                                              for m in messages))
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(
                "messages: this model has no chat template; send prompt or token_ids instead",
                code="FAILED_PRECONDITION",
            )
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:
            out = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template's own checks (role order, ...) raise anything
            raise InvalidRequest(f"messages: the model's chat template rejected them: {exc}") from None
        # transformers 5 returns a BatchEncoding; older versions a plain list.
        ids = out["input_ids"] if not isinstance(out, list) else out
        return list(ids)
