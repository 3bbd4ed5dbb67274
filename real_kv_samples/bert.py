"""A small BERT encoder forward in plain torch that records every layer's Q, K and V.

Loads a Hugging Face ``BertModel`` checkpoint (``config.json`` + ``model.safetensors``) with
``safetensors`` only; no ``transformers`` and no hub access. Inference only (dropout off), one
unpadded sequence at a time, absolute position embeddings, token type 0, exact (erf) GELU,
post-LayerNorm blocks as in the original BERT:

    h_0 = LN(word_emb[ids] + pos_emb[0..T-1] + type_emb[0])
    per layer: q, k, v = h W_q^T + b_q, ...        (split into H heads of D = hidden/H)
               a = softmax(q k^T / sqrt(D)) v      (bidirectional)
               h' = LN(h + a W_o^T + b_o)
               h_next = LN(h' + GELU(h' W_i^T + b_i) W_2^T + b_2)

All math in fp32 on the chosen device.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT ``config.json`` that the forward needs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str = "gelu"

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        if raw.get("model_type", "bert") != "bert":
            raise ValueError(f"{path}: expected model_type 'bert', got {raw.get('model_type')!r}")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only absolute position embeddings are supported")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: only hidden_act 'gelu' is supported")
        fields = cls.__dataclass_fields__
        return cls(**{k: raw[k] for k in fields if k in raw})


@dataclass(frozen=True)
class LayerCapture:
    """One layer's activations for one sequence (fp32).

    ``q``, ``k``, ``v``: ``[T, H, D]`` projections (biases included) that attention reads;
    ``hidden_in`` / ``hidden_out``: ``[T, hidden]`` input and output of the layer.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    hidden_in: torch.Tensor
    hidden_out: torch.Tensor


class Bert:
    """BERT encoder weights plus a recording forward (see the module docstring)."""

    def __init__(self, config: BertConfig, weights: dict[str, torch.Tensor]):
        self.config = config
        self.w = weights
        missing = [k for k in self._required_keys() if k not in weights]
        if missing:
            raise ValueError(f"weights: missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _required_keys(self) -> list[str]:
        keys = [
            "embeddings.word_embeddings.weight",
            "embeddings.position_embeddings.weight",
            "embeddings.token_type_embeddings.weight",
            "embeddings.LayerNorm.weight",
            "embeddings.LayerNorm.bias",
        ]
        for i in range(self.config.num_hidden_layers):
            p = f"encoder.layer.{i}."
            for name in (
                "attention.self.query",
                "attention.self.key",
                "attention.self.value",
                "attention.output.dense",
                "attention.output.LayerNorm",
                "intermediate.dense",
                "output.dense",
                "output.LayerNorm",
            ):
                keys += [p + name + ".weight", p + name + ".bias"]
        return keys

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: torch.device | str = "cpu") -> Bert:
        """Load ``config.json`` and ``model.safetensors`` from ``model_dir`` onto ``device``
        (tensors in fp32). Needs the ``safetensors`` package."""
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        config = BertConfig.from_json(model_dir / "config.json")
        raw = load_file(str(model_dir / "model.safetensors"), device="cpu")
        weights = {
            k.removeprefix("bert."): v.to(device=device, dtype=torch.float32)
            for k, v in raw.items()
            if v.is_floating_point()
        }
        return cls(config, weights)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(
            x,
            (x.shape[-1],),
            self.w[name + ".weight"],
            self.w[name + ".bias"],
            self.config.layer_norm_eps,
        )

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> list[LayerCapture]:
        """Run one unpadded sequence ``input_ids [T]`` (int64) and return one
        :class:`LayerCapture` per layer."""
        cfg = self.config
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids: expected a non-empty [T] tensor, got {input_ids.shape}")
        if input_ids.numel() > cfg.max_position_embeddings:
            raise ValueError(
                f"input_ids: {input_ids.numel()} tokens exceed max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        device = self.w["embeddings.word_embeddings.weight"].device
        ids = input_ids.to(device)
        t = ids.numel()
        h = (
            self.w["embeddings.word_embeddings.weight"][ids]
            + self.w["embeddings.position_embeddings.weight"][:t]
            + self.w["embeddings.token_type_embeddings.weight"][0]
        )
        h = self._ln(h, "embeddings.LayerNorm")
        heads, d = cfg.num_attention_heads, cfg.head_size
        captures = []
        for i in range(cfg.num_hidden_layers):
            p = f"encoder.layer.{i}."
            q = self._linear(h, p + "attention.self.query").view(t, heads, d)
            k = self._linear(h, p + "attention.self.key").view(t, heads, d)
            v = self._linear(h, p + "attention.self.value").view(t, heads, d)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
            ctx = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(t, -1)
            a = self._ln(
                h + self._linear(ctx, p + "attention.output.dense"),
                p + "attention.output.LayerNorm",
            )
            ff = F.gelu(self._linear(a, p + "intermediate.dense"))
            out = self._ln(a + self._linear(ff, p + "output.dense"), p + "output.LayerNorm")
            captures.append(LayerCapture(q=q, k=k, v=v, hidden_in=h, hidden_out=out))
            h = out
        return captures
