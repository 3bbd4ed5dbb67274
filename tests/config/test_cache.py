import pytest

from vllm.config.cache import CACHE_DTYPES, CacheConfig


def test_defaults() -> None:
    config = CacheConfig()
    assert config.block_size == 16
    assert config.cache_dtype == "auto"
    assert config.kv_cache_dtype_skip_layers == []


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_accepts_every_documented_dtype(cache_dtype: str) -> None:
    assert CacheConfig(cache_dtype=cache_dtype).cache_dtype == cache_dtype  # type: ignore[arg-type]


@pytest.mark.parametrize("cache_dtype", ["fp4", "int8", "FP8", "", "bf16"])
def test_unknown_dtype_lists_accepted_values(cache_dtype: str) -> None:
    with pytest.raises(ValueError, match=r"cache_dtype.*expected one of auto, .*nvfp4"):
        CacheConfig(cache_dtype=cache_dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [0, -16, 1.5, True])
def test_bad_block_size(block_size: object) -> None:
    with pytest.raises(ValueError, match="block_size: expected a positive int"):
        CacheConfig(block_size=block_size)  # type: ignore[arg-type]


def test_skip_layers_must_be_a_list_of_names() -> None:
    assert CacheConfig(kv_cache_dtype_skip_layers=["sliding_window"]).kv_cache_dtype_skip_layers
    with pytest.raises(ValueError, match="kv_cache_dtype_skip_layers"):
        CacheConfig(kv_cache_dtype_skip_layers="sliding_window")  # type: ignore[arg-type]
