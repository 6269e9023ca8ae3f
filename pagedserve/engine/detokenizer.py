"""Incremental detokenization and stop-string detection for one sequence (the technique of vLLM / TGI).

Each step decodes only a small window of tokens: ids[prefix:read] is text already emitted, ids[read:] is new.
Decoding the window from `prefix` gives tokens their in-context spacing (a sentencepiece "▁" at the start of a
decode is stripped; byte-level tokens may hold part of a UTF-8 character), and the new text is what the window
adds beyond decode(ids[prefix:read]). Text ending in U+FFFD waits: the next token may complete the character.
"""
from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from pagedserve.sampling_params import SamplingParams

# Trailing prompt tokens that prefix the first output decode, so the first output token gets its in-context text.
_INITIAL_PREFIX_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # While streaming, hold back the characters that could still turn out to begin an excluded stop string.
        self.stop_buffer_length = params.max_stop_len - 1 if self.stop and not self.include_stop_str_in_output else 0
        self.output_text = ""
        self.num_output_tokens = 0
        self.stop_reason: str | None = None  # the stop string that matched
        # The decode window; ids before it are dropped once emitted, so memory stays O(window).
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_PREFIX_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._returned_offset = 0  # output_text[:_returned_offset] was already returned in delta mode

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Appends generated tokens; returns the stop string they completed, or None.

        On a match, output_text is cut before the stop string (after it with include_stop_str_in_output).
        Stop strings are not matched while the output has at most min_tokens tokens (as in vLLM).
        """
        if not new_token_ids:
            return None
        self.num_output_tokens += len(new_token_ids)
        self._ids.extend(new_token_ids)
        new_text = self._decode_new_text(final=False)
        self.output_text += new_text
        if not new_text or not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        return self._check_stop_strings(len(new_text))

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text for this output: all of it, or with delta only what was not returned before.

        While not finished, the last stop_buffer_length characters are held back. When finished (and not by a stop
        string), text still waiting for the rest of a UTF-8 character is flushed, so the final text equals
        tokenizer.decode of the output tokens.
        """
        if finished and self.stop_reason is None:
            self.output_text += self._decode_new_text(final=True)
        end = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        if not delta:
            return self.output_text[: max(end, 0)]
        if end <= self._returned_offset:
            return ""
        text = self.output_text[self._returned_offset : end]
        self._returned_offset = end
        return text

    def _decode(self, ids: list[int]) -> str:
        # Space clean-up (" ." -> ".") can rewrite text across window boundaries, so it stays off, as in vLLM.
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_new_text(self, final: bool) -> str:
        """Text the pending tokens add; "" while they end inside a character (unless final) or add nothing."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix_text) or (text.endswith("\ufffd") and not final):
            return ""
        # The tokens just emitted become the next window's prefix.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return text[len(prefix_text) :]

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        """Finds the earliest stop string that ends inside the new text and truncates output_text there."""
        match: tuple[int, str] | None = None
        for stop in self.stop:
            # Only matches that end in the new text: start at most len(stop) - 1 characters before it.
            start = max(len(self.output_text) - new_char_count - len(stop) + 1, 0)
            index = self.output_text.find(stop, start)
            if index != -1 and (match is None or index < match[0]):
                match = (index, stop)
        if match is None:
            return None
        index, stop = match
        self.output_text = self.output_text[: index + len(stop) if self.include_stop_str_in_output else index]
        self.stop_reason = stop
        return stop
