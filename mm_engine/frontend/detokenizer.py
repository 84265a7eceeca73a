"""Incremental detokenization for streaming, with stop strings.

Decoding token by token is wrong in two ways: byte-level tokens can split a UTF-8 character
(decoding half of one gives U+FFFD), and many decoders change a token's text depending on its
neighbours (a leading space is dropped at the start of a decode). So each step decodes a small
window of token ids and takes the text past what the window's earlier tokens already gave:

    ids:  ... [prefix_offset ... read_offset) [read_offset ... end)
               context, text already out       new tokens

Text ending in U+FFFD is held back until a later token completes the character. The window moves
forward once its new tokens have given complete text, so a step costs O(window), not O(output).

The text equals `tokenizer.decode(output_ids, skip_special_tokens=...)` of the output ids alone, as
transformers' `generate` + `decode` gives it; the prompt is not used as decoding context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mm_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"
# A UTF-8 character has at most 4 bytes, so this many new tokens still ending in U+FFFD means
# invalid bytes rather than an unfinished character: stop waiting so the window stays small.
MAX_PENDING_TOKENS = 16


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids  # kept for callers; decoding uses output ids only
        self.params = params
        self.output_token_ids: list[int] = []
        self.stopped = False  # a stop string appeared; no more text will come
        self.stop_str: str | None = None  # the stop string that matched
        self._prefix_offset = 0
        self._read_offset = 0
        self._extra = 0  # chars past the context text already taken while the window ends in U+FFFD
        self._chunks: list[str] = []  # text already returned as deltas
        self._held = ""  # text that could be the start of a stop string, not yet returned
        self._flushed = False
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    @property
    def text(self) -> str:
        """All output text so far: the deltas returned plus text held back for stop strings."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return (self._chunks[0] if self._chunks else "") + self._held

    def step(self, new_token_ids: list[int]) -> str:
        """Append generated tokens; return the text that became final (may be empty)."""
        if self.stopped or self._flushed:
            return ""
        new_text = ""
        # One token at a time, so the window can move at every character boundary inside a chunk.
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            new_text += self._decode_new(final=False)
        return self._release(new_text)

    def flush(self) -> str:
        """Return everything held back; call once when the request ends for a reason other than stop."""
        if self.stopped or self._flushed:
            return ""
        delta = self._release(self._decode_new(final=True))
        delta += self._held
        if self._held:
            self._chunks.append(self._held)
        self._held = ""
        self._flushed = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        ids = self.output_token_ids
        context = self._decode(ids[self._prefix_offset : self._read_offset])
        window = self._decode(ids[self._prefix_offset :])
        start = len(context) + self._extra
        complete = (
            final or not window.endswith(REPLACEMENT) or len(ids) - self._read_offset >= MAX_PENDING_TOKENS
        )
        end = len(window) if complete else len(window.rstrip(REPLACEMENT))
        delta = window[start:end]
        if complete and len(window) > len(context):
            self._prefix_offset, self._read_offset, self._extra = self._read_offset, len(ids), 0
        else:
            # Tokens that gave no text yet (a skipped special token, half a character) stay in the
            # window: the decoder may put a space or the rest of a character there once more come.
            self._extra = max(self._extra, end - len(context))
        return delta

    def _release(self, new_text: str) -> str:
        """Return the part of the new text that is safe to stream, after checking stop strings."""
        out = self._cut_at_stop(self._held + new_text) if self.params.stop else new_text
        if out:
            self._chunks.append(out)
        return out

    def _cut_at_stop(self, pending: str) -> str:
        # A stop string can only start inside the held text (it is the longest suffix that could
        # begin one), so searching held + new text is enough.
        match = self._find_stop(pending)
        if match is not None:
            pos, stop = match
            self.stopped, self.stop_str, self._held = True, stop, ""
            return pending[: pos + len(stop)] if self.params.include_stop_str_in_output else pending[:pos]
        keep = self._stop_prefix_len(pending)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            pos = text.find(stop)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._max_stop_len - 1), 0, -1):
            tail = text[-n:]
            if any(stop.startswith(tail) for stop in self.params.stop):
                return n
        return 0
