"""A batch of prompts for greedy generation: validated token ids, the shared prefix, and
the pages a run needs (framework-neutral; both integrations use it before any model call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError, check_bool, check_int, fail, refuse_listed_bools
from ..page_table import MAX_ENTRIES


@dataclass(frozen=True)
class PromptBatch:
    """``B`` prompts (tuples of token ids) and the length of their shared prefix.

    ``prefix_len`` tokens open every prompt and are prefilled once, in one sequence that
    every prompt forks (so the pages holding them are shared and a cascade can read them
    once); it leaves at least one token of every prompt to its own prefill, whose last
    position gives the first new token. ``prefix_len`` is 0 for a single prompt or when
    sharing is off.
    """

    prompts: tuple[tuple[int, ...], ...]
    prefix_len: int
    max_new_tokens: int

    @property
    def size(self) -> int:
        return len(self.prompts)

    @property
    def prefix(self) -> tuple[int, ...]:
        return self.prompts[0][:self.prefix_len]

    @property
    def suffixes(self) -> list[tuple[int, ...]]:
        return [p[self.prefix_len:] for p in self.prompts]

    def pages_needed(self, page_size: int) -> int:
        """Pages that hold the whole run: the prefix's pages once, then each sequence's
        own pages up to its final length (its copy of a shared partial last page
        included; the last copy may write in place, so one page can stay free)."""
        full = self.prefix_len // page_size
        shared = -(-self.prefix_len // page_size)
        own = sum(-(-self.tokens_held(i) // page_size) - full for i in range(self.size))
        return shared + own

    def tokens_held(self, i: int) -> int:
        """K/V rows prompt ``i``'s sequence ends with: the prompt and every new token but
        the last (chosen, never fed back)."""
        return len(self.prompts[i]) + self.max_new_tokens - 1


def _token_ids(fn: str, i: int, prompt: Any, vocab_size: int) -> tuple[int, ...]:
    refuse_listed_bools(fn, f"prompts[{i}]", prompt)      # [True, 2] is not token 1
    try:
        a = np.asarray(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
    except (TypeError, ValueError) as exc:
        raise fail(fn, f"prompts[{i}] must be a 1-D sequence of token ids, got "
                       f"{type(prompt).__name__}") from exc
    if a.ndim != 1 or a.size == 0 or not (np.issubdtype(a.dtype, np.integer)):
        raise fail(fn, f"prompts[{i}] must be a non-empty 1-D sequence of integer token ids, "
                       f"got shape {list(a.shape)} of {a.dtype}")
    bad = np.flatnonzero((a < 0) | (a >= vocab_size))
    if bad.size:
        raise fail(fn, f"prompts[{i}][{int(bad[0])}] = {int(a[bad[0]])} is not a token id of "
                       f"the model (vocabulary size {vocab_size})")
    return tuple(int(t) for t in a)


def prompt_batch(fn: str, prompts: Sequence[Any], max_new_tokens: int, *, vocab_size: int,
                 max_positions: int | None, share_prefix: bool = True) -> PromptBatch:
    """Validate ``prompts`` (a non-empty list of 1-D token-id sequences: lists, tuples,
    numpy or torch/MLX integer vectors) and find their shared prefix.

    Raises ``InvalidArgumentError`` naming the prompt and what is wrong: an empty or
    non-integer prompt, a token id outside the vocabulary, or a prompt that with
    ``max_new_tokens`` would pass the model's ``max_positions`` (its position table).
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise InvalidArgumentError(f"{fn}: prompts must be a non-empty list of token-id "
                                   f"sequences, got {type(prompts).__name__}")
    new = check_int(fn, "max_new_tokens", max_new_tokens)
    check_bool(fn, "share_prefix", share_prefix)
    ids = tuple(_token_ids(fn, i, p, vocab_size) for i, p in enumerate(prompts))
    if max_positions is not None:
        for i, p in enumerate(ids):
            # the last new token is chosen, never fed back: it takes no position
            if len(p) + new - 1 > max_positions:
                raise fail(fn, f"prompts[{i}] has {len(p)} tokens; with max_new_tokens="
                               f"{new} it needs {len(p) + new - 1} positions, but the model "
                               f"has {max_positions} (max_position_embeddings)")
    prefix = 0
    if share_prefix and len(ids) > 1:
        shortest = min(len(p) for p in ids)
        while prefix < shortest - 1 and all(p[prefix] == ids[0][prefix] for p in ids):
            prefix += 1
    return PromptBatch(ids, prefix, new)


def pool_pages(fn: str, batch: PromptBatch, page_size: int, num_pages: int | None) -> int:
    """The pool size for ``batch``: ``num_pages`` when it holds the whole run (else
    ``InvalidArgumentError`` before anything runs, naming the pages needed), or
    ``pages_needed`` (what the run uses, or one more) when ``num_pages`` is ``None``."""
    need = batch.pages_needed(page_size)
    if need > MAX_ENTRIES:           # past any pool (PagePool's num_pages bound)
        raise fail(fn, f"{batch.size} prompts of up to {max(map(len, batch.prompts))} tokens "
                       f"plus max_new_tokens={batch.max_new_tokens} need {need} pages of "
                       f"{page_size} tokens, more than a pool holds ({MAX_ENTRIES})")
    if num_pages is None:
        return need
    have = check_int(fn, "num_pages", num_pages, note=" or None")
    if need > have:
        longest = max(range(batch.size), key=lambda i: len(batch.prompts[i]))
        raise fail(fn, f"the pool of {have} pages of {page_size} tokens cannot hold the run: "
                       f"{batch.size} prompts of {[len(p) for p in batch.prompts]} tokens "
                       f"(shared prefix {batch.prefix_len}) plus max_new_tokens="
                       f"{batch.max_new_tokens} need {need} pages (the longest, prompts"
                       f"[{longest}], alone needs "
                       f"{-(-batch.tokens_held(longest) // page_size)})")
    return have
