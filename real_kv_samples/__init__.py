"""Real K/V for ``vllm-kv check --real``: the activations of a small real model over shipped text.

Not part of the ``vllm`` library: ``vllm.accuracy`` measures what a cache format costs on any
:class:`~vllm.accuracy.samples.KVSample`; this package produces such samples from a real model,
all-MiniLM-L6-v2 (:mod:`real_kv_samples.minilm`), run by a plain-torch BERT forward
(:mod:`real_kv_samples.bert`) over English paragraphs (:mod:`real_kv_samples.texts`) tokenized
by a WordPiece tokenizer (:mod:`real_kv_samples.wordpiece`). The weights come from the optional
``accuracy`` extra; ``vllm-kv check`` imports this package only when ``--real`` is given.

It also holds the end-to-end report of ``vllm-kv check --model``: a real language model,
SmolLM2-135M-Instruct (:mod:`real_kv_samples.smollm2`, the ``model`` extra), run with its
attention on the paged cache (:mod:`real_kv_samples.paged_llama`), scored per cache format
(:mod:`real_kv_samples.lm_report`). Those modules are imported only when ``--model`` is given.
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
