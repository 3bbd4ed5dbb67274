"""A small BERT (uncased) WordPiece tokenizer over a ``vocab.txt``, without extra dependencies.

It follows the reference BERT tokenizer: clean the text (drop control characters and U+FFFD,
map whitespace to spaces), put spaces around CJK ideographs, lower-case and strip accents (NFD,
drop combining marks), split on whitespace and punctuation, then split each word greedily into
the longest vocabulary pieces, continuation pieces prefixed with ``##``; a word longer than
100 characters, or one with no split, becomes ``[UNK]``.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path


def _is_whitespace(ch: str) -> bool:
    return ch in (" ", "\t", "\n", "\r") or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    if ch in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(ch) in ("Cc", "Cf")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def basic_tokenize(text: str, lower_case: bool = True) -> list[str]:
    """Words and punctuation marks of ``text`` (the "basic" step before WordPiece)."""
    cleaned = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        if _is_whitespace(ch):
            cleaned.append(" ")
        elif _is_cjk(cp):
            cleaned.append(f" {ch} ")
        else:
            cleaned.append(ch)
    words: list[str] = []
    for word in "".join(cleaned).split():
        if lower_case:
            word = word.lower()
            word = "".join(
                c for c in unicodedata.normalize("NFD", word) if unicodedata.category(c) != "Mn"
            )
        current = ""
        for ch in word:
            if _is_punctuation(ch):
                if current:
                    words.append(current)
                    current = ""
                words.append(ch)
            else:
                current += ch
        if current:
            words.append(current)
    return words


class WordPieceTokenizer:
    """BERT uncased tokenizer over ``vocab.txt`` (one token per line; the line number is the id).

    ``encode(text)`` gives ``[CLS] pieces... [SEP]`` ids, truncated to ``max_length`` tokens.
    """

    def __init__(self, vocab_file: str | Path, lower_case: bool = True, max_length: int = 512):
        lines = Path(vocab_file).read_text(encoding="utf-8").splitlines()
        self.vocab: dict[str, int] = {tok: i for i, tok in enumerate(lines) if tok}
        self.lower_case = lower_case
        self.max_length = max_length
        for special in ("[CLS]", "[SEP]", "[UNK]"):
            if special not in self.vocab:
                raise ValueError(f"vocab_file: {vocab_file} has no {special} token")

    def wordpiece(self, word: str, max_chars: int = 100) -> list[str]:
        """Greedy longest-match-first pieces of one word (``[UNK]`` when impossible)."""
        if len(word) > max_chars:
            return ["[UNK]"]
        pieces: list[str] = []
        start = 0
        while start < len(word):
            end = len(word)
            piece = None
            while start < end:
                candidate = word[start:end] if start == 0 else "##" + word[start:end]
                if candidate in self.vocab:
                    piece = candidate
                    break
                end -= 1
            if piece is None:
                return ["[UNK]"]
            pieces.append(piece)
            start = end
        return pieces

    def tokenize(self, text: str) -> list[str]:
        """WordPiece tokens of ``text`` (no special tokens)."""
        out: list[str] = []
        for word in basic_tokenize(text, self.lower_case):
            out.extend(self.wordpiece(word))
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids ``[CLS] ... [SEP]``, at most ``max_length`` of them."""
        pieces = self.tokenize(text)[: self.max_length - 2]
        return [self.vocab["[CLS]"], *(self.vocab[p] for p in pieces), self.vocab["[SEP]"]]
