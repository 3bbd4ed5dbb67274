"""The WordPiece tokenizer of the real-model K/V source, on hand-made vocabularies."""

from __future__ import annotations

from pathlib import Path

from real_kv_samples.wordpiece import WordPieceTokenizer, basic_tokenize


def test_basic_tokenize() -> None:
    assert basic_tokenize("Héllo, WORLD!  naïve\tcafé's 3.5") == [
        "hello",
        ",",
        "world",
        "!",
        "naive",
        "cafe",
        "'",
        "s",
        "3",
        ".",
        "5",
    ]
    assert basic_tokenize("a中b") == ["a", "中", "b"]


def test_wordpiece(tmp_path: Path) -> None:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "un", "##aff", "##able", "run", "##ning", ","]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tok = WordPieceTokenizer(path, max_length=6)
    assert tok.tokenize("Unaffable, running xyz") == [
        "un",
        "##aff",
        "##able",
        ",",
        "run",
        "##ning",
        "[UNK]",
    ]
    # max_length 6: [CLS] + the first 4 pieces + [SEP]
    assert tok.encode("unaffable running") == [2, 4, 5, 6, 7, 3]
