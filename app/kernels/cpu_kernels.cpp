// The CPU path's kernels: paged attention over dense, fp8 and fp4 pages read and dequantized inside
// the loop, the K/V stores, and the Llama layer's elementwise ops fused one pass each.
//
// Built on first use by app/kernels/cpu_kernels.py (torch.utils.cpp_extension.load); the torch
// reference in app/kernels/attention_ref.py is the ground truth it is tested against.
//
//   decode(...)  one new token per sequence: a loop per (sequence, KV head) over the sequence's
//                tokens in tiles of TILE, each token's K and V dequantized in registers or a small
//                float buffer (AVX-512: 16-wide rows; AVX2: 8-wide rows; plain C++: the tile's K
//                transposed, so its scores are TILE-wide FMAs), an online softmax, and P x V
//                accumulated in float. The context is never materialized.
//   gather(...)  the listed blocks dequantized into [n * block_size, H, D] of the compute dtype,
//                for prefill chunks, whose attention then runs in torch's fused CPU kernel.
//
// Page layouts are those of app/kernels/paged.py: every array [num_blocks, block_size, H, ...],
// contiguous. fp4: codes [.., D/2] uint8 (element 2i low nibble), scales [.., D/G] e4m3, scale_exp
// [..] uint8 (2^(e - 127)), out_vals [.., k] bf16, out_idx [.., k] uint8 (added to the codes' value).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define APP_AVX512 1
#if defined(__AVX512BF16__)
#define APP_AVX512_BF16 1  // bf16 pair dot products (vdpbf16ps): the bf16 decode and prefill loops
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define APP_AVX2 1  // CPUs without AVX-512 (e.g. Zen 1-3): 8-wide decode rows, fp4 store and dequantization
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int TILE = 16;  // tokens per tile of the decode loop (one AVX-512 vector of floats)

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline float pow2(int e) {  // 2^e, exact for normal results
  return e >= -126 && e <= 127 ? bits_to_float(uint32_t(e + 127) << 23) : std::ldexp(1.0f, e);
}

float e4m3_to_float(uint8_t b) {  // float8_e4m3fn: no infinities, 0x7f / 0xff are NaN
  const int s = b >> 7, e = (b >> 3) & 0xF, m = b & 0x7;
  float v;
  if (e == 0xF && m == 0x7) v = NAN;
  else if (e == 0) v = std::ldexp(float(m), -9);  // subnormal: m / 8 * 2^-6
  else v = std::ldexp(1.0f + m / 8.0f, e - 7);
  return s ? -v : v;
}

// E2M1 magnitudes by 3-bit code (the sign is bit 3 of a code).
constexpr float kE2M1[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

struct Tables {
  float e4m3[256];
  float e2m1_pair[256][2];  // byte -> (low nibble value, high nibble value)
  Tables() {
    auto code = [&](int c) { return (c & 8) ? -kE2M1[c & 7] : kE2M1[c & 7]; };
    for (int b = 0; b < 256; ++b) {
      e4m3[b] = e4m3_to_float(uint8_t(b));
      e2m1_pair[b][0] = code(b & 0xF);
      e2m1_pair[b][1] = code(b >> 4);
    }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

// exp(x) for x <= 0 (scores minus their running max), vectorizable: 2^(x log2 e) split into an
// integer power built in the exponent bits and a degree-6 polynomial on [-0.5, 0.5] (rel. err ~2e-7).
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// fast_exp for 8 floats, the same operations (the polynomial's steps as FMAs, as the compiler
// contracts the scalar ones).
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#ifdef APP_AVX512
// 16 e4m3 bytes -> floats, each the e4m3 value x 2^-8: the bits moved into fp16 (sign, then the
// exponent and mantissa fields one place lower: the bias differs by 8), subnormals included.
inline __m512 e4m3x16_times_2m8(__m128i b) {
  const __m256i w = _mm256_cvtepu8_epi16(b);
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_cvtph_ps(bits);
}
#endif

// One tile of the online softmax: scores sg[0, n) become probabilities (0 up to TILE) against the
// running max m, and l their running sum; returns what the accumulator must be multiplied by.
inline float softmax_tile(float* sg, int n, float& m, float& l) {
  float mx = m;
  for (int t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
  const float corr = fast_exp(m - mx);
  m = mx;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int t = 0; t < TILE; ++t) {
    const float p = t < n ? fast_exp(sg[t] - mx) : 0.0f;
    sg[t] = p;
    sum += p;
  }
  l = l * corr + sum;
  return corr;
}

// What the decode's vector path asks of a reader besides vload (x[0 .. D/16) <- the row in the
// order pos() gives, times the returned factor): dense and fp8 rows keep their order, no outliers.
struct InOrderRows {
  static constexpr bool kVec8 = false;  // no load_pos (decode_one_avx2 calls load)
  static int pos(int e) { return e; }
  bool vec_ok(int D) const { return D % 16 == 0 && D <= 256; }
  int num_outliers() const { return 0; }
  void outlier(int64_t, int64_t, int, int&, float&) const {}
#ifdef APP_AVX512
  __mmask16 voutliers(int64_t, int64_t, __m512i&, __m512&) const { return 0; }
#endif
};

// A reader turns (slot, head) into head_dim floats. slot = block_id * block_size + offset.
struct DenseReader : InOrderRows {
  const void* base;
  at::ScalarType dtype;
  int64_t row;  // elements per (slot, head) row: head_dim
  int64_t heads;
  void load(int64_t slot, int64_t h, float* dst, int D) const {
    const int64_t at = (slot * heads + h) * row;
    if (dtype == at::kBFloat16) {
      const uint16_t* p = static_cast<const uint16_t*>(base) + at;
      int d = 0;
#ifdef APP_AVX2
      for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(
                                      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + d))), 16)));
#endif
      for (; d < D; ++d) dst[d] = bf16_to_float(p[d]);
    } else if (dtype == at::kHalf) {
      const at::Half* p = static_cast<const at::Half*>(base) + at;
      for (int d = 0; d < D; ++d) dst[d] = float(p[d]);
    } else {
      const float* p = static_cast<const float*>(base) + at;
      for (int d = 0; d < D; ++d) dst[d] = p[d];
    }
  }
#ifdef APP_AVX512
  float vload(int64_t slot, int64_t h, __m512* x, int D) const {
    const int64_t at = (slot * heads + h) * row;
    if (dtype == at::kBFloat16) {
      const uint16_t* p = static_cast<const uint16_t*>(base) + at;
      for (int v = 0; v < D / 16; ++v)
        x[v] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * v))), 16));
    } else if (dtype == at::kHalf) {
      const uint16_t* p = static_cast<const uint16_t*>(base) + at;
      for (int v = 0; v < D / 16; ++v) x[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * v)));
    } else {
      const float* p = static_cast<const float*>(base) + at;
      for (int v = 0; v < D / 16; ++v) x[v] = _mm512_loadu_ps(p + 16 * v);
    }
    return 1.0f;
  }
#endif
};

struct FP8Reader : InOrderRows {
  const uint8_t* values;  // [slots, H, D]
  const float* scale;     // [slots, H]
  int64_t heads;
  void load(int64_t slot, int64_t h, float* dst, int D) const {
    const float* lut = tables().e4m3;
    const int64_t r = slot * heads + h;
    const uint8_t* p = values + r * D;
    const float s = scale[r];
    for (int d = 0; d < D; ++d) dst[d] = lut[p[d]] * s;
  }
#ifdef APP_AVX512
  float vload(int64_t slot, int64_t h, __m512* x, int D) const {
    const int64_t r = slot * heads + h;
    const uint8_t* p = values + r * D;
    for (int v = 0; v < D / 16; ++v) x[v] = e4m3x16_times_2m8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v)));
    return scale[r] * 256.0f;
  }
#endif
};

#ifdef APP_AVX2
// The sum and the maximum of an 8-float vector's lanes.
inline float hsum8(__m256 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}
inline float hmax8(__m256 a) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// 4 code bytes -> their 8 E2M1 values in order (element 2i: the low nibble of byte i), unscaled.
inline __m256 e2m1x8(const uint8_t* c) {
  uint32_t w;
  std::memcpy(&w, c, 4);
  const __m128i twice = _mm_shuffle_epi8(_mm_cvtsi32_si128(int(w)),
                                         _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
  // lane j: code j in its low 4 bits (bits above are ignored by the permute and the sign's mask)
  const __m256i v = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(twice), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  const __m256 mag = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kE2M1), v);  // by the low 3 bits
  const __m256 sign = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 28), _mm256_set1_epi32(INT32_MIN)));
  return _mm256_xor_ps(mag, sign);
}
#endif

struct FP4Reader {
  const uint8_t* codes;      // [slots, H, D/2]
  const uint8_t* scales;     // [slots, H, D/G] e4m3
  const uint8_t* scale_exp;  // [slots, H]
  const uint16_t* out_vals;  // [slots, H, k] bf16
  const uint8_t* out_idx;    // [slots, H, k]
  int64_t heads;
  int group;
  int outliers;
  int row_groups;              // head_dim / group, kept so that reading a row divides nothing
  int32_t lane_group[8 * 16];  // [run b][lane j]: (32b + 2j) / group, for the vector path
  uint8_t half_group[16];      // [i]: 16 i / group, the group of elements [16 i, 16 i + 16) (load_pos)
  void set_lanes() {
    for (int i = 0; i < 8 * 16; ++i) lane_group[i] = std::min(15, (32 * (i / 16) + 2 * (i % 16)) / group);
    for (int i = 0; i < 16; ++i) half_group[i] = uint8_t(std::min(255, 16 * i / group));
  }
  void load(int64_t slot, int64_t h, float* dst, int D) const {
    const Tables& t = tables();
    const int64_t r = slot * heads + h;
    const uint8_t* c = codes + r * (D / 2);
    const uint8_t* s = scales + r * row_groups;
    const float second = pow2(int(scale_exp[r]) - 127);
#ifdef APP_AVX2
    if (group % 8 == 0) {  // 8 values per step, the same products as below
      for (int g = 0; g < row_groups; ++g) {
        const __m256 sg = _mm256_set1_ps(t.e4m3[s[g]] * second);
        for (int i = 0; i < group; i += 8)
          _mm256_storeu_ps(dst + g * group + i, _mm256_mul_ps(e2m1x8(c + (g * group + i) / 2), sg));
      }
      for (int k = 0; k < outliers; ++k)
        dst[out_idx[r * outliers + k]] += bf16_to_float(out_vals[r * outliers + k]);
      return;
    }
#endif
    for (int g = 0; g < row_groups; ++g) {
      const float sg = t.e4m3[s[g]] * second;
      for (int i = 0; i < group / 2; ++i) {
        const uint8_t b = c[g * group / 2 + i];
        dst[g * group + 2 * i] = t.e2m1_pair[b][0] * sg;
        dst[g * group + 2 * i + 1] = t.e2m1_pair[b][1] * sg;
      }
    }
    for (int k = 0; k < outliers; ++k)
      dst[out_idx[r * outliers + k]] += bf16_to_float(out_vals[r * outliers + k]);
  }
  // The vector paths read 16 code bytes (32 elements) at a time: lanes j hold elements 2j (low
  // nibbles) and 2j + 1 (high nibbles), so each run of 32 elements is stored evens first.
  static int pos(int e) { return 32 * (e / 32) + (e % 2) * 16 + (e % 32) / 2; }
  static constexpr bool kVec8 = true;
#ifdef APP_AVX2
  // The 8-wide row load: dst[0, D) <- the row in pos() order, outliers not added. 16 code bytes
  // split into nibbles, mapped to 2x their E2M1 value as int8 by one byte shuffle each, widened to
  // floats and multiplied by half their group's scale (the same products as load's, exactly).
  // Vector 4b + j holds elements 32b + 16 (j % 2) + 2i + j / 2 (i < 8): one group each when the
  // group is a multiple of 16.
  bool vec8_ok(int D) const { return D % 32 == 0 && D <= 256 && group % 16 == 0; }
  void load_pos(int64_t slot, int64_t h, float* dst, int D) const {
    const Tables& t = tables();
    const int64_t r = slot * heads + h;
    const uint8_t* c = codes + r * (D / 2);
    const uint8_t* s = scales + r * row_groups;
    const float half = pow2(int(scale_exp[r]) - 127) * 0.5f;
    const __m128i twice = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    auto put = [](float* p, __m128i b8, __m256 sc) {
      _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8)), sc));
    };
    for (int b = 0; b < D / 32; ++b) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * b));
      const __m128i lo = _mm_shuffle_epi8(twice, _mm_and_si128(v, low4));
      const __m128i hi = _mm_shuffle_epi8(twice, _mm_and_si128(_mm_srli_epi16(v, 4), low4));
      const __m256 s0 = _mm256_set1_ps(t.e4m3[s[half_group[2 * b]]] * half);
      const __m256 s1 = _mm256_set1_ps(t.e4m3[s[half_group[2 * b + 1]]] * half);
      float* p = dst + 32 * b;
      put(p, lo, s0);
      put(p + 8, _mm_unpackhi_epi64(lo, lo), s1);
      put(p + 16, hi, s0);
      put(p + 24, _mm_unpackhi_epi64(hi, hi), s1);
    }
  }
#endif
  bool vec_ok(int D) const { return D % 32 == 0 && D <= 256 && D / group <= 16 && outliers <= 16; }
  int num_outliers() const { return outliers; }
  void outlier(int64_t slot, int64_t h, int k, int& idx, float& val) const {
    const int64_t r = (slot * heads + h) * outliers + k;
    idx = out_idx[r];
    val = bf16_to_float(out_vals[r]);
  }
#ifdef APP_AVX512
  float vload(int64_t slot, int64_t h, __m512* x, int D) const {
    const int64_t r = slot * heads + h;
    const int ng = row_groups;
    const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f,
                                        -4.f, -6.f);
    // the group scales (x 2^-8), one per lane of a 16-float vector
    const __m512 sv = e4m3x16_times_2m8(_mm_maskz_loadu_epi8(__mmask16((1u << ng) - 1), scales + r * ng));
    const uint8_t* c = codes + r * (D / 2);
    for (int b = 0; b < D / 32; ++b) {
      // lane j of run b holds elements 32b + 2j and 32b + 2j + 1, both of group lane_group[b][j]
      const __m512 lane_scale = _mm512_permutexvar_ps(_mm512_loadu_si512(lane_group + 16 * b), sv);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * b)));
      x[2 * b] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)), table), lane_scale);
      x[2 * b + 1] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table), lane_scale);
    }
    return pow2(int(scale_exp[r]) - 127 + 8);
  }
  // The outliers as vectors: lanes < num_outliers() hold pos(index) and the value.
  __mmask16 voutliers(int64_t slot, int64_t h, __m512i& where, __m512& val) const {
    const int64_t r = (slot * heads + h) * outliers;
    const __mmask16 mask = __mmask16((1u << outliers) - 1);
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, out_idx + r));
    // pos(e) = 32 (e / 32) + (e % 2) 16 + (e % 32) / 2
    where = _mm512_add_epi32(
        _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(idx, 5), 5),
                         _mm512_slli_epi32(_mm512_and_si512(idx, _mm512_set1_epi32(1)), 4)),
        _mm512_srli_epi32(_mm512_and_si512(idx, _mm512_set1_epi32(31)), 1));
    val = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, out_vals + r)), 16));
    return mask;
  }
#endif
};

void load_query(const at::Tensor& q, int64_t row, int64_t head0, int G, int D, float scale, float* dst) {
  for (int g = 0; g < G; ++g) {
    const int64_t at = (row * q.size(1) + head0 + g) * D;
    if (q.scalar_type() == at::kBFloat16) {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(q.data_ptr()) + at;
      for (int d = 0; d < D; ++d) dst[g * D + d] = bf16_to_float(p[d]) * scale;
    } else if (q.scalar_type() == at::kHalf) {
      const at::Half* p = q.data_ptr<at::Half>() + at;
      for (int d = 0; d < D; ++d) dst[g * D + d] = float(p[d]) * scale;
    } else {
      const float* p = q.data_ptr<float>() + at;
      for (int d = 0; d < D; ++d) dst[g * D + d] = p[d] * scale;
    }
  }
}

// lse (when given, [T, H] float32): the log of the softmax's denominator, m + log(l), for merging
// with attention over other keys.
void store_out(at::Tensor& out, int64_t row, int64_t head0, int G, int D, const float* acc, const float* l,
               const float* m, float* lse) {
  for (int g = 0; g < G; ++g) {
    if (lse) lse[row * out.size(1) + head0 + g] = m[g] + std::log(l[g]);
    const int64_t at = (row * out.size(1) + head0 + g) * D;
    const float inv = 1.0f / l[g];
    if (out.scalar_type() == at::kBFloat16) {
      at::BFloat16* p = out.data_ptr<at::BFloat16>() + at;
      for (int d = 0; d < D; ++d) p[d] = at::BFloat16(acc[g * D + d] * inv);
    } else if (out.scalar_type() == at::kHalf) {
      at::Half* p = out.data_ptr<at::Half>() + at;
      for (int d = 0; d < D; ++d) p[d] = at::Half(acc[g * D + d] * inv);
    } else {
      float* p = out.data_ptr<float>() + at;
      for (int d = 0; d < D; ++d) p[d] = acc[g * D + d] * inv;
    }
  }
}

// [G, D] rows between natural order and a reader's pos() order (the vector paths keep q and the
// accumulator in the order their rows come in): to[g, pos(e)] = from[g, e], and back.
template <typename R>
void to_pos_order(const float* from, float* to, int G, int D) {
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < D; ++e) to[g * D + R::pos(e)] = from[g * D + e];
}
template <typename R>
void from_pos_order(const float* from, float* to, int G, int D) {
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < D; ++e) to[g * D + e] = from[g * D + R::pos(e)];
}

// The online softmax's state before the first tile: accumulators [G, D] zero, maxima [G] -1e30, sums [G] 0.
inline void start_softmax(float* acc, float* m, float* l, int G, int D) {
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m, m + G, -1e30f);
  std::fill(l, l + G, 0.0f);
}

// Block tables, int32 or int64 [num_seqs, max_blocks] (any row stride), read without tensor calls.
struct BlockTable {
  const int32_t* t32;
  const int64_t* t64;
  int64_t stride;
  explicit BlockTable(const at::Tensor& t)
      : t32(t.scalar_type() == at::kInt ? t.data_ptr<int32_t>() : nullptr),
        t64(t.scalar_type() == at::kInt ? nullptr : t.data_ptr<int64_t>()), stride(t.stride(0)) {
    TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "block tables: int32 or int64");
    TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, "block tables: [num_seqs, max_blocks], rows contiguous");
  }
  int64_t operator()(int64_t i, int64_t j) const { return t32 ? t32[i * stride + j] : t64[i * stride + j]; }
  // The page slot of sequence i's token at position pos.
  int64_t slot(int64_t i, int64_t pos, int block_size) const { return (*this)(i, pos / block_size) * block_size + pos % block_size; }
};

// One (sequence, KV head): its G query heads attend to its seq_len tokens.
template <typename KR, typename VR>
void decode_one(const KR& kr, const VR& vr, const at::Tensor& q, at::Tensor& out, const BlockTable& tables,
                int64_t seq, int64_t row, int64_t seq_len, int64_t kv_head, int G, int D, int block_size,
                float scale, std::vector<float>& buf, float* lse) {
  float* qv = buf.data();            // [G, D]
  float* acc = qv + G * D;           // [G, D]
  float* kt = acc + G * D;           // [D, TILE]: K of the tile, transposed
  float* vt = kt + D * TILE;         // [TILE, D]
  float* s = vt + TILE * D;          // [G, TILE]
  float* m = s + G * TILE;           // [G]
  float* l = m + G;                  // [G]
  float* krow = l + G;               // [D]
  load_query(q, row, kv_head * G, G, D, scale, qv);
  start_softmax(acc, m, l, G, D);
  for (int64_t t0 = 0; t0 < seq_len; t0 += TILE) {
    const int n = int(std::min<int64_t>(TILE, seq_len - t0));
    for (int t = 0; t < n; ++t) {
      const int64_t pos = t0 + t;
      const int64_t slot = tables.slot(seq, pos, block_size);
      kr.load(slot, kv_head, krow, D);
      for (int d = 0; d < D; ++d) kt[d * TILE + t] = krow[d];
      vr.load(slot, kv_head, vt + t * D, D);
    }
    for (int t = n; t < TILE; ++t)
      for (int d = 0; d < D; ++d) kt[d * TILE + t] = 0.0f;
    for (int g = 0; g < G; ++g) {
      float* sg = s + g * TILE;
      for (int t = 0; t < TILE; ++t) sg[t] = 0.0f;
      for (int d = 0; d < D; ++d) {
        const float qd = qv[g * D + d];
        const float* kd = kt + d * TILE;
#pragma omp simd
        for (int t = 0; t < TILE; ++t) sg[t] += qd * kd[t];
      }
      const float corr = softmax_tile(sg, n, m[g], l[g]);
      float* ag = acc + g * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) ag[d] *= corr;
      for (int t = 0; t < n; ++t) {
        const float p = sg[t];
        const float* vrow = vt + t * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) ag[d] += p * vrow[d];
      }
    }
  }
  store_out(out, row, kv_head * G, G, D, acc, l, m, lse);
}

#ifdef APP_AVX512
// lanes t of the result = the sum of a[t]'s lanes (a[0, 16) is overwritten): pairs of vectors
// halve into one at each of four levels (8 + 4 + 2 + 1 two-source permutes and adds).
inline __m512 hsum16(__m512* a) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int n = 16; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i)
      a[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], even, a[2 * i + 1]),
                           _mm512_permutex2var_ps(a[2 * i], odd, a[2 * i + 1]));
  return a[0];
}

// The same as decode_one with AVX-512 rows: each token's K and V come in as D/16 vectors (codes
// mapped to values by a permute, the group scales one multiply per 16 values), the score is one
// FMA per vector and a horizontal add, P x V one FMA per vector; q and the accumulator live in
// the readers' element order (pos()), the output is put back in order at the end.
template <typename KR, typename VR>
void decode_one_vec(const KR& kr, const VR& vr, const at::Tensor& q, at::Tensor& out, const BlockTable& tables,
                    int64_t seq, int64_t row, int64_t seq_len, int64_t kv_head, int G, int D, int block_size,
                    float scale, std::vector<float>& buf, float* lse) {
  const int nv = D / 16;
  float* qn = buf.data();      // [G, D] natural order
  float* qp = qn + G * D;      // [G, D] in K's order
  float* acc = qp + G * D;     // [G, D] in V's order
  float* s = acc + G * D;      // [G, TILE]
  float* m = s + G * TILE;     // [G]
  float* l = m + G;            // [G]
  float* vt = l + G;           // [TILE, D]: the tile's V rows (factor applied), in V's order
  float* av = vt + TILE * D;   // [G, TILE, 16]: each token's 16 partial scores, summed by hsum16
  load_query(q, row, kv_head * G, G, D, scale, qn);
  to_pos_order<KR>(qn, qp, G, D);
  start_softmax(acc, m, l, G, D);
  const int ko = kr.num_outliers(), vo = vr.num_outliers();
  __m512 x[16];
  int64_t slots[TILE];
  for (int64_t t0 = 0; t0 < seq_len; t0 += TILE) {
    const int n = int(std::min<int64_t>(TILE, seq_len - t0));
    for (int t = 0; t < n; ++t) {
      const int64_t p = t0 + t;
      slots[t] = tables.slot(seq, p, block_size);
      const float f = kr.vload(slots[t], kv_head, x, D);
      __m512i opos = _mm512_setzero_si512();
      __m512 oval = _mm512_setzero_ps();
      const __mmask16 omask = ko ? kr.voutliers(slots[t], kv_head, opos, oval) : __mmask16(0);
      for (int g = 0; g < G; ++g) {
        const float* qg = qp + g * D;
        __m512 a = _mm512_mul_ps(x[0], _mm512_loadu_ps(qg));
        for (int v = 1; v < nv; ++v) a = _mm512_fmadd_ps(x[v], _mm512_loadu_ps(qg + 16 * v), a);
        a = _mm512_mul_ps(a, _mm512_set1_ps(f));
        if (ko) {  // q at the outliers' positions times their values, in the same sum
          a = _mm512_fmadd_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), omask, opos, qg, 4), oval, a);
        }
        _mm512_storeu_ps(av + (g * TILE + t) * 16, a);
      }
    }
    for (int g = 0; g < G; ++g) {
      __m512 a[TILE];
      for (int t = 0; t < TILE; ++t) a[t] = t < n ? _mm512_loadu_ps(av + (g * TILE + t) * 16) : _mm512_setzero_ps();
      float* sg = s + g * TILE;
      _mm512_storeu_ps(sg, hsum16(a));
      const float corr = softmax_tile(sg, n, m[g], l[g]);
      if (corr != 1.0f) {
        const __m512 c = _mm512_set1_ps(corr);
        for (int v = 0; v < nv; ++v) _mm512_storeu_ps(acc + g * D + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * v), c));
      }
    }
    for (int t = 0; t < n; ++t) {  // V dequantized once per token, for every query head
      const __m512 f = _mm512_set1_ps(vr.vload(slots[t], kv_head, x, D));
      for (int v = 0; v < nv; ++v) _mm512_storeu_ps(vt + t * D + 16 * v, _mm512_mul_ps(f, x[v]));
    }
    for (int g = 0; g < G; ++g) {  // P x V, four accumulators at a time held in registers
      const float* pg = s + g * TILE;
      float* ag = acc + g * D;
      for (int v0 = 0; v0 < nv; v0 += 4) {
        const int k = std::min(4, nv - v0);
        __m512 o[4];
        for (int j = 0; j < 4; ++j) o[j] = j < k ? _mm512_loadu_ps(ag + 16 * (v0 + j)) : _mm512_setzero_ps();
        for (int t = 0; t < n; ++t) {
          const __m512 pt = _mm512_set1_ps(pg[t]);
          for (int j = 0; j < 4; ++j)
            if (j < k) o[j] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt + t * D + 16 * (v0 + j)), o[j]);
        }
        for (int j = 0; j < k; ++j) _mm512_storeu_ps(ag + 16 * (v0 + j), o[j]);
      }
      for (int t = 0; t < n && vo; ++t)
        for (int k = 0; k < vo; ++k) {
          int idx;
          float val;
          vr.outlier(slots[t], kv_head, k, idx, val);
          ag[VR::pos(idx)] += pg[t] * val;
        }
    }
  }
  from_pos_order<VR>(acc, qn, G, D);  // back in order (qn is free now)
  store_out(out, row, kv_head * G, G, D, qn, l, m, lse);
}
#endif

#ifdef APP_AVX2
// decode_one with 8-wide rows (CPUs with AVX2 and no AVX-512): each token's K row is loaded once
// and its score for each query head is D/8 FMAs and a horizontal add, without decode_one's
// transposed copy of the tile; P x V runs on accumulators held in registers, 4 vectors at a time.
// Needs D % 8 == 0. KV (VV): K's (V's) rows come from the reader's load_pos, in its pos() order
// without outliers, which are added apart; q (the accumulator) is then kept in that order and the output put
// back in order at the end. Otherwise rows come from load(), in order.
template <typename KR, typename VR, bool KV, bool VV>
void decode_one_avx2(const KR& kr, const VR& vr, const at::Tensor& q, at::Tensor& out, const BlockTable& tables,
                     int64_t seq, int64_t row, int64_t seq_len, int64_t kv_head, int G, int D, int block_size,
                     float scale, std::vector<float>& buf, float* lse) {
  const int nv = D / 8;
  float* qv = buf.data();     // [G, D] in K's order
  float* acc = qv + G * D;    // [G, D] in V's order
  float* vt = acc + G * D;    // [TILE, D] in V's order
  float* s = vt + TILE * D;   // [G, TILE]
  float* m = s + G * TILE;    // [G]
  float* l = m + G;           // [G]
  float* krow = l + G;        // [D]
  float* tmp = krow + D;      // [G, D]: q in order (KV), then the output in order (VV)
  load_query(q, row, kv_head * G, G, D, scale, KV ? tmp : qv);  // with KV, tmp keeps q in order for the outliers
  if constexpr (KV) to_pos_order<KR>(tmp, qv, G, D);
  start_softmax(acc, m, l, G, D);
  for (int64_t t0 = 0; t0 < seq_len; t0 += TILE) {
    const int n = int(std::min<int64_t>(TILE, seq_len - t0));
    for (int t = 0; t < n; ++t) {
      const int64_t pos = t0 + t;
      const int64_t slot = tables.slot(seq, pos, block_size);
      if constexpr (KV) kr.load_pos(slot, kv_head, krow, D);
      else kr.load(slot, kv_head, krow, D);
      for (int g = 0; g < G; ++g) {
        const float* qg = qv + g * D;
        // two accumulators: half the dependent FMA chain
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(krow), _mm256_loadu_ps(qg)), b = _mm256_setzero_ps();
        int v = 1;
        for (; v + 1 < nv; v += 2) {
          b = _mm256_fmadd_ps(_mm256_loadu_ps(krow + 8 * v), _mm256_loadu_ps(qg + 8 * v), b);
          a = _mm256_fmadd_ps(_mm256_loadu_ps(krow + 8 * v + 8), _mm256_loadu_ps(qg + 8 * v + 8), a);
        }
        if (v < nv) b = _mm256_fmadd_ps(_mm256_loadu_ps(krow + 8 * v), _mm256_loadu_ps(qg + 8 * v), b);
        float sc = hsum8(_mm256_add_ps(a, b));
        if constexpr (KV)
          for (int k = 0; k < kr.num_outliers(); ++k) {
            int idx;
            float val;
            kr.outlier(slot, kv_head, k, idx, val);
            sc += tmp[g * D + idx] * val;
          }
        s[g * TILE + t] = sc;
      }
      float* vrow = vt + t * D;
      if constexpr (VV) {
        vr.load_pos(slot, kv_head, vrow, D);
        for (int k = 0; k < vr.num_outliers(); ++k) {
          int idx;
          float val;
          vr.outlier(slot, kv_head, k, idx, val);
          vrow[VR::pos(idx)] += val;
        }
      } else {
        vr.load(slot, kv_head, vrow, D);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* sg = s + g * TILE;
      const float corr = softmax_tile(sg, n, m[g], l[g]);
      float* ag = acc + g * D;
      const __m256 c = _mm256_set1_ps(corr);
      for (int v0 = 0; v0 < nv; v0 += 4) {
        const int k = std::min(4, nv - v0);
        __m256 o[4];
        for (int j = 0; j < 4; ++j) {
          o[j] = j < k ? _mm256_loadu_ps(ag + 8 * (v0 + j)) : _mm256_setzero_ps();
          if (corr != 1.0f) o[j] = _mm256_mul_ps(o[j], c);
        }
        for (int t = 0; t < n; ++t) {
          const __m256 pt = _mm256_set1_ps(sg[t]);
          for (int j = 0; j < 4; ++j)
            if (j < k) o[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + t * D + 8 * (v0 + j)), o[j]);
        }
        for (int j = 0; j < k; ++j) _mm256_storeu_ps(ag + 8 * (v0 + j), o[j]);
      }
    }
  }
  if constexpr (VV) {
    from_pos_order<VR>(acc, tmp, G, D);  // back in order (tmp is free now)
    store_out(out, row, kv_head * G, G, D, tmp, l, m, lse);
  } else {
    store_out(out, row, kv_head * G, G, D, acc, l, m, lse);
  }
}
#endif

#ifdef APP_AVX512_BF16
// 2^x for 16 floats, x <= 0 (x <= -150 gives exactly 0): 2^round(x) by scalef times a degree-6
// polynomial on [-0.5, 0.5] (rel. err ~2e-7), as fast_exp.
inline __m512 vexp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// decode_one for bf16 pages and a bf16 query, D = 16 * NV: a tile's 16 scores come from bf16 pair
// dot products (vdpbf16ps, exact products summed in float32) reduced together (hsum16), the
// online softmax runs on the tile's vector (log2 units), P x V is float32 FMAs into accumulators
// held in registers across the tile.
template <int NV>
void decode_one_bf16(const DenseReader& kr, const DenseReader& vr, const at::Tensor& q, at::Tensor& out,
                     const BlockTable& tables, int64_t seq, int64_t row, int64_t seq_len, int64_t kv_head, int G,
                     int block_size, float scale, std::vector<float>& buf, float* lse) {
  constexpr int D = 16 * NV, NK = D / 32;
  float* acc = buf.data();   // [G, D]
  float* p = acc + G * D;    // [G, TILE]
  float* m = p + G * TILE;   // [G], log2 units
  float* l = m + G;          // [G]
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m, m + G, -INFINITY);
  std::fill(l, l + G, 0.0f);
  const uint16_t* qrow = reinterpret_cast<const uint16_t*>(q.data_ptr()) + (row * q.size(1) + kv_head * G) * D;
  const uint16_t* kbase = static_cast<const uint16_t*>(kr.base);
  const uint16_t* vbase = static_cast<const uint16_t*>(vr.base);
  const float c = scale * 1.44269504088896341f;
  const uint16_t* kt[TILE];
  const uint16_t* vt[TILE];
  for (int64_t t0 = 0; t0 < seq_len; t0 += TILE) {
    const int n = int(std::min<int64_t>(TILE, seq_len - t0));
    for (int t = 0; t < n; ++t) {
      const int64_t pos = t0 + t;
      const int64_t slot = tables.slot(seq, pos, block_size);
      kt[t] = kbase + (slot * kr.heads + kv_head) * D;
      vt[t] = vbase + (slot * vr.heads + kv_head) * D;
    }
    const __mmask16 valid = n == TILE ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    for (int g = 0; g < G; ++g) {
      __m512bh qv[NK];
      for (int j = 0; j < NK; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qrow + g * D + 32 * j);
      __m512 a[TILE];
      for (int t = 0; t < TILE; ++t) {
        a[t] = _mm512_setzero_ps();
        if (t < n)
          for (int j = 0; j < NK; ++j) a[t] = _mm512_dpbf16_ps(a[t], qv[j], (__m512bh)_mm512_loadu_si512(kt[t] + 32 * j));
      }
      const __m512 sv = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, hsum16(a), _mm512_set1_ps(c));
      const float mnew = std::max(m[g], _mm512_reduce_max_ps(sv));
      const float corr = std::exp2(m[g] - mnew);
      m[g] = mnew;
      const __m512 e = vexp2(_mm512_sub_ps(sv, _mm512_set1_ps(mnew)));
      _mm512_storeu_ps(p + g * TILE, e);
      l[g] = l[g] * corr + _mm512_reduce_add_ps(e);
      __m512 o[NV];
      const __m512 cv = _mm512_set1_ps(corr);
      for (int v = 0; v < NV; ++v) o[v] = _mm512_mul_ps(cv, _mm512_loadu_ps(acc + g * D + 16 * v));
      for (int t = 0; t < n; ++t) {
        const __m512 pt = _mm512_set1_ps(p[g * TILE + t]);
        for (int v = 0; v < NV; ++v)
          o[v] = _mm512_fmadd_ps(pt, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vt[t] + 16 * v))), 16)), o[v]);
      }
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + g * D + 16 * v, o[v]);
    }
  }
  for (int g = 0; g < G; ++g) m[g] *= 0.69314718055994531f;  // natural units for the LSE
  store_out(out, row, kv_head * G, G, D, acc, l, m, lse);
}

// Whether decode_one_bf16 takes these readers and shapes (bf16 pages, a bf16 query, D 64/128/256).
template <typename KR, typename VR>
int bf16_decode_nv(const KR& kr, const VR& vr, const at::Tensor& q, int D) {
  if constexpr (std::is_same_v<KR, DenseReader> && std::is_same_v<VR, DenseReader>) {
    if (kr.dtype == at::kBFloat16 && vr.dtype == at::kBFloat16 && q.scalar_type() == at::kBFloat16 &&
        (D == 64 || D == 128 || D == 256))
      return D / 16;
  }
  return 0;
}
#endif

template <typename KR, typename VR>
void decode_all(const KR& kr, const VR& vr, const at::Tensor& q, at::Tensor& out, const BlockTable& tables,
                const at::Tensor& seq_lens, const at::Tensor& rows, int64_t kv_heads, int block_size, double scale,
                float* lse) {
  const int64_t num_seqs = seq_lens.size(0);
  const int D = int(q.size(2));
  const int G = int(q.size(1) / kv_heads);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
#ifdef APP_AVX512
  const bool vec = kr.vec_ok(D) && vr.vec_ok(D);
#else
  const bool vec = false;
#endif
#ifdef APP_AVX2
  bool vec8 = D % 8 == 0;
  if constexpr (KR::kVec8) vec8 = vec8 && kr.vec8_ok(D);
  if constexpr (VR::kVec8) vec8 = vec8 && vr.vec8_ok(D);
#endif
#ifdef APP_AVX512_BF16
  const int nv16 = bf16_decode_nv(kr, vr, q, D);
#endif
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(3 * G * D + 2 * D * TILE + G * TILE + 2 * G + D + 16 * G * TILE);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t seq = i / kv_heads, h = i % kv_heads;
      if (row[seq] < 0) continue;  // not a decode
#ifdef APP_AVX512_BF16
      if constexpr (std::is_same_v<KR, DenseReader> && std::is_same_v<VR, DenseReader>) {
        if (nv16) {
          const int64_t r = row[seq], len = lens[seq];
          const float sc = float(scale);
          if (nv16 == 4) decode_one_bf16<4>(kr, vr, q, out, tables, seq, r, len, h, G, block_size, sc, buf, lse);
          else if (nv16 == 8) decode_one_bf16<8>(kr, vr, q, out, tables, seq, r, len, h, G, block_size, sc, buf, lse);
          else decode_one_bf16<16>(kr, vr, q, out, tables, seq, r, len, h, G, block_size, sc, buf, lse);
          continue;
        }
      }
#endif
#ifdef APP_AVX512
      if (vec) {
        decode_one_vec(kr, vr, q, out, tables, seq, row[seq], lens[seq], h, G, D, block_size, float(scale), buf, lse);
        continue;
      }
#endif
#ifdef APP_AVX2
      if constexpr (KR::kVec8 || VR::kVec8) {
        if (vec8) {
          decode_one_avx2<KR, VR, KR::kVec8, VR::kVec8>(kr, vr, q, out, tables, seq, row[seq], lens[seq], h, G, D,
                                                        block_size, float(scale), buf, lse);
          continue;
        }
      }
      if (D % 8 == 0) {
        decode_one_avx2<KR, VR, false, false>(kr, vr, q, out, tables, seq, row[seq], lens[seq], h, G, D, block_size,
                                              float(scale), buf, lse);
        continue;
      }
#endif
      decode_one(kr, vr, q, out, tables, seq, row[seq], lens[seq], h, G, D, block_size, float(scale), buf, lse);
    }
  });
  (void)vec;
}

template <typename R>
void gather_all(const R& r, at::Tensor& out, const at::Tensor& block_ids, int64_t heads, int block_size) {
  const int D = int(out.size(2));
  const int64_t n = block_ids.size(0) * block_size;
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  const at::ScalarType dt = out.scalar_type();
  at::parallel_for(0, n * heads, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tok = i / heads, h = i % heads;
      const int64_t slot = ids[tok / block_size] * block_size + tok % block_size;
      r.load(slot, h, row.data(), D);
      if (dt == at::kBFloat16) {
        at::BFloat16* p = out.data_ptr<at::BFloat16>() + i * D;
        for (int d = 0; d < D; ++d) p[d] = at::BFloat16(row[d]);
      } else if (dt == at::kHalf) {
        at::Half* p = out.data_ptr<at::Half>() + i * D;
        for (int d = 0; d < D; ++d) p[d] = at::Half(row[d]);
      } else {
        std::memcpy(out.data_ptr<float>() + i * D, row.data(), D * sizeof(float));
      }
    }
  });
}

// Pages of one layer's K or V, as passed from Python: kind 0 dense [t], 1 fp8 [values, scale],
// 2 fp4 [codes, scales, scale_exp, out_vals, out_idx].
struct Pages {
  int kind;
  std::vector<at::Tensor> t;
  int64_t heads, block_size, head_dim;
  int group;
};

Pages make_pages(int64_t kind, std::vector<at::Tensor> t, int64_t group) {
  for (auto& x : t) TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "pages must be contiguous CPU tensors");
  Pages p{int(kind), t, t[0].size(2), t[0].size(1), 0, int(group)};
  p.head_dim = kind == 2 ? 2 * t[0].size(3) : t[0].size(3);
  if (kind == 0) TORCH_CHECK(t.size() == 1, "dense pages: one tensor");
  if (kind == 1) TORCH_CHECK(t.size() == 2 && t[0].scalar_type() == at::kFloat8_e4m3fn && t[1].scalar_type() == at::kFloat,
                             "fp8 pages: (e4m3 values, float32 scale)");
  if (kind == 2) {
    TORCH_CHECK(t.size() == 5, "fp4 pages: codes, scales, scale_exp, out_vals, out_idx");
    TORCH_CHECK(group > 0 && p.head_dim % group == 0 && t[1].size(3) == p.head_dim / group, "fp4 group");
  }
  return p;
}

template <typename F>
void with_reader(const Pages& p, F&& f) {
  if (p.kind == 0) {
    f(DenseReader{{}, p.t[0].data_ptr(), p.t[0].scalar_type(), p.head_dim, p.heads});
  } else if (p.kind == 1) {
    f(FP8Reader{{}, reinterpret_cast<const uint8_t*>(p.t[0].data_ptr()), p.t[1].data_ptr<float>(), p.heads});
  } else {
    FP4Reader r{p.t[0].data_ptr<uint8_t>(), reinterpret_cast<const uint8_t*>(p.t[1].data_ptr()),
                p.t[2].data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(p.t[3].data_ptr()),
                p.t[4].data_ptr<uint8_t>(), p.heads, p.group, int(p.t[3].size(3)), int(p.head_dim / p.group), {}, {}};
    r.set_lanes();
    f(r);
  }
}


// E2M1 code of a (scaled) value's magnitude: nearest, ties to even, saturating at 6, as
// fp4.e2m1_encode (a midpoint goes up where the even neighbour is the upper one: 0.75, 1.75, 3.5).
inline int e2m1_magnitude_code(float a) {
  return int(a > 0.25f) + int(a >= 0.75f) + int(a > 1.25f) + int(a >= 1.75f) + int(a > 2.5f) + int(a >= 3.5f) +
         int(a > 5.0f);
}

// One group x[0, n) quantized to E2M1 with the scale `safe`: its codes (magnitude code, sign bit 8
// on nonzero negatives; one byte each) into code[0, n), and the squared error sum of
// (e2m1(x / safe) * safe - x)^2 (the order of the sum is the only difference from the torch path).
inline float group_codes(const float* x, int n, float safe, uint8_t* code) {
  float err = 0.0f;
  int i = 0;
#ifdef APP_AVX512
  const __m512 s = _mm512_set1_ps(safe);
  const __m512 grid = _mm512_maskz_loadu_ps(0xFF, kE2M1);  // kE2M1 in lanes 0-7
  const __m512i one = _mm512_set1_epi32(1), eight = _mm512_set1_epi32(8);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    const __m512 v = _mm512_div_ps(xv, s);
    const __m512 a = _mm512_abs_ps(v);
    __m512i c = _mm512_setzero_si512();
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_GT_OQ), c, one);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.75f), _CMP_GE_OQ), c, one);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.25f), _CMP_GT_OQ), c, one);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.75f), _CMP_GE_OQ), c, one);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, _mm512_set1_ps(2.5f), _CMP_GT_OQ), c, one);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.5f), _CMP_GE_OQ), c, one);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, _mm512_set1_ps(5.0f), _CMP_GT_OQ), c, one);
    const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 q = _mm512_permutexvar_ps(c, grid);
    q = _mm512_mask_sub_ps(q, neg, _mm512_setzero_ps(), q);
    const __m512 diff = _mm512_sub_ps(_mm512_mul_ps(q, s), xv);
    acc = _mm512_fmadd_ps(diff, diff, acc);
    const __mmask16 signed_ = neg & _mm512_cmpneq_epi32_mask(c, _mm512_setzero_si512());
    c = _mm512_mask_or_epi32(c, signed_, c, eight);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(code + i), _mm512_cvtepi32_epi8(c));
  }
  err = _mm512_reduce_add_ps(acc);
#elif defined(APP_AVX2)
  // No division: |x| is compared with each boundary times the scale. b safe is exact (b has at most
  // 3 significant bits, safe, an e4m3 value, 4), and for every e4m3 scale and boundary
  // fl(|x| / safe) > b  <=>  |x| > b safe (and >= alike): checked for all of them in
  // tests/test_fp4.py. (A quotient that underflows to -0 has x's sign flipped, but code 0 either way.)
  const __m256 s = _mm256_set1_ps(safe);
  const __m256 grid = _mm256_loadu_ps(kE2M1);
  const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  const __m256i eight = _mm256_set1_epi32(8);
  // The code by a binary search over the 7 boundaries (three comparisons where counting the
  // boundaries passed took seven): bit 2 is |x| >= 1.75 safe, bit 1 |x| >= 0.75 or 3.5 safe (by bit
  // 2), bit 0 |x| > 0.25, 1.25, 2.5 or 5 safe (by bits 2-1). The boundaries that round up (>=)
  // decide the upper bits, the four that round down (>) the last.
  const __m256 mid = _mm256_set1_ps(1.75f * safe), lo = _mm256_set1_ps(0.75f * safe), hi = _mm256_set1_ps(3.5f * safe);
  const __m256 last = _mm256_setr_ps(0.25f * safe, 1.25f * safe, 2.5f * safe, 5.0f * safe, 0, 0, 0, 0);
  const __m256i two = _mm256_set1_epi32(2), one = _mm256_set1_epi32(1);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    const __m256 a = _mm256_andnot_ps(sign, xv);
    const __m256 m2 = _mm256_cmp_ps(a, mid, _CMP_GE_OQ);
    const __m256 m1 = _mm256_cmp_ps(a, _mm256_blendv_ps(lo, hi, m2), _CMP_GE_OQ);
    const __m256i top = _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(m2), two),
                                        _mm256_and_si256(_mm256_castps_si256(m1), one));  // code >> 1
    const __m256 m0 = _mm256_cmp_ps(a, _mm256_permutevar8x32_ps(last, top), _CMP_GT_OQ);
    __m256i c = _mm256_sub_epi32(_mm256_add_epi32(top, top), _mm256_castps_si256(m0));  // a true m0 is -1
    const __m256 neg = _mm256_cmp_ps(xv, zero, _CMP_LT_OQ);
    const __m256 q = _mm256_xor_ps(_mm256_permutevar8x32_ps(grid, c), _mm256_and_ps(neg, sign));
    const __m256 diff = _mm256_sub_ps(_mm256_mul_ps(q, s), xv);
    acc = _mm256_fmadd_ps(diff, diff, acc);
    const __m256i signed_ = _mm256_and_si256(_mm256_castps_si256(neg), _mm256_cmpgt_epi32(c, _mm256_setzero_si256()));
    c = _mm256_or_si256(c, _mm256_and_si256(signed_, eight));
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c, c), _mm256_setzero_si256());  // bytes 0-3 per lane
    const uint32_t lo32 = uint32_t(_mm256_cvtsi256_si32(b)), hi32 = uint32_t(_mm256_extract_epi32(b, 4));
    std::memcpy(code + i, &lo32, 4);
    std::memcpy(code + i + 4, &hi32, 4);
  }
  err = hsum8(acc);
#endif
  for (; i < n; ++i) {
    const float v = x[i] / safe;
    const int c = e2m1_magnitude_code(std::fabs(v));
    const float q = kE2M1[c];
    const float diff = (v < 0 ? -q : q) * safe - x[i];
    err += diff * diff;
    code[i] = uint8_t((v < 0 && c > 0) ? c | 8 : c);
  }
  return err;
}

// ceil(log2(v)) for v > 0, exactly (frexp: v = m 2^e, m in [0.5, 1)).
inline int ceil_log2(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const int biased = int((u >> 23) & 0xFF);
  if (biased > 0) return biased - 127 + ((u & 0x7FFFFF) != 0);  // normal: 2^e * 1.m
  int e;
  const float m = std::frexp(v, &e);
  return m == 0.5f ? e - 1 : e;
}

// x in [2^-6, 448] (e4m3's normal range, which the scale search guarantees) rounded to e4m3 as
// c10::Float8_e4m3fn does (nearest, ties to even): the value, and its byte in `bits`. The float's
// mantissa rounded to 3 bits in place; a carry moves into the exponent, as it should.
inline float e4m3_round_normal(float x, uint8_t& bits) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFFu + ((u >> 20) & 1u);
  u &= ~0xFFFFFu;
  bits = uint8_t(((((u >> 23) & 0xFFu) - 127u + 7u) << 3) | ((u >> 20) & 7u));
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// One vector x[D] (float, modified) -> its fp4 record at row r of the pages (fp4.fp4_quantize).
void fp4_quantize_row(float* x, int D, int group, int outliers, const std::vector<float>& targets, int64_t r,
                      uint8_t* codes, uint8_t* scales, uint8_t* scale_exp, at::BFloat16* out_vals, uint8_t* out_idx) {
  // Outliers: the `outliers` largest magnitudes (> 0; the lower index first among equals), kept in
  // bf16 and taken out of x; unused slots hold value 0 at index 0.
  // Vector-wide (AVX-512, AVX2): k rounds of taking the largest left, the lowest index among
  // equals. Otherwise one pass keeping the k largest so far in order; strict comparisons keep
  // the lower index ahead of a later equal magnitude. A magnitude of 0 is never taken.
  float top_v[16];
  int top_i[16];
  for (int k = 0; k < outliers; ++k) top_v[k] = 0.0f, top_i[k] = -1;
#ifdef APP_AVX512
  if (outliers && D % 16 == 0 && D <= 256) {  // the same picks, in order: the largest left, lowest index first
    __m512 mag[16];
    for (int v = 0; v < D / 16; ++v) mag[v] = _mm512_abs_ps(_mm512_loadu_ps(x + 16 * v));
    for (int k = 0; k < outliers; ++k) {
      __m512 mx = mag[0];
      for (int v = 1; v < D / 16; ++v) mx = _mm512_max_ps(mx, mag[v]);
      const float best = _mm512_reduce_max_ps(mx);
      if (!(best > 0.0f)) break;
      const __m512 b = _mm512_set1_ps(best);
      for (int v = 0; v < D / 16; ++v) {
        const __mmask16 hit = _mm512_cmp_ps_mask(mag[v], b, _CMP_EQ_OQ);
        if (hit) {
          const int lane = __builtin_ctz(unsigned(hit));
          top_v[k] = best;
          top_i[k] = 16 * v + lane;
          mag[v] = _mm512_mask_mov_ps(mag[v], __mmask16(1u << lane), _mm512_set1_ps(-1.0f));
          break;
        }
      }
    }
  }
  for (int d = 0; d < D && outliers && !(D % 16 == 0 && D <= 256); ++d) {
#elif defined(APP_AVX2)
  if (outliers && D % 8 == 0 && D <= 256) {  // as the AVX-512 picks, 8 lanes a vector
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mag[32];
    for (int v = 0; v < D / 8; ++v) mag[v] = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * v));
    for (int k = 0; k < outliers; ++k) {
      __m256 mx = mag[0];
      for (int v = 1; v < D / 8; ++v) mx = _mm256_max_ps(mx, mag[v]);
      const float best = hmax8(mx);
      if (!(best > 0.0f)) break;
      const __m256 b = _mm256_set1_ps(best);
      for (int v = 0; v < D / 8; ++v) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(mag[v], b, _CMP_EQ_OQ));
        if (hit) {
          const int lane = __builtin_ctz(unsigned(hit));
          top_v[k] = best;
          top_i[k] = 8 * v + lane;
          const __m256i at = _mm256_cmpeq_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(lane));
          mag[v] = _mm256_blendv_ps(mag[v], _mm256_set1_ps(-1.0f), _mm256_castsi256_ps(at));  // never again
          break;
        }
      }
    }
  }
  for (int d = 0; d < D && outliers && !(D % 8 == 0 && D <= 256); ++d) {
#else
  for (int d = 0; d < D && outliers; ++d) {
#endif
    const float a = std::fabs(x[d]);
    if (!(a > top_v[outliers - 1])) continue;
    int k = outliers - 1;
    while (k > 0 && a > top_v[k - 1]) {
      top_v[k] = top_v[k - 1];
      top_i[k] = top_i[k - 1];
      --k;
    }
    top_v[k] = a;
    top_i[k] = d;
  }
  for (int k = 0; k < outliers; ++k) {
    out_vals[r * outliers + k] = at::BFloat16(top_i[k] < 0 ? 0.0f : x[top_i[k]]);
    out_idx[r * outliers + k] = uint8_t(top_i[k] < 0 ? 0 : top_i[k]);
  }
  for (int k = 0; k < outliers; ++k) x[out_idx[r * outliers + k]] -= float(out_vals[r * outliers + k]);
  const int ng = D / group;
  float top = 0.0f;
  float amax[512];
  for (int g = 0; g < ng; ++g) {
    float m = 0.0f;
    int i = 0;
#ifdef APP_AVX512
    if (group % 16 == 0) {  // a maximum is exact in any order
      __m512 mv = _mm512_setzero_ps();
      for (; i < group; i += 16) mv = _mm512_max_ps(mv, _mm512_abs_ps(_mm512_loadu_ps(x + g * group + i)));
      m = _mm512_reduce_max_ps(mv);
    }
#endif
#ifdef APP_AVX2
    if (group % 8 == 0) {  // a maximum is exact in any order
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 mv = _mm256_setzero_ps();
      for (; i < group; i += 8) mv = _mm256_max_ps(mv, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + g * group + i)));
      m = hmax8(mv);
    }
#endif
    for (; i < group; ++i) m = std::max(m, std::fabs(x[g * group + i]));
    amax[g] = m;
    top = std::max(top, m);
  }
  top /= *std::min_element(targets.begin(), targets.end());
  const int e = top > 0 ? std::min(127, std::max(-126, ceil_log2(top / 448.0f))) : -127;
  scale_exp[r] = uint8_t(e + 127);
  const float second = pow2(e);
  const float inv_second = 1.0f / second;  // a power of two: multiplying is dividing, exactly
#pragma omp simd
  for (int d = 0; d < D; ++d) x[d] *= inv_second;  // units of the second-level scale
  uint8_t code[2][512];  // the codes of the best candidate so far, and of the one being tried
  for (int g = 0; g < ng; ++g) {
    const float* xg = x + g * group;
    const float amax_n = amax[g] / second;
    float best_err = INFINITY;
    uint8_t best_scale = 0;
    int best = 0;
    for (size_t c = 0; c < targets.size(); ++c) {
      uint8_t bits;
      const float safe = e4m3_round_normal(std::max(amax_n / targets[c], 0.015625f), bits);
      const int cur = c == 0 ? 0 : 1 - best;
      const float err = group_codes(xg, group, safe, code[cur]);
      if (c == 0 || err < best_err) {
        best_err = err;
        best_scale = bits;
        best = cur;
      }
    }
    scales[r * ng + g] = best_scale;
    const uint8_t* cb = code[best];
    uint8_t* out = codes + r * (D / 2) + g * group / 2;
    for (int i = 0; i < group / 2; ++i) out[i] = uint8_t(cb[2 * i] | (cb[2 * i + 1] << 4));
  }
}
}  // namespace

// out (any float dtype), q: [T, num_heads, D]; lse: empty or float32 [T, num_heads] (the LSE, see
// store_out); rows[i]: the query row of sequence i (< 0: skip it); block_tables [S, max_blocks]
// int32/int64; seq_lens [S] int64 (tokens attended, the new one included).
void decode(at::Tensor out, at::Tensor q, int64_t k_kind, std::vector<at::Tensor> k, int64_t k_group,
            int64_t v_kind, std::vector<at::Tensor> v, int64_t v_group, at::Tensor block_tables,
            at::Tensor seq_lens, at::Tensor rows, double scale, at::Tensor lse) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && q.dim() == 3, "q/out: contiguous [T, H, D]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && rows.scalar_type() == at::kLong, "seq_lens/rows: int64");
  const Pages kp = make_pages(k_kind, k, k_group), vp = make_pages(v_kind, v, v_group);
  TORCH_CHECK(kp.head_dim == q.size(2) && vp.head_dim == q.size(2) && q.size(1) % kp.heads == 0, "head shapes");
  TORCH_CHECK(seq_lens.size(0) == rows.size(0) && seq_lens.size(0) <= block_tables.size(0), "one row per sequence");
  for (int64_t i = 0; i < seq_lens.size(0); ++i)
    TORCH_CHECK(seq_lens.data_ptr<int64_t>()[i] <= block_tables.size(1) * kp.block_size, "seq_len beyond its block table");
  float* lse_p = nullptr;
  if (lse.numel()) {
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == q.size(0) * q.size(1),
                "lse: float32 [T, H]");
    lse_p = lse.data_ptr<float>();
  }
  TORCH_CHECK(out.sizes() == q.sizes(), "out: q's shape");
  with_reader(kp, [&](const auto& kr) {
    with_reader(vp, [&](const auto& vr) {
      decode_all(kr, vr, q, out, BlockTable(block_tables), seq_lens, rows, kp.heads, int(kp.block_size), scale,
                 lse_p);
    });
  });
}

// out [len(block_ids) * block_size, H, D] (any float dtype) <- the blocks, dequantized.
void gather(at::Tensor out, int64_t kind, std::vector<at::Tensor> pages, int64_t group, at::Tensor block_ids) {
  const Pages p = make_pages(kind, pages, group);
  TORCH_CHECK(out.is_contiguous() && out.size(0) == block_ids.size(0) * p.block_size && out.size(1) == p.heads &&
              out.size(2) == p.head_dim, "gather: out shape");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(), "block_ids: int64");
  const int64_t num_blocks = pages[0].size(0);
  for (int64_t i = 0; i < block_ids.size(0); ++i) {
    const int64_t b = block_ids.data_ptr<int64_t>()[i];
    TORCH_CHECK(b >= 0 && b < num_blocks, "block id out of range");
  }
  with_reader(p, [&](const auto& r) { gather_all(r, out, block_ids, p.heads, int(p.block_size)); });
}

// x [N, H, D] float32 (finite), slots [N] int64 >= 0: quantize each vector and write it to its slot.
void store_fp4(at::Tensor x, at::Tensor slots, std::vector<at::Tensor> pages, int64_t group,
               std::vector<double> targets_d) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3, "x: contiguous float32 [N, H, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: int64");
  const Pages p = make_pages(2, pages, group);
  const int D = int(x.size(2)), outliers = int(pages[3].size(3));
  const int64_t H = x.size(1), n = x.size(0);
  TORCH_CHECK(H == p.heads && D == p.head_dim && D <= 512, "store_fp4: head shapes (head_dim <= 512)");
  const std::vector<float> targets(targets_d.begin(), targets_d.end());
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  uint8_t* codes = pages[0].data_ptr<uint8_t>();
  uint8_t* scales = reinterpret_cast<uint8_t*>(pages[1].data_ptr());
  uint8_t* scale_exp = pages[2].data_ptr<uint8_t>();
  at::BFloat16* out_vals = pages[3].data_ptr<at::BFloat16>();
  uint8_t* out_idx = pages[4].data_ptr<uint8_t>();
  at::parallel_for(0, n * H, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(row.data(), xp + i * D, D * sizeof(float));
      const int64_t r = sl[i / H] * H + i % H;
      fp4_quantize_row(row.data(), D, int(group), outliers, targets, r, codes, scales, scale_exp, out_vals, out_idx);
    }
  });
}

// x [N, H, D] float32 (finite) -> e4m3 values and a float32 scale per vector (amax maps to 448).
void store_fp8(at::Tensor x, at::Tensor slots, at::Tensor values, at::Tensor scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3, "x: contiguous float32 [N, H, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && values.is_contiguous() && scale.is_contiguous(), "store_fp8 args");
  const int D = int(x.size(2));
  const int64_t H = x.size(1), n = x.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  at::parallel_for(0, n * H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = x.data_ptr<float>() + i * D;
      float amax = 0.0f;
      for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(v[d]));
      float s = amax / 448.0f;
      if (!(s > 0)) s = 1.0f;
      const int64_t r = sl[i / H] * H + i % H;
      scale.data_ptr<float>()[r] = s;
      c10::Float8_e4m3fn* out = values.data_ptr<c10::Float8_e4m3fn>() + r * D;
      for (int d = 0; d < D; ++d) out[d] = c10::Float8_e4m3fn(v[d] / s);
    }
  });
}

namespace {

// The layer ops take contiguous CPU tensors of float32, bf16 or fp16.
void check_float_tensor(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "contiguous CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "float32, bf16 or fp16");
}

template <typename T>
bool all_finite(const T* p, int64_t n) {
  float acc = 0.0f;  // x * 0 is 0 for finite x, NaN for NaN and Inf
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += float(p[i]) * 0.0f;
  return acc == 0.0f;
}

}  // namespace

inline float sum_of_squares(const float* v, int64_t n) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
  return ss;
}

// float -> bf16 by bits (round to nearest even; NaN stays non-finite; bf16_to_float is the other
// way), so the loops vectorize.
inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float ld(const at::BFloat16& x) { return bf16_to_float(reinterpret_cast<const uint16_t&>(x)); }
inline float ld(const at::Half& x) { return float(x); }
inline float ld(const float& x) { return x; }
inline float ld(const double& x) { return float(x); }
inline void st(at::BFloat16& y, float v) { reinterpret_cast<uint16_t&>(y) = to_bf16_bits(v); }
inline void st(at::Half& y, float v) { y = at::Half(v); }
inline void st(float& y, float v) { y = v; }
inline void st(double& y, float v) { y = v; }
// Rounding a float to the element type as torch does (bf16/fp16: nearest even), back as float.
template <typename T>
inline float rounded(float v) {
  T tmp;
  st(tmp, v);
  return ld(tmp);
}

template <typename T>
void silu_mul_row(const T* g, const T* u, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {  // 8 at a time, the scalar loop's operations (the compiler
    // does not vectorize that one: its branches hold a division)
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
      const __m256 gi = _mm256_loadu_ps(g + i);
      const __m256 e = fast_exp8(_mm256_or_ps(gi, sign));  // exp(-|g|)
      const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(gi, e), gi, _mm256_cmp_ps(gi, zero, _CMP_GE_OQ));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float gi = ld(g[i]);
    const float e = fast_exp(-std::fabs(gi));  // exp(-|g|) <= 1: no overflow either way
    const float silu = gi >= 0 ? gi / (1.0f + e) : gi * e / (1.0f + e);
    st(out[i], rounded<T>(silu) * ld(u[i]));
  }
}

// RMSNorm with the residual added first, rounding where the torch path rounds: h = x + residual
// in the dtype, y = weight * (h * rsqrt(mean(h^2) + eps)) rounded to the dtype, then the product
// with weight rounded. x, residual [T, H]; returns (y, h) (h undefined without residual).
std::vector<at::Tensor> rms_norm(at::Tensor x, at::Tensor weight, double eps, c10::optional<at::Tensor> residual) {
  check_float_tensor(x), check_float_tensor(weight);
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor y = at::empty_like(x), h = residual.has_value() ? at::empty_like(x) : at::Tensor();
  if (residual.has_value()) check_float_tensor(*residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const scalar_t* rp = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* hp = residual.has_value() ? h.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(H);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* xr = xp + t * H;
        float* v = row.data();
        if (rp) {
          const scalar_t* rr = rp + t * H;
          scalar_t* hr = hp + t * H;
          for (int64_t i = 0; i < H; ++i) {
            st(hr[i], ld(xr[i]) + ld(rr[i]));
            v[i] = ld(hr[i]);
          }
        } else {
          for (int64_t i = 0; i < H; ++i) v[i] = ld(xr[i]);
        }
        const float r = 1.0f / std::sqrt(sum_of_squares(v, H) / float(H) + float(eps));
        scalar_t* yr = yp + t * H;
        for (int64_t i = 0; i < H; ++i) st(yr[i], ld(wp[i]) * rounded<scalar_t>(v[i] * r));
      }
    });
  });
  return {y, h};
}

// RoPE (rotate-half) on the query and key parts of the fused projection qkv [T, (H + 2K) D], in
// float, rounded to the dtype; cos/sin [T, D] float32. Returns q [T, H, D], k [T, K, D].
std::vector<at::Tensor> rope_qk(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t H, int64_t K) {
  check_float_tensor(qkv);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "cos/sin: contiguous float32");
  const int64_t T = qkv.size(0), D = cos.size(1), W = qkv.size(1), half = D / 2;
  at::Tensor q = at::empty({T, H, D}, qkv.options()), k = at::empty({T, K, D}, qkv.options());
  const float* c = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_qk", [&] {
    const scalar_t* xp = qkv.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* ct = c + t * D;
        const float* sn_t = sn + t * D;
        for (int64_t hd = 0; hd < H + K; ++hd) {
          scalar_t* o = hd < H ? qp + (t * H + hd) * D : kp + (t * K + hd - H) * D;
          const scalar_t* x = xp + t * W + hd * D;
          for (int64_t j = 0; j < half; ++j) {
            const float x1 = ld(x[j]), x2 = ld(x[j + half]);
            st(o[j], x1 * ct[j] - x2 * sn_t[j]);
            st(o[j + half], x2 * ct[j + half] + x1 * sn_t[j + half]);
          }
        }
      }
    });
  });
  return {q, k};
}

// silu(gate) * up for x = [gate | up] [T, 2I]: silu rounded to the dtype, then the product.
at::Tensor silu_and_mul(at::Tensor x) {
  check_float_tensor(x);
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({T, I}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = xp + t * 2 * I;
        const scalar_t* u = g + I;
        scalar_t* out = yp + t * I;
        silu_mul_row(g, u, out, I);
      }
    });
  });
  return y;
}

// Tokens whose K or V vector holds NaN/Inf: flags [N] (1 = not finite). key/value [N, H, D] of
// any float dtype and any row stride between tokens.
at::Tensor nonfinite_tokens(at::Tensor key, at::Tensor value) {
  const int64_t N = key.size(0);
  at::Tensor flags = at::zeros({N}, at::kBool);
  bool* f = flags.data_ptr<bool>();
  for (const at::Tensor& x : {key.contiguous(), value.contiguous()}) {
    check_float_tensor(x);
    const int64_t n = x.numel() / std::max<int64_t>(N, 1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "nonfinite_tokens", [&] {
      const scalar_t* p = x.data_ptr<scalar_t>();
      at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) f[t] |= !all_finite(p + t * n, n);
      });
    });
  }
  return flags;
}

// ---- prefill attention in bf16 with AVX512-BF16 dot products ----------------------------------
//
// A flash-attention loop per (KV head, block of query rows): scores for a tile of keys from bf16
// pair dot products (vdpbf16ps) accumulated in float32, an online softmax in float32, the
// probabilities rounded to bf16 (as torch's flash kernel does) for the product with V, the output
// divided by the softmax sum at the end. K and V of the head are first repacked so that one
// 512-bit load carries the operand of 16 lanes: K as [key/16][D/2][16] words (a word = the two bf16
// of one dimension pair of one key), V as [key/2][D] words (a word = one dimension of two keys).
// The query rows of a KV head are its query heads' rows for every token (GQA folded into rows).
namespace {
#ifdef APP_AVX512_BF16
#define APP_PREFILL_BF16 1

constexpr int PF_ROWS = 24;   // query rows per block (a multiple of the two micro-kernels' rows)
constexpr int PF_KEYS = 128;  // keys per tile (a multiple of 32)
constexpr int QK_ROWS = 8, PV_ROWS = 6;

// s[r][0, 32) = q[r] . k[key0 + j] for R rows (q rows of D bf16 = D/2 words, stride ldq words).
template <int R>
inline void qk_tile(const uint32_t* q, int ldq, const uint32_t* kp, int D, float* s, int lds) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  const uint32_t* k0 = kp;                 // keys key0 .. key0 + 16
  const uint32_t* k1 = kp + 16 * (D / 2);  // the next 16
  for (int p = 0; p < D / 2; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(k0 + 16 * p);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(k1 + 16 * p);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(q[r * ldq + p]));
      a0[r] = _mm512_dpbf16_ps(a0[r], a, b0);
      a1[r] = _mm512_dpbf16_ps(a1[r], a, b1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * lds, a0[r]);
    _mm512_storeu_ps(s + r * lds + 16, a1[r]);
  }
}

// o[r][0, 64) += p[r] . v[0, n) (p rows of n bf16, n even, stride ldp words; vp: [n/2][D] words).
template <int R>
inline void pv_tile(const uint32_t* p, int ldp, const uint32_t* vp, int D, int n, float* o, int ldo) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_loadu_ps(o + r * ldo + 16 * j);
  for (int m = 0; m < n / 2; ++m) {
    __m512bh b[4];
    for (int j = 0; j < 4; ++j) b[j] = (__m512bh)_mm512_loadu_si512(vp + m * D + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(p[r * ldp + m]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + r * ldo + 16 * j, acc[r][j]);
}

template <int MAXR, template <int> class F, typename... A>
inline void rows_dispatch(int rows, A... args) {
  switch (rows) {
    case 1: F<1>::run(args...); break;
    case 2: F<2>::run(args...); break;
    case 3: F<3>::run(args...); break;
    case 4: F<4>::run(args...); break;
    case 5: F<5>::run(args...); break;
    case 6: F<6>::run(args...); break;
    case 7: if constexpr (MAXR >= 7) F<7>::run(args...); break;
    case 8: if constexpr (MAXR >= 8) F<8>::run(args...); break;
  }
}
template <int R> struct QK { template <typename... A> static void run(A... a) { qk_tile<R>(a...); } };
template <int R> struct PV { template <typename... A> static void run(A... a) { pv_tile<R>(a...); } };

// One block of rows [r0, r1) of KV head h: rows are (token, query head of the group) pairs.
void prefill_block(const uint16_t* q, void* out, bool out_f32, float* lse, const uint32_t* kp, const uint32_t* vp,
                   int64_t nq, int64_t nk, int H, int G, int h, int D, float scale, bool causal, int64_t r0, int64_t r1) {
  const int R = int(r1 - r0), ldq = D / 2;
  alignas(64) uint32_t qb[PF_ROWS * 128];  // D <= 256
  alignas(64) float s[PF_ROWS * PF_KEYS];
  alignas(64) uint16_t pb[PF_ROWS * PF_KEYS];
  alignas(64) float o[PF_ROWS * 256];
  float m[PF_ROWS], l[PF_ROWS];
  int64_t limit[PF_ROWS];  // keys [0, limit) are visible to the row
  const int64_t base = nk - nq;
  for (int r = 0; r < R; ++r) {
    const int64_t t = (r0 + r) / G, head = int64_t(h) * G + (r0 + r) % G;
    std::memcpy(qb + r * ldq, q + (t * H + head) * D, D * 2);
    limit[r] = causal ? base + t + 1 : nk;
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  std::memset(o, 0, sizeof(float) * R * D);
  const float c = scale * 1.44269504088896341f;  // scores in log2 units
  const int64_t end = limit[R - 1];              // the last row sees the most keys (or all see all)
  for (int64_t k0 = 0; k0 < end; k0 += PF_KEYS) {
    const int n = int(std::min<int64_t>(PF_KEYS, end - k0));
    const int n32 = (n + 31) / 32 * 32;
    for (int j = 0; j < n32; j += 32)
      for (int r = 0; r < R; r += QK_ROWS)
        rows_dispatch<8, QK>(std::min(QK_ROWS, R - r), qb + r * ldq, ldq, kp + (k0 + j) * (D / 2), D,
                             s + r * PF_KEYS + j, PF_KEYS);
    for (int r = 0; r < R; ++r) {
      float* sr = s + r * PF_KEYS;
      const int valid = int(std::max<int64_t>(0, std::min<int64_t>(n32, limit[r] - k0)));
      __m512 mx = _mm512_set1_ps(m[r]);
      for (int j = 0; j < n32; j += 16) {
        const __mmask16 keep = j + 16 <= valid ? __mmask16(0xFFFF) : j >= valid ? 0 : __mmask16((1u << (valid - j)) - 1);
        const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), keep, _mm512_loadu_ps(sr + j), _mm512_set1_ps(c));
        _mm512_storeu_ps(sr + j, x);
        mx = _mm512_max_ps(mx, x);
      }
      const float mnew = _mm512_reduce_max_ps(mx);
      const float corr = m[r] == -INFINITY ? 0.0f : std::exp2(m[r] - mnew);
      m[r] = mnew;
      const __m512 mv = _mm512_set1_ps(mnew);
      __m512 sum = _mm512_setzero_ps();
      uint16_t* pr = pb + r * PF_KEYS;
      for (int j = 0; j < n32; j += 16) {
        const __m512 e = vexp2(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mv));
        const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), eb);
        sum = _mm512_add_ps(sum, e);
      }
      l[r] = l[r] * corr + _mm512_reduce_add_ps(sum);
      if (corr != 1.0f) {
        const __m512 cv = _mm512_set1_ps(corr);
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(cv, _mm512_loadu_ps(o + r * D + d)));
      }
    }
    const uint32_t* p32 = reinterpret_cast<const uint32_t*>(pb);
    for (int d = 0; d < D; d += 64)
      for (int r = 0; r < R; r += PV_ROWS)
        rows_dispatch<6, PV>(std::min(PV_ROWS, R - r), p32 + r * (PF_KEYS / 2), PF_KEYS / 2,
                             vp + (k0 / 2) * D + d, D, n32, o + r * D + d, D);
  }
  for (int r = 0; r < R; ++r) {
    const int64_t t = (r0 + r) / G, head = int64_t(h) * G + (r0 + r) % G;
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    if (lse) lse[t * H + head] = (m[r] + std::log2(l[r])) * 0.69314718055994531f;  // natural log
    if (out_f32) {
      float* dst = static_cast<float*>(out) + (t * H + head) * D;
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(inv, _mm512_loadu_ps(o + r * D + d)));
      continue;
    }
    uint16_t* dst = static_cast<uint16_t*>(out) + (t * H + head) * D;
    for (int d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(o + r * D + d))));
  }
}
#endif
}  // namespace

bool has_prefill_bf16() {
#ifdef APP_PREFILL_BF16
  return true;
#else
  return false;
#endif
}

// q: [nq, H, D] bf16; k, v: [nk, KVH, D] bf16; out: q's shape, bf16 or float32 (all contiguous).
// causal: query i sits at key nk - nq + i and sees keys [0, nk - nq + i]; otherwise every query sees
// every key. lse: empty, or float32 [nq, H] <- log of each softmax's denominator (for merging).
void prefill_bf16(at::Tensor out, at::Tensor q, at::Tensor k, at::Tensor v, double scale, bool causal,
                  at::Tensor lse) {
#ifdef APP_PREFILL_BF16
  for (const at::Tensor* x : {&q, &k, &v})
    TORCH_CHECK(x->is_contiguous() && x->scalar_type() == at::kBFloat16 && x->dim() == 3, "contiguous bf16 [n, heads, D]");
  TORCH_CHECK(out.is_contiguous() && (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "out: contiguous bf16 or float32");
  const int64_t nq = q.size(0), nk = k.size(0);
  const int H = int(q.size(1)), KVH = int(k.size(1)), D = int(q.size(2));
  TORCH_CHECK(out.sizes() == q.sizes() && v.sizes() == k.sizes() && k.size(2) == D, "shapes");
  TORCH_CHECK(D % 64 == 0 && D <= 256 && H % KVH == 0 && nq > 0 && nk >= (causal ? nq : 1),
              "head_dim a multiple of 64 up to 256, nk >= nq (causal) or >= 1");
  float* lse_p = nullptr;
  if (lse.numel()) {
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == nq * H, "lse: float32 [nq, H]");
    lse_p = lse.data_ptr<float>();
  }
  const int G = H / KVH;
  const int64_t nk32 = (nk + 31) / 32 * 32;
  // Repack K and V per head (zeros past nk).
  std::vector<uint32_t> kp(size_t(KVH) * nk32 * (D / 2), 0u), vp(size_t(KVH) * (nk32 / 2) * D, 0u);
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(k.data_ptr());
  const uint16_t* v16 = reinterpret_cast<const uint16_t*>(v.data_ptr());
  at::parallel_for(0, KVH * (nk32 / 16), 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t h = b / (nk32 / 16), blk = b % (nk32 / 16);
      uint32_t* kd = kp.data() + (h * nk32 + blk * 16) * (D / 2);
      uint16_t* vd = reinterpret_cast<uint16_t*>(vp.data() + (h * (nk32 / 2) + blk * 8) * D);
      for (int j = 0; j < 16; ++j) {
        const int64_t key = blk * 16 + j;
        if (key >= nk) break;
        const uint32_t* src = k32 + (key * KVH + h) * (D / 2);
        for (int p = 0; p < D / 2; ++p) kd[p * 16 + j] = src[p];
        const uint16_t* vs = v16 + (key * KVH + h) * D;
        uint16_t* vrow = vd + (j / 2) * 2 * D + (j % 2);
        for (int d = 0; d < D; ++d) vrow[2 * d] = vs[d];
      }
    }
  });
  const int64_t rows = nq * G, blocks = (rows + PF_ROWS - 1) / PF_ROWS;
  const uint16_t* q16 = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const bool out_f32 = out.scalar_type() == at::kFloat;
  at::parallel_for(0, KVH * blocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int h = int(i / blocks);
      const int64_t r0 = (i % blocks) * PF_ROWS, r1 = std::min(rows, r0 + PF_ROWS);
      prefill_block(q16, out.data_ptr(), out_f32, lse_p, kp.data() + h * nk32 * (D / 2),
                    vp.data() + h * (nk32 / 2) * D, nq, nk, H, G, h, D, float(scale), causal, r0, r1);
    }
  });
#else
  TORCH_CHECK(false, "prefill_bf16 needs a CPU with AVX512-BF16 (check has_prefill_bf16())");
#endif
}

// The kernels run without the GIL (their arguments are converted before, their results after): a
// replica's event loop (requests in, outputs out) runs in another thread of the same process while
// the engine thread is in a kernel; holding it there stalled that loop for milliseconds a step.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("prefill_bf16", &prefill_bf16, "prefill attention in bf16 (AVX512-BF16), causal or not, with the LSE", nogil);
  m.def("has_prefill_bf16", &has_prefill_bf16, "whether prefill_bf16 was built");
  m.def("decode", &decode, "paged decode attention over dense / fp8 / fp4 pages", nogil);
  m.def("gather", &gather, "dequantize paged blocks into a contiguous tensor", nogil);
  m.def("store_fp4", &store_fp4, "quantize vectors to fp4 and write them to their slots", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm with the residual added first", nogil);
  m.def("rope_qk", &rope_qk, "RoPE on the query and key parts of the fused projection", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up", nogil);
  m.def("nonfinite_tokens", &nonfinite_tokens, "tokens whose K or V holds NaN/Inf", nogil);
  m.def("store_fp8", &store_fp8, "quantize vectors to fp8 (a scale per vector) and write them to their slots", nogil);
}
