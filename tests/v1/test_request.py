"""Request shapes: Request, SamplingParams, LoRARequest, multimodal records."""

from __future__ import annotations

import pytest
import torch

from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus


def _req(tokens: list[int] | None = None, **kw) -> Request:
    kw.setdefault("sampling_params", SamplingParams(max_tokens=5))
    kw.setdefault("pooling_params", None)
    return Request(request_id=kw.pop("request_id", "r"), prompt_token_ids=tokens, **kw)


def test_token_views_and_appending() -> None:
    seen: list[int] = []

    def hasher(request: Request) -> list[bytes]:
        seen.append(request.num_tokens)
        return [b"x"] * (request.num_tokens // 4 - len(request.block_hashes))

    r = _req([1, 2, 3], block_hasher=hasher)
    assert r.num_prompt_tokens == 3 and r.num_tokens == 3 and r.max_tokens == 5
    assert r.block_hashes == [] and r.status == RequestStatus.WAITING and not r.is_finished()
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6, 7, 8])
    assert seen == [3, 4, 8] and len(r.block_hashes) == 2
    assert r.all_token_ids[2:5] == [3, 4, 5] and r.output_token_ids == [4, 5, 6, 7, 8]
    assert r.num_output_tokens == 5 and len(r.all_token_ids) == 8
    with pytest.raises(TypeError):
        r.all_token_ids[0] = 9  # type: ignore[index]


def test_prompt_embeds_only_and_validation() -> None:
    r = _req(None, prompt_embeds=torch.zeros(6, 2))
    assert r.num_prompt_tokens == 6 and list(r.all_token_ids) == [0] * 6
    with pytest.raises(ValueError, match="prompt_token_ids: expected token ids or prompt_embeds"):
        _req(None)
    with pytest.raises(ValueError, match="can't both be unset"):
        _req([1], sampling_params=None)
    with pytest.raises(ValueError, match="max_tokens: expected an int >= 1 or None, got 0"):
        SamplingParams(max_tokens=0)


def test_skip_reading_prefix_cache() -> None:
    assert _req([1]).skip_reading_prefix_cache is False
    assert _req([1], sampling_params=SamplingParams(prompt_logprobs=1)).skip_reading_prefix_cache
    explicit = SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)
    assert _req([1], sampling_params=explicit).skip_reading_prefix_cache is False


def test_priority_order() -> None:
    a = _req([1], request_id="a", priority=0, arrival_time=2.0)
    b = _req([1], request_id="b", priority=0, arrival_time=1.0)
    c = _req([1], request_id="c", priority=-1, arrival_time=9.0)
    assert sorted([a, b, c]) == [c, b, a]


def test_generation_config_eos() -> None:
    p = SamplingParams(max_tokens=3, stop_token_ids=[42])
    p.update_from_generation_config({"eos_token_id": [7, 100]}, eos_token_id=100)
    assert p.eos_token_id == 100 and p.all_stop_token_ids == {7, 42, 100}
    assert p.stop_token_ids == [7, 42]


def test_lora_request() -> None:
    a = LoRARequest("name", 2, "/a")
    assert a.adapter_id == 2 and a.name == "name" and a.path == "/a"
    assert a == LoRARequest("name", 3, "/b") and hash(a) == hash("name")
    with pytest.raises(ValueError, match="id must be > 0, got 0"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="lora_path: expected a non-empty path"):
        LoRARequest("x", 1, "")


def test_multimodal_records() -> None:
    plain = PlaceholderRange(offset=3, length=4)
    assert plain.get_num_embeds() == 4
    masked = PlaceholderRange(3, 4, is_embed=torch.tensor([True, False, True, True]))
    assert masked.get_num_embeds() == 3 and masked != plain
    feature = MultiModalFeatureSpec(
        data=MultiModalKwargsItem.dummy(2), modality="image", identifier="h", mm_position=masked
    )
    assert feature.data is not None and feature.data["dummy"].numel() == 2
    r = _req(list(range(8)), mm_features=[feature])
    assert r.has_encoder_inputs and r.get_num_encoder_embeds(0) == 3
    with pytest.raises(IndexError, match="input_id: expected 0..0, got 1"):
        r.get_num_encoder_embeds(1)
