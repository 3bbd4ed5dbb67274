"""``AttentionLayerScales``: the public scale accessors and ``set_kv_scales`` (checked before
anything changes), fed from the calibration observer."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant import KVScaleObserver
from vllm.v1.attention.backends import AttentionLayerScales


def test_set_kv_scales_from_the_observer() -> None:
    layer = AttentionLayerScales()
    obs = KVScaleObserver(per_head=True)
    obs.observe(torch.randn(5, 2, 16), torch.randn(5, 2, 16))
    k_scale, v_scale = obs.scales("nvfp4")
    layer.set_kv_scales(k_scale, v_scale)
    assert layer.k_scale is k_scale and layer._k_scale is k_scale
    assert layer.v_scale is v_scale and layer._v_scale is v_scale
    layer.set_kv_scales(torch.tensor(0.5), torch.ones(1))  # 0-d, upstream's shape
    assert layer.k_scale.shape == torch.Size([])


@pytest.mark.parametrize(
    ("k_scale", "v_scale", "message"),
    [
        (torch.tensor(0.0), torch.tensor(1.0), r"k_scale: expected finite scales > 0, got \[0.0\]"),
        (torch.tensor(1.0), torch.tensor([1.0, float("nan")]), "v_scale: expected finite scales"),
        (
            torch.tensor(1.0, dtype=torch.float64),
            torch.tensor(1.0),
            "k_scale: expected a torch.float32",
        ),
        (torch.tensor(1.0), torch.ones(2, 2), r"v_scale: expected one value .* got shape \[2, 2\]"),
    ],
)
def test_set_kv_scales_rejects_before_changing(
    k_scale: torch.Tensor, v_scale: torch.Tensor, message: str
) -> None:
    layer = AttentionLayerScales()
    before = (layer.k_scale, layer.v_scale)
    with pytest.raises(ValueError, match=message):
        layer.set_kv_scales(k_scale, v_scale)
    assert (layer.k_scale, layer.v_scale) == before
