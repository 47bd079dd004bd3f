"""Incremental detokenization: a request's text grows by decoding only its newest tokens, with a few earlier
ones as context (a tokenizer may print a token differently at the start of a text), instead of decoding
the whole output every step. Text ends where the last complete character does; the rest waits for the
tokens that complete it, and is flushed as it is when the request finishes."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class IncrementalText:
    text: str = ""
    prefix: int = 0          # first token of the context window decoded again each time
    read: int = 0            # tokens whose text is in `text`

    def extend(self, tokenizer, token_ids: list[int]) -> int:
        """Take in the tokens after `read`; returns where the new text starts in `text`."""
        start = len(self.text)
        if len(token_ids) == self.read:
            return start
        before = tokenizer.decode(token_ids[self.prefix:self.read], skip_special_tokens=True)
        after = tokenizer.decode(token_ids[self.prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(token_ids)
        return start

    def flush(self, tokenizer, token_ids: list[int]) -> None:
        """The finished request's last tokens, complete characters or not."""
        before = tokenizer.decode(token_ids[self.prefix:self.read], skip_special_tokens=True)
        self.text += tokenizer.decode(token_ids[self.prefix:], skip_special_tokens=True)[len(before):]
        self.prefix = self.read = len(token_ids)


def find_stop(stops: Sequence[str], text: str, since: int) -> int | None:
    """Where the earliest stop string starts in `text` if one ends after position `since` (the text before it
    was searched already), else None."""
    window = max(0, since - max(len(s) for s in stops) + 1)
    cuts = [i for i in (text.find(s, window) for s in stops) if i >= 0]
    return min(cuts) if cuts else None
