"""The CPU extension of the paged KV cache (app/kernels/cpu_kernels.py) against the torch reference.

The same steps go through two caches of each format, one on the extension (what the CPU runs by
default), one with `use_cpu_kernels = False` (the torch reference): a ragged prefill, a step of
decodes, a mixed step and a long chunk over earlier context. Stored pages are equal bit for bit;
attention over the same pages agrees to the rounding of the compute dtype (the extension's decode
reads exact page values in float32; its prefill attends in the compute dtype, as the GPU does).
"""

import math

import pytest
import torch

from app.engine.attention import AttentionMetadata
from app.engine.kv_cache import KVCacheSpec, create_kv_cache
from app.kernels import cpu_kernels
from app.kernels.fp4 import FP4Format
from kernels_testing import DEFAULT_FP4, FORMATS, keys_like_llama, paged_step, rel_err

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no CPU extension: {cpu_kernels.problem()}")

CASES = {
    **{name: kv for name, kv in FORMATS.items() if name != "fp4-zscore"},
    "fp16": ("fp16", (None, None)),
    "fp32": ("fp32", (None, None)),
    "fp4-rotated": ("fp4", tuple(FP4Format(group_size=f.group_size, outliers=f.outliers, rotate=True,
                                           scale_targets=f.scale_targets) for f in DEFAULT_FP4)),
    "fp4-g16-8-outliers": ("fp4", (FP4Format(group_size=16, outliers=8, scale_targets=(6.0, 4.0)),
                                   FP4Format(group_size=16, outliers=2))),
    # groups of 8: on AVX2 CPUs the decode reads rows through load() (vload8 needs groups of 16k)
    "fp4-g8": ("fp4", (FP4Format(group_size=8, outliers=1), FP4Format(group_size=8))),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("head_dim,block_size,num_heads,dtype", [
    (64, 16, 8, torch.bfloat16),  # GQA 4, the default block size
    (128, 4, 2, torch.bfloat16),  # MHA, small blocks: a tile spans several blocks
    (8, 16, 8, torch.float32),  # stories260K's shape (head_dim 8, float32 compute)
    (12, 16, 4, torch.float32),  # head_dim not a multiple of 8: the decode's plain C++ loop on any CPU
], ids=["d64-bs16-gqa4", "d128-bs4-mha", "d8-fp32", "d12-fp32"])
def test_cpu_extension_matches_the_torch_reference(name, head_dim, block_size, num_heads, dtype):
    kv, formats = CASES[name]
    if formats[0] is not None and formats[0].rotate and head_dim & (head_dim - 1):
        pytest.skip("rotation needs a power-of-two head_dim")
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=head_dim, block_size=block_size, compute_dtype=dtype)
    ext, ref = (create_kv_cache(kv, spec, 3 * 160 // block_size, "cpu", formats) for _ in range(2))
    assert ext.cpu_kernels_enabled()
    ref.use_cpu_kernels = False
    gen = torch.Generator().manual_seed(0)
    per_seq = 160 // block_size  # blocks per sequence: up to 160 tokens
    tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1] for i in range(3)]  # scattered, reversed
    computed = [0, 0, 0]
    # ragged prefill, decodes, mixed, long chunks over earlier context beside decodes (the last
    # one over 77 earlier tokens: in bf16 the first 64 are attended in full, 13 join the causal part)
    for new in ([20, 5, 33], [1, 1, 1], [7, 1, 1], [1, 70, 1], [1, 50, 1]):
        meta, q, k, v = paged_step(tables, computed, new, spec, num_heads, gen)
        ext.store(1, k, v, meta.slot_mapping)
        ref.store(1, k, v, meta.slot_mapping)
        for got, want in zip(ext.layer_pages(1), ref.layer_pages(1)):
            for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
                assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), "stored pages differ"
        scale = head_dim ** -0.5
        got = ext.attention(1, q, meta, scale).float()
        want = ref.attention(1, q, meta, scale).float()
        decode_rows = [meta.query_start_loc[i] for i, n in enumerate(new) if n == 1]
        # decodes: float32 throughout, as the reference; prefill chunks: the compute dtype's rounding
        if decode_rows:
            assert rel_err(got[decode_rows], want[decode_rows]) < 1e-5 * (1 if dtype == torch.float32 else 300)
        assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
        computed = [c + n for c, n in zip(computed, new)]


def _filled_caches(kv, dtype, num_blocks, n, seed):
    """The extension's cache and the torch reference's (one layer, 2 KV heads of 64, blocks of 16),
    both holding the same n tokens of Llama-like keys at slots 0..n-1; -> (ext, ref, generator)."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, compute_dtype=dtype)
    ext, ref = (create_kv_cache(kv, spec, num_blocks, "cpu") for _ in range(2))
    ref.use_cpu_kernels = False
    gen = torch.Generator().manual_seed(seed)
    k = keys_like_llama(n, 2, 64, gen=gen).bfloat16()
    v = torch.randn(n, 2, 64, generator=gen).bfloat16()
    for cache in (ext, ref):
        cache.store(0, k, v, torch.arange(n))
    return ext, ref, gen


def _step_meta(tables, seq_lens, query_lens):
    """A step's metadata over pages already written (nothing stored): -> (meta, query_start_loc)."""
    qsl = [0]
    for m in query_lens:
        qsl.append(qsl[-1] + m)
    width = max(map(len, tables))
    meta = AttentionMetadata(slot_mapping=torch.full((qsl[-1],), -1),
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             seq_lens=seq_lens, query_start_loc=qsl)
    return meta, qsl


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
def test_long_context_decode_and_shared_blocks(kv, dtype):
    """Decodes of 1,000+ tokens where sequences share their first blocks (prefix-cache hits): the
    pair sharing the most decodes in cascade (the shared blocks once for the group, merged with each one's own
    tokens by log-sum-exp; bf16 compute needs AVX512-BF16, float32 runs on any CPU), the others
    alone; both agree with the reference."""
    ext, ref, gen = _filled_caches(kv, dtype, 200, 1300, seed=1)
    shared = list(range(60))  # 960 tokens
    tables = [shared + list(range(100 + 20 * i, 100 + 20 * i + 22)) for i in range(3)]
    tables[2] = list(range(81))[::-1]  # no sharing
    tables.append(shared[:30] + list(range(140, 160)))  # shares 30 of the blocks, ends in a partial block
    meta, _ = _step_meta(tables, [1200, 1290, 1296, 790], [1, 1, 1, 1])
    q = torch.randn(4, 8, 64, generator=gen).to(dtype)  # GQA 4
    got, want = ext.attention(0, q, meta, 0.125).float(), ref.attention(0, q, meta, 0.125).float()
    if dtype == torch.float32 or cpu_kernels.load().has_prefill_bf16():
        assert ext._cascade_step[1] == [([0, 1], 60)]  # the pair's 60 blocks; 3 (30 of them) alone
    # in bf16 cascade also P and (fp8) the gathered prefix round to bf16, as in prefill
    f32 = dtype == torch.float32
    for i in range(4):
        assert rel_err(got[i], want[i]) < (1e-5 if f32 else 3e-3 if i in (2, 3) else 8e-3)
    ext.cascade_min_tokens = 0  # off: every sequence alone
    alone = ext.attention(0, q, meta, 0.125).float()
    assert rel_err(alone, want) < (1e-5 if f32 else 3e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv", ["bf16", "fp4"])
def test_prefill_chunks_sharing_a_cached_prompt_attend_to_it_together(kv, dtype):
    """Prompts that hit one cached prompt (many agents sending it at once) prefill their new tokens
    in cascade with each other and with decodes on it: the shared blocks once for the group, each
    chunk's own tokens causally, merged by log-sum-exp; a chunk that shares nothing runs alone. All
    agree with the reference, and with cascade off."""
    ext, ref, gen = _filled_caches(kv, dtype, 200, 1500, seed=2)
    shared = list(range(60))  # 960 tokens
    tables = [shared + list(range(100 + 3 * i, 103 + 3 * i)) for i in range(3)]  # + their own blocks
    tables.append(list(range(90))[::-1])  # shares nothing
    # two chunks and a decode on the shared prompt, a chunk alone
    meta, qsl = _step_meta(tables, [960 + 15, 960 + 40, 960 + 33, 1000], [15, 40, 1, 30])
    q = torch.randn(qsl[-1], 8, 64, generator=gen).to(dtype)  # GQA 4
    got, want = ext.attention(0, q, meta, 0.125).float(), ref.attention(0, q, meta, 0.125).float()
    if dtype == torch.float32 or cpu_kernels.load().has_prefill_bf16():
        assert ext._cascade_step[1] == [([0, 1, 2], 60)]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i in range(4):
        assert rel_err(got[qsl[i]:qsl[i + 1]], want[qsl[i]:qsl[i + 1]]) < tol, i
    ext.cascade_min_tokens = 0
    ext._cascade_step = None
    alone = ext.attention(0, q, meta, 0.125).float()
    assert rel_err(alone, want) < tol


def test_a_sequence_sharing_less_does_not_shrink_the_others_cascade():
    """Two prompts A and B that start with one 20-block system prompt, two sequences on each, and a
    newcomer that shares only the system prompt: A's pair cascades over its 60 blocks, B's over its
    45, the newcomer attends alone (it would have cut every group to 20 blocks); all agree with the
    reference."""
    ext, ref, gen = _filled_caches("fp4", torch.float32, 300, 300 * 16, seed=3)
    system = list(range(20))
    a, b = system + list(range(20, 60)), system + list(range(100, 125))
    tables = [a + [200, 201], a + [202], b + [203], b + [204, 205], system + [206, 207]]
    meta, qsl = _step_meta(tables, [60 * 16 + 20, 60 * 16 + 1, 45 * 16 + 1, 45 * 16 + 30, 20 * 16 + 20],
                           [20, 1, 1, 14, 20])
    q = torch.randn(qsl[-1], 4, 64, generator=gen)
    got, want = ext.attention(0, q, meta, 0.125), ref.attention(0, q, meta, 0.125)
    assert ext._cascade_step[1] == [([0, 1], 60), ([2, 3], 45)]
    assert rel_err(got, want) < 1e-5


def test_store_refuses_non_finite_and_writes_nothing():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, compute_dtype=torch.bfloat16)
    for kv in ("fp4", "fp8"):
        cache = create_kv_cache(kv, spec, 4, "cpu")
        before = [t.clone() for t in cache.pages[0]]
        k = torch.randn(3, 1, 64).bfloat16()
        v = k.clone()
        v[2, 0, 5] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            cache.store(0, k, v, torch.arange(3))
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, cache.pages[0]))


def _boundary_groups(n, targets, gen):
    """n groups of 32 float32 values: the group's largest |value| A first, the others within two
    ulps of an E2M1 rounding boundary b (0.25, 0.75, ... 5) times one of the store's candidate
    scales for A (the e4m3 scale A / target, in units of the vector's power-of-two second scale)."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    groups = []
    for _ in range(n):
        amax = float(torch.empty(()).uniform_(0.5, 2.0, generator=gen)) * 2.0 ** int(torch.randint(-6, 7, (), generator=gen))
        second = 2.0 ** math.ceil(math.log2(amax / min(targets) / 448))  # one group per vector: its amax is the top
        scales = [float(torch.tensor(amax / second / t).to(torch.float8_e4m3fn).float()) * second for t in targets]
        s = torch.tensor(scales)[torch.randint(len(scales), (31,), generator=gen)]
        x = bounds[torch.randint(7, (31,), generator=gen)] * s  # exact: few significant bits
        for _ in range(2):  # up to two ulps either way
            step = torch.randint(-1, 2, (31,), generator=gen)
            x = torch.where(step > 0, torch.nextafter(x, torch.tensor(math.inf)),
                            torch.where(step < 0, torch.nextafter(x, torch.tensor(0.0)), x))
        x = torch.where(x < amax, x, torch.full_like(x, amax / 3))
        x = x * torch.where(torch.rand(31, generator=gen) < 0.5, -1.0, 1.0)
        groups.append(torch.cat([torch.tensor([amax]), x]))
    return torch.stack(groups)


def test_fp4_store_codes_at_rounding_boundaries_equal_the_reference():
    """Values whose quotient by a candidate scale lies within ulps of an E2M1 rounding boundary get
    the torch reference's codes and scales, bit for bit (the AVX2 store compares |x| with exact
    per-scale thresholds instead of dividing; a threshold one ulp off would show here)."""
    targets = (6.0, 5.0, 4.5, 4.0)
    fmt = FP4Format(group_size=32, outliers=0, scale_targets=targets)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=32, block_size=16, compute_dtype=torch.float32)
    ext, ref = (create_kv_cache("fp4", spec, 32, "cpu", (fmt, fmt)) for _ in range(2))
    ref.use_cpu_kernels = False
    gen = torch.Generator().manual_seed(0)
    k = _boundary_groups(512, targets, gen).view(512, 1, 32)
    v = -k.flip(0)
    for cache in (ext, ref):
        cache.store(0, k, v, torch.arange(512))
    for got, want in zip(ext.layer_pages(0), ref.layer_pages(0)):
        for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), "stored pages differ"


@pytest.mark.parametrize("head_dim", [64, 36])
def test_fp4_store_outlier_ties_take_the_lowest_index(head_dim):
    """Magnitudes from a handful of values, so that outlier candidates tie (and some vectors hold
    fewer nonzero entries than slots): the extension picks the reference's slots, bit for bit
    (lowest index first among equals, zeros never). head_dim 36: the scalar pick on any CPU."""
    fmt = FP4Format(group_size=8, outliers=8)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=16, compute_dtype=torch.float32)
    ext, ref = (create_kv_cache("fp4", spec, 16, "cpu", (fmt, fmt)) for _ in range(2))
    ref.use_cpu_kernels = False
    gen = torch.Generator().manual_seed(0)
    values = torch.tensor([0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0])
    k = values[torch.randint(7, (256, 2, head_dim), generator=gen)]
    k[:8] *= (torch.rand(8, 2, head_dim, generator=gen) < 0.05)  # mostly zeros: empty slots
    v = k.roll(1, 0)
    for cache in (ext, ref):
        cache.store(0, k, v, torch.arange(256))
    for got, want in zip(ext.layer_pages(0), ref.layer_pages(0)):
        for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), "stored pages differ"


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
def test_stories260k_tokens_equal_the_torch_reference(stories_paths, kv):
    """The engine on the extension gives the torch reference path's greedy tokens, token for token
    (float32 compute; chunked prefill with a prefix-cache hit and a batch of decodes)."""
    from app import LLM, SamplingParams
    from test_engine import PROMPTS

    model, tok = stories_paths
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for use_ext in (True, False):
        llm = LLM(model=model, tokenizer=tok, dtype="float32", kv_cache_dtype=kv, block_size=4,
                  max_num_batched_tokens=32)
        cache = llm.engine.executor.runner.kv_cache
        cache.use_cpu_kernels = use_ext
        assert cache.cpu_kernels_enabled() == use_ext
        outs.append([o.token_ids for o in llm.generate(PROMPTS + PROMPTS[-1:], params)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("k", [64, 172])
def test_padded_projection_keeps_tokens_apart(k):
    """llama.linear pads bf16 rows to a multiple of 64 on the CPU (where the reduction allows it):
    the result is the unpadded product's, and a NaN in one token's row stays in that row."""
    import torch.nn.functional as F

    from app.engine.models.decoder import linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, k, generator=gen).bfloat16()
    for rows in (5, 64, 100):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        torch.testing.assert_close(linear(x, w).float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
        x[1] = float("nan")
        if k % 32 == 0:  # with a reduction tail oneDNN's bf16 kernels leak a NaN row into a
            # neighbour at some row counts by themselves (linear leaves those shapes unpadded)
            assert torch.isnan(linear(x, w)).any(1).nonzero().flatten().tolist() == [1]


def _causal_ref(q, k, v, scale, causal=True):
    """float32 attention of q [nq, H, D] at the last nq of k/v's [nk, KVH, D] positions (causal), or
    of every query over every key; -> (out [nq, H, D], log-sum-exp of the scores [nq, H])."""
    nq, nk, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf, vf = (x.float().repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))
    s = qf @ kf.transpose(1, 2) * scale
    if causal:
        s.masked_fill_(torch.arange(nk)[None, :] > torch.arange(nk - nq, nk)[:, None], float("-inf"))
    return (s.softmax(-1) @ vf).transpose(0, 1), s.logsumexp(-1).transpose(0, 1)


@pytest.mark.parametrize("n,nk,heads,kv_heads,head_dim", [(1, 1, 2, 2, 64), (250, 3200, 2, 2, 64), (7, 300, 9, 3, 64)])
def test_prefix_attention_float32_matches_the_reference(n, nk, heads, kv_heads, head_dim):
    """Cascade decoding's shared-prefix half in float32 compute (torch's flash kernel): the output
    and the log-sum-exp that merge_attention weighs it by."""
    gen = torch.Generator().manual_seed(n + nk)
    q, k, v = (torch.randn(m, h, head_dim, generator=gen) for m, h in ((n, heads), (nk, kv_heads), (nk, kv_heads)))
    k[: nk // 3] *= 4
    out, lse = cpu_kernels.prefix_attention(q, k, v, head_dim ** -0.5)
    ref, ref_lse = _causal_ref(q, k, v, head_dim ** -0.5, causal=False)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == q.shape[:2]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.load().has_prefill_bf16(),
                    reason="no AVX512-BF16 prefill on this CPU")
@pytest.mark.parametrize("nq,nk,heads,kv_heads,head_dim", [
    (1, 1, 2, 2, 64), (5, 5, 2, 2, 64), (37, 100, 2, 2, 64),  # a row block, a key tile, a partial tile
    (200, 1000, 9, 3, 64),  # GQA 3 (SmolLM2's heads): rows of three heads per token, blocks across tokens
    (64, 64, 4, 1, 128), (130, 300, 2, 2, 128), (3, 260, 2, 1, 192), (33, 33, 1, 1, 256),
])
def test_prefill_bf16_matches_the_float32_reference(nq, nk, heads, kv_heads, head_dim):
    """The extension's bf16 flash loop (the CPU's bf16 prefill) agrees with float32 attention to bf16
    rounding, as torch's flash kernel does, over causal limits that cut key tiles anywhere."""
    gen = torch.Generator().manual_seed(nq * 1000 + nk)
    q, k, v = (torch.randn(n, h, head_dim, generator=gen).bfloat16() for n, h in
               ((nq, heads), (nk, kv_heads), (nk, kv_heads)))
    k[: nk // 3] *= 4  # a spread of score magnitudes: the online softmax rescales
    scale = head_dim ** -0.5
    out = cpu_kernels.prefill(q, k, v, scale)
    ref, _ = _causal_ref(q, k, v, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    assert rel_err(out.float(), ref) < 8e-3
    # unmasked, float32 out and the log-sum-exp (cascade decoding's shared-prefix half)
    out, lse = cpu_kernels.prefix_attention(q, k, v, scale)
    ref, ref_lse = _causal_ref(q, k, v, scale, causal=False)
    assert out.dtype == torch.float32 and rel_err(out, ref) < 8e-3
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.load().has_prefill_bf16(),
                    reason="no AVX512-BF16 prefill on this CPU")
def test_prefill_bf16_refuses_bad_shapes():
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    kv = torch.zeros(3, 2, 64, dtype=torch.bfloat16)  # fewer keys than queries
    with pytest.raises(RuntimeError, match="head_dim"):
        cpu_kernels.load().prefill_bf16(torch.empty_like(q), q, kv, kv, 1.0, True, torch.empty(0))
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.load().prefill_bf16(torch.empty_like(q), q.float(), kv, kv, 1.0, True, torch.empty(0))
    with pytest.raises(RuntimeError, match="lse"):
        cpu_kernels.load().prefill_bf16(torch.empty_like(q), q, kv, kv, 1.0, False, torch.empty(3))


def test_silu_and_mul_vector_loop_equals_its_scalar_loop():
    """float32 rows go 8 at a time through fast_exp8 where the CPU has AVX2 (the rest, and rows
    shorter than 8, through the scalar loop): the same operations, so the same bits."""
    gen = torch.Generator().manual_seed(0)
    g, u = torch.randn(2, 4099, generator=gen) * 6
    g[:8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30, 87.0, -90.0])
    rows = cpu_kernels.silu_and_mul(torch.cat([g, u])[None])[0]  # one long row
    single = cpu_kernels.silu_and_mul(torch.stack([g, u], 1))[:, 0]  # 4099 rows of one element
    assert torch.equal(rows, single)
    assert rel_err(rows, torch.nn.functional.silu(g) * u) < 1e-6


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the CPU extension")
def test_kernels_release_the_gil():
    """A replica's event loop shares the process with the engine thread: while a kernel runs, other
    Python threads run (they stalled for the whole kernel while it held the GIL)."""
    import threading
    import time

    x = torch.randn(2, 2 * 8_000_000)  # silu_and_mul over 16M values: tens of ms a call
    busy = threading.Event()

    def kernel() -> None:
        busy.set()
        for _ in range(5):
            cpu_kernels.silu_and_mul(x)
        busy.clear()

    t = threading.Thread(target=kernel)
    start = time.perf_counter()
    t.start()
    busy.wait()
    ticks = 0
    while busy.is_set():  # Python work in this thread meanwhile
        ticks += 1
        time.sleep(0.001)
    t.join()
    elapsed = time.perf_counter() - start
    # free, this thread ticks about once a ms (181 in 0.20 s on the 2-core VM); while the kernels held
    # the GIL it got a turn only between their calls and at Python's switch interval (22 in 0.23 s)
    assert elapsed > 0.05 and ticks >= 0.3 * elapsed / 0.001, (ticks, elapsed)
