"""The GPU prefill path (app/engine/prefill_plan.py: decode rows through the decode kernel, quantized
pages through the dense scratch) against the float32 torch path over the same pages, on an H200.

Skipped without CUDA (CI has none); run on the GPU machine with
`TRITON_INTERPRET=0 python3 -m pytest -q tests/test_prefill_gpu.py`. Steps: first chunks, chunks over a
cached context that ends on a page boundary (256) and inside a page (300 + 27), mixed with decodes;
GQA groups of 4 and 8, head_dim 64 and 128; a scratch of 64 blocks, so the long sequences go in groups.
Bound as the interpreted prefill tests': 1e-2 (bf16 operands and outputs against float32).
"""

import random

import pytest
import torch

from app.engine.attention import AttentionMetadata
from app.engine.kv_cache import KVCacheSpec, create_kv_cache
from app.kernels import paged
from kernels_testing import paged_step, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or paged.interpreting(),
                                reason="needs CUDA (and TRITON_INTERPRET unset)")

STEPS = ([256, 300, 17, 40], [33, 27, 1, 1], [1, 512, 1, 64], [1, 1, 1, 1])  # new tokens per sequence


def _cuda(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=meta.slot_mapping.cuda(), block_tables=meta.block_tables.cuda(),
                             seq_lens=meta.seq_lens, query_start_loc=meta.query_start_loc)


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(8, 4, 128), (2, 8, 128), (2, 4, 64), (1, 8, 64)])
def test_prefill_path_matches_float32_reference_on_gpu(kv, num_kv_heads, group, head_dim):
    spec = KVCacheSpec(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                       compute_dtype=torch.bfloat16)
    need = [-(-sum(s[i] for s in STEPS) // 16) for i in range(4)]
    ids = list(range(sum(need) + 3))
    random.Random(0).shuffle(ids)
    tables, start = [], 0
    for n in need:
        tables.append(ids[start:start + n])
        start += n
    cache = create_kv_cache(kv, spec, len(ids), "cuda")
    assert cache.kernels_enabled()
    cache.scratch_tokens = 64 * 16
    gen = torch.Generator().manual_seed(1)
    computed = [0, 0, 0, 0]
    for new in STEPS:
        meta, q, k, v = paged_step(tables, computed, new, spec, num_kv_heads * group, gen)
        meta, q, k, v = _cuda(meta), q.cuda(), k.cuda(), v.cuda()
        cache.store(0, k, v, meta.slot_mapping)
        got = cache.attention(0, q, meta, head_dim ** -0.5)
        want = cache._attend(0, q, meta, head_dim ** -0.5, cache.read_exact)
        assert rel_err(got, want) < 1e-2, (kv, new)
        computed = [c + n for c, n in zip(computed, new)]
