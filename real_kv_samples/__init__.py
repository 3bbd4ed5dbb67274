"""Real K/V for ``vllm-kv check --real``: the activations of a small real model over shipped text.

Not part of the ``vllm`` library: ``vllm.accuracy`` measures what a cache format costs on any
:class:`~vllm.accuracy.samples.KVSample`; this package produces such samples from a real model,
all-MiniLM-L6-v2 (:mod:`real_kv_samples.minilm`), run by a plain-torch BERT forward
(:mod:`real_kv_samples.bert`) over English paragraphs (:mod:`real_kv_samples.texts`) tokenized
by a WordPiece tokenizer (:mod:`real_kv_samples.wordpiece`). The weights come from the optional
``accuracy`` extra; ``vllm-kv check`` imports this package only when ``--real`` is given.
"""

from real_kv_samples.minilm import (
    INSTALL_HINT,
    MODEL_MODULE,
    MODEL_NAME,
    MODEL_PACKAGE,
    MissingDependencyError,
    describe,
    encode_paragraphs,
    missing_packages,
    model_dir,
    real_samples,
)

__all__ = [
    "INSTALL_HINT",
    "MODEL_MODULE",
    "MODEL_NAME",
    "MODEL_PACKAGE",
    "MissingDependencyError",
    "describe",
    "encode_paragraphs",
    "missing_packages",
    "model_dir",
    "real_samples",
]
