// The CPU kernels, as XLA FFI custom calls (see cpu_kernels.py for how they are built and called).
//
// JaxserveRaggedPagedAttention: the CPU's counterpart of the Mosaic GPU attention kernel, with
// the semantics of ragged_paged_attention_reference. In pure JAX each chunk of pages is first
// gathered into a copy and then multiplied in many tiny batched matmuls, which reaches a few
// GB/s. Here every key and value row is read once, straight from its page, and scored against
// all the query rows that need it (the query heads sharing its KV head, and up to kQueryBlock
// tokens of one sequence). Units: (sequence, KV head, block of query tokens).
//
// JaxserveSmallMatmul: x [M, K] @ w, w [K, N] (or [N, K] with transposed), for the few rows of
// a decode step; the engine uses it for a tied LM head (x @ table.T), where XLA's CPU dot is
// slow. Each weight element is read once for all M rows. Units: blocks of output columns.
//
// Units are taken from an atomic counter by the calling thread and by helpers on XLA's
// intra-op thread pool (run_units).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#if defined(__linux__)
#include <sched.h>
#endif
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQueryBlock = 16;  // query tokens of one sequence that share a pass over its keys
constexpr int64_t kKeyChunk = 64;    // keys scored together before one softmax rescale
constexpr int64_t kTransposeRows = 8;  // from this many query rows, transposing a key chunk pays
constexpr int64_t kHeadsTogetherUnits = 16;  // from this many (sequence, token block) units, see Attention
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load(float x) { return x; }
inline float load(uint16_t bf16) {
  uint32_t bits = uint32_t(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float x, float* p) { *p = x; }
inline void store(float x, uint16_t* p) {  // bfloat16, round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) {
    *p = 0x7fc0;
    return;
  }
  bits += 0x7fff + ((bits >> 16) & 1);
  *p = uint16_t(bits >> 16);
}

// exp(x) for x <= 0 (scores minus their running maximum), in plain arithmetic; Cephes' expf
// polynomial, within 2 ulp. The AVX-512 build's softmax takes the same steps 16 lanes at once
// (exp_nonpositive16): the compiler does not vectorize the loop over this one. Below -87 it
// returns ~1e-38 rather than 0: callers zero masked entries themselves.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float z = x * x;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

template <typename KT>
inline float dot(const float* q, const KT* k, int64_t d) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * load(k[i]);
  return s;
}

struct Problem {
  const void* q;
  const void* k_pages;
  const void* v_pages;
  const int32_t* kv_lens;
  const int32_t* block_tables;
  const int32_t* query_start_loc;
  const int32_t* tree_mask;  // [num_tokens, tree_words]
  void* out;
  int64_t num_tokens, num_heads, head_dim, num_pages, page_size, num_kv_heads, num_seqs, max_pages;
  int64_t tree_words;  // a token sees new token j < 32 * tree_words only if bit j % 32 of word j / 32 is set
  float sm_scale, soft_cap;
  int64_t sliding_window;
  // Batch invariance: one summation order for a query row, whatever its unit's size and first
  // position (no transposed scores, key chunks aligned to kKeyChunk, sequential sums).
  bool fixed_order;
};

struct Unit {
  int32_t seq, kv_head;
  int64_t first, count;  // query tokens [first, first + count) of the sequence's new tokens
  int64_t kv_heads = 1;  // KV heads kv_head.. taken together (one decode token: see attend)
};

#if defined(__AVX512F__)
#define JAXSERVE_ATTEND_AVX512 1
// The decode rows of a unit (its query heads for one or a few tokens), head_dim a multiple of 16.
// A key's score was a dot product ending in a horizontal sum; here 16 keys' lane-wise products
// are reduced together (sums_of_16), and the value rows feed accumulators held in registers.
inline __m512 floats16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 floats16(const uint16_t* p) {  // bfloat16: the high half of a float
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Lane i of the result: the sum of v[i]'s 16 lanes. Pairs of vectors are folded into one, then
// pairs of those, down to one: 15 adds for the 16 sums, where 16 reductions take 64.
inline __m512 sums_of_16(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // per 128-bit lane: four keys' sums of that lane
    quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 2; ++j)  // 128-bit lanes: keys 8j..8j+3 (two halves), keys 8j+4..8j+7 (two halves)
    halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp_nonpositive on 16 lanes, the same steps. The compiler leaves the scalar loop over a row's
// scores unvectorized (its floor sits under the mask of skipped keys), and it cost a third of
// the decode units' own time.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // a NaN stays NaN, as in the scalar code
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(c));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// pr[c] = exp(sr[c] - max) for c < n, 0 where sr[c] is -inf (a skipped key); returns their sum.
inline float softmax_numerators(const float* sr, float max, int64_t n, float* pr) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const __mmask16 lanes = n - c0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - c0)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, sr + c0);
    const __mmask16 seen = lanes & _mm512_cmp_ps_mask(x, _mm512_set1_ps(kNegInf), _CMP_NEQ_UQ);
    const __m512 e = _mm512_maskz_mov_ps(seen, exp_nonpositive16(_mm512_sub_ps(x, _mm512_set1_ps(max))));
    _mm512_mask_storeu_ps(pr + c0, lanes, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// sr[c] = qr . k_rows[c] for c < n <= kKeyChunk (sr is written up to the next multiple of 16).
template <int NV, typename KT>
void decode_scores(const float* qr, const KT* const* k_rows, int64_t n, float* sr, int64_t off) {
  __m512 q[NV];
  for (int j = 0; j < NV; ++j) q[j] = _mm512_loadu_ps(qr + 16 * j);
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    __m512 t[16];
    for (int c = 0; c < 16; ++c) {
      const KT* k = k_rows[std::min<int64_t>(c0 + c, n - 1)] + off;  // past n: the last key again, unused
      __m512 s = _mm512_mul_ps(q[0], floats16(k));
      for (int j = 1; j < NV; ++j) s = _mm512_fmadd_ps(q[j], floats16(k + 16 * j), s);
      t[c] = s;
    }
    _mm512_storeu_ps(sr + c0, sums_of_16(t));
  }
}

// acc[r] += sum over c < n of pr[r][c] * v_rows[c] for MR rows (pr's rows kKeyChunk apart).
template <int NV, int MR, typename KT>
void decode_values(const float* pr, const KT* const* v_rows, int64_t n, float* acc, int64_t off) {
  __m512 a[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc + (r * NV + j) * 16);
  for (int64_t c = 0; c < n; ++c) {
    __m512 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = floats16(v_rows[c] + off + 16 * j);
    for (int r = 0; r < MR; ++r) {
      const __m512 w = _mm512_set1_ps(pr[r * kKeyChunk + c]);
      for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(w, v[j], a[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + (r * NV + j) * 16, a[r][j]);
}

// decode_values for any number of rows: blocks of as many as fit in registers with a value row.
template <int NV, typename KT>
void decode_values(const float* pr, const KT* const* v_rows, int64_t n, float* acc, int64_t rows, int64_t off) {
  constexpr int kRows = NV <= 4 ? 4 : 2;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    decode_values<NV, kRows>(pr + r * kKeyChunk, v_rows, n, acc + r * NV * 16, off);
  const float* pr_left = pr + r * kKeyChunk;
  float* acc_left = acc + r * NV * 16;
  switch (rows - r) {
    case 3: decode_values<NV, 3>(pr_left, v_rows, n, acc_left, off); break;
    case 2: decode_values<NV, 2>(pr_left, v_rows, n, acc_left, off); break;
    case 1: decode_values<NV, 1>(pr_left, v_rows, n, acc_left, off); break;
    default: break;
  }
}
#endif

// One unit: the query heads of `kv_head` for `count` new tokens of `seq`, over its context.
// kD: the head dim when known at compile time (the loops over it unroll), else 0.
// A decode token's unit may take `kv_heads` KV heads together: a page holds a token's heads side by
// side, so each key chunk is then read as one contiguous run per token instead of one per head.
template <typename QT, typename KT, int kD>
void attend(const Problem& p, const Unit& u) {
  const int64_t groups = p.num_heads / p.num_kv_heads, d = kD ? kD : p.head_dim;
  const int64_t heads_rows = u.kv_heads * groups, rows = u.count * heads_rows;  // query rows per token, in all
  const int64_t q_len = p.query_start_loc[u.seq + 1] - p.query_start_loc[u.seq];
  const int64_t kv_len = std::min<int64_t>(p.kv_lens[u.seq], p.max_pages * p.page_size);
  const int64_t new0 = kv_len - q_len;  // position of the sequence's first new token
  const int64_t token0 = p.query_start_loc[u.seq] + u.first;
  const QT* q = static_cast<const QT*>(p.q);
  QT* out = static_cast<QT*>(p.out);
  const KT* k_pages = static_cast<const KT*>(p.k_pages);
  const KT* v_pages = static_cast<const KT*>(p.v_pages);
  const int32_t* table = p.block_tables + int64_t(u.seq) * p.max_pages;

  // Many rows (a prefill block): score against a transposed copy of each key chunk.
  const bool transposed = !p.fixed_order && u.count * groups >= kTransposeRows;
#if defined(JAXSERVE_ATTEND_AVX512)
  constexpr int kVectors = kD % 16 == 0 ? kD / 16 : 0;  // a head's row in AVX-512 vectors
  // Fewer rows (decode): 16 keys scored at once, values into registers. Not in the fixed order,
  // whose sums must be those of a prefill chunk's rows.
  const bool decode = kVectors > 0 && !transposed && !p.fixed_order;
#else
  const bool decode = false;
#endif
  if (u.kv_heads > 1 && !(decode && u.count == 1)) {  // heads together only where the decode path runs
    for (int64_t h = 0; h < u.kv_heads; ++h) attend<QT, KT, kD>(p, {u.seq, int32_t(u.kv_head + h), u.first, u.count});
    return;
  }
  thread_local std::vector<float> buf;
  buf.resize(rows * (2 * d + 2 + 2 * kKeyChunk) + d * kKeyChunk);
  float* qf = buf.data();               // [rows, d]: row i * groups + g, scaled
  float* acc = qf + rows * d;           // [rows, d]
  float* m = acc + rows * d;            // [rows]: running maximum
  float* l = m + rows;                  // [rows]: running sum
  float* s = l + rows;                  // [rows, kKeyChunk]: scores
  float* pr = s + rows * kKeyChunk;     // [rows, kKeyChunk]: probabilities
  float* kt = pr + rows * kKeyChunk;    // [d, kKeyChunk]: the key chunk, transposed
  for (int64_t i = 0; i < u.count; ++i)
    for (int64_t g = 0; g < heads_rows; ++g) {
      const QT* src = q + ((token0 + i) * p.num_heads + u.kv_head * groups + g) * d;
      float* dst = qf + (i * heads_rows + g) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = load(src[e]) * p.sm_scale;
    }
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);

  const int64_t pos0 = new0 + u.first, last = pos0 + u.count - 1;  // first and last query positions
  int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, pos0 - p.sliding_window + 1) : 0;
  if (p.fixed_order) lo -= lo % kKeyChunk;  // the same chunks for every unit (earlier keys masked)
  bool plain_tree = true;  // no tree mask among this unit's tokens
  for (int64_t i = token0 * p.tree_words; i < (token0 + u.count) * p.tree_words; ++i)
    plain_tree = plain_tree && p.tree_mask[i] == -1;
  const KT* k_rows[kKeyChunk];
  const KT* v_rows[kKeyChunk];
  for (int64_t start = lo; start <= last && start < kv_len; start += kKeyChunk) {
    const int64_t n = std::min<int64_t>({kKeyChunk, last + 1 - start, kv_len - start});
    const auto offset_of = [&](int64_t pos) {
      const int64_t page = std::clamp<int64_t>(table[pos / p.page_size], 0, p.num_pages - 1);
      return ((page * p.page_size + pos % p.page_size) * p.num_kv_heads + u.kv_head) * d;
    };
    for (int64_t c = 0; c < n; ++c) {
      const int64_t offset = offset_of(start + c);
      k_rows[c] = k_pages + offset;
      v_rows[c] = v_pages + offset;
    }
#if defined(JAXSERVE_ATTEND_AVX512)
    // The next chunk's rows (its pages lie anywhere), into L2 while this one is computed: a slice
    // after each query row's scores. All at once, or into L1, the prefetches wait on each other
    // (the core's miss buffers) instead of beside the arithmetic: 64 decode rows on one core,
    // 79 and 68 ms against 62.
    int64_t prefetched = start + kKeyChunk;
    const int64_t prefetch_end = decode ? std::min<int64_t>({start + 2 * kKeyChunk, last + 1, kv_len}) : prefetched;
    const auto prefetch_until = [&](int64_t until) {
      constexpr int64_t kLine = 64 / sizeof(KT);
      for (; prefetched < std::min(until, prefetch_end); ++prefetched) {
        const int64_t offset = offset_of(prefetched);
        for (int64_t e = 0; e < u.kv_heads * d; e += kLine) {
          _mm_prefetch(reinterpret_cast<const char*>(k_pages + offset + e), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(v_pages + offset + e), _MM_HINT_T1);
        }
      }
    };
#endif
    if (transposed) {  // scores of all rows at once: keys as columns, no per-dot horizontal sum
      for (int64_t c = 0; c < n; ++c)
        for (int64_t e = 0; e < d; ++e) kt[e * kKeyChunk + c] = load(k_rows[c][e]);
      for (int64_t r = 0; r < rows; ++r) {
        float row[kKeyChunk] = {};
        const float* qr = qf + r * d;
        for (int64_t e = 0; e < d; ++e) {
          const float qe = qr[e];
          const float* col = kt + e * kKeyChunk;
#pragma omp simd
          for (int64_t c = 0; c < kKeyChunk; ++c) row[c] += qe * col[c];
        }
        std::copy(row, row + n, s + r * kKeyChunk);
      }
    }
    // Usually every row sees every key of the chunk: no mask to work out per key.
    const bool all_seen = start + n - 1 <= pos0 && (p.sliding_window <= 0 || start > last - p.sliding_window) &&
                          (plain_tree || start + n - 1 < new0);
    for (int64_t i = 0; i < u.count; ++i) {
      const int64_t qpos = pos0 + i;
      const int32_t* words = p.tree_mask + (token0 + i) * p.tree_words;
      for (int64_t g = 0; g < heads_rows; ++g) {
        const int64_t r = i * heads_rows + g;
        float* sr = s + r * kKeyChunk;
#if defined(JAXSERVE_ATTEND_AVX512)
        if constexpr (kVectors > 0)
          if (decode) decode_scores<kVectors>(qf + r * d, k_rows, n, sr, g / groups * d);
        if (decode) prefetch_until(start + kKeyChunk + (r + 1) * kKeyChunk / rows);
#endif
        if (!transposed && !decode)
          for (int64_t c = 0; c < n; ++c) sr[c] = dot(qf + r * d, k_rows[c], d);
        if (p.soft_cap > 0)
          for (int64_t c = 0; c < n; ++c) sr[c] = p.soft_cap * std::tanh(sr[c] / p.soft_cap);
        if (!all_seen)
          for (int64_t c = 0; c < n; ++c) {
            const int64_t pos = start + c, j = pos - new0;  // j: offset among the new tokens
            bool seen = pos <= qpos && (p.sliding_window <= 0 || pos > qpos - p.sliding_window);
            seen = seen && (j < 0 || j >= 32 * p.tree_words || ((words[j / 32] >> (j % 32)) & 1));
            if (!seen) sr[c] = kNegInf;
          }
        float chunk_max = kNegInf;
#pragma omp simd reduction(max : chunk_max)
        for (int64_t c = 0; c < n; ++c) chunk_max = std::max(chunk_max, sr[c]);
        float* prr = pr + r * kKeyChunk;
        if (chunk_max == kNegInf) {  // nothing this row may see in the chunk
          std::fill(prr, prr + n, 0.0f);
          continue;
        }
        const float m_new = std::max(m[r], chunk_max);
        const float alpha = m[r] == kNegInf ? 0.0f : exp_nonpositive(m[r] - m_new);
#if defined(JAXSERVE_ATTEND_AVX512)
        float sum = softmax_numerators(sr, m_new, n, prr);
#else
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < n; ++c) {
          const float e = sr[c] == kNegInf ? 0.0f : exp_nonpositive(sr[c] - m_new);
          prr[c] = e;
          sum += e;
        }
#endif
        if (p.fixed_order) {  // the vectorized sum's order depends on n; masked keys add exact zeros
          sum = 0.0f;
          for (int64_t c = 0; c < n; ++c) sum += prr[c];
        }
        m[r] = m_new;
        l[r] = l[r] * alpha + sum;
        if (alpha != 1.0f) {
          float* ar = acc + r * d;
#pragma omp simd
          for (int64_t e = 0; e < d; ++e) ar[e] *= alpha;
        }
      }
    }
#if defined(JAXSERVE_ATTEND_AVX512)
    if constexpr (kVectors > 0)
      if (decode) {  // a unit of several heads has one token: each head's rows lie together
        for (int64_t h = 0; h < u.kv_heads; ++h)
          decode_values<kVectors>(pr + h * groups * kKeyChunk, v_rows, n, acc + h * groups * d,
                                  u.kv_heads == 1 ? rows : groups, h * d);
        continue;
      }
#endif
    for (int64_t c = 0; c < n; ++c) {  // each value row once, into every row that saw it
      const KT* v = v_rows[c];
      for (int64_t r = 0; r < rows; ++r) {
        const float w = pr[r * kKeyChunk + c];
        if (w == 0.0f) continue;
        float* ar = acc + r * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) ar[e] += w * load(v[e]);
      }
    }
  }
  for (int64_t i = 0; i < u.count; ++i)
    for (int64_t g = 0; g < heads_rows; ++g) {
      const int64_t r = i * heads_rows + g;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      QT* dst = out + ((token0 + i) * p.num_heads + u.kv_head * groups + g) * d;
      for (int64_t e = 0; e < d; ++e) store(acc[r * d + e] * inv, dst + e);
    }
}

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Work a call shares with helper threads: every thread runs work(), which returns when
// nothing is left for it. The calling thread alone can run all of it, so a helper that
// comes late (or never) only costs speed, and a late one finds nothing left to do.
struct Job {
  virtual ~Job() = default;
  virtual void work() = 0;
};

// Helpers from XLA's pool that stay a little after their job. A decode step calls these
// kernels 60 or more times in a row, tens of microseconds apart, and waking a parked pool
// thread for each call cost 30-50 us; a helper that lingers is handed the next job at once.
class Helpers {
 public:
  // Starts `wanted` helpers on `job`: lingering ones first, then new tasks on the pool.
  void start(ffi::ThreadPool& pool, const std::shared_ptr<Job>& job, int64_t wanted) {
    int64_t handed = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      idle_ += seats_;  // a job no lingering helper took yet: its seats go back
      handed = std::min(idle_, wanted);
      idle_ -= handed;
      offered_ = handed ? job : nullptr;
      seats_ = handed;
      generation_.fetch_add(1, std::memory_order_release);
    }
    for (int64_t i = handed; i < wanted; ++i) pool.Schedule([this, job] { serve(job); });
  }

 private:
  // Single-stream decode on two cores, tok/s against no lingering (about 39): 10 us alike,
  // 15-25 us about 41, 40 us and more slower again (the spinning takes a core from XLA).
  static constexpr auto kLinger = std::chrono::microseconds(20);

  void serve(std::shared_ptr<Job> job) {
    while (job) {
      job->work();
      job = linger();
    }
  }

  // Waits up to kLinger for a job offered to the idle helpers; nullptr: none came.
  std::shared_ptr<Job> linger() {
    uint64_t seen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++idle_;
      seen = generation_.load(std::memory_order_relaxed);
    }
    const auto until = std::chrono::steady_clock::now() + kLinger;
    for (int spins = 0;; ++spins) {
      const bool offer = generation_.load(std::memory_order_acquire) != seen;
      const bool late = !offer && spins % 64 == 0 && std::chrono::steady_clock::now() > until;
      if (offer || late) {
        std::lock_guard<std::mutex> lock(mu_);
        seen = generation_.load(std::memory_order_relaxed);
        if (seats_ > 0) {  // a seat was kept for an idle helper: this one takes it
          std::shared_ptr<Job> job = offered_;
          if (--seats_ == 0) offered_ = nullptr;
          return job;
        }
        if (late) {
          --idle_;
          return nullptr;
        }
      }
      spins < 1024 ? pause() : std::this_thread::yield();
    }
  }

  std::mutex mu_;
  std::atomic<uint64_t> generation_{0};  // bumped by every start
  int64_t idle_ = 0, seats_ = 0;          // helpers lingering unclaimed; seats kept on offered_
  std::shared_ptr<Job> offered_;
};

Helpers& helpers() {
  static Helpers* h = new Helpers();  // never destroyed: pool threads may still linger at exit
  return *h;
}

// The cores the calling thread may run on: the process's, or fewer where jaxserve pinned jax's
// threads (jaxserve.parallel.devices.pin_cpu_compute). Read once per thread: a pinned thread stays so.
int64_t usable_cores() {
  thread_local const int64_t n = [] {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max<int64_t>(1, CPU_COUNT(&set));
#endif
    return std::max<int64_t>(1, std::thread::hardware_concurrency());
  }();
  return n;
}

// Helpers for a call that could use up to `most`: no more than the pool has, nor than the other
// cores this thread may use. On one core a helper would only take turns with the caller, spinning.
int64_t helper_count(ffi::ThreadPool& pool, int64_t most) {
  return std::max<int64_t>(0, std::min({most, int64_t(pool.num_threads()), usable_cores() - 1}));
}

// Runs run(i) for i in [0, n) on this thread and up to the pool's threads; returns when all are done.
// Helpers that start late find no work left, and hold `shared` (not this frame) meanwhile.
template <typename Run>
void run_units(ffi::ThreadPool& pool, int64_t n, Run run) {
  struct Shared : Job {
    Shared(Run run, int64_t n) : run(std::move(run)), n(n) {}
    Run run;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    void work() override {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        run(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(run), n);
  helpers().start(pool, shared, helper_count(pool, n - 1));
  shared->work();
  while (shared->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

template <typename QT, typename KT>
auto pick(int64_t head_dim) -> void (*)(const Problem&, const Unit&) {
  if (head_dim == 64) return attend<QT, KT, 64>;
  if (head_dim == 128) return attend<QT, KT, 128>;
  return attend<QT, KT, 0>;
}

template <typename QT>
void zero_rows(void* out, int64_t from, int64_t to, int64_t row) {
  QT* o = static_cast<QT*>(out);
  std::fill(o + from * row, o + to * row, QT(0));
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                     ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> block_tables,
                     ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> tree_mask,
                     ffi::Result<ffi::AnyBuffer> out, float sm_scale, int64_t sliding_window, float soft_cap,
                     bool fixed_order) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("expected q [T, H, D], pages [P, page_size, KV, D], tables [S, max_pages]");
  const auto qt = q.element_type(), kt = k_pages.element_type();
  const bool q_ok = qt == ffi::DataType::F32 || qt == ffi::DataType::BF16;
  const bool k_ok = kt == ffi::DataType::F32 || kt == ffi::DataType::BF16;
  if (!q_ok || !k_ok || v_pages.element_type() != kt || out->element_type() != qt)
    return ffi::Error::InvalidArgument("q and the pages must be float32 or bfloat16, K and V alike, out as q");
  Problem p{q.untyped_data(), k_pages.untyped_data(), v_pages.untyped_data(), kv_lens.typed_data(),
            block_tables.typed_data(), query_start_loc.typed_data(), tree_mask.typed_data(),
            out->untyped_data(), qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[0], td[1],
            qd[0] ? int64_t(tree_mask.element_count()) / qd[0] : 1, sm_scale, soft_cap, sliding_window, fixed_order};
  if (kd[3] != p.head_dim || p.num_heads % p.num_kv_heads || kv_lens.element_count() != size_t(p.num_seqs) ||
      query_start_loc.element_count() != size_t(p.num_seqs + 1) || p.tree_words < 1 ||
      tree_mask.element_count() != size_t(p.num_tokens * p.tree_words))
    return ffi::Error::InvalidArgument("inconsistent shapes for ragged paged attention");

  const bool q32 = qt == ffi::DataType::F32, k32 = kt == ffi::DataType::F32;
  const auto run = q32 ? (k32 ? pick<float, float>(p.head_dim) : pick<float, uint16_t>(p.head_dim))
                       : (k32 ? pick<uint16_t, float>(p.head_dim) : pick<uint16_t, uint16_t>(p.head_dim));
  // Units, and zeros for the tokens no sequence owns (padding).
  std::vector<Unit> units;
  const int32_t* qsl = p.query_start_loc;
  std::vector<char> owned(p.num_tokens, 0);
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const int64_t begin = std::clamp<int64_t>(qsl[s], 0, p.num_tokens);
    const int64_t end = std::clamp<int64_t>(qsl[s + 1], begin, p.num_tokens);
    if (end == begin || p.kv_lens[s] < end - begin) continue;  // empty, or not a valid sequence
    if (end - begin != qsl[s + 1] - qsl[s]) continue;
    std::fill(owned.begin() + begin, owned.begin() + end, 1);
    for (int64_t first = 0; first < end - begin; first += kQueryBlock)
      for (int32_t h = 0; h < p.num_kv_heads; ++h) units.push_back({s, h, first, std::min(kQueryBlock, end - begin - first)});
  }
  const int64_t row = p.num_heads * p.head_dim;
  for (int64_t t = 0; t < p.num_tokens; ++t)
    if (!owned[t]) (q32 ? zero_rows<float> : zero_rows<uint16_t>)(p.out, t, t + 1, row);
  // With many units, a thread takes a block of query tokens for all KV heads at once: a page holds
  // a token's heads side by side, so one thread then reads it whole, from memory once (11 % faster
  // on 64 decode rows). With few, every head is a unit of its own, so that both cores have work.
  const int64_t heads = int64_t(units.size()) >= kHeadsTogetherUnits * p.num_kv_heads ? p.num_kv_heads : 1;
  run_units(pool, int64_t(units.size()) / heads, [&p, &units, run, heads](int64_t i) {
    const Unit& u = units[i * heads];
    run(p, {u.seq, u.kv_head, u.first, u.count, heads});  // one decode token: its heads read together
  });
  return ffi::Error::Success();
}

constexpr int64_t kMaxRows = 16;       // rows of x a small matmul takes
constexpr int64_t kColumnBlock = 256;  // output columns per unit ([K, N] weights)
constexpr int64_t kRowBlock = 64;      // weight rows per unit ([N, K] weights)

// y[:, cols] = x @ w[:, cols] for w [K, N]: each weight row's slice read once, for all rows of x.
template <typename XT, typename WT>
void matmul_columns(const XT* x, const WT* w, XT* y, int64_t m, int64_t k, int64_t n, int64_t col0, int64_t cols) {
  float acc[kMaxRows][kColumnBlock] = {};
  float xf[kMaxRows];
  for (int64_t i = 0; i < k; ++i) {
    const WT* wi = w + i * n + col0;
    for (int64_t r = 0; r < m; ++r) xf[r] = load(x[r * k + i]);
    for (int64_t r = 0; r < m; ++r) {
      const float xr = xf[r];
      float* ar = acc[r];
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) ar[c] += xr * load(wi[c]);
    }
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < cols; ++c) store(acc[r][c], y + r * n + col0 + c);
}

// y[:, rows] = x @ w[rows].T for w [N, K] (a tied embedding as the LM head).
template <typename XT, typename WT>
void matmul_rows(const XT* x, const WT* w, XT* y, int64_t m, int64_t k, int64_t n, int64_t row0, int64_t rows) {
  thread_local std::vector<float> xf;
  xf.resize(m * k);
  for (int64_t e = 0; e < m * k; ++e) xf[e] = load(x[e]);
  int64_t j = row0;
  for (; j + 4 <= row0 + rows; j += 4)  // four weight rows at once: four independent sums in flight
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = xf.data() + r * k;
      const WT *w0 = w + j * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t i = 0; i < k; ++i) {
        const float xi = xr[i];
        s0 += xi * load(w0[i]);
        s1 += xi * load(w1[i]);
        s2 += xi * load(w2[i]);
        s3 += xi * load(w3[i]);
      }
      XT* yr = y + r * n + j;
      store(s0, yr), store(s1, yr + 1), store(s2, yr + 2), store(s3, yr + 3);
    }
  for (; j < row0 + rows; ++j)
    for (int64_t r = 0; r < m; ++r) store(dot(xf.data() + r * k, w + j * k, k), y + r * n + j);
}

template <typename XT, typename WT>
void small_matmul(ffi::ThreadPool& pool, const void* x, const void* w, void* y, int64_t m, int64_t k, int64_t n,
                  bool transposed) {
  const XT* xt = static_cast<const XT*>(x);
  const WT* wt = static_cast<const WT*>(w);
  XT* yt = static_cast<XT*>(y);
  const int64_t block = transposed ? kRowBlock : kColumnBlock;
  run_units(pool, (n + block - 1) / block, [=](int64_t u) {
    const int64_t first = u * block, count = std::min(block, n - first);
    if (transposed)
      matmul_rows(xt, wt, yt, m, k, n, first, count);
    else
      matmul_columns(xt, wt, yt, m, k, n, first, count);
  });
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                       bool transposed) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[0] > kMaxRows || xd[1] != wd[transposed ? 1 : 0])
    return ffi::Error::InvalidArgument("expected x [M <= 16, K] and w [K, N] (or [N, K] transposed)");
  const auto xt = x.element_type(), wt = w.element_type();
  const bool x_ok = xt == ffi::DataType::F32 || xt == ffi::DataType::BF16;
  const bool w_ok = wt == ffi::DataType::F32 || wt == ffi::DataType::BF16;
  if (!x_ok || !w_ok || y->element_type() != xt)
    return ffi::Error::InvalidArgument("x and w must be float32 or bfloat16, y as x");
  const int64_t m = xd[0], k = xd[1], n = transposed ? wd[0] : wd[1];
  const bool x32 = xt == ffi::DataType::F32, w32 = wt == ffi::DataType::F32;
  const auto run = x32 ? (w32 ? small_matmul<float, float> : small_matmul<float, uint16_t>)
                       : (w32 ? small_matmul<uint16_t, float> : small_matmul<uint16_t, uint16_t>);
  run(pool, x.untyped_data(), w.untyped_data(), y->untyped_data(), m, k, n, transposed);
  return ffi::Error::Success();
}

// ---- Float products of a few dozen rows (JaxserveDenseMatmul) ----
//
// y = x @ w for w [K, N] as the model stores it. A unit is a tile of kDenseTile output columns for
// every row of x, in blocks of kDenseRowBlock rows: a block's 8 x 48 sums live in 24 AVX-512
// registers through K, so each weight value read feeds eight FMAs (small_matmul's column loop
// keeps its sums in memory, which costs more than XLA's dot from about 8 rows). A tile's rows lie
// N apart, a page or more, which the hardware prefetcher does not follow: while its first row
// block runs, a worker prefetches the tile it will likely take next (read on demand, the same
// loop ran at 55-75 % of the speed; with it, as fast as on weights packed at load). Each sum is
// one fma chain over k in order, so a row's result is the same bits whatever the other rows of
// the call (batch invariance), with AVX-512 or not. (The greedy argmax below uses the same
// AVX-512 test.)
constexpr int64_t kDenseTile = 48;
constexpr int64_t kDenseRowBlock = 8;
// Rows of x the engine sends here; more (a prefill) go to XLA's dot, which packs its operands.
constexpr int64_t kDenseMaxRows = 64;

// A unit's tile of a weight (and, passed as `next`, the one to prefetch meanwhile).
template <typename WT>
struct DenseTile {
  const WT* w;   // the tile's first column in row 0
  int64_t n;     // the weight's row stride (its N)
  int64_t cols;  // kDenseTile, or fewer in a last tile
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define JAXSERVE_DENSE_AVX512 1
// 16 weights as floats; the lanes outside `mask` zero (a full mask reads without one).
inline __m512 load_masked(const float* p, __mmask16 mask) {
  return mask == 0xffff ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask, p);
}
inline __m512 load_masked(const uint16_t* p, __mmask16 mask) {  // bfloat16: the high half of a float
  const __m256i bits = mask == 0xffff ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                      : _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __mmask16 lanes_from(int64_t cols, int64_t first) {
  const int64_t left = std::clamp<int64_t>(cols - first, 0, 16);
  return __mmask16((1u << left) - 1);
}

// One block's sums over k in [0, K) into out [MR][kDenseTile]; with kPrefetch, the next tile's
// rows are fetched too; kRagged: a last tile of fewer columns, read with masks. (The sums are
// this function's locals, and the loops separate, so that the compiler keeps the sums in
// registers: with masked loads for every tile, or a branch in the loop, it stored them to the
// stack every step, at 40 % of the speed.)
template <int MR, bool kPrefetch, bool kRagged, typename XT, typename WT>
void dense_sums(const XT* x, int64_t k, const WT* w, int64_t n, __mmask16 m0, __mmask16 m1, __mmask16 m2,
                const char* next, int64_t next_n, int64_t next_bytes, float* out) {
  __m512 acc[MR][3];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    if constexpr (kPrefetch) {
      const char* p = next + i * next_n * int64_t(sizeof(WT));
      for (int64_t b = 0; b < next_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
      _mm_prefetch(p + next_bytes - 1, _MM_HINT_T1);  // the last line, where the tile is not aligned
    }
    const WT* wi = w + i * n;
    __m512 w0, w1, w2;
    if constexpr (kRagged)
      w0 = load_masked(wi, m0), w1 = load_masked(wi + 16, m1), w2 = load_masked(wi + 32, m2);
    else
      w0 = load_masked(wi, 0xffff), w1 = load_masked(wi + 16, 0xffff), w2 = load_masked(wi + 32, 0xffff);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(load(x[r * k + i]));
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) _mm512_storeu_ps(out + r * kDenseTile + 16 * j, acc[r][j]);
}

template <int MR, typename XT, typename WT>
void dense_block(const XT* x, int64_t k, const DenseTile<WT>& tile, XT* y, int64_t ldy, const DenseTile<WT>* next) {
  const int64_t cols = tile.cols;
  const __mmask16 m0 = lanes_from(cols, 0), m1 = lanes_from(cols, 16), m2 = lanes_from(cols, 32);
  alignas(64) float sums[MR * kDenseTile];
  const char* ahead = next ? reinterpret_cast<const char*>(next->w) : nullptr;
  const int64_t ahead_n = next ? next->n : 0, ahead_bytes = next ? next->cols * int64_t(sizeof(WT)) : 0;
  if (cols < kDenseTile)  // a last tile: it has no next
    dense_sums<MR, false, true>(x, k, tile.w, tile.n, m0, m1, m2, nullptr, 0, 0, sums);
  else if (next)
    dense_sums<MR, true, false>(x, k, tile.w, tile.n, m0, m1, m2, ahead, ahead_n, ahead_bytes, sums);
  else
    dense_sums<MR, false, false>(x, k, tile.w, tile.n, m0, m1, m2, nullptr, 0, 0, sums);
  for (int r = 0; r < MR; ++r) {
    const float* s = sums + r * kDenseTile;
    XT* yr = y + r * ldy;
    if constexpr (std::is_same_v<XT, float>)
      std::memcpy(yr, s, cols * sizeof(float));
    else
      for (int64_t c = 0; c < cols; ++c) store(s[c], yr + c);
  }
}

template <typename XT, typename WT>
void dense_tile(const XT* x, int64_t m, int64_t k, const DenseTile<WT>& tile, XT* y, const DenseTile<WT>* next) {
  using Block = void (*)(const XT*, int64_t, const DenseTile<WT>&, XT*, int64_t, const DenseTile<WT>*);
  static constexpr Block blocks[kDenseRowBlock + 1] = {
      nullptr,
      dense_block<1, XT, WT>,
      dense_block<2, XT, WT>,
      dense_block<3, XT, WT>,
      dense_block<4, XT, WT>,
      dense_block<5, XT, WT>,
      dense_block<6, XT, WT>,
      dense_block<7, XT, WT>,
      dense_block<8, XT, WT>,
  };
  for (int64_t r = 0; r < m; r += kDenseRowBlock) {
    const int64_t rows = std::min(kDenseRowBlock, m - r);
    blocks[rows](x + r * k, k, tile, y + r * tile.n, tile.n, r == 0 ? next : nullptr);
  }
}
#else
// The same fma chains, one sum at a time.
template <typename XT, typename WT>
void dense_tile(const XT* x, int64_t m, int64_t k, const DenseTile<WT>& tile, XT* y, const DenseTile<WT>*) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < tile.cols; ++c) {
      float sum = 0.0f;
      for (int64_t i = 0; i < k; ++i) sum = std::fma(load(x[r * k + i]), load(tile.w[i * tile.n + c]), sum);
      store(sum, y + r * tile.n + c);
    }
}
#endif

#if defined(JAXSERVE_DENSE_AVX512)
constexpr bool kDenseVectorized = true;
#else
constexpr bool kDenseVectorized = false;
#endif

template <typename XT, typename WT>
void dense_matmuls(ffi::ThreadPool& pool, const XT* x, int64_t m, int64_t k, const std::vector<const void*>& ws,
                   const std::vector<int64_t>& ns, const std::vector<void*>& ys) {
  std::vector<DenseTile<WT>> tiles;  // every weight's tiles, one unit each
  std::vector<XT*> outs;             // where each tile's columns start in its y
  for (size_t j = 0; j < ws.size(); ++j)
    for (int64_t c = 0; c < ns[j]; c += kDenseTile) {
      tiles.push_back({static_cast<const WT*>(ws[j]) + c, ns[j], std::min(kDenseTile, ns[j] - c)});
      outs.push_back(static_cast<XT*>(ys[j]) + c);
    }
  // run_units hands out units in turn, so a worker's next unit is about `workers` further on.
  const int64_t units = int64_t(tiles.size());
  const int64_t workers = 1 + helper_count(pool, units - 1);
  run_units(pool, units, [&](int64_t u) {
    const int64_t after = u + workers;
    dense_tile(x, m, k, tiles[u], outs[u], after < units ? &tiles[after] : nullptr);
  });
}

// x [M <= 64, K], then one w [K, N] per output y [M, N]; float32 or bfloat16 (the weights one dtype).
ffi::Error DenseMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto xd = x.dimensions();
  const auto xt = x.element_type();
  const bool x_ok = xt == ffi::DataType::F32 || xt == ffi::DataType::BF16;
  if (xd.size() != 2 || xd[0] > kDenseMaxRows || !x_ok || rets.size() == 0 || args.size() != rets.size())
    return ffi::Error::InvalidArgument("dense_matmul: expected x [M <= 64, K] float32 or bfloat16, then a w per y");
  const int64_t m = xd[0], k = xd[1];
  std::vector<const void*> ws;
  std::vector<void*> ys;
  std::vector<int64_t> ns;
  ffi::DataType wt = ffi::DataType::F32;
  for (size_t j = 0; j < args.size(); ++j) {
    auto w = args.get<ffi::AnyBuffer>(j);
    auto y = rets.get<ffi::AnyBuffer>(j);
    if (w.has_error() || y.has_error()) return ffi::Error::InvalidArgument("dense_matmul: unreadable buffers");
    auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (j == 0) wt = w->element_type();
    const bool w_ok = w->element_type() == wt && (wt == ffi::DataType::F32 || wt == ffi::DataType::BF16);
    if (wd.size() != 2 || wd[0] != k || !w_ok || yd.size() != 2 || yd[0] != m || yd[1] != wd[1] ||
        (*y)->element_type() != xt)
      return ffi::Error::InvalidArgument(
          "dense_matmul: each w must be [K, N] (float32 or bfloat16, all alike) and its y [M, N] in x's dtype");
    ws.push_back(w->untyped_data());
    ys.push_back((*y)->untyped_data());
    ns.push_back(wd[1]);
  }
  const bool x32 = xt == ffi::DataType::F32, w32 = wt == ffi::DataType::F32;
  const void* xp = x.untyped_data();
  if (x32 && w32)
    dense_matmuls<float, float>(pool, static_cast<const float*>(xp), m, k, ws, ns, ys);
  else if (x32)
    dense_matmuls<float, uint16_t>(pool, static_cast<const float*>(xp), m, k, ws, ns, ys);
  else if (w32)
    dense_matmuls<uint16_t, float>(pool, static_cast<const uint16_t*>(xp), m, k, ws, ns, ys);
  else
    dense_matmuls<uint16_t, uint16_t>(pool, static_cast<const uint16_t*>(xp), m, k, ws, ns, ys);
  return ffi::Error::Success();
}

// ---- The greedy token of each row (JaxserveGreedyArgmax) ----
//
// jnp.argmax over each row of float32 logits [S, V], bit for bit: the first maximum, or the
// first NaN of a row that has one. XLA's CPU argmax reduces (value, index) pairs, and the
// sampler's max-compare-min form loses XLA's fast reductions in the same program as the
// sampler's draw (4.8 against 0.7 ms on [48, 49152]); here a row is read twice from cache:
// its maximum (and whether it has a NaN), then where that maximum first is.
int32_t first_of(const float* row, int64_t v, float value, bool nan) {
  int64_t i = 0;
#if defined(JAXSERVE_DENSE_AVX512)
  const __m512 want = _mm512_set1_ps(value);
  for (; i + 16 <= v; i += 16) {
    const __m512 x = _mm512_loadu_ps(row + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(x, want, _CMP_EQ_OQ);
    if (hit) return int32_t(i + __builtin_ctz(hit));
  }
#endif
  for (; i < v; ++i)
    if (nan ? std::isnan(row[i]) : row[i] == value) return int32_t(i);
  return 0;  // not reached: the maximum is in the row
}

int32_t row_argmax(const float* row, int64_t v) {
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(JAXSERVE_DENSE_AVX512)
  __m512 tops = _mm512_set1_ps(top);
  __mmask16 nans = 0;
  for (; i + 16 <= v; i += 16) {
    const __m512 x = _mm512_loadu_ps(row + i);
    nans |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    tops = _mm512_max_ps(tops, x);
  }
  top = _mm512_reduce_max_ps(tops), nan = nans != 0;
#endif
  for (; i < v; ++i) {
    nan = nan || std::isnan(row[i]);
    top = std::max(top, row[i]);
  }
  return first_of(row, v, top, nan);
}

ffi::Error GreedyArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  auto d = logits.dimensions();
  if (d.size() != 2 || d[1] < 1 || out->element_count() != size_t(d[0]))
    return ffi::Error::InvalidArgument("greedy_argmax: expected logits [S, V >= 1] and out [S]");
  const int64_t s = d[0], v = d[1];
  const float* x = logits.typed_data();
  int32_t* y = out->typed_data();
  constexpr int64_t kRowsPerUnit = 4;
  run_units(pool, (s + kRowsPerUnit - 1) / kRowsPerUnit, [=](int64_t u) {
    for (int64_t r = u * kRowsPerUnit; r < std::min(s, (u + 1) * kRowsPerUnit); ++r) y[r] = row_argmax(x + r * v, v);
  });
  return ffi::Error::Success();
}

// ---- 4-bit weights for a few rows (JaxserveQuantizedMatmul) ----
//
// y = x @ W for an int4 weight W [K, N] (w[k, n] = scales[g, n] * nibble + offsets[g, n] for
// g = k / group, as in quantized_matmul.py) in the tiled layout of cpu_kernels.tile_int4: tiles of
// kInt4Tile output columns, each stored whole, so that a tile streams from memory in order:
//   packed [tiles, K / 2, kInt4Tile] (k = 2i in the low nibble of row i, 2i + 1 in the high one),
//   scales and offsets [tiles, G, kInt4Tile], float32, or float16 where it holds them exactly.
// (The canonical [K / 2, N] layout read a tile as K / 2 strided pieces: 2.5x slower from memory.)
// A group's sum is taken over the nibbles and scaled once, as llama.cpp's Q4_1 dot does:
//   sum_k x[k] w[k, n] = scales[g, n] * sum_k x[k] q[k, n] + offsets[g, n] * sum_k x[k],
// so the weight is read at half a byte a value and never written out as floats (the pure-JAX
// path dequantizes the whole weight to floats first, every step). A unit is one tile; a column's
// sums run in one order (int4_column) whatever the rows of the call (batch invariance).
constexpr int64_t kInt4Tile = 32;
// Rows of x the quantized kernels take: a tile's weights are converted in registers once per
// four rows, so up to 64 rows (a batch of decode steps) still beat dequantizing the whole
// weight to floats first (the pure-JAX path, which longer steps take).
constexpr int64_t kQuantizedMaxRows = 64;

// A float16 value (an int4 weight's scales and offsets where float16 holds them exactly, as GGUF's
// own d and m: half the bytes of float32 to read).
struct Half {
  uint16_t bits;
};
inline float load(Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.bits);
#else
  const uint32_t sign = uint32_t(h.bits & 0x8000) << 16, exp = (h.bits >> 10) & 0x1f, man = h.bits & 0x3ff;
  float f;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    f = std::ldexp(float(man), -24);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// With AVX-512 a tile's 32 columns are two vectors: a step converts its weights once for up to
// four rows in registers, twice the columns of an AVX2 vector per instruction. Each lane (column)
// runs the same fma chain as with AVX2 or none, so the sums are the same bits.
#if defined(__AVX512F__)
#define JAXSERVE_AVX512 1
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

// Column c of a tile for one row: its nibble sums group by group, each pair as
// fma(b, high, fma(a, low, sum)), then total = fma(offset, xsum, fma(scale, sum, total)).
template <typename ST>
float int4_column(const float* x, const float* xsum, const uint8_t* packed, const ST* scales, const ST* offsets,
                  int64_t k, int64_t group, int64_t c) {
  float total = 0.0f;
  for (int64_t g = 0; g < k / group; ++g) {
    float sum = 0.0f;
    for (int64_t i = g * group / 2; i < (g + 1) * group / 2; ++i) {
      const uint8_t q = packed[i * kInt4Tile + c];
      sum = std::fma(x[2 * i + 1], float(q >> 4), std::fma(x[2 * i], float(q & 15), sum));
    }
    total = std::fma(load(offsets[g * kInt4Tile + c]), xsum[g], std::fma(load(scales[g * kInt4Tile + c]), sum, total));
  }
  return total;
}

#if defined(__AVX2__) && defined(__FMA__)
// int4_column for R rows and C vectors of 8 columns from column c0 of a tile, in registers: the
// nibbles converted once for all rows. out[r] gets the C * 8 columns.
template <int R, int C, typename ST>
void int4_columns_avx2(const float* const* x, const float* const* xsum, const uint8_t* packed, const ST* scales,
                       const ST* offsets, int64_t k, int64_t group, int64_t c0, float* const* out) {
  __m256 total[R][C];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) total[r][v] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32(15);
  for (int64_t g = 0; g < k / group; ++g) {
    __m256 sum[R][C];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < C; ++v) sum[r][v] = _mm256_setzero_ps();
    for (int64_t i = g * group / 2; i < (g + 1) * group / 2; ++i) {
      const uint8_t* row = packed + i * kInt4Tile + c0;
      __m256 lo[C], hi[C];
      for (int v = 0; v < C; ++v) {
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * v)));
        lo[v] = _mm256_cvtepi32_ps(_mm256_and_si256(q, mask));
        hi[v] = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(x[r] + 2 * i), b = _mm256_broadcast_ss(x[r] + 2 * i + 1);
        for (int v = 0; v < C; ++v) sum[r][v] = _mm256_fmadd_ps(b, hi[v], _mm256_fmadd_ps(a, lo[v], sum[r][v]));
      }
    }
    for (int v = 0; v < C; ++v) {
      const __m256 s = load8(scales + g * kInt4Tile + c0 + 8 * v), o = load8(offsets + g * kInt4Tile + c0 + 8 * v);
      for (int r = 0; r < R; ++r)
        total[r][v] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(xsum[r] + g), _mm256_fmadd_ps(s, sum[r][v], total[r][v]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) _mm256_storeu_ps(out[r] + 8 * v, total[r][v]);
}

#if defined(JAXSERVE_AVX512)
// int4_columns_avx2 for R rows and a whole tile (two vectors of 16 columns).
template <int R, typename ST>
void int4_tile_avx512(const float* const* x, const float* const* xsum, const uint8_t* packed, const ST* scales,
                      const ST* offsets, int64_t k, int64_t group, float* const* out) {
  __m512 total[R][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) total[r][v] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(15);
  for (int64_t g = 0; g < k / group; ++g) {
    __m512 sum[R][2];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v) sum[r][v] = _mm512_setzero_ps();
    for (int64_t i = g * group / 2; i < (g + 1) * group / 2; ++i) {
      const uint8_t* row = packed + i * kInt4Tile;
      __m512 lo[2], hi[2];
      for (int v = 0; v < 2; ++v) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v)));
        lo[v] = _mm512_cvtepi32_ps(_mm512_and_si512(q, mask));
        hi[v] = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r][2 * i]), b = _mm512_set1_ps(x[r][2 * i + 1]);
        for (int v = 0; v < 2; ++v) sum[r][v] = _mm512_fmadd_ps(b, hi[v], _mm512_fmadd_ps(a, lo[v], sum[r][v]));
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m512 s = load16(scales + g * kInt4Tile + 16 * v), o = load16(offsets + g * kInt4Tile + 16 * v);
      for (int r = 0; r < R; ++r)
        total[r][v] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[r][g]), _mm512_fmadd_ps(s, sum[r][v], total[r][v]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(out[r] + 16 * v, total[r][v]);
}
#endif

// Rows [r0, r0 + R) of one tile: one row holds a whole tile in registers (4 vectors); two or
// four rows take it in halves (the nibbles of a half converted once for all of them).
template <int R, typename ST>
void int4_tile_rows(const float* xf, const float* xsums, const uint8_t* packed, const ST* scales, const ST* offsets,
                    int64_t k, int64_t group, int64_t r0, float* out) {
  const float *x[R], *xs[R];
  float* o[R];
  for (int r = 0; r < R; ++r) x[r] = xf + (r0 + r) * k, xs[r] = xsums + (r0 + r) * (k / group);
#if defined(JAXSERVE_AVX512)
  for (int r = 0; r < R; ++r) o[r] = out + (r0 + r) * kInt4Tile;
  int4_tile_avx512<R>(x, xs, packed, scales, offsets, k, group, o);
#else
  if (R == 1) {
    o[0] = out + r0 * kInt4Tile;
    return int4_columns_avx2<R, 4>(x, xs, packed, scales, offsets, k, group, 0, o);
  }
  for (int64_t half = 0; half < kInt4Tile; half += 16) {
    for (int r = 0; r < R; ++r) o[r] = out + (r0 + r) * kInt4Tile + half;
    int4_columns_avx2<R, 2>(x, xs, packed, scales, offsets, k, group, half, o);
  }
#endif
}
#endif

// One tile for all m rows: out [m, kInt4Tile].
template <typename ST>
void int4_tile(const float* xf, const float* xsums, const uint8_t* packed, const ST* scales, const ST* offsets,
               int64_t m, int64_t k, int64_t group, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) int4_tile_rows<4>(xf, xsums, packed, scales, offsets, k, group, r, out);
  for (; r + 2 <= m; r += 2) int4_tile_rows<2>(xf, xsums, packed, scales, offsets, k, group, r, out);
  for (; r < m; ++r) int4_tile_rows<1>(xf, xsums, packed, scales, offsets, k, group, r, out);
#else
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < kInt4Tile; ++c)
      out[r * kInt4Tile + c] =
          int4_column(xf + r * k, xsums + r * (k / group), packed, scales, offsets, k, group, c);
#endif
}

// x [m, k] as floats (the kernels' sums run in float32 whatever x's dtype).
template <typename XT>
std::vector<float> as_floats(const XT* x, int64_t count) {
  std::vector<float> xf(count);
  for (int64_t e = 0; e < count; ++e) xf[e] = load(x[e]);
  return xf;
}

// Tile t's [m, kInt4Tile] sums into its columns of y [m, n] (those past n are the layout's
// zero padding, dropped here).
template <typename XT>
void store_tile(const float* out, XT* y, int64_t m, int64_t n, int64_t t) {
  const int64_t first = t * kInt4Tile, cols = std::min(kInt4Tile, n - first);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < cols; ++c) store(out[r * kInt4Tile + c], y + r * n + first + c);
}

// x's sum over each group of `group` values, per row: [m, k / group].
std::vector<float> group_sums(const std::vector<float>& xf, int64_t m, int64_t k, int64_t group) {
  std::vector<float> sums(m * (k / group));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      float total = 0.0f;
      for (int64_t e = g * group; e < (g + 1) * group; e += 2) total += xf[r * k + e] + xf[r * k + e + 1];
      sums[r * (k / group) + g] = total;
    }
  return sums;
}

// ---- 8-bit weights for a few rows (JaxserveQuantizedMatmul) ----
//
// y = x @ W for W [K, N] with w[k, n] = scales[g, n] * q[k, n] (+ offsets[g, n]), q int8 and
// g = k / group: GGUF's Q8_0 blocks (32 values and a float16 scale), as a tied LM head's table
// often comes, its Q5_0 and Q6_K blocks, and with offsets its Q5_1 and Q5_K ones. Tiled as the
// int4 weights are (cpu_kernels.tile_int8): q [tiles, K, kInt4Tile], scales (and offsets)
// [tiles, G, kInt4Tile] in float32 or float16. A group's sum is taken over the int8 values and
// scaled once (llama.cpp's Q8_0 dot), its offset times the group's sum of x added after (as the
// int4 kernel does), in one order per column whatever the rows of the call. Without offsets
// (nullptr) there is no offset term at all.

template <typename ST>
float int8_column(const float* x, const float* xsum, const int8_t* q, const ST* scales, const ST* offsets, int64_t k,
                  int64_t group, int64_t c) {
  float total = 0.0f;
  for (int64_t g = 0; g < k / group; ++g) {
    float sum = 0.0f;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) sum = std::fma(x[i], float(q[i * kInt4Tile + c]), sum);
    total = std::fma(load(scales[g * kInt4Tile + c]), sum, total);
    if (offsets) total = std::fma(load(offsets[g * kInt4Tile + c]), xsum[g], total);
  }
  return total;
}

#if defined(__AVX2__) && defined(__FMA__)
// int8_column for R rows and C vectors of 8 columns from column c0 of a tile, in registers: the
// int8 values converted once for all rows. out[r] gets the C * 8 columns.
template <int R, int C, typename ST>
void int8_columns_avx2(const float* const* x, const float* const* xsum, const int8_t* q, const ST* scales,
                       const ST* offsets, int64_t k, int64_t group, int64_t c0, float* const* out) {
  __m256 total[R][C];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) total[r][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < k / group; ++g) {
    __m256 sum[R][C];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < C; ++v) sum[r][v] = _mm256_setzero_ps();
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      const int8_t* row = q + i * kInt4Tile + c0;
      __m256 w[C];
      for (int v = 0; v < C; ++v)
        w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * v))));
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(x[r] + i);
        for (int v = 0; v < C; ++v) sum[r][v] = _mm256_fmadd_ps(a, w[v], sum[r][v]);
      }
    }
    for (int v = 0; v < C; ++v) {
      const __m256 s = load8(scales + g * kInt4Tile + c0 + 8 * v);
      for (int r = 0; r < R; ++r) total[r][v] = _mm256_fmadd_ps(s, sum[r][v], total[r][v]);
      if (offsets) {
        const __m256 o = load8(offsets + g * kInt4Tile + c0 + 8 * v);
        for (int r = 0; r < R; ++r) total[r][v] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(xsum[r] + g), total[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < C; ++v) _mm256_storeu_ps(out[r] + 8 * v, total[r][v]);
}
#endif

#if defined(JAXSERVE_AVX512)
// int8_columns_avx2 for R rows and a whole tile (two vectors of 16 columns).
template <int R, typename ST>
void int8_tile_avx512(const float* const* x, const float* const* xsum, const int8_t* q, const ST* scales,
                      const ST* offsets, int64_t k, int64_t group, float* const* out) {
  __m512 total[R][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) total[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / group; ++g) {
    __m512 sum[R][2];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 2; ++v) sum[r][v] = _mm512_setzero_ps();
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      const int8_t* row = q + i * kInt4Tile;
      __m512 w[2];
      for (int v = 0; v < 2; ++v)
        w[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v))));
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r][i]);
        for (int v = 0; v < 2; ++v) sum[r][v] = _mm512_fmadd_ps(a, w[v], sum[r][v]);
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m512 s = load16(scales + g * kInt4Tile + 16 * v);
      for (int r = 0; r < R; ++r) total[r][v] = _mm512_fmadd_ps(s, sum[r][v], total[r][v]);
      if (offsets) {
        const __m512 o = load16(offsets + g * kInt4Tile + 16 * v);
        for (int r = 0; r < R; ++r) total[r][v] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[r][g]), total[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(out[r] + 16 * v, total[r][v]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Rows [r0, r0 + R) of one tile, as int4_tile_rows takes them.
template <int R, typename ST>
void int8_tile_rows(const float* xf, const float* xsums, const int8_t* q, const ST* scales, const ST* offsets,
                    int64_t k, int64_t group, int64_t r0, float* out) {
  const float *x[R], *xs[R];
  float* o[R];
  for (int r = 0; r < R; ++r) x[r] = xf + (r0 + r) * k, xs[r] = xsums ? xsums + (r0 + r) * (k / group) : nullptr;
#if defined(JAXSERVE_AVX512)
  for (int r = 0; r < R; ++r) o[r] = out + (r0 + r) * kInt4Tile;
  int8_tile_avx512<R>(x, xs, q, scales, offsets, k, group, o);
#else
  if (R == 1) {
    o[0] = out + r0 * kInt4Tile;
    return int8_columns_avx2<R, 4>(x, xs, q, scales, offsets, k, group, 0, o);
  }
  for (int64_t half = 0; half < kInt4Tile; half += 16) {
    for (int r = 0; r < R; ++r) o[r] = out + (r0 + r) * kInt4Tile + half;
    int8_columns_avx2<R, 2>(x, xs, q, scales, offsets, k, group, half, o);
  }
#endif
}
#endif

// One tile for all m rows: out [m, kInt4Tile]. xsums [m, k / group]: x's group sums (with offsets).
template <typename ST>
void int8_tile(const float* xf, const float* xsums, const int8_t* q, const ST* scales, const ST* offsets, int64_t m,
               int64_t k, int64_t group, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) int8_tile_rows<4>(xf, xsums, q, scales, offsets, k, group, r, out);
  for (; r + 2 <= m; r += 2) int8_tile_rows<2>(xf, xsums, q, scales, offsets, k, group, r, out);
  for (; r < m; ++r) int8_tile_rows<1>(xf, xsums, q, scales, offsets, k, group, r, out);
#else
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < kInt4Tile; ++c)
      out[r * kInt4Tile + c] =
          int8_column(xf + r * k, xsums ? xsums + r * (k / group) : nullptr, q, scales, offsets, k, group, c);
#endif
}

// ---- Either kind, any mix, in one call: JaxserveQuantizedMatmul ----
//
// y_j = x @ W_j for int4 and int8 weights of one K (q, k and v, or gate and up): x converted and
// the helpers woken once, every weight's tiles one pool of units. Each weight has its own kind,
// group and scale dtype, as a GGUF's mixes come.

// One weight in its tiled layout: int4 (packed) or int8 (q), scales and offsets [tiles, G, 32];
// offsets nullptr: none (symmetric int8). n: its output columns (the last tile's rest is padding).
struct QuantWeight {
  const uint8_t* packed = nullptr;  // int4 [tiles, K / 2, 32]
  const int8_t* q = nullptr;        // int8 [tiles, K, 32]
  const void* scales = nullptr;
  const void* offsets = nullptr;
  bool half = false;  // float16 scales and offsets, else float32
  int64_t k = 0, n = 0, group = 0, tiles = 0;

  // x's group sums [m, k / group] where the weight has offsets (the tiles add offset * sum), else empty.
  std::vector<float> sums(const std::vector<float>& xf, int64_t m) const {
    return offsets ? group_sums(xf, m, k, group) : std::vector<float>();
  }
  // Tile t of x @ W for m rows of xf [m, k]: out [m, kInt4Tile]. xsums: sums(xf, m).
  void tile(const float* xf, const std::vector<float>& xsums, int64_t m, int64_t t, float* out) const {
    if (half)
      tile_as<Half>(xf, xsums, m, t, out);
    else
      tile_as<float>(xf, xsums, m, t, out);
  }

 private:
  template <typename ST>
  void tile_as(const float* xf, const std::vector<float>& xsums, int64_t m, int64_t t, float* out) const {
    const int64_t stride = t * (k / group) * kInt4Tile;
    const ST* s = static_cast<const ST*>(scales) + stride;
    const ST* o = offsets ? static_cast<const ST*>(offsets) + stride : nullptr;
    if (packed)
      int4_tile(xf, xsums.data(), packed + t * (k / 2) * kInt4Tile, s, o, m, k, group, out);
    else
      int8_tile(xf, offsets ? xsums.data() : nullptr, q + t * k * kInt4Tile, s, o, m, k, group, out);
  }
};

// The weight that starts at args[at], checked: int4 as packed (uint8), scales, offsets; int8 as q
// (int8), scales, and offsets where the next argument is a float array. `k`: its inputs; `n`: its
// outputs, 0 for any the tiles hold (the caller sets and checks it). Moves `at` past it; returns
// an empty string, or what is wrong.
std::string read_weight(const ffi::RemainingArgs& args, size_t& at, int64_t k, int64_t n, QuantWeight& w) {
  auto values = args.get<ffi::AnyBuffer>(at), scales = args.get<ffi::AnyBuffer>(at + 1);
  if (values.has_error() || scales.has_error()) return "a weight needs its values and scales";
  const bool int4 = values->element_type() == ffi::DataType::U8;
  if (!int4 && values->element_type() != ffi::DataType::S8)
    return "a weight's values must be uint8 (int4, packed) or int8";
  const auto st = scales->element_type();
  if (st != ffi::DataType::F32 && st != ffi::DataType::F16) return "scales must be float32 or float16";
  w = QuantWeight();
  const void* offsets = nullptr;
  at += 2;
  if (at < args.size()) {
    auto next = args.get<ffi::AnyBuffer>(at);
    if (next.has_error()) return "an unreadable argument";
    if (next->element_type() == ffi::DataType::F32 || next->element_type() == ffi::DataType::F16) {
      if (next->element_type() != st || !std::equal(next->dimensions().begin(), next->dimensions().end(),
                                                    scales->dimensions().begin(), scales->dimensions().end()))
        return "offsets must be as their scales: [tiles, G, 32], the same dtype";
      offsets = next->untyped_data();
      ++at;
    }
  }
  if (int4 && !offsets) return "an int4 weight needs offsets";
  auto vd = values->dimensions(), sd = scales->dimensions();
  if (vd.size() != 3 || sd.size() != 3 || vd[2] != kInt4Tile || sd[2] != kInt4Tile || sd[0] != vd[0] || sd[1] < 1)
    return "expected values [tiles, K (int8) or K / 2 (int4), 32] and scales [tiles, G, 32]";
  const int64_t rows = int4 ? 2 * vd[1] : vd[1];
  if (rows != k || k % sd[1]) return "a weight's K must be its input's, with G dividing it";
  // NOTE: x's group sums add pairs (group_sums): an offset needs an even group.
  if (offsets && (k / sd[1]) % 2) return "offsets need an even group size";
  if (n && !((vd[0] - 1) * kInt4Tile < n && n <= vd[0] * kInt4Tile)) return "N must fall in the last tile";
  if (int4)
    w.packed = static_cast<const uint8_t*>(values->untyped_data());
  else
    w.q = static_cast<const int8_t*>(values->untyped_data());
  w.scales = scales->untyped_data(), w.offsets = offsets, w.half = st == ffi::DataType::F16;
  w.k = k, w.n = n ? n : vd[0] * kInt4Tile, w.group = k / sd[1], w.tiles = vd[0];
  return "";
}

// The weights of a call, one after another from args[at] to the end.
std::string read_weights(const ffi::RemainingArgs& args, size_t at, int64_t k, const std::vector<int64_t>& ns,
                         std::vector<QuantWeight>& weights) {
  weights.resize(ns.size());
  for (size_t j = 0; j < ns.size(); ++j) {
    if (at >= args.size()) return "fewer weights than outputs";
    if (std::string why = read_weight(args, at, k, ns[j], weights[j]); !why.empty()) return why;
  }
  return at == args.size() ? "" : "more arguments than weights";
}

template <typename XT>
void quantized_matmuls(ffi::ThreadPool& pool, const XT* x, int64_t m, int64_t k, const std::vector<QuantWeight>& weights,
                       const std::vector<XT*>& ys) {
  const std::vector<float> xf = as_floats(x, m * k);
  std::vector<std::vector<float>> sums;
  std::vector<int64_t> first(1, 0);  // the first unit of each weight, and the total
  for (const QuantWeight& w : weights) {
    sums.push_back(w.sums(xf, m));
    first.push_back(first.back() + w.tiles);
  }
  run_units(pool, first.back(), [&](int64_t u) {
    size_t j = 0;
    while (u >= first[j + 1]) ++j;
    float out[kQuantizedMaxRows * kInt4Tile];
    weights[j].tile(xf.data(), sums[j], m, u - first[j], out);
    store_tile(out, ys[j], m, weights[j].n, u - first[j]);
  });
}

// x, then the weights (see read_weight); one y [M, N] per weight.
ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto xd = x.dimensions();
  const auto xt = x.element_type();
  if (xd.size() != 2 || xd[0] > kQuantizedMaxRows || rets.size() == 0)
    return ffi::Error::InvalidArgument("expected x [M <= 64, K], then a weight per output");
  if (xt != ffi::DataType::F32 && xt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("x must be float32 or bfloat16");
  const int64_t m = xd[0], k = xd[1];
  std::vector<int64_t> ns;
  std::vector<void*> ys;
  for (size_t j = 0; j < rets.size(); ++j) {
    auto y = rets.get<ffi::AnyBuffer>(j);
    if (y.has_error() || (*y)->dimensions().size() != 2 || (*y)->dimensions()[0] != m || (*y)->element_type() != xt)
      return ffi::Error::InvalidArgument("each y must be [M, N] in x's dtype");
    ns.push_back((*y)->dimensions()[1]);
    ys.push_back((*y)->untyped_data());
  }
  std::vector<QuantWeight> weights;
  if (std::string why = read_weights(args, 0, k, ns, weights); !why.empty())
    return ffi::Error::InvalidArgument("quantized_matmul: " + why);
  auto typed = [&](auto* x_typed) {
    using XT = std::remove_const_t<std::remove_pointer_t<decltype(x_typed)>>;
    std::vector<XT*> out;
    for (void* y : ys) out.push_back(static_cast<XT*>(y));
    quantized_matmuls(pool, x_typed, m, k, weights, out);
  };
  if (xt == ffi::DataType::F32)
    typed(static_cast<const float*>(x.untyped_data()));
  else
    typed(static_cast<const uint16_t*>(x.untyped_data()));
  return ffi::Error::Success();
}

// ---- Few-row decoder blocks: JaxserveNormQKV and JaxserveOProjMLP ----
//
// A decode step's layer as XLA runs it is a chain of a dozen small ops; on the CPU each op
// pays a dispatch and a wake-up of the thread pool, and the step's time grows well past its
// weight bytes over the read bandwidth. These kernels run each half of a layer as one call:
// phases of units (a K-split slice of a projection, a block of a reduction), with the
// calling thread and the pool's helpers spinning between phases instead of sleeping.

int64_t cores() {
  static const int64_t n = std::max<int64_t>(1, std::thread::hardware_concurrency());  // a system call
  return n;
}

// K-split units per projection: one per core (at two cores, 2 and 4 measured alike and 8 and
// 16 slower: each unit costs a partial sum to reduce), at least 64 rows each. A function of
// K and the machine, so that a row's result does not depend on how many rows run with it.
int64_t split_count(int64_t k) { return std::clamp<int64_t>(cores(), 1, std::max<int64_t>(1, k / 64)); }

template <typename T>
float rounded(float x) {  // x as the model's dtype holds it
  T t;
  store(x, &t);
  return load(t);
}

// Runs the phases in order: phase p's units i in [0, sizes[p]) as run(p, i), on this thread and
// on up to cores - 1 of the pool's threads. Between phases each thread spins (then yields) until
// every unit of the phase is done. A helper that starts late finds the phases done and leaves;
// the calling thread alone can run everything, so a busy pool only makes it slower.
template <typename Run>
void run_phases(ffi::ThreadPool& pool, std::vector<int64_t> sizes, Run run) {
  struct Shared : Job {
    Shared(std::vector<int64_t> sizes, Run run)
        : sizes(std::move(sizes)), run(std::move(run)), next(this->sizes.size()), done(this->sizes.size()) {
      for (size_t p = 0; p < this->sizes.size(); ++p) next[p].store(0), done[p].store(0);
    }
    std::vector<int64_t> sizes;
    Run run;
    std::vector<std::atomic<int64_t>> next, done;
    void work() override {
      for (size_t p = 0; p < sizes.size(); ++p) {
        for (int64_t i; (i = next[p].fetch_add(1, std::memory_order_relaxed)) < sizes[p];) {
          run(p, i);
          done[p].fetch_add(1, std::memory_order_release);
        }
        for (int spins = 0; done[p].load(std::memory_order_acquire) < sizes[p]; ++spins)
          spins < 4096 ? pause() : std::this_thread::yield();
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(sizes), std::move(run));
  helpers().start(pool, shared, helper_count(pool, cores() - 1));
  shared->work();
}

// part [m, n] = x[:, k0:k1] @ w[k0:k1, :] for w [k, n]: four weight rows per pass, in column
// tiles that keep the m accumulator rows in the L1 cache.
template <typename XT, typename WT>
void matmul_part(const XT* x, const WT* w, float* part, int64_t m, int64_t k, int64_t n, int64_t k0, int64_t k1) {
  std::fill(part, part + m * n, 0.0f);
  const int64_t tile = std::clamp<int64_t>(8192 / m, 64, n);
  for (int64_t c0 = 0; c0 < n; c0 += tile) {
    const int64_t cols = std::min(tile, n - c0);
    int64_t i = k0;
    for (; i + 4 <= k1; i += 4) {
      const WT *w0 = w + i * n + c0, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
      for (int64_t r = 0; r < m; ++r) {
        const float a0 = load(x[r * k + i]), a1 = load(x[r * k + i + 1]), a2 = load(x[r * k + i + 2]),
                    a3 = load(x[r * k + i + 3]);
        float* acc = part + r * n + c0;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c)
          acc[c] += a0 * load(w0[c]) + a1 * load(w1[c]) + a2 * load(w2[c]) + a3 * load(w3[c]);
      }
    }
    for (; i < k1; ++i)
      for (int64_t r = 0; r < m; ++r) {
        const float a = load(x[r * k + i]);
        const WT* wi = w + i * n + c0;
        float* acc = part + r * n + c0;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) acc[c] += a * load(wi[c]);
      }
  }
}

// One projection of a block: its m input rows, its weights [k, n], and its K-split partial sums.
template <typename XT, typename T>
struct Projection {
  const XT* x;
  const T* w;
  int64_t m, k, n, split;
  std::vector<float> parts;  // [split, m, n]
  Projection(const XT* x, const T* w, int64_t m, int64_t k, int64_t n)
      : x(x), w(w), m(m), k(k), n(n), split(split_count(k)), parts(split * m * n) {}
  void run(int64_t u) { matmul_part(x, w, parts.data() + u * m * n, m, k, n, k * u / split, k * (u + 1) / split); }
  float sum(int64_t r, int64_t c) const {  // (x @ w)[r, c]
    float total = 0.0f;
    for (int64_t u = 0; u < split; ++u) total += parts[(u * m + r) * n + c];
    return total;
  }
};

// h = weight * RMSNorm(x), rounded where the model's dtype rounds (jaxserve.model.RMSNorm).
template <typename T>
void rms_norm(const T* x, const T* weight, float eps, int64_t m, int64_t d, float* h) {
  for (int64_t r = 0; r < m; ++r) {
    float squares = 0.0f;
    for (int64_t e = 0; e < d; ++e) squares += load(x[r * d + e]) * load(x[r * d + e]);
    const float scale = 1.0f / std::sqrt(squares / float(d) + eps);
    for (int64_t e = 0; e < d; ++e)
      h[r * d + e] = rounded<T>(load(weight[e]) * rounded<T>(load(x[r * d + e]) * scale));
  }
}

constexpr int64_t kReduceBlock = 256;  // output columns per reduction unit

// q, k, v = RMSNorm(x) @ wq, wk, wv (without biases). Phases: the norm; the projections' K-split
// units; the partial sums reduced into the outputs, by blocks of columns.
template <typename T>
void norm_qkv(ffi::ThreadPool& pool, const T* x, const T* norm_w, const T* wq, const T* wk, const T* wv, float eps,
              int64_t m, int64_t d, int64_t nq, int64_t nk, T* q, T* k, T* v) {
  std::vector<float> h(m * d);
  std::vector<Projection<float, T>> proj;
  proj.reserve(3);
  proj.emplace_back(h.data(), wq, m, d, nq);
  proj.emplace_back(h.data(), wk, m, d, nk);
  proj.emplace_back(h.data(), wv, m, d, nk);
  T* outs[3] = {q, k, v};
  const int64_t split = proj[0].split, blocks = (nq + kReduceBlock - 1) / kReduceBlock,
                kv_blocks = (nk + kReduceBlock - 1) / kReduceBlock;
  run_phases(pool, {1, 3 * split, blocks + 2 * kv_blocks}, [&](size_t phase, int64_t i) {
    if (phase == 0) return rms_norm(x, norm_w, eps, m, d, h.data());
    if (phase == 1) return proj[i / split].run(i % split);
    const int64_t j = i < blocks ? 0 : 1 + (i - blocks) / kv_blocks;
    const int64_t block = j == 0 ? i : (i - blocks) % kv_blocks, n = proj[j].n;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = block * kReduceBlock; c < std::min(n, (block + 1) * kReduceBlock); ++c)
        store(proj[j].sum(r, c), outs[j] + r * n + c);
  });
}

// The rest of a layer: x1 = x + attn @ wo; out = x1 + MLP(RMSNorm(x1)), with the MLP
// down(silu(gate(h)) * up(h)). Phases: o_proj; the residual and the norm; gate and up; the
// activation; down; the residual.
template <typename T>
void o_proj_mlp(ffi::ThreadPool& pool, const T* attn, const T* x, const T* wo, const T* norm_w, const T* wg,
                const T* wu, const T* wd, float eps, int64_t m, int64_t a, int64_t d, int64_t f, T* out) {
  std::vector<T> x1(m * d);
  std::vector<float> h(m * d), act(m * f);
  Projection<T, T> o(attn, wo, m, a, d);
  Projection<float, T> gate(h.data(), wg, m, d, f), up(h.data(), wu, m, d, f);
  Projection<float, T> down(act.data(), wd, m, f, d);
  const int64_t act_blocks = (f + kReduceBlock - 1) / kReduceBlock;
  run_phases(pool, {o.split, 1, 2 * gate.split, act_blocks, down.split, 1}, [&](size_t phase, int64_t i) {
    switch (phase) {
      case 0: return o.run(i);
      case 1:
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < d; ++c)
            store(load(x[r * d + c]) + rounded<T>(o.sum(r, c)), &x1[r * d + c]);
        return rms_norm(x1.data(), norm_w, eps, m, d, h.data());
      case 2: return (i < gate.split ? gate : up).run(i % gate.split);
      case 3:
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = i * kReduceBlock; c < std::min(f, (i + 1) * kReduceBlock); ++c) {
            const float g = rounded<T>(gate.sum(r, c)), u = rounded<T>(up.sum(r, c));
            act[r * f + c] = rounded<T>(rounded<T>(g / (1.0f + std::exp(-g))) * u);
          }
        return;
      case 4: return down.run(i);
      default:
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < d; ++c)
            store(load(x1[r * d + c]) + rounded<T>(down.sum(r, c)), out + r * d + c);
    }
  });
}

// ---- A mixture of experts for a few tokens: JaxserveMoeExperts ----
//
// y[t] = sum over token t's choices j of weights[t, j] * expert_{chosen[t, j]}(x[t]), each expert
// down(silu(gate(x)) * up(x)) on weights stacked [E, D, F] (gate, up) and [E, F, D] (down), as
// moe.run_touched_experts computes it: float32 sums, each projection rounded to the model's dtype,
// and a token's weighted outputs added in ascending expert order. Only the experts some token
// chose are read, each once, on its own tokens. As o_proj_mlp, each projection is K-split over
// the cores (contiguous weight rows per unit). Phases: gate and up of every touched expert; the
// activation, by (expert, block of F columns); down; the weighted sums, by token. A row's result
// depends only on its token (batch invariance).
template <typename T>
void moe_experts(ffi::ThreadPool& pool, const T* x, const int32_t* chosen, const float* weights, const T* wg,
                 const T* wu, const T* wd, int64_t t, int64_t k, int64_t e, int64_t d, int64_t f, T* y) {
  // The (token, choice) pairs sorted by expert, tokens in order within an expert (a counting sort).
  std::vector<int64_t> starts(e + 1, 0), pair_row(t * k, -1);
  for (int64_t i = 0; i < t * k; ++i)
    if (chosen[i] >= 0 && chosen[i] < e) ++starts[chosen[i] + 1];  // no such expert: the pair adds nothing
  for (int64_t ex = 0; ex < e; ++ex) starts[ex + 1] += starts[ex];
  std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
  const int64_t rows = starts[e];
  std::vector<T> xs(rows * d);  // x's rows in sorted order
  for (int64_t i = 0; i < t * k; ++i)
    if (chosen[i] >= 0 && chosen[i] < e) {
      pair_row[i] = fill[chosen[i]]++;
      std::copy(x + (i / k) * d, x + (i / k + 1) * d, xs.begin() + pair_row[i] * d);
    }
  std::vector<float> act(rows * f);
  std::vector<int64_t> touched;
  std::vector<Projection<T, T>> gate, up;
  std::vector<Projection<float, T>> down;
  gate.reserve(e), up.reserve(e), down.reserve(e);
  for (int64_t ex = 0; ex < e; ++ex) {
    const int64_t m = starts[ex + 1] - starts[ex];
    if (m == 0) continue;
    touched.push_back(ex);
    gate.emplace_back(xs.data() + starts[ex] * d, wg + ex * d * f, m, d, f);
    up.emplace_back(xs.data() + starts[ex] * d, wu + ex * d * f, m, d, f);
    down.emplace_back(act.data() + starts[ex] * f, wd + ex * f * d, m, f, d);
  }
  const int64_t n = int64_t(touched.size()), split = split_count(d), down_split = split_count(f);
  const int64_t act_blocks = (f + kReduceBlock - 1) / kReduceBlock;
  run_phases(pool, {2 * n * split, n * act_blocks, n * down_split, t}, [&](size_t phase, int64_t i) {
    switch (phase) {
      case 0: return (i % 2 ? up : gate)[i / 2 / split].run(i / 2 % split);
      case 1: {
        const int64_t j = i / act_blocks, block = i % act_blocks, first = starts[touched[j]];
        for (int64_t r = 0; r < gate[j].m; ++r)
          for (int64_t c = block * kReduceBlock; c < std::min(f, (block + 1) * kReduceBlock); ++c) {
            const float g = rounded<T>(gate[j].sum(r, c)), u = rounded<T>(up[j].sum(r, c));
            act[(first + r) * f + c] = rounded<T>(rounded<T>(g / (1.0f + std::exp(-g))) * u);
          }
        return;
      }
      case 2: return down[i / down_split].run(i % down_split);
      default: {  // token i's weighted sum, in ascending expert order as the expert loop adds them
        struct Pick {
          int64_t at, row;  // index among the touched experts, row among its tokens
          float weight;
          bool operator<(const Pick& o) const { return at < o.at; }
        };
        std::vector<Pick> mine;
        for (int64_t j = 0; j < k; ++j)
          if (pair_row[i * k + j] >= 0) {
            const int64_t ex = chosen[i * k + j];
            const int64_t at = std::lower_bound(touched.begin(), touched.end(), ex) - touched.begin();
            mine.push_back({at, pair_row[i * k + j] - starts[ex], weights[i * k + j]});
          }
        std::sort(mine.begin(), mine.end());
        for (int64_t c = 0; c < d; ++c) {
          float sum = 0.0f;
          for (const Pick& p : mine) sum += rounded<T>(down[p.at].sum(p.row, c)) * p.weight;
          store(sum, y + i * d + c);
        }
      }
    }
  });
}

bool is_float(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

template <typename Buffer>
bool shape_is(const Buffer& b, std::initializer_list<int64_t> dims) {
  auto got = b.dimensions();
  return got.size() == dims.size() && std::equal(dims.begin(), dims.end(), got.begin());
}

ffi::Error NormQKV(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer norm_w, ffi::AnyBuffer wq,
                   ffi::AnyBuffer wk, ffi::AnyBuffer wv, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> k,
                   ffi::Result<ffi::AnyBuffer> v, float eps) {
  const auto t = x.element_type();
  for (auto type : {norm_w.element_type(), wq.element_type(), wk.element_type(), wv.element_type(),
                    q->element_type(), k->element_type(), v->element_type()})
    if (!is_float(t) || type != t) return ffi::Error::InvalidArgument("every array must be float32, or every bfloat16");
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] > kMaxRows || wq.dimensions().size() != 2 || wk.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("expected x [M <= 16, D] and weights [D, N]");
  const int64_t m = xd[0], d = xd[1], nq = wq.dimensions()[1], nk = wk.dimensions()[1];
  if (!shape_is(norm_w, {d}) || !shape_is(wq, {d, nq}) || !shape_is(wk, {d, nk}) || !shape_is(wv, {d, nk}) ||
      !shape_is(*q, {m, nq}) || !shape_is(*k, {m, nk}) || !shape_is(*v, {m, nk}))
    return ffi::Error::InvalidArgument("inconsistent shapes for norm_qkv");
  if (t == ffi::DataType::F32)
    norm_qkv<float>(pool, x.typed_data<float>(), norm_w.typed_data<float>(), wq.typed_data<float>(),
                    wk.typed_data<float>(), wv.typed_data<float>(), eps, m, d, nq, nk, q->typed_data<float>(),
                    k->typed_data<float>(), v->typed_data<float>());
  else
    norm_qkv<uint16_t>(pool, static_cast<const uint16_t*>(x.untyped_data()),
                       static_cast<const uint16_t*>(norm_w.untyped_data()),
                       static_cast<const uint16_t*>(wq.untyped_data()), static_cast<const uint16_t*>(wk.untyped_data()),
                       static_cast<const uint16_t*>(wv.untyped_data()), eps, m, d, nq, nk,
                       static_cast<uint16_t*>(q->untyped_data()), static_cast<uint16_t*>(k->untyped_data()),
                       static_cast<uint16_t*>(v->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error OProjMLP(ffi::ThreadPool pool, ffi::AnyBuffer attn, ffi::AnyBuffer x, ffi::AnyBuffer wo,
                    ffi::AnyBuffer norm_w, ffi::AnyBuffer wg, ffi::AnyBuffer wu, ffi::AnyBuffer wd,
                    ffi::Result<ffi::AnyBuffer> out, float eps) {
  const auto t = x.element_type();
  for (auto type : {attn.element_type(), wo.element_type(), norm_w.element_type(), wg.element_type(),
                    wu.element_type(), wd.element_type(), out->element_type()})
    if (!is_float(t) || type != t) return ffi::Error::InvalidArgument("every array must be float32, or every bfloat16");
  auto ad = attn.dimensions(), xd = x.dimensions(), gd = wg.dimensions();
  if (ad.size() != 2 || xd.size() != 2 || gd.size() != 2 || ad[0] > kMaxRows)
    return ffi::Error::InvalidArgument("expected attn [M <= 16, A], x [M, D] and weights [K, N]");
  const int64_t m = ad[0], a = ad[1], d = xd[1], f = gd[1];
  if (!shape_is(x, {m, d}) || !shape_is(wo, {a, d}) || !shape_is(norm_w, {d}) || !shape_is(wg, {d, f}) ||
      !shape_is(wu, {d, f}) || !shape_is(wd, {f, d}) || !shape_is(*out, {m, d}))
    return ffi::Error::InvalidArgument("inconsistent shapes for o_proj_mlp");
  if (t == ffi::DataType::F32)
    o_proj_mlp<float>(pool, attn.typed_data<float>(), x.typed_data<float>(), wo.typed_data<float>(),
                      norm_w.typed_data<float>(), wg.typed_data<float>(), wu.typed_data<float>(),
                      wd.typed_data<float>(), eps, m, a, d, f, out->typed_data<float>());
  else {
    auto in = [](const ffi::AnyBuffer& b) { return static_cast<const uint16_t*>(b.untyped_data()); };
    o_proj_mlp<uint16_t>(pool, in(attn), in(x), in(wo), in(norm_w), in(wg), in(wu), in(wd), eps, m, a, d, f,
                         static_cast<uint16_t*>(out->untyped_data()));
  }
  return ffi::Error::Success();
}

// ---- The same blocks on 4- and 8-bit weights: JaxserveQuantizedNormQKV, JaxserveQuantizedOProjMLP ----
//
// norm_qkv and o_proj_mlp for a layer whose projections are QuantWeights (int4 or int8, each its
// own layout), computed as the model's ops compute them with the quantized_matmul products: the
// same rounding to the model's dtype between them. A unit is a tile of 32 output columns (a
// weight's tiles already give the cores enough units; no K-split).

template <typename T>
void quantized_norm_qkv(ffi::ThreadPool& pool, const T* x, const T* norm_w, const std::vector<QuantWeight>& w,
                        float eps, int64_t m, int64_t d, T* const* outs) {
  std::vector<float> h(m * d);
  std::vector<std::vector<float>> sums(3);
  const int64_t first[4] = {0, w[0].tiles, w[0].tiles + w[1].tiles, w[0].tiles + w[1].tiles + w[2].tiles};
  run_phases(pool, {1, first[3]}, [&](size_t phase, int64_t u) {
    if (phase == 0) {
      rms_norm(x, norm_w, eps, m, d, h.data());
      for (int j = 0; j < 3; ++j) sums[j] = w[j].sums(h, m);
      return;
    }
    const int j = u < first[1] ? 0 : u < first[2] ? 1 : 2;
    float tile[kQuantizedMaxRows * kInt4Tile];
    w[j].tile(h.data(), sums[j], m, u - first[j], tile);
    store_tile(tile, outs[j], m, w[j].n, u - first[j]);
  });
}

// w: o_proj, gate, up, down. Phases: o_proj's tiles; the residual, the norm; gate's and up's tile
// t together, with the activation of their columns; the activation's group sums (for down's
// offsets); down's tiles, each adding its columns' residual.
template <typename T>
void quantized_o_proj_mlp(ffi::ThreadPool& pool, const T* attn, const T* x, const T* norm_w,
                          const std::vector<QuantWeight>& w, float eps, int64_t m, int64_t a, int64_t d, T* out) {
  const QuantWeight &wo = w[0], &wg = w[1], &wu = w[2], &wd = w[3];
  const int64_t f = wd.k;
  const std::vector<float> af = as_floats(attn, m * a), a_sums = wo.sums(af, m);
  std::vector<float> o(m * d), h(m * d), act(m * f), h_sums_g, h_sums_u, act_sums;
  std::vector<T> x1(m * d);
  run_phases(pool, {wo.tiles, 1, wg.tiles, 1, wd.tiles}, [&](size_t phase, int64_t t) {
    float tile[kQuantizedMaxRows * kInt4Tile];
    switch (phase) {
      case 0:
        wo.tile(af.data(), a_sums, m, t, tile);
        return store_tile(tile, o.data(), m, d, t);
      case 1:
        for (int64_t e = 0; e < m * d; ++e) store(load(x[e]) + rounded<T>(o[e]), &x1[e]);
        rms_norm(x1.data(), norm_w, eps, m, d, h.data());
        h_sums_g = wg.sums(h, m), h_sums_u = wu.sums(h, m);
        return;
      case 2: {
        float up[kQuantizedMaxRows * kInt4Tile];
        wg.tile(h.data(), h_sums_g, m, t, tile);
        wu.tile(h.data(), h_sums_u, m, t, up);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = t * kInt4Tile; c < std::min(f, (t + 1) * kInt4Tile); ++c) {
            const int64_t i = r * kInt4Tile + c - t * kInt4Tile;
            const float gc = rounded<T>(tile[i]), uc = rounded<T>(up[i]);
            act[r * f + c] = rounded<T>(rounded<T>(gc / (1.0f + std::exp(-gc))) * uc);
          }
        return;
      }
      case 3:
        act_sums = wd.sums(act, m);
        return;
      default:
        wd.tile(act.data(), act_sums, m, t, tile);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = t * kInt4Tile; c < std::min(d, (t + 1) * kInt4Tile); ++c)
            store(load(x1[r * d + c]) + rounded<T>(tile[r * kInt4Tile + c - t * kInt4Tile]), out + r * d + c);
    }
  });
}

// The activations of a quantized layer block, checked: float32 or bfloat16, one dtype.
bool one_float_dtype(std::initializer_list<ffi::DataType> types) {
  for (auto t : types)
    if (!is_float(t) || t != *types.begin()) return false;
  return true;
}

ffi::Error QuantizedNormQKV(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer norm_w, ffi::RemainingArgs args,
                            ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> k,
                            ffi::Result<ffi::AnyBuffer> v, float eps) {
  if (!one_float_dtype({x.element_type(), norm_w.element_type(), q->element_type(), k->element_type(),
                        v->element_type()}))
    return ffi::Error::InvalidArgument("x, the norm's weight and q, k, v must be float32, or bfloat16");
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] > kQuantizedMaxRows) return ffi::Error::InvalidArgument("expected x [M <= 64, D]");
  const int64_t m = xd[0], d = xd[1];
  ffi::AnyBuffer* outs[3] = {&*q, &*k, &*v};
  std::vector<int64_t> ns;
  for (auto* out : outs) {
    if (out->dimensions().size() != 2 || out->dimensions()[0] != m)
      return ffi::Error::InvalidArgument("q, k and v must be [M, N]");
    ns.push_back(out->dimensions()[1]);
  }
  std::vector<QuantWeight> w;
  if (!shape_is(norm_w, {d})) return ffi::Error::InvalidArgument("the norm's weight must be [D]");
  if (std::string why = read_weights(args, 0, d, ns, w); !why.empty())
    return ffi::Error::InvalidArgument("quantized_norm_qkv: " + why);
  if (x.element_type() == ffi::DataType::F32) {
    float* ys[3] = {q->typed_data<float>(), k->typed_data<float>(), v->typed_data<float>()};
    quantized_norm_qkv<float>(pool, x.typed_data<float>(), norm_w.typed_data<float>(), w, eps, m, d, ys);
  } else {
    uint16_t* ys[3];
    for (int j = 0; j < 3; ++j) ys[j] = static_cast<uint16_t*>(outs[j]->untyped_data());
    quantized_norm_qkv<uint16_t>(pool, static_cast<const uint16_t*>(x.untyped_data()),
                                 static_cast<const uint16_t*>(norm_w.untyped_data()), w, eps, m, d, ys);
  }
  return ffi::Error::Success();
}

ffi::Error QuantizedOProjMLP(ffi::ThreadPool pool, ffi::AnyBuffer attn, ffi::AnyBuffer x, ffi::AnyBuffer norm_w,
                             ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out, float eps) {
  if (!one_float_dtype({x.element_type(), attn.element_type(), norm_w.element_type(), out->element_type()}))
    return ffi::Error::InvalidArgument("attn, x, the norm's weight and the result must be float32, or bfloat16");
  auto ad = attn.dimensions(), xd = x.dimensions();
  if (ad.size() != 2 || xd.size() != 2 || ad[0] > kQuantizedMaxRows || xd[0] != ad[0])
    return ffi::Error::InvalidArgument("expected attn [M <= 64, A] and x [M, D]");
  const int64_t m = ad[0], a = ad[1], d = xd[1];
  if (!shape_is(norm_w, {d}) || !shape_is(*out, {m, d}))
    return ffi::Error::InvalidArgument("the norm's weight must be [D] and the result [M, D]");
  // o_proj [A -> D], then gate and up [D -> F], down [F -> D]: F is down's K, read first.
  std::vector<QuantWeight> w(4);
  size_t at = 0;
  std::string why = read_weight(args, at, a, d, w[0]);
  for (int j = 1; j < 3 && why.empty(); ++j) why = at < args.size() ? read_weight(args, at, d, 0, w[j]) : "too few weights";
  if (why.empty()) {
    auto down = args.get<ffi::AnyBuffer>(at);
    if (down.has_error() || down->dimensions().size() != 3) why = "too few weights";
    else {
      const int64_t f = (down->element_type() == ffi::DataType::U8 ? 2 : 1) * down->dimensions()[1];
      why = read_weight(args, at, f, d, w[3]);
      for (int j = 1; j < 3 && why.empty(); ++j) {
        if (!((w[j].tiles - 1) * kInt4Tile < f && f <= w[j].tiles * kInt4Tile)) why = "gate and up must have F outputs, down's K";
        w[j].n = f;
      }
      if (why.empty() && (at != args.size() || w[1].tiles != w[2].tiles)) why = "expected four weights, gate and up alike";
    }
  }
  if (!why.empty()) return ffi::Error::InvalidArgument("quantized_o_proj_mlp: " + why);
  if (x.element_type() == ffi::DataType::F32)
    quantized_o_proj_mlp<float>(pool, attn.typed_data<float>(), x.typed_data<float>(), norm_w.typed_data<float>(), w,
                                eps, m, a, d, out->typed_data<float>());
  else {
    auto in = [](const ffi::AnyBuffer& b) { return static_cast<const uint16_t*>(b.untyped_data()); };
    quantized_o_proj_mlp<uint16_t>(pool, in(attn), in(x), in(norm_w), w, eps, m, a, d,
                                   static_cast<uint16_t*>(out->untyped_data()));
  }
  return ffi::Error::Success();
}

ffi::Error MoeExperts(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> chosen,
                      ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer wg, ffi::AnyBuffer wu, ffi::AnyBuffer wd,
                      ffi::Result<ffi::AnyBuffer> y) {
  const auto t = x.element_type();
  for (auto type : {wg.element_type(), wu.element_type(), wd.element_type(), y->element_type()})
    if (!is_float(t) || type != t) return ffi::Error::InvalidArgument("x, the experts and y must be float32, or bfloat16");
  auto xd = x.dimensions(), cd = chosen.dimensions(), gd = wg.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || gd.size() != 3)
    return ffi::Error::InvalidArgument("expected x [T, D], chosen and weights [T, k], experts [E, D, F]");
  const int64_t n = xd[0], d = xd[1], k = cd[1], e = gd[0], f = gd[2];
  if (cd[0] != n || !shape_is(weights, {n, k}) || !shape_is(wg, {e, d, f}) || !shape_is(wu, {e, d, f}) ||
      !shape_is(wd, {e, f, d}) || !shape_is(*y, {n, d}))
    return ffi::Error::InvalidArgument("inconsistent shapes for moe_experts");
  if (t == ffi::DataType::F32)
    moe_experts<float>(pool, x.typed_data<float>(), chosen.typed_data(), weights.typed_data(), wg.typed_data<float>(),
                       wu.typed_data<float>(), wd.typed_data<float>(), n, k, e, d, f, y->typed_data<float>());
  else {
    auto in = [](const ffi::AnyBuffer& b) { return static_cast<const uint16_t*>(b.untyped_data()); };
    moe_experts<uint16_t>(pool, in(x), chosen.typed_data(), weights.typed_data(), in(wg), in(wu), in(wd), n, k, e, d, f,
                          static_cast<uint16_t*>(y->untyped_data()));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transposed"));

// Whether the dense kernel has its vector path here (else the engine leaves its products to XLA).
extern "C" int JaxserveDenseMatmulVectorized() { return kDenseVectorized; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDenseMatmul, DenseMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .RemainingArgs()        // one w [K, N] per output
                                  .RemainingRets());      // y [M, N] per weight

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGreedyArgmax, GreedyArgmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [S, V]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // [S]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .RemainingArgs()  // per weight: int4 packed [tiles, K / 2, 32] uint8 or int8
                                                    // q [tiles, K, 32], scales [tiles, G, 32] float32 or
                                                    // float16, offsets as scales (int4; int8 where it has them)
                                  .RemainingRets());  // per weight: y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pages
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tree_mask
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("fixed_order"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveNormQKV, NormQKV,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // the norm's weight
                                  .Arg<ffi::AnyBuffer>()  // wq
                                  .Arg<ffi::AnyBuffer>()  // wk
                                  .Arg<ffi::AnyBuffer>()  // wv
                                  .Ret<ffi::AnyBuffer>()  // q
                                  .Ret<ffi::AnyBuffer>()  // k
                                  .Ret<ffi::AnyBuffer>()  // v
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveOProjMLP, OProjMLP,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // attn
                                  .Arg<ffi::AnyBuffer>()  // x, the layer's input
                                  .Arg<ffi::AnyBuffer>()  // wo
                                  .Arg<ffi::AnyBuffer>()  // the post-attention norm's weight
                                  .Arg<ffi::AnyBuffer>()  // w_gate
                                  .Arg<ffi::AnyBuffer>()  // w_up
                                  .Arg<ffi::AnyBuffer>()  // w_down
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMoeExperts, MoeExperts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // chosen experts [T, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // their routing weights [T, k]
                                  .Arg<ffi::AnyBuffer>()  // gate [E, D, F]
                                  .Arg<ffi::AnyBuffer>()  // up [E, D, F]
                                  .Arg<ffi::AnyBuffer>()  // down [E, F, D]
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedNormQKV, QuantizedNormQKV,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // the norm's weight
                                  .RemainingArgs()  // wq, wk, wv as JaxserveQuantizedMatmul takes weights
                                  .Ret<ffi::AnyBuffer>()  // q
                                  .Ret<ffi::AnyBuffer>()  // k
                                  .Ret<ffi::AnyBuffer>()  // v
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedOProjMLP, QuantizedOProjMLP,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // attn
                                  .Arg<ffi::AnyBuffer>()  // x, the layer's input
                                  .Arg<ffi::AnyBuffer>()  // the post-attention norm's weight
                                  .RemainingArgs()  // wo, w_gate, w_up, w_down as JaxserveQuantizedMatmul's
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"));
