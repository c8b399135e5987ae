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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQueryBlock = 16;  // query tokens of one sequence that share a pass over its keys
constexpr int64_t kKeyChunk = 64;    // keys scored together before one softmax rescale
constexpr int64_t kTransposeRows = 8;  // from this many query rows, transposing a key chunk pays
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

// exp(x) for x <= 0 (scores minus their running maximum), in plain arithmetic so that loops
// over it vectorize; Cephes' expf polynomial, within 2 ulp. Below -87 it returns ~1e-38
// rather than 0: callers zero masked entries themselves.
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
  const int32_t* tree_mask;
  void* out;
  int64_t num_tokens, num_heads, head_dim, num_pages, page_size, num_kv_heads, num_seqs, max_pages;
  float sm_scale, soft_cap;
  int64_t sliding_window;
};

struct Unit {
  int32_t seq, kv_head;
  int64_t first, count;  // query tokens [first, first + count) of the sequence's new tokens
};

// One unit: the query heads of `kv_head` for `count` new tokens of `seq`, over its context.
// kD: the head dim when known at compile time (the loops over it unroll), else 0.
template <typename QT, typename KT, int kD>
void attend(const Problem& p, const Unit& u) {
  const int64_t groups = p.num_heads / p.num_kv_heads, d = kD ? kD : p.head_dim, rows = u.count * groups;
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
  const bool transposed = rows >= kTransposeRows;
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
    for (int64_t g = 0; g < groups; ++g) {
      const QT* src = q + ((token0 + i) * p.num_heads + u.kv_head * groups + g) * d;
      float* dst = qf + (i * groups + g) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = load(src[e]) * p.sm_scale;
    }
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);

  const int64_t pos0 = new0 + u.first, last = pos0 + u.count - 1;  // first and last query positions
  const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, pos0 - p.sliding_window + 1) : 0;
  bool plain_tree = true;  // no tree mask among this unit's tokens
  for (int64_t i = 0; i < u.count; ++i) plain_tree = plain_tree && p.tree_mask[token0 + i] == -1;
  const KT* k_rows[kKeyChunk];
  const KT* v_rows[kKeyChunk];
  for (int64_t start = lo; start <= last && start < kv_len; start += kKeyChunk) {
    const int64_t n = std::min<int64_t>({kKeyChunk, last + 1 - start, kv_len - start});
    for (int64_t c = 0; c < n; ++c) {
      const int64_t pos = start + c;
      const int64_t page = std::clamp<int64_t>(table[pos / p.page_size], 0, p.num_pages - 1);
      const int64_t offset = ((page * p.page_size + pos % p.page_size) * p.num_kv_heads + u.kv_head) * d;
      k_rows[c] = k_pages + offset;
      v_rows[c] = v_pages + offset;
    }
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
      const int32_t word = p.tree_mask[token0 + i];
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t r = i * groups + g;
        float* sr = s + r * kKeyChunk;
        if (!transposed)
          for (int64_t c = 0; c < n; ++c) sr[c] = dot(qf + r * d, k_rows[c], d);
        if (p.soft_cap > 0)
          for (int64_t c = 0; c < n; ++c) sr[c] = p.soft_cap * std::tanh(sr[c] / p.soft_cap);
        if (!all_seen)
          for (int64_t c = 0; c < n; ++c) {
            const int64_t pos = start + c, j = pos - new0;  // j: offset among the new tokens
            bool seen = pos <= qpos && (p.sliding_window <= 0 || pos > qpos - p.sliding_window);
            seen = seen && (j < 0 || j >= 32 || ((word >> j) & 1));
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
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < n; ++c) {
          const float e = sr[c] == kNegInf ? 0.0f : exp_nonpositive(sr[c] - m_new);
          prr[c] = e;
          sum += e;
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
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r = i * groups + g;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      QT* dst = out + ((token0 + i) * p.num_heads + u.kv_head * groups + g) * d;
      for (int64_t e = 0; e < d; ++e) store(acc[r * d + e] * inv, dst + e);
    }
}

// Runs run(i) for i in [0, n) on this thread and up to the pool's threads; returns when all are done.
// Helpers that start late find no work left, and hold `shared` (not this frame) meanwhile.
template <typename Run>
void run_units(ffi::ThreadPool& pool, int64_t n, Run run) {
  struct Shared {
    Shared(Run run, int64_t n) : run(std::move(run)), n(n) {}
    Run run;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    void work() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        run(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>(std::move(run), n);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
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
                     ffi::Result<ffi::AnyBuffer> out, float sm_scale, int64_t sliding_window, float soft_cap) {
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
            sm_scale, soft_cap, sliding_window};
  if (kd[3] != p.head_dim || p.num_heads % p.num_kv_heads || kv_lens.element_count() != size_t(p.num_seqs) ||
      query_start_loc.element_count() != size_t(p.num_seqs + 1) || tree_mask.element_count() != size_t(p.num_tokens))
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
  run_units(pool, int64_t(units.size()), [&p, &units, run](int64_t i) { run(p, units[i]); });
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
  for (int64_t j = row0; j < row0 + rows; ++j)
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transposed"));

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
                                  .Attr<float>("soft_cap"));
