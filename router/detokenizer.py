"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding each new token alone is wrong twice over: byte-level tokenizers split one character
(an emoji, a CJK ideogram) across several tokens, and SentencePiece tokenizers decide a token's
leading space from its neighbour. So, like vLLM and TGI, we decode a short window of tokens
twice, with and without the new ones, and emit the difference; text that ends in U+FFFD (an
incomplete UTF-8 sequence) is held back until the tokens that complete it arrive.

We keep this loop rather than ``tokenizers.decoders.DecodeStream`` (same algorithm, checked with
tokenizers 0.23): DecodeStream has no flush, so an output that ends mid-character loses its last
bytes instead of ending in U+FFFD, and a prompt that ends mid-character leaks a U+FFFD into the
first output piece.
"""

from __future__ import annotations

# How many prompt tokens to decode as context ahead of the first output token.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Detokenize one request's output tokens as they arrive.

    ``add(token_id)`` returns the text completed by that token (often ``""`` while a character
    is incomplete); ``flush()`` returns whatever is still held back, once the request ends.
    Joining every returned piece gives ``tokenizer.decode(output_ids)``.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = len(context)  # tokens before this have been emitted as text
        self.num_output_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False
        )

    def add(self, token_id: int) -> str:
        """Take one new token; return the text it completes."""
        self._ids.append(token_id)
        self.num_output_tokens += 1
        return self._emit(final=False)

    def flush(self) -> str:
        """Return the held-back text (incomplete characters decode as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta
