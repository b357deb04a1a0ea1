"""Retrieval drafts (SAM-Decoding): a suffix automaton over the prompt and the generated tokens
proposes the continuation of the longest suffix of the text that occurred before.

    index = SuffixIndex()
    index.extend(prompt_ids + [first_token])      # then each round's committed tokens
    chain = index.propose(8)                      # tokens to follow the last one: a draft chain

Vocabulary:
  * text        every committed token of the sequence, in order (the last one is the round's root).
  * match       the longest suffix of the text that also ends at an earlier position; its first
                occurrence ends at `first[state]`, and the chain is what followed it there.
  * state       a suffix-automaton state: the set of substrings sharing their end positions;
                `length` the longest of them, `link` the state of the next shorter suffixes,
                `first` the end position of their first occurrence.

`extend` is amortised O(1) per token (the classic online construction); `propose` walks suffix
links from the whole text's state to the first with an earlier occurrence. Proposals are one-hot
(the chain is a guess, not a distribution), so verification stays exact for sampling too.
Pure: no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable


class SuffixIndex:
    def __init__(self, min_match: int = 2) -> None:
        self.min_match = min_match  # shorter matches propose nothing (too weak a signal)
        self.text: list[int] = []
        self._next: list[dict[int, int]] = [{}]
        self._link: list[int] = [-1]
        self._len: list[int] = [0]
        self._first: list[int] = [-1]
        self._last = 0

    def __len__(self) -> int:
        return len(self.text)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self._add(int(t))

    def _new(self, length: int, first: int, nxt: dict[int, int], link: int) -> int:
        self._next.append(nxt)
        self._len.append(length)
        self._first.append(first)
        self._link.append(link)
        return len(self._len) - 1

    def _add(self, c: int) -> None:
        pos = len(self.text)
        self.text.append(c)
        cur = self._new(self._len[self._last] + 1, pos, {}, -1)
        p = self._last
        while p != -1 and c not in self._next[p]:
            self._next[p][c] = cur
            p = self._link[p]
        if p == -1:
            self._link[cur] = 0
        else:
            q = self._next[p][c]
            if self._len[p] + 1 == self._len[q]:
                self._link[cur] = q
            else:
                clone = self._new(self._len[p] + 1, self._first[q], dict(self._next[q]), self._link[q])
                while p != -1 and self._next[p].get(c) == q:
                    self._next[p][c] = clone
                    p = self._link[p]
                self._link[q] = clone
                self._link[cur] = clone
        self._last = cur

    def match(self) -> tuple[int, int]:
        """(length, end) of the longest suffix that also ends before the last position: `end` is
        where its first occurrence ends; (0, -1) if none."""
        n = len(self.text)
        v = self._last
        while v > 0 and self._first[v] >= n - 1:
            v = self._link[v]
        if v <= 0:
            return 0, -1
        return self._len[v], self._first[v]

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the match's first occurrence (empty if the match is
        shorter than `min_match`). Example: text [1 2 3 9 1 2] -> match [1 2] -> [3, 9, 1, 2][:limit]."""
        if limit < 1:
            return []
        length, end = self.match()
        if length < self.min_match:
            return []
        return self.text[end + 1: end + 1 + limit]
