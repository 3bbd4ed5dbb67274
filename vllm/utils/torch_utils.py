"""Torch dtype maps, KV-cache dtype resolution, NVFP4 cache-layout utilities, upstream vLLM's
test-cache helpers and its generic torch helpers (lossless casts, strides, padding, seeding).

The runtime helpers (thread counts, host-to-device copies, streams) live in
:mod:`vllm.utils.torch_runtime` and are re-exported here, upstream's home of them.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Collection, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from vllm.kv_quant.formats import (
    find_format,
    lookup,
    nvfp4_packed_dim,
    torch_dtype_names,
)
from vllm.kv_quant.fp8 import Fp8Format, quantize_fp8
from vllm.kv_quant.nvfp4_cache import nvfp4_split_data_scale
from vllm.utils.torch_runtime import (  # noqa: F401  (upstream's path of these names)
    OMP_NUM_THREADS_SET_BY_VLLM,
    PIN_MEMORY,
    async_tensor_h2d,
    aux_stream,
    available_cpu_count,
    current_stream,
    guard_cuda_initialization,
    np_to_pinned_tensor,
    set_default_torch_num_threads,
    set_torch_threads_for_runtime,
    startup_omp_num_threads,
)

logger = logging.getLogger(__name__)


class _StorageDtypes(Mapping[str, torch.dtype]):
    """The format registry's storage dtype of each ``kv_cache_dtype`` string and torch dtype
    name, read live: a format registered later (``register_kv_cache_dtype``) is in it at once."""

    def __getitem__(self, name: str) -> torch.dtype:
        return torch_dtype_names()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(torch_dtype_names())

    def __len__(self) -> int:
        return len(torch_dtype_names())

    def __repr__(self) -> str:
        return repr(torch_dtype_names())


STR_DTYPE_TO_TORCH_DTYPE: Mapping[str, torch.dtype] = _StorageDtypes()
"""Storage dtype of each ``kv_cache_dtype`` string and torch dtype name (``half``), from the
format registry (``auto`` is resolved against the model; upstream's dict, here a live view)."""

MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP: dict[str, str] = {
    algo: lookup(algo).name for algo in ("fp8", "nvfp4")
}
"""ModelOpt ``kv_cache_quant_algo`` names (lower-cased) to our ``kv_cache_dtype`` strings."""

TORCH_DTYPE_TO_NUMPY_DTYPE: dict[torch.dtype, type[np.generic]] = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.uint8: np.uint8,
    torch.int32: np.int32,
    torch.int64: np.int64,
}
"""The torch dtypes :func:`make_tensor_with_pad` builds, with their NumPy twins (upstream's)."""

T = TypeVar("T")


def get_dtype_size(dtype: torch.dtype) -> int:
    """Size of one element of ``dtype`` in bytes."""
    return torch.tensor([], dtype=dtype).element_size()


def _dtype_family(dtype: torch.dtype) -> int:
    """0 bool, 1 integer, 2 floating point, 3 complex, in the order in which upstream's rule
    counts a cast as lossless."""
    if dtype == torch.bool:
        return 0
    if dtype.is_complex:
        return 3
    return 2 if dtype.is_floating_point else 1


def is_lossless_cast(src_dtype: torch.dtype, tgt_dtype: torch.dtype) -> bool:
    """Whether casting a tensor from ``src_dtype`` to ``tgt_dtype`` keeps every value (upstream's
    rule): a cast to a later family (bool < integer < floating point < complex) counts as
    lossless and to an earlier one as lossy; within a family the target must span the source's
    range, and for floats also its resolution."""
    if src_dtype == tgt_dtype:
        return True
    src_family, tgt_family = _dtype_family(src_dtype), _dtype_family(tgt_dtype)
    if src_family != tgt_family:
        return src_family < tgt_family
    if src_family == 1:
        src_int, tgt_int = torch.iinfo(src_dtype), torch.iinfo(tgt_dtype)
        return tgt_int.min <= src_int.min and src_int.max <= tgt_int.max
    src_fp, tgt_fp = torch.finfo(src_dtype), torch.finfo(tgt_dtype)
    return (
        tgt_fp.min <= src_fp.min
        and src_fp.max <= tgt_fp.max
        and tgt_fp.resolution <= src_fp.resolution
    )


def common_broadcastable_dtype(dtypes: Collection[torch.dtype]) -> torch.dtype:
    """The dtype among ``dtypes`` that the most of them cast to losslessly
    (:func:`is_lossless_cast`); on a tie the first such one."""
    candidates = list(dtypes)
    if not candidates:
        raise ValueError("dtypes: expected at least one dtype, got none")
    best, best_count = candidates[0], -1
    for target in candidates:
        count = sum(is_lossless_cast(dtype, target) for dtype in candidates)
        if count > best_count:
            best, best_count = target, count
    return best


def is_meta_module(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (recursively) is on the meta device."""
    tensors = (*module.parameters(), *module.buffers())
    return any(t.is_meta for t in tensors)


def is_strictly_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous with every stride canonical, size-1 dims included (each
    stride the span of the dims inside it): ``is_contiguous()`` ignores a size-1 dim's stride,
    which some kernels still compute with; :func:`canonicalize_singleton_dim_strides` fixes it.
    """
    span = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if stride != span:
            return False
        span *= size
    return True


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether the elements of ``t`` fill one gap-free, non-overlapping span of memory in some
    dim order (a permutation of a contiguous tensor), where ``is_contiguous()`` also asks for
    row-major order. Size-1 dims, whatever their stride, do not count."""
    span = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda dim: dim[1]):
        if size == 1:
            continue
        if stride != span:
            return False
        span *= size
    return True


def canonicalize_singleton_dim_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every size-1 dim given its canonical stride, the span of the dims inside it
    (a zero-copy ``as_strided`` view); ``t`` itself when nothing changes.

    torch takes any stride on a size-1 dim (``is_contiguous()`` still holds), so an allocator may
    leave e.g. stride 1 on a single-KV-head dim. CUDA TMA (FlashInfer XQA, FlashAttention 3/4 on
    H100 and later) needs every stride but the outermost to be a multiple of 16 bytes and faults
    on such a tensor. Strides of the other dims are kept, non-canonical ones included.
    """
    strides = list(t.stride())
    span = 1  # elements spanned by one step of the dim just inside
    for dim in reversed(range(t.dim())):
        if t.shape[dim] == 1:
            strides[dim] = span
        span = strides[dim] * t.shape[dim]
    if tuple(strides) == t.stride():
        return t
    return t.as_strided(t.shape, strides)


_DEFAULT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes torch takes as its default dtype."""


@contextlib.contextmanager
def set_default_torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Run the block with ``dtype`` as torch's default floating-point dtype, restoring the
    previous one afterwards, also on an exception."""
    if not isinstance(dtype, torch.dtype) or dtype not in _DEFAULT_DTYPES:
        raise ValueError(
            f"dtype: expected one of {', '.join(map(str, _DEFAULT_DTYPES))}, got {dtype!r}"
        )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def make_ndarray_with_pad(
    x: list[list[T]],
    pad: T,
    dtype: npt.DTypeLike,
    *,
    max_len: int | None = None,
) -> npt.NDArray[Any]:
    """The rows of ``x`` as a ``(len(x), max_len)`` array, each row padded at its end with
    ``pad``; ``max_len`` defaults to the longest row (0 when there is none)."""
    if max_len is None:
        max_len = max(map(len, x), default=0)
    elif isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"max_len: expected None or a non-negative int, got {max_len!r}")
    for i, row in enumerate(x):
        if len(row) > max_len:
            raise ValueError(f"x: row {i} has {len(row)} items, more than max_len={max_len}")
    padded = np.full((len(x), max_len), pad, dtype=dtype)
    for i, row in enumerate(x):
        padded[i, : len(row)] = row
    return padded


def make_tensor_with_pad(
    x: list[list[T]],
    pad: T,
    dtype: torch.dtype,
    *,
    max_len: int | None = None,
    device: str | torch.device | None = None,
    pin_memory: bool = False,
) -> torch.Tensor:
    """:func:`make_ndarray_with_pad` as a ``dtype`` tensor (a key of
    :data:`TORCH_DTYPE_TO_NUMPY_DTYPE`) on ``device`` (default: CPU), pinned if ``pin_memory``.
    """
    if dtype not in TORCH_DTYPE_TO_NUMPY_DTYPE:
        raise ValueError(
            f"dtype: expected one of {', '.join(map(str, TORCH_DTYPE_TO_NUMPY_DTYPE))}, "
            f"got {dtype!r}"
        )
    padded = make_ndarray_with_pad(x, pad, TORCH_DTYPE_TO_NUMPY_DTYPE[dtype], max_len=max_len)
    tensor = torch.from_numpy(padded).to(device)
    return tensor.pin_memory() if pin_memory else tensor


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """True for the quantized (FP8, NVFP4, per-token-head) cache dtype strings, False for the
    unquantized ones and for a string that names no format (a predicate, as upstream's: it does
    not raise)."""
    fmt = find_format(kv_cache_dtype)
    return fmt is not None and fmt.is_quantized


def kv_cache_uses_per_token_head_scales(kv_cache_dtype: str) -> bool:
    """True for the dtypes whose writer stores one fp32 scale per token and head inline
    (``int8_per_token_head``, ``fp8_per_token_head``); False otherwise, unknown names included."""
    fmt = find_format(kv_cache_dtype)
    return fmt is not None and fmt.is_per_token_head


def _storage_dtype(kv_cache_dtype: str, model_dtype: object, arg_name: str) -> torch.dtype:
    """Storage dtype for ``kv_cache_dtype``, ``auto`` resolving to ``model_dtype`` (a torch
    dtype or its name; the argument ``arg_name`` of the caller)."""
    names = torch_dtype_names()
    if kv_cache_dtype in names:
        return names[kv_cache_dtype]
    fmt = lookup(kv_cache_dtype, include_mla_only=False)
    if isinstance(model_dtype, torch.dtype):
        return fmt.resolve_storage_dtype(model_dtype)
    if isinstance(model_dtype, str) and model_dtype in names:
        return fmt.resolve_storage_dtype(names[model_dtype])
    raise ValueError(
        f"{arg_name}: kv_cache_dtype='auto' needs the model dtype as a torch.dtype or one "
        f"of {', '.join(names)}, got {model_dtype!r}"
    )


def kv_cache_dtype_str_to_dtype(kv_cache_dtype: str, model_config: Any) -> torch.dtype:
    """Storage dtype for ``kv_cache_dtype``; ``auto`` resolves to the model's dtype.

    ``model_config`` is what upstream passes, a ``ModelConfig`` (its ``dtype`` is read), or the
    model dtype itself (a torch dtype or its name); ``None`` means float16, upstream's default
    for tests that have no model. A torch dtype name that is not a cache dtype (``half``) is
    taken as that dtype, as upstream does.
    """
    model_dtype: object
    if model_config is None:
        model_dtype = torch.float16
    elif isinstance(model_config, torch.dtype | str):
        model_dtype = model_config
    else:
        model_dtype = getattr(model_config, "dtype", None)
    return _storage_dtype(kv_cache_dtype, model_dtype, "model_config")


def get_kv_cache_torch_dtype(
    cache_dtype: str | torch.dtype | None,
    model_dtype: str | torch.dtype | None = None,
) -> torch.dtype:
    """Storage dtype of a KV cache (upstream's name and signature).

    A string is resolved as by :func:`kv_cache_dtype_str_to_dtype`, except that ``auto`` needs
    ``model_dtype`` (as upstream, no float16 default); a ``torch.dtype`` is returned as is;
    anything else raises ``ValueError``.
    """
    if isinstance(cache_dtype, torch.dtype):
        return cache_dtype
    if isinstance(cache_dtype, str):
        return _storage_dtype(cache_dtype, model_dtype, "model_dtype")
    raise ValueError(
        f"cache_dtype: expected a kv_cache_dtype string or a torch.dtype, got {cache_dtype!r}"
    )


def _modelopt_scheme_algo(scheme: Mapping[str, Any]) -> str | None:
    """The ModelOpt algorithm a ``kv_cache_scheme`` dict describes (static 8-bit floats: fp8,
    4-bit floats: nvfp4), None for any other."""
    if scheme.get("type") != "float":
        return None
    if scheme.get("num_bits") == 8 and scheme.get("dynamic") is False:
        return "fp8"
    return "nvfp4" if scheme.get("num_bits") == 4 else None


def get_kv_cache_quant_algo_string(quant_cfg: Mapping[str, Any]) -> str | None:
    """The ``kv_cache_dtype`` a checkpoint's ``quantization_config`` asks for.

    Only ModelOpt configs (``quant_method`` starting with ``modelopt``) name one, as a
    ``kv_cache_scheme`` dict or a ``kv_cache_quant_algo`` string, in the nested
    ``quantization`` section or at the top level (the first set of: nested scheme, top scheme,
    nested algo, top algo). Returns the :data:`MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP` entry of a
    known algorithm (case-insensitive), ``"auto"`` with a warning for an unknown one, and
    ``None`` when nothing is set or the config is not ModelOpt's.
    """
    if not isinstance(quant_cfg, Mapping):
        raise ValueError(
            f"quant_cfg: expected a quantization_config mapping, got {type(quant_cfg).__name__}"
        )
    method = quant_cfg.get("quant_method")
    if not (isinstance(method, str) and method.startswith("modelopt")):
        return None
    nested = quant_cfg.get("quantization")
    inner = nested if isinstance(nested, Mapping) else quant_cfg
    algo = (
        inner.get("kv_cache_scheme")
        or quant_cfg.get("kv_cache_scheme")
        or inner.get("kv_cache_quant_algo")
        or quant_cfg.get("kv_cache_quant_algo")
    )
    if isinstance(algo, Mapping):
        name = _modelopt_scheme_algo(algo)
    elif isinstance(algo, str):
        name = algo.lower()
    else:
        return None
    if name in MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP:
        return MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP[name]
    logger.warning(
        "Unknown kv_cache_quant_algo %r in the model's quantization config (known: %s); "
        "using kv_cache_dtype 'auto'",
        algo,
        ", ".join(MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP),
    )
    return "auto"


def resolve_kv_cache_dtype_string(kv_cache_dtype: str, model_config: Any) -> str:
    """``kv_cache_dtype`` itself, or for ``auto`` the dtype the checkpoint's quantization config
    asks for (:func:`get_kv_cache_quant_algo_string` of ``model_config.hf_config``'s
    ``quantization_config``), ``auto`` when it asks for none or there is no such config."""
    if not isinstance(kv_cache_dtype, str):
        raise ValueError(f"kv_cache_dtype: expected a str, got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    hf_config = getattr(model_config, "hf_config", None)
    quant_cfg = getattr(hf_config, "quantization_config", None)
    if quant_cfg is not None:
        return get_kv_cache_quant_algo_string(quant_cfg) or "auto"
    return "auto"


_MAX_SEED = 2**32 - 1
"""NumPy's global generator takes 32-bit seeds."""


def set_random_seed(seed: int | None, data_parallel_index: int = 0) -> None:
    """Seed Python's ``random``, NumPy and torch (every device); ``None`` leaves them alone.

    Data-parallel engines share the engine seed yet must not draw alike for requests without a
    seed of their own: a ``data_parallel_index`` above 0 seeds with a 32-bit value derived from
    ``(seed, data_parallel_index)`` by NumPy's ``SeedSequence`` (the value upstream derives,
    so the streams match upstream's); index 0 seeds with ``seed`` itself.
    """
    index = data_parallel_index
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"data_parallel_index: expected a non-negative int, got {index!r}")
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed: expected None or an int in [0, 2**32 - 1], got {seed!r}")
    if index:
        seed = int(np.random.SeedSequence((seed, index)).generate_state(1)[0])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def nvfp4_kv_cache_full_dim(head_size: int) -> int:
    """Packed NVFP4 bytes per head per side: ``D/2`` data bytes plus ``D/16`` scale bytes
    (upstream's name for the registry's NVFP4 row size)."""
    return nvfp4_packed_dim(head_size)


def nvfp4_kv_cache_split_views(
    kv_cache: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Data and scale views of a packed NVFP4 cache, as upstream vLLM returns them.

    A 5-D cache ``(B, 2, N, H, F)`` gives ``((k_data, v_data), (k_scale, v_scale))``; a 4-D
    side ``(B, N, H, F)`` gives one-element tuples ``((data,), (scale,))``, so that
    ``(data,), (scale,) = nvfp4_kv_cache_split_views(key_cache)`` unpacks it. Data views are
    uint8 ``(B, N, H, D/2)``, scale views float8_e4m3fn ``(B, N, H, D/16)``; NHD and HND are
    read from the strides and kept.
    """
    if kv_cache.dim() == 4:
        data, scale = nvfp4_split_data_scale(kv_cache)
        return (data,), (scale,)
    if kv_cache.dim() == 5 and kv_cache.shape[1] == 2:
        k_data, k_scale = nvfp4_split_data_scale(kv_cache[:, 0])
        v_data, v_scale = nvfp4_split_data_scale(kv_cache[:, 1])
        return (k_data, v_data), (k_scale, v_scale)
    raise ValueError(
        "kv_cache: expected a 4-D side (B, N, H, F) or a 5-D cache (B, 2, N, H, F), "
        f"got shape {tuple(kv_cache.shape)}"
    )


_CACHE_LAYOUT_ORDERS: dict[str, tuple[int, ...]] = {
    "NHD": (0, 1, 2, 3, 4),
    "HND": (0, 1, 3, 2, 4),
    "NHC": (0, 1, 2, 3, 4),
    "HNC": (0, 1, 3, 2, 4),
}
"""Physical dim order of a logical ``(B, 2, N, H, F)`` cache for each ``cache_layout``; upstream
spells the layouts both NHD / HND and (newer code and tests) NHC / HNC."""


def _fill_random(cache: torch.Tensor, cache_dtype: str | torch.dtype | None, bound: float) -> None:
    """Fill ``cache`` with values uniform in ``[-bound, bound]``, stored as its format stores
    them: FP8 caches get the bytes of those values (scale 1), unquantized caches the values."""
    fp8_variant = lookup(cache_dtype).fp8_variant if isinstance(cache_dtype, str) else None
    if fp8_variant is not None:
        values = torch.empty(cache.shape, dtype=torch.float32, device=cache.device)
        values.uniform_(-bound, bound)
        one = torch.ones((), dtype=torch.float32)
        cache.copy_(quantize_fp8(values, one, Fp8Format(fp8_variant)))
    elif cache.dtype.is_floating_point:
        cache.uniform_(-bound, bound)
    else:
        raise ValueError(f"cache_dtype: cannot fill a {cache.dtype} cache for {cache_dtype!r}")


def create_kv_caches_with_random_flash(
    num_blocks: int,
    block_size: int,
    num_layers: int,
    num_heads: int,
    head_size: int,
    cache_dtype: str | torch.dtype | None,
    model_dtype: str | torch.dtype | None = None,
    seed: int | None = None,
    device: str | None = "cuda",
    cache_layout: str | None = "NHD",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random flash-layout caches, one ``(B, 2, N, H, F)`` tensor per layer (upstream's helper).

    Returns ``(key_caches, value_caches)``: per layer the views ``kv[:, 0]`` and ``kv[:, 1]``,
    logical ``(B, N, H, F)``, stored in ``cache_layout`` order (``NHD`` / ``NHC`` token-major,
    ``HND`` / ``HNC`` head-major).
    ``F = head_size`` except for ``nvfp4`` (``F = 9 * head_size / 16``, random bytes).
    Unquantized values are uniform in ``+-head_size**-0.5``; FP8 caches hold those values'
    bytes at scale 1.
    """
    if cache_layout not in _CACHE_LAYOUT_ORDERS:
        raise ValueError(
            f"cache_layout: expected one of {', '.join(_CACHE_LAYOUT_ORDERS)}, got {cache_layout!r}"
        )
    set_random_seed(seed)
    dtype = get_kv_cache_torch_dtype(cache_dtype, model_dtype)
    fmt = lookup(cache_dtype) if isinstance(cache_dtype, str) else None
    # Packed formats (NVFP4) get random bytes: every byte pattern is a valid code there.
    is_packed = fmt is not None and fmt.block_scale_group is not None
    last_dim = fmt.last_dim(head_size) if fmt is not None else head_size
    logical = (num_blocks, 2, block_size, num_heads, last_dim)
    order = _CACHE_LAYOUT_ORDERS[cache_layout]
    physical = tuple(logical[i] for i in order)
    to_logical = [order.index(i) for i in range(len(order))]
    key_caches: list[torch.Tensor] = []
    value_caches: list[torch.Tensor] = []
    for _ in range(num_layers):
        if is_packed:
            raw = torch.randint(0, 256, physical, dtype=torch.uint8, device=device)
        else:
            raw = torch.empty(physical, dtype=dtype, device=device)
            _fill_random(raw, cache_dtype, head_size**-0.5)
        kv = raw.permute(*to_logical)
        key_caches.append(kv[:, 0])
        value_caches.append(kv[:, 1])
    return key_caches, value_caches


def create_kv_caches_with_random(
    num_blocks: int,
    block_size: int,
    num_layers: int,
    num_heads: int,
    head_size: int,
    cache_dtype: str | torch.dtype | None,
    model_dtype: str | torch.dtype | None = None,
    seed: int | None = None,
    device: str | None = "cuda",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random caches in upstream's older paged layout (upstream's helper): per layer a key cache
    ``(B, H, D/x, N, x)`` with ``x = 16 / element size`` and a value cache ``(B, H, D, N)``.

    Values as in :func:`create_kv_caches_with_random_flash`; FP8 needs ``head_size % 16 == 0``;
    NVFP4 has no such layout.
    """
    fmt = lookup(cache_dtype) if isinstance(cache_dtype, str) else None
    if fmt is not None and fmt.block_scale_group is not None:
        raise ValueError(
            f"cache_dtype: {cache_dtype} has no (B, H, D/x, N, x) layout; use the flash one"
        )
    if fmt is not None and fmt.fp8_variant is not None and head_size % 16:
        raise ValueError(
            f"head_size: an {cache_dtype} cache in this layout needs a multiple of 16, "
            f"got {head_size}"
        )
    set_random_seed(seed)
    dtype = get_kv_cache_torch_dtype(cache_dtype, model_dtype)
    x = 16 // get_dtype_size(dtype)
    bound = head_size**-0.5
    key_caches: list[torch.Tensor] = []
    value_caches: list[torch.Tensor] = []
    for _ in range(num_layers):
        key_cache = torch.empty(
            (num_blocks, num_heads, head_size // x, block_size, x), dtype=dtype, device=device
        )
        _fill_random(key_cache, cache_dtype, bound)
        key_caches.append(key_cache)
    for _ in range(num_layers):
        value_cache = torch.empty(
            (num_blocks, num_heads, head_size, block_size), dtype=dtype, device=device
        )
        _fill_random(value_cache, cache_dtype, bound)
        value_caches.append(value_cache)
    return key_caches, value_caches
