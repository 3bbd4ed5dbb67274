"""The format comparison harness of the KV-cache formats (``vllm-kv check``, docs/accuracy.md).

The pipeline, one step a module, each step replaceable so that a test can inject a fault:

1. K/V to test with, as :class:`~vllm.accuracy.samples.KVSample` (queries, bf16 keys and
   values of one layer): :mod:`vllm.accuracy.synthetic` (seeded, LLM-like), or any source of
   samples, such as the real-model activations of the separate ``real_kv_samples`` package
   (``vllm-kv check --real``).
2. :mod:`vllm.accuracy.formats`: the cache formats under test and their data-derived scales.
3. :mod:`vllm.accuracy.cache_io`: write K/V into a paged cache (through
   ``reshape_and_cache_flash`` or the reference codecs) as a
   :class:`~vllm.accuracy.paged_cache.PagedCache`, and pick the reader that reads it back:
   :mod:`vllm.accuracy.codec_reader` (the reference codecs) or
   :mod:`vllm.accuracy.backend_reader` (the reference attention backend).
4. :mod:`vllm.accuracy.metrics`: reconstruction and attention-output error from
   (original K/V, cache, reader); :mod:`vllm.accuracy.attention` holds the fp32 reference math.
5. :mod:`vllm.accuracy.runner`: every format over every sample, with a ``tamper`` hook between
   writing and reading; tables and JSON.
"""
