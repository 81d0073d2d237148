// Hylo gradient-compression operators for MXNet's extension library API
// (mxnet/lib_api.h, MXNet >= 1.9). Loaded by mxhylo/ops/build.py with
// mx.library.load(); the ops then appear as mx.nd.hylo_*.
//
// Operators (all CPU, dense, float32 unless stated; n = elements of grad):
//   hylo_quantize_2bit(grad f32|f16, residual f32 [mutated];
//                      threshold[, value][, pending_threshold, pending_value][, defer])
//       -> codes int32 (ceil(n/16),), stats f32 (3,)
//   hylo_settle_2bit(codes int32, residual f32; value) -> residual - decoded
//   hylo_split_sections(x f32 (n,); offsets) -> k arrays f32, x's sections
//   hylo_encode_2bit(grad f32|f16, residual f32 [mutated][, velocity f32];
//                    threshold[, value][, momentum][, bound])
//       -> codes int32 (ceil(n/16),), stats f32 (4,)[, velocity' f32]
//       stats: sum |a|, non-finite count, mean |a| of the sent, rows cut
//   hylo_l1_stats(grad f32|f16, residual f32) -> stats f32 (2,)
//   hylo_dequantize_2bit(codes int32; value, shape) -> out f32 shape
//   hylo_dequantize_2bit_add(codes int32, acc f32; value) -> acc + decoded
//   hylo_select_kernels(grad f32|f16 (O,..), residual f32 [mutated]; k)
//       -> indices int32 (max(k,1),), values f32 (max(k,1), F), stats f32 (2,)
//   hylo_scatter_kernels(indices int32 (k,), values f32 (k,F); shape) -> dense f32
//   hylo_scatter_kernels_add(indices, values, acc f32) -> acc with rows += values
//   hylo_sum_2bit(codes int32 (W, ceil(n/16)); size) -> packed sums uint8
//   hylo_decode_sums(packed uint8, scale f32 (first value used); workers, shape)
//       -> out f32 shape
//   hylo_unpack_bytes(values f32 ([R,] m); nbytes) -> bytes uint8 ([R,] nbytes), bad f32 (R,)
// The *_add operators are called with out=acc: MXNet then hands the same
// buffer as input and output, so only the touched data is read and written.
// Python (mxhylo/ops/__init__.py) validates arguments first and handles the
// zero-size results MXNet 1.x cannot express as operator outputs (k = 0).
//
// Semantics shared with the NDArray reference (mxhylo/ops/reference.py):
// a = float(grad) + residual in float32; a non-finite `a` is never folded into
// the residual (its residual element stays unchanged), gets code 0 / value 0,
// and is counted in stats[1] so the caller can raise an error naming the layer.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cerrno>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <locale>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "mxnet/lib_api.h"
#include <unistd.h>

using namespace mxnet::ext;  // NOLINT

namespace {

typedef std::unordered_map<std::string, std::string> Attrs;

// ---------------------------------------------------------------- threading
// None: every kernel runs on the MXNet engine thread that calls it. One
// thread reaches memory speed (python -m mxhylo.bench ops), and no thread of
// this library is left waiting, or spinning, on cores that forward and
// backward need between exchanges (the library is built without OpenMP).

// 1: use the AVX-512 row-norm kernel of select_kernels when compiled in;
// hylo_set_simd(0) selects the portable loop (both give bitwise the same
// results; the tests run both).
int g_simd = 1;

// ---------------------------------------------------------------- helpers
inline bool is_finite(float a) { return std::fabs(a) <= FLT_MAX; }  // false for NaN, Inf

// IEEE half -> float bits, exact, branch-free (so GCC vectorizes the loop
// below on targets without F16C). F16C gives the same float for every half
// except that it quiets a signalling NaN; NaN grads never reach an output.
inline uint32_t half_to_float_bits(uint16_t h) {
  const int32_t em = h & 0x7fff;                 // exponent and mantissa
  const int32_t sign = (h & 0x8000) << 16;
  const int32_t normal = (em << 13) + 0x38000000;  // exponent rebiased by 127 - 15
  const int32_t special = (em << 13) | 0x7f800000;  // Inf, NaN (payload kept)
  const float sub = static_cast<float>(em) * 5.9604644775390625e-08f;  // em * 2^-24, exact
  int32_t subbits;
  std::memcpy(&subbits, &sub, sizeof(subbits));
  const int32_t bits = em >= 0x7c00 ? special : (em >= 0x0400 ? normal : subbits);
  return static_cast<uint32_t>(bits | sign);
}

// Gradient elements as float32: float32 data is used in place, float16 is
// converted chunk by chunk into `buf` (which stays in L1).
inline const float* as_float(const float* g, int64_t, float*) { return g; }
inline const float* as_float(const uint16_t* g, int64_t m, float* buf) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= m; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i));
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < m; ++i) {
    const uint32_t bits = half_to_float_bits(g[i]);
    std::memcpy(buf + i, &bits, sizeof(bits));
  }
  return buf;
}

int64_t shape_size(const std::vector<unsigned int>& s) {
  int64_t n = 1;
  for (size_t i = 0; i < s.size(); ++i) n *= s[i];
  return n;
}

bool get_attr(const Attrs& attrs, const char* key, std::string* val) {
  Attrs::const_iterator it = attrs.find(key);
  if (it == attrs.end()) {
    MX_ERROR_MSG << "missing attribute '" << key << "'";
    return false;
  }
  *val = it->second;
  return true;
}

// A float32 attribute arrives as text ('%.9g' of a float32), parsed in the
// classic locale so a process-wide setlocale() cannot turn '.' into ','. It
// must be finite, and with `positive` also > 0.
bool parse_float(const Attrs& attrs, const char* key, bool positive, float* out) {
  std::string s;
  if (!get_attr(attrs, key, &s)) return false;
  std::istringstream in(s);
  in.imbue(std::locale::classic());
  float v = 0.f;
  in >> v;
  if (in.fail() || !is_finite(v) || (positive && !(v > 0.f))) {
    MX_ERROR_MSG << "attribute '" << key << "' must be a finite float"
                 << (positive ? " > 0" : "") << ", got '" << s << "'";
    return false;
  }
  *out = v;
  return true;
}

bool parse_threshold(const Attrs& attrs, float* t) {
  return parse_float(attrs, "threshold", true, t);
}

bool parse_int(const Attrs& attrs, const char* key, int64_t* out) {
  std::string s;
  if (!get_attr(attrs, key, &s)) return false;
  std::istringstream in(s);
  in.imbue(std::locale::classic());
  long long v = -1;  // NOLINT
  in >> v;
  if (in.fail() || v < 0) {
    MX_ERROR_MSG << "attribute '" << key << "' must be an integer >= 0, got '" << s << "'";
    return false;
  }
  *out = v;
  return true;
}

// "(5, 3, 3, 3)" / "[7, 1]" / "5,3" -> {5, 3, 3, 3}
bool parse_shape(const Attrs& attrs, std::vector<unsigned int>* shape) {
  std::string s;
  if (!get_attr(attrs, "shape", &s)) return false;
  shape->clear();
  uint64_t cur = 0;
  bool in_num = false;
  for (size_t i = 0; i <= s.size(); ++i) {
    const char c = i < s.size() ? s[i] : ',';
    if (c >= '0' && c <= '9') {
      cur = cur * 10 + static_cast<uint64_t>(c - '0');
      in_num = true;
      if (cur > 0xffffffffull) break;
    } else if (c == ',' || c == ')' || c == ']' || c == ' ') {
      if (in_num) shape->push_back(static_cast<unsigned int>(cur));
      cur = 0;
      in_num = false;
    } else if (c != '(' && c != '[' && c != 'L') {
      shape->clear();
      break;
    }
  }
  if (shape->empty() || shape_size(*shape) == 0) {
    MX_ERROR_MSG << "attribute 'shape' must be a tuple of positive ints, got '" << s << "'";
    return false;
  }
  return true;
}

bool expect_inputs(const std::vector<std::vector<unsigned int> >& in, size_t n,
                   const char* op) {
  if (in.size() != n) {
    MX_ERROR_MSG << op << ": expected " << n << " inputs, got " << in.size();
    return false;
  }
  return true;
}

bool is_grad_type(int t) { return t == kFloat32 || t == kFloat16; }

std::vector<unsigned int> dims(std::initializer_list<int64_t> l) {
  std::vector<unsigned int> v;
  for (int64_t x : l) v.push_back(static_cast<unsigned int>(x));
  return v;
}

MXReturnValue mutate_residual(const Attrs&, std::vector<int>* idx) {
  idx->push_back(1);  // residual is updated in place
  return MX_SUCCESS;
}

// ===================================================== 2-bit quantization
// One source for every ISA level: the element math is written on GCC vector
// types as wide as the target's registers (kW floats: 16 with AVX-512, 8
// with AVX2, 4 with SSE2; GCC scalarizes compares on wider types), a code
// word of 16 elements being 16 / kW of them. Every operation is an
// elementwise IEEE float32 add/sub, a compare or a bitwise select, so each
// level computes bitwise the same codes and residuals, branch-free; and the
// sum of |a| has one fixed order (below), so the statistics match bit for bit.
//
// The sum of |a| (stats[0]): element i goes to float lane i % 16; every
// chunk of kChunk elements (counted from element 0) is summed lane by lane
// in element order, the 16 lanes are then added in lane order (0, 1, .., 15)
// into one float, and the chunks' floats are added in order into a double.
// The same order in every build, whatever the vector width. The sum of the
// sent |a| behind the default value (quantize_all) has the same order.
const int64_t kChunk = 1024;  // elements; a multiple of 16. fp16 is converted per chunk.

#if defined(__AVX512F__)
const int kW = 16;
#elif defined(__AVX2__)
const int kW = 8;
#else
const int kW = 4;
#endif
const int kV = 16 / kW;  // vectors per code word
typedef float vf __attribute__((vector_size(4 * kW)));
typedef int32_t vi __attribute__((vector_size(4 * kW)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef int32_t v2i __attribute__((vector_size(8)));
#define HYLO_INLINE inline __attribute__((always_inline))

HYLO_INLINE vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

HYLO_INLINE void storev(float* p, vi v) { std::memcpy(p, &v, sizeof(v)); }

HYLO_INLINE vi as_int(vf v) {
  vi i;
  std::memcpy(&i, &v, sizeof(i));
  return i;
}

HYLO_INLINE vf as_float(vi v) {
  vf f;
  std::memcpy(&f, &v, sizeof(f));
  return f;
}

// Packing 16 codes c_j in {0, 1, 2} into sum of c_j << 2j with shifts by
// constants only (SSE2 has no per-lane shift): fold the upper half of the
// codes onto the lower half shifted by 16 bits, then by 8, 4, 2. Code j ends
// at bit 16*b3 + 8*b2 + 4*b1 + 2*b0 = 2j, where j = 8*b3 + 4*b2 + 2*b1 + b0.
// First across the kV vectors of a word, then inside the last vector.
HYLO_INLINE uint32_t fold_lanes(v4i c) {  // codes at 4 lanes, shifts 4 and 2 left
  const v2i c2 = __builtin_shufflevector(c, c, 0, 1) | (__builtin_shufflevector(c, c, 2, 3) << 4);
  return static_cast<uint32_t>(c2[0] | (c2[1] << 2));
}
HYLO_INLINE uint32_t fold_lanes(v8i c) {
  return fold_lanes(v4i(__builtin_shufflevector(c, c, 0, 1, 2, 3) |
                        (__builtin_shufflevector(c, c, 4, 5, 6, 7) << 8)));
}
HYLO_INLINE uint32_t fold_lanes(v16i c) {
  return fold_lanes(v8i(__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7) |
                        (__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15) << 16)));
}
HYLO_INLINE uint32_t pack_word(vi* c) {  // c[v] holds codes kW*v .. kW*v + kW-1
  for (int cnt = kV, shift = 16; cnt > 1; cnt /= 2, shift /= 2)
    for (int v = 0; v < cnt / 2; ++v) c[v] |= c[v + cnt / 2] << shift;
  return fold_lanes(c[0]);
}

// What an earlier deferred quantize (threshold pt, value pv) owes on a stored
// residual lane r: that call stored r = a where it read a finite a, and sent
// exactly the elements with |a| >= pt, as +-pv by a's sign; so it owes
// copysign(pv, r) where |r| >= pt, and +0 elsewhere. Valid when that call saw
// no non-finite a (it stored the old r there, which owes nothing): the caller
// settles such a call by its codes instead (hylo_settle_2bit).
HYLO_INLINE vf owed(vf r, vf pt, vf pval) {
  const vi kAbs = vi{} + 0x7fffffff;
  const vi ri = as_int(r);
  const vi owes = as_float(ri & kAbs) >= pt;
  return owes ? as_float((ri & ~kAbs) | as_int(pval)) : vf{};
}

// Sixteen elements (one code word). With kPending, the residual first pays
// what an earlier deferred call owes: r <- r - q_prev (q_prev = owed(r, pt,
// pval); r - (+0) keeps r bit for bit, -0 included).
// Then a = g + r; |a| of finite a into acc[v], non-finite counts into bad[v]
// (-1 per element); with kWrite, the residual <- a (finite a; the old r
// otherwise) and the |a| of the elements sent (|a| >= t) into sacc[v], their
// count into scnt[v]: the caller owes r <- r - q, q = +-value by the returned
// code word, once the value is known (deferred: at the next call, or settle).
// +v for a >= t, -v for a <= -t: the decision is the threshold's.
template <bool kWrite, bool kPending>
HYLO_INLINE uint32_t quantize_word(const float* g, float* r, vf t, vf nt, vf pt, vf pval,
                                   vf* acc, vi* bad, vf* sacc, vi* scnt) {
  const vi kAbs = vi{} + 0x7fffffff;
  const vf fmax = vf{} + FLT_MAX;
  vi c[kV];
  for (int v = 0; v < kV; ++v) {
    vf r0 = loadv(r + kW * v);
    if (kPending) r0 = r0 - owed(r0, pt, pval);
    const vf a = loadv(g + kW * v) + r0;
    const vi absi = as_int(a) & kAbs;
    const vi fin = as_float(absi) <= fmax;  // -1, or 0 for NaN and +-Inf
    acc[v] += as_float(absi & fin);         // |a|, or +0 if not finite
    bad[v] += ~fin;
    if (!kWrite) continue;
    const vi pos = fin & (a >= t);
    const vi neg = fin & (a <= nt);
    const vi sent = pos | neg;
    sacc[v] += as_float(absi & sent);
    scnt[v] += sent;
    storev(r + kW * v, as_int(fin ? a : r0));  // non-finite: old r
    c[v] = (pos & 1) | (neg & 2);
  }
  return kWrite ? pack_word(c) : 0;
}

// The end of a chunk: its 16 float lanes (lane j = element i % 16 == j) added
// in lane order, the fixed order above; the per-lane counts (-1 per element)
// taken off *count.
HYLO_INLINE float reduce_lanes(const vf* acc, const vi* cnt, int64_t* count) {
  float lanes[16];
  int32_t counts[16];
  std::memcpy(lanes, acc, sizeof(lanes));
  std::memcpy(counts, cnt, sizeof(counts));
  float sum = 0.f;
  for (int j = 0; j < 16; ++j) {
    sum += lanes[j];
    *count -= counts[j];
  }
  return sum;
}

// One pass over all n elements: the pending q_prev paid (kPending), codes
// written and residual <- a (kWrite; the new q owed), the statistics summed:
// stats[0] = sum |a| (finite a), stats[1] = count of non-finite a; returns the
// mean |a| of the elements sent (t if none is; FLT_MAX if the sum
// overflows), the value quantize sends by default: what is sent keeps those
// elements' L1 mass (t alone, the smallest of them, sends less than they hold
// and leaves the rest waiting in the residual). Both sums have the fixed
// order of the header comment. kWrite = false: statistics only, r unchanged.
//
// kVelocity: the input quantized is the velocity u * momentum + float32(g) (u
// float32, read only), formed chunk by chunk into `velocity_out` (the loop of
// velocity_all, so bitwise hylo_momentum_velocity's result) while the chunk is in
// L1: one pass where that was two over memory.
template <typename T, bool kWrite, bool kPending, bool kVelocity = false>
float quantize_all(const T* g, float* r, uint32_t* codes, int64_t n, float t,
                   float pending_threshold, float pending_value, float* stats,
                   const float* u = nullptr, float* velocity_out = nullptr,
                   float momentum = 0.f) {
  float gbuf[kChunk];  // fp16 chunk as float32
  const vf tv = vf{} + t, ntv = vf{} - t;
  const vf ptv = vf{} + pending_threshold, pv = vf{} + pending_value;
  double l1 = 0.0, sent_total = 0.0;
  int64_t nbad = 0, nsent = 0;
  for (int64_t e0 = 0; e0 < n; e0 += kChunk) {
    const int64_t m = std::min(kChunk, n - e0);
    const float* gf = as_float(g + e0, m, gbuf);
    if (kVelocity) {
      const float* ul = u + e0;
      float* vl = velocity_out + e0;
      for (int64_t i = 0; i < m; ++i) {
        const float scaled = ul[i] * momentum;
        vl[i] = scaled + gf[i];
      }
      gf = vl;
    }
    float* rr = r + e0;
    uint32_t* cc = kWrite ? codes + e0 / 16 : nullptr;
    vf acc[kV], sacc[kV];
    vi bad[kV], scnt[kV];
    for (int v = 0; v < kV; ++v) {
      acc[v] = sacc[v] = vf{};
      bad[v] = scnt[v] = vi{};
    }
    int64_t i = 0;
    for (; i + 16 <= m; i += 16) {
      const uint32_t word = quantize_word<kWrite, kPending>(gf + i, rr + i, tv, ntv, ptv, pv,
                                                            acc, bad, sacc, scnt);
      if (kWrite) cc[i / 16] = word;
    }
    if (i < m) {  // last word: the zero padding is finite, has code 0 and adds +0
      float gt[16] = {0.f}, rt[16] = {0.f};
      std::memcpy(gt, gf + i, (m - i) * sizeof(float));
      std::memcpy(rt, rr + i, (m - i) * sizeof(float));
      // (the padding's residual is +0: it owes nothing)
      const uint32_t word = quantize_word<kWrite, kPending>(gt, rt, tv, ntv, ptv, pv,
                                                            acc, bad, sacc, scnt);
      if (kWrite) {
        std::memcpy(rr + i, rt, (m - i) * sizeof(float));
        cc[i / 16] = word;
      }
    }
    l1 += reduce_lanes(acc, bad, &nbad);
    if (kWrite) sent_total += reduce_lanes(sacc, scnt, &nsent);
  }
  stats[0] = static_cast<float>(l1);
  stats[1] = static_cast<float>(nbad);
  if (nsent == 0) return t;
  const double mean = sent_total / static_cast<double>(nsent);
  return mean <= FLT_MAX ? static_cast<float>(mean) : FLT_MAX;
}

// Attributes: 'value' (a float > 0) is the magnitude sent, by default the
// mean |a| of the elements sent; 'pending_threshold' and 'pending_value'
// (floats > 0, both or neither) are those of an earlier deferred call on this
// residual that saw no non-finite a, whose owed q this call pays first;
// 'defer' ("1") leaves this call's q owed (residual <- a, one pass), by
// default the op pays it in a second pass (residual <- a - q).
bool parse_optional_float(const Attrs& attrs, const char* key, bool* given, float* v) {
  *given = attrs.count(key) > 0;
  return !*given || parse_float(attrs, key, true, v);
}

struct QuantizeAttrs {
  float t = 0.f, value = 0.f, pending_threshold = 0.f, pending_value = 0.f;
  bool value_given = false, pending = false, defer = false;
};

bool parse_quantize(const Attrs& attrs, QuantizeAttrs* q) {
  if (!parse_threshold(attrs, &q->t) ||
      !parse_optional_float(attrs, "value", &q->value_given, &q->value) ||
      !parse_optional_float(attrs, "pending_value", &q->pending, &q->pending_value))
    return false;
  bool pending_t = false;
  if (!parse_optional_float(attrs, "pending_threshold", &pending_t, &q->pending_threshold))
    return false;
  if (pending_t != q->pending) {
    MX_ERROR_MSG << "attributes 'pending_threshold' and 'pending_value' go together";
    return false;
  }
  if (attrs.count("defer")) {
    const std::string& d = attrs.at("defer");
    if (d != "0" && d != "1") {
      MX_ERROR_MSG << "attribute 'defer' must be 0 or 1, got '" << d << "'";
      return false;
    }
    q->defer = d == "1";
  }
  return true;
}

MXReturnValue quantize_parse(const Attrs& attrs, int* nin, int* nout) {
  QuantizeAttrs q;
  if (!parse_quantize(attrs, &q)) return MX_FAIL;
  *nin = 2;
  *nout = 2;
  return MX_SUCCESS;
}

bool grad_residual_types(const std::vector<int>& in, const char* op) {
  if (in.size() != 2 || !is_grad_type(in[0]) || in[1] != kFloat32) {
    MX_ERROR_MSG << op << ": grad must be float32 or float16 and residual float32";
    return false;
  }
  return true;
}

bool grad_residual_shapes(const std::vector<std::vector<unsigned int> >& in, const char* op) {
  if (!expect_inputs(in, 2, op)) return false;
  if (in[0] != in[1]) {
    MX_ERROR_MSG << op << ": grad and residual shapes differ";
    return false;
  }
  return true;
}

MXReturnValue quantize_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if (!grad_residual_types(*in, "hylo_quantize_2bit")) return MX_FAIL;
  (*out)[0] = kInt32;
  (*out)[1] = kFloat32;
  return MX_SUCCESS;
}

bool check_codes(const std::vector<unsigned int>& codes, int64_t n, const char* op) {
  if (codes.size() != 1 || static_cast<int64_t>(codes[0]) != (n + 15) / 16) {
    MX_ERROR_MSG << op << ": codes must have shape (" << (n + 15) / 16 << ",) for " << n
                 << " elements";
    return false;
  }
  return true;
}

MXReturnValue quantize_shape(const Attrs&, std::vector<std::vector<unsigned int> >* in,
                             std::vector<std::vector<unsigned int> >* out) {
  if (!grad_residual_shapes(*in, "hylo_quantize_2bit")) return MX_FAIL;
  const int64_t n = shape_size((*in)[0]);
  (*out)[0] = dims({(n + 15) / 16});
  (*out)[1] = dims({3});
  return MX_SUCCESS;
}

void settle_all(const uint32_t* codes, float* r, int64_t n, float value);

template <typename T>
float quantize_any(const T* g, float* r, uint32_t* codes, int64_t n, const QuantizeAttrs& q,
                   float* stats) {
  return q.pending ? quantize_all<T, true, true>(g, r, codes, n, q.t, q.pending_threshold,
                                                 q.pending_value, stats)
                   : quantize_all<T, true, false>(g, r, codes, n, q.t, 0.f, 0.f, stats);
}

MXReturnValue quantize_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                               std::vector<MXTensor>* out, const OpResource&) {
  QuantizeAttrs q;
  if (!parse_quantize(attrs, &q)) return MX_FAIL;
  MXTensor& g = (*in)[0];
  float* r = (*in)[1].data<float>();
  uint32_t* codes = (*out)[0].data<uint32_t>();
  float* stats = (*out)[1].data<float>();
  const int64_t n = g.size();
  const float mean = g.dtype == kFloat16
      ? quantize_any(g.data<uint16_t>(), r, codes, n, q, stats)
      : quantize_any(g.data<float>(), r, codes, n, q, stats);
  const float v = q.value_given ? q.value : mean;
  if (!q.defer) settle_all(codes, r, n, v);
  stats[2] = v;
  return MX_SUCCESS;
}

MXReturnValue stats_parse(const Attrs&, int* nin, int* nout) {
  *nin = 2;
  *nout = 1;
  return MX_SUCCESS;
}

MXReturnValue stats_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if (!grad_residual_types(*in, "hylo_l1_stats")) return MX_FAIL;
  (*out)[0] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue stats_shape(const Attrs&, std::vector<std::vector<unsigned int> >* in,
                          std::vector<std::vector<unsigned int> >* out) {
  if (!grad_residual_shapes(*in, "hylo_l1_stats")) return MX_FAIL;
  (*out)[0] = dims({2});
  return MX_SUCCESS;
}

MXReturnValue stats_forward(const Attrs&, std::vector<MXTensor>* in,
                            std::vector<MXTensor>* out, const OpResource&) {
  MXTensor& g = (*in)[0];
  float* r = (*in)[1].data<float>();  // read only: kWrite = false
  float* stats = (*out)[0].data<float>();
  const int64_t n = g.size();
  // t only matters for writes; any positive value will do.
  if (g.dtype == kFloat16)
    quantize_all<uint16_t, false, false>(g.data<uint16_t>(), r, nullptr, n, 1.f, 0.f, 0.f, stats);
  else
    quantize_all<float, false, false>(g.data<float>(), r, nullptr, n, 1.f, 0.f, 0.f, stats);
  return MX_SUCCESS;
}

// ===================================================== 2-bit dequantization
// out[i] =, += or -= {0, +t, -t, 0}[code], t the value quantize sent; code 3
// is never produced and decodes to 0 (kMode: 0 write, 1 add, 2 subtract; the
// subtraction is a quantize's owed r - q, bit for bit, -0 - (+0) = -0 included).
// A whole word is kV vectors of kW lanes: lane l of vector v shifts the word by
// 2 (kW v + l) (an arithmetic shift: the & 3 keeps the same two bits), and the
// code's sign (c & 1) - (c >> 1) converts exactly, so each element is the
// scalar loop's o +- float(sign) * t bit for bit. GCC left that scalar loop
// unvectorized for AVX2: this form measured 0.6 -> 0.13 ns an element (native
// AVX-512) and 2.2 -> 0.2-0.36 (AVX2) on a 3840-element block in L1.
template <int kMode>
void dequantize_all(const uint32_t* codes, float* out, int64_t n, float t) {
  const int64_t full = n / 16;
  vi shift[kV];
  for (int v = 0; v < kV; ++v)
    for (int l = 0; l < kW; ++l) shift[v][l] = 2 * (kW * v + l);
  const vf tv = vf{} + t;
  for (int64_t w = 0; w < full; ++w) {
    const vi word = vi{} + static_cast<int32_t>(codes[w]);
    float* o = out + w * 16;
    for (int v = 0; v < kV; ++v) {
      const vi c = (word >> shift[v]) & 3;
      const vf x = __builtin_convertvector((c & 1) - (c >> 1), vf) * tv;
      vf ov = loadv(o + kW * v);
      ov = kMode == 1 ? ov + x : kMode == 2 ? ov - x : x;
      std::memcpy(o + kW * v, &ov, sizeof(ov));
    }
  }
  if (full * 16 < n) {
    const uint32_t word = codes[full];
    for (int64_t i = full * 16; i < n; ++i) {
      const uint32_t c = (word >> (2 * (i - full * 16))) & 3u;
      const float v = static_cast<float>(static_cast<int>(c & 1u) - static_cast<int>(c >> 1)) * t;
      out[i] = kMode == 1 ? out[i] + v : kMode == 2 ? out[i] - v : v;
    }
  }
}

void settle_all(const uint32_t* codes, float* r, int64_t n, float value) {
  dequantize_all<2>(codes, r, n, value);  // r - (+0) keeps r: -0 stays -0
}

bool parse_value(const Attrs& attrs, float* t) {
  return parse_float(attrs, "value", true, t);
}

MXReturnValue deq_parse(const Attrs& attrs, int* nin, int* nout) {
  float t;
  std::vector<unsigned int> shape;
  if (!parse_value(attrs, &t) || !parse_shape(attrs, &shape)) return MX_FAIL;
  *nin = 1;
  *nout = 1;
  return MX_SUCCESS;
}

MXReturnValue deq_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if ((*in)[0] != kInt32) {
    MX_ERROR_MSG << "hylo_dequantize_2bit: codes must be int32";
    return MX_FAIL;
  }
  for (size_t i = 1; i < in->size(); ++i) {
    if ((*in)[i] != kFloat32) {
      MX_ERROR_MSG << "hylo_dequantize_2bit_add / hylo_settle_2bit: acc (residual) must be float32";
      return MX_FAIL;
    }
  }
  (*out)[0] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue deq_shape(const Attrs& attrs, std::vector<std::vector<unsigned int> >* in,
                        std::vector<std::vector<unsigned int> >* out) {
  std::vector<unsigned int> shape;
  if (!expect_inputs(*in, 1, "hylo_dequantize_2bit") || !parse_shape(attrs, &shape) ||
      !check_codes((*in)[0], shape_size(shape), "hylo_dequantize_2bit"))
    return MX_FAIL;
  (*out)[0] = shape;
  return MX_SUCCESS;
}

MXReturnValue deq_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                          std::vector<MXTensor>* out, const OpResource&) {
  float t;
  if (!parse_value(attrs, &t)) return MX_FAIL;
  dequantize_all<0>((*in)[0].data<uint32_t>(), (*out)[0].data<float>(), (*out)[0].size(), t);
  return MX_SUCCESS;
}

MXReturnValue deq_add_parse(const Attrs& attrs, int* nin, int* nout) {
  float t;
  if (!parse_value(attrs, &t)) return MX_FAIL;
  *nin = 2;
  *nout = 1;
  return MX_SUCCESS;
}

// The in-place decoders, called with out=acc (MXNet then hands the same buffer
// as input and output): kMode 1 hylo_dequantize_2bit_add (acc + decoded), 2
// hylo_settle_2bit (residual - decoded: what a deferred quantize owes).
template <int kMode>
const char* inplace_name() {
  return kMode == 1 ? "hylo_dequantize_2bit_add" : "hylo_settle_2bit";
}

template <int kMode>
MXReturnValue deq_inplace_shape(const Attrs&, std::vector<std::vector<unsigned int> >* in,
                                std::vector<std::vector<unsigned int> >* out) {
  if (!expect_inputs(*in, 2, inplace_name<kMode>()) ||
      !check_codes((*in)[0], shape_size((*in)[1]), inplace_name<kMode>()))
    return MX_FAIL;
  (*out)[0] = (*in)[1];
  return MX_SUCCESS;
}

template <int kMode>
MXReturnValue deq_inplace_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                                  std::vector<MXTensor>* out, const OpResource&) {
  float t;
  if (!parse_value(attrs, &t)) return MX_FAIL;
  const float* acc = (*in)[1].data<float>();
  float* o = (*out)[0].data<float>();
  const int64_t n = (*out)[0].size();
  if (o != acc) std::memcpy(o, acc, n * sizeof(float));  // called without out=acc
  dequantize_all<kMode>((*in)[0].data<uint32_t>(), o, n, t);
  return MX_SUCCESS;
}

// ===================================================== kernel (filter) top-k
// A kernel is one output filter: row o of the weight viewed as (O, F).
// Pass 1 reads grad and residual once: a = grad + residual, the row norms,
// and residual <- a where a is finite (non-finite elements keep their old
// residual). Pass 2 touches only the k chosen rows: values <- residual row,
// residual row <- 0. Rows holding a non-finite `a` (rare: the caller raises
// on them) also record a bitmask of those elements, so pass 2 can emit 0
// there and leave the old residual in place.

const int64_t kRowChunk = 4096;  // elements per row chunk; multiple of 8

struct BadRow {
  int64_t row;
  std::vector<uint64_t> mask;  // bit j set: element j of the row is non-finite
};

template <typename T>
void fold_rows(const T* g, float* r, int64_t F, int64_t o0, int64_t o1, double* norm2,
               double* bad_out, std::vector<BadRow>* bad_rows) {
  float gbuf[kRowChunk];
  float zbuf[kRowChunk];
  uint32_t fbuf[kRowChunk];
  int64_t bad = 0;
  for (int64_t o = o0; o < o1; ++o) {
    // Eight fixed lanes by element position: the sum order (and so tie
    // breaking between equal rows) does not depend on alignment or threads.
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    bool row_bad = false;
    for (int64_t c0 = 0; c0 < F; c0 += kRowChunk) {
      const int64_t m = std::min(kRowChunk, F - c0);
      const float* gf = as_float(g + o * F + c0, m, gbuf);
      float* rr = r + o * F + c0;
      // Same vectorizable form as quantize_range: no branches, no reduction.
      for (int64_t i = 0; i < m; ++i) {
        const float r0 = rr[i];
        const float a = gf[i] + r0;
        const int fin = std::fabs(a) <= FLT_MAX;
        zbuf[i] = fin ? a : 0.f;
        fbuf[i] = static_cast<uint32_t>(1 - fin);
        rr[i] = fin ? a : r0;
      }
      int64_t i = 0;
      for (; i + 8 <= m; i += 8) {
        for (int l = 0; l < 8; ++l) {
          const double v = zbuf[i + l];
          acc[l] += v * v;  // exact square of a float; summed in double
        }
      }
      for (int l = 0; i < m; ++i, ++l) {
        const double v = zbuf[i];
        acc[l] += v * v;
      }
      uint32_t nb = 0;
      for (int64_t j = 0; j < m; ++j) nb += fbuf[j];
      if (nb) {
        bad += nb;
        if (!row_bad) {
          BadRow br;
          br.row = o;
          br.mask.assign((F + 63) / 64, 0);
          bad_rows->push_back(std::move(br));
          row_bad = true;
        }
        std::vector<uint64_t>& mask = bad_rows->back().mask;
        for (int64_t j = 0; j < m; ++j)
          if (fbuf[j]) mask[(c0 + j) >> 6] |= uint64_t(1) << ((c0 + j) & 63);
      }
    }
    norm2[o] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
  *bad_out = static_cast<double>(bad);
}

#if defined(__AVX512F__)
// AVX-512 version of fold_rows: one pass, 16 elements a step, no L1 buffers
// (the portable loops measured 0.55x memcpy on 64 MB, this 1.0x; 1.7x-2x
// the portable speed in cache). A row's eight float64 lanes are exactly the
// eight lanes of fold_rows (element j goes to lane j % 8, in order of j), and
// fma(v, v, acc) equals acc + v * v because the square of a float is exact in
// float64: the norms, and so the selection, are bitwise those of fold_rows.

inline __m512 avx512_load16(const float* p, int64_t left, __mmask16 live) {
  return left >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(live, p);
}
inline __m512 avx512_load16(const uint16_t* p, int64_t left, __mmask16) {
  if (left >= 16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  uint16_t tmp[16] = {0};
  std::memcpy(tmp, p, static_cast<size_t>(left) * sizeof(uint16_t));
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tmp)));
}

// Elements [j, j + 16) of one row (lanes >= left, on the last step only, load
// as 0: finite, add 0). Returns the mask of non-finite elements.
template <typename T, bool kFull>
inline unsigned fold16(const T* g, float* r, int64_t left, __m512d* acc) {
  const __mmask16 live = kFull ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
  const __m512 r0 = kFull ? _mm512_loadu_ps(r) : _mm512_maskz_loadu_ps(live, r);
  const __m512 a = _mm512_add_ps(avx512_load16(g, kFull ? 16 : left, live), r0);
  const __mmask16 fin =
      _mm512_cmp_ps_mask(_mm512_abs_ps(a), _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ);
  const __m512 upd = _mm512_mask_mov_ps(r0, fin, a);  // non-finite: old residual
  if (kFull)
    _mm512_storeu_ps(r, upd);
  else
    _mm512_mask_storeu_ps(r, live, upd);
  const __m512 z = _mm512_maskz_mov_ps(fin, a);  // non-finite: 0
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(z));
  const __m512d hi =
      _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
  *acc = _mm512_fmadd_pd(lo, lo, *acc);  // elements j .. j+7 -> lanes 0..7
  *acc = _mm512_fmadd_pd(hi, hi, *acc);  // elements j+8 .. j+15 -> lanes 0..7
  return static_cast<unsigned>(live & ~fin);
}

template <typename T>
void fold_rows_avx512(const T* g, float* r, int64_t F, int64_t o0, int64_t o1, double* norm2,
                      double* bad_out, std::vector<BadRow>* bad_rows) {
  // The non-finite mask of each step goes to nb[step]: a branch or a call in
  // the loop made GCC keep the accumulator in memory (2x slower). Rows that
  // had any (rare: the caller raises on them) get their BadRow afterwards.
  const int64_t steps = (F + 15) / 16;
  std::vector<uint16_t> nb(steps);
  int64_t bad = 0;
  for (int64_t o = o0; o < o1; ++o) {
    const T* gr = g + o * F;
    float* rr = r + o * F;
    __m512d acc = _mm512_setzero_pd();
    unsigned any = 0;
    int64_t j = 0, s = 0;
    for (; j + 16 <= F; j += 16, ++s) {
      const unsigned m = fold16<T, true>(gr + j, rr + j, 16, &acc);
      nb[s] = static_cast<uint16_t>(m);
      any |= m;
    }
    if (j < F) {
      const unsigned m = fold16<T, false>(gr + j, rr + j, F - j, &acc);
      nb[s] = static_cast<uint16_t>(m);
      any |= m;
    }
    double l[8];
    _mm512_storeu_pd(l, acc);
    norm2[o] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    if (!any) continue;
    BadRow br;
    br.row = o;
    br.mask.assign((F + 63) / 64, 0);
    for (int64_t t = 0; t < steps; ++t) {
      const uint64_t m = nb[t];
      bad += __builtin_popcountll(m);
      br.mask[t >> 2] |= m << (16 * (t & 3));  // elements 16t .. 16t+15
    }
    bad_rows->push_back(std::move(br));
  }
  *bad_out = static_cast<double>(bad);
}
#endif

template <typename T>
void select_all(const T* g, float* r, int64_t O, int64_t F, int64_t k, int32_t* indices,
                float* values, float* stats) {
  std::vector<double> norm2(O);
  double nbad = 0.0;
  std::vector<BadRow> bad_rows;
#if defined(__AVX512F__)
  if (g_simd)
    fold_rows_avx512<T>(g, r, F, 0, O, norm2.data(), &nbad, &bad_rows);
  else
#endif
    fold_rows<T>(g, r, F, 0, O, norm2.data(), &nbad, &bad_rows);
  double total = 0.0;
  for (int64_t o = 0; o < O; ++o) total += norm2[o];
  stats[0] = static_cast<float>(total);
  stats[1] = static_cast<float>(nbad);

  // Top-k rows by norm, ties to the lower index: a strict total order, so
  // nth_element picks exactly the set a stable sort would.
  std::vector<int64_t> order(O);
  for (int64_t o = 0; o < O; ++o) order[o] = o;
  const double* n2 = norm2.data();
  auto before = [n2](int64_t a, int64_t b) { return n2[a] > n2[b] || (n2[a] == n2[b] && a < b); };
  if (k < O) std::nth_element(order.begin(), order.begin() + k, order.end(), before);
  std::sort(order.begin(), order.begin() + k);
  for (int64_t i = 0; i < k; ++i) indices[i] = static_cast<int32_t>(order[i]);

  std::unordered_map<int64_t, const std::vector<uint64_t>*> masks;
  for (size_t i = 0; i < bad_rows.size(); ++i) masks[bad_rows[i].row] = &bad_rows[i].mask;

  for (int64_t i = 0; i < k; ++i) {
    float* row = r + order[i] * F;
    float* v = values + i * F;
    if (masks.empty() || masks.find(order[i]) == masks.end()) {
      std::memcpy(v, row, F * sizeof(float));
      std::memset(row, 0, F * sizeof(float));
      continue;
    }
    const std::vector<uint64_t>& mask = *masks.find(order[i])->second;
    for (int64_t j = 0; j < F; ++j) {
      if ((mask[j >> 6] >> (j & 63)) & 1) {
        v[j] = 0.f;  // non-finite: emit 0, keep the old residual
      } else {
        v[j] = row[j];
        row[j] = 0.f;
      }
    }
  }
}

MXReturnValue select_parse(const Attrs& attrs, int* nin, int* nout) {
  int64_t k;
  if (!parse_int(attrs, "k", &k)) return MX_FAIL;
  *nin = 2;
  *nout = 3;
  return MX_SUCCESS;
}

MXReturnValue select_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if (!grad_residual_types(*in, "hylo_select_kernels")) return MX_FAIL;
  (*out)[0] = kInt32;
  (*out)[1] = kFloat32;
  (*out)[2] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue select_shape(const Attrs& attrs, std::vector<std::vector<unsigned int> >* in,
                           std::vector<std::vector<unsigned int> >* out) {
  int64_t k;
  if (!parse_int(attrs, "k", &k) || !grad_residual_shapes(*in, "hylo_select_kernels"))
    return MX_FAIL;
  const std::vector<unsigned int>& s = (*in)[0];
  if (s.empty() || k > static_cast<int64_t>(s[0])) {
    MX_ERROR_MSG << "hylo_select_kernels: k must be in [0, O]";
    return MX_FAIL;
  }
  const int64_t F = shape_size(s) / s[0];
  // MXNet 1.x cannot allocate a zero-size output: k = 0 gets one dummy row,
  // which the Python wrapper replaces by empty arrays.
  const int64_t rows = std::max<int64_t>(k, 1);
  (*out)[0] = dims({rows});
  (*out)[1] = dims({rows, F});
  (*out)[2] = dims({2});
  return MX_SUCCESS;
}

MXReturnValue select_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                             std::vector<MXTensor>* out, const OpResource&) {
  int64_t k;
  if (!parse_int(attrs, "k", &k)) return MX_FAIL;
  MXTensor& g = (*in)[0];
  float* r = (*in)[1].data<float>();
  const int64_t O = g.shape[0];
  const int64_t F = O ? g.size() / O : 0;
  int32_t* idx = (*out)[0].data<int32_t>();
  float* vals = (*out)[1].data<float>();
  if (k == 0) {  // dummy row, see select_shape
    idx[0] = 0;
    std::memset(vals, 0, F * sizeof(float));
  }
  if (g.dtype == kFloat16)
    select_all<uint16_t>(g.data<uint16_t>(), r, O, F, k, idx, vals, (*out)[2].data<float>());
  else
    select_all<float>(g.data<float>(), r, O, F, k, idx, vals, (*out)[2].data<float>());
  return MX_SUCCESS;
}

// ===================================================== kernel scatter
// Indices must be strictly increasing and inside [0, O): what
// hylo_select_kernels produces. Checked before any write, since a bad index
// arriving over the network must not write outside `out`.
bool check_rows(const int32_t* idx, int64_t k, int64_t O) {
  for (int64_t i = 0; i < k; ++i) {
    if (idx[i] < 0 || idx[i] >= O || (i > 0 && idx[i] <= idx[i - 1])) {
      MX_ERROR_MSG << "hylo_scatter_kernels: indices must be strictly increasing and in [0, "
                   << O << "); indices[" << i << "] = " << idx[i];
      return false;
    }
  }
  return true;
}

bool scatter_types(const std::vector<int>& in) {
  if (in[0] != kInt32 || in[1] != kFloat32 || (in.size() > 2 && in[2] != kFloat32)) {
    MX_ERROR_MSG << "hylo_scatter_kernels: indices must be int32, values and out float32";
    return false;
  }
  return true;
}

bool scatter_shapes(const std::vector<std::vector<unsigned int> >& in,
                    const std::vector<unsigned int>& shape) {
  const std::vector<unsigned int>& idx = in[0];
  const std::vector<unsigned int>& val = in[1];
  const int64_t F = shape_size(shape) / shape[0];
  if (idx.size() != 1 || val.size() != 2 || val[0] != idx[0] || val[1] != F) {
    MX_ERROR_MSG << "hylo_scatter_kernels: need indices (k,) and values (k, " << F << ")";
    return false;
  }
  return true;
}

MXReturnValue scatter_parse(const Attrs& attrs, int* nin, int* nout) {
  std::vector<unsigned int> shape;
  if (!parse_shape(attrs, &shape)) return MX_FAIL;
  *nin = 2;
  *nout = 1;
  return MX_SUCCESS;
}

MXReturnValue scatter_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if (!scatter_types(*in)) return MX_FAIL;
  (*out)[0] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue scatter_shape(const Attrs& attrs, std::vector<std::vector<unsigned int> >* in,
                            std::vector<std::vector<unsigned int> >* out) {
  std::vector<unsigned int> shape;
  if (!expect_inputs(*in, 2, "hylo_scatter_kernels") || !parse_shape(attrs, &shape) ||
      !scatter_shapes(*in, shape))
    return MX_FAIL;
  (*out)[0] = shape;
  return MX_SUCCESS;
}

MXReturnValue scatter_forward(const Attrs&, std::vector<MXTensor>* in,
                              std::vector<MXTensor>* out, const OpResource&) {
  const int32_t* idx = (*in)[0].data<int32_t>();
  const float* vals = (*in)[1].data<float>();
  MXTensor& o = (*out)[0];
  const int64_t O = o.shape[0], F = o.size() / O, k = (*in)[0].size();
  if (!check_rows(idx, k, O)) return MX_FAIL;
  float* dst = o.data<float>();
  // Rows are increasing: zero the gap before each row, then copy it.
  int64_t next = 0;
  for (int64_t i = 0; i < k; ++i) {
    std::memset(dst + next * F, 0, (idx[i] - next) * F * sizeof(float));
    std::memcpy(dst + idx[i] * F, vals + i * F, F * sizeof(float));
    next = idx[i] + 1;
  }
  std::memset(dst + next * F, 0, (O - next) * F * sizeof(float));
  return MX_SUCCESS;
}

MXReturnValue scatter_add_parse(const Attrs&, int* nin, int* nout) {
  *nin = 3;
  *nout = 1;
  return MX_SUCCESS;
}

MXReturnValue scatter_add_shape(const Attrs&, std::vector<std::vector<unsigned int> >* in,
                                std::vector<std::vector<unsigned int> >* out) {
  if (!expect_inputs(*in, 3, "hylo_scatter_kernels_add") || (*in)[2].empty() ||
      !scatter_shapes(*in, (*in)[2]))
    return MX_FAIL;
  (*out)[0] = (*in)[2];
  return MX_SUCCESS;
}

MXReturnValue scatter_add_forward(const Attrs&, std::vector<MXTensor>* in,
                                  std::vector<MXTensor>* out, const OpResource&) {
  const int32_t* idx = (*in)[0].data<int32_t>();
  const float* vals = (*in)[1].data<float>();
  const float* acc = (*in)[2].data<float>();
  MXTensor& o = (*out)[0];
  const int64_t O = o.shape[0], F = o.size() / O, k = (*in)[0].size();
  if (!check_rows(idx, k, O)) return MX_FAIL;
  float* dst = o.data<float>();
  if (dst != acc) std::memcpy(dst, acc, O * F * sizeof(float));  // called without out=acc
  for (int64_t i = 0; i < k; ++i) {
    float* row = dst + static_cast<int64_t>(idx[i]) * F;
    const float* v = vals + i * F;
    for (int64_t j = 0; j < F; ++j) row[j] += v[j];
  }
  return MX_SUCCESS;
}

// ===================================================== momentum correction
// Two elementwise passes of DGC's momentum correction (kvstore/momentum.py),
// each one fused pass instead of MXNet's two or three. Each element is one
// IEEE float32 multiply and one add or subtract, never contracted into an FMA
// (-ffp-contract=off), so every ISA build and MXNet's own `u * m + g` and
// `a - p * f` give the same bits; NaN and Inf propagate as IEEE says.

// v = u * m + float32(g): grad g (float32 | float16), velocity u (float32).
template <typename T>
void velocity_all(const T* g, const float* u, float* v, int64_t n, float m) {
  float buf[kChunk];
  for (int64_t lo = 0; lo < n; lo += kChunk) {
    const int64_t len = std::min(kChunk, n - lo);
    const float* gf = as_float(g + lo, len, buf);
    const float* ul = u + lo;
    float* vl = v + lo;
    for (int64_t i = 0; i < len; ++i) {
      const float scaled = ul[i] * m;
      vl[i] = scaled + gf[i];
    }
  }
}

MXReturnValue velocity_parse(const Attrs& attrs, int* nin, int* nout) {
  float m;
  if (!parse_float(attrs, "momentum", false, &m)) return MX_FAIL;
  *nin = 2;
  *nout = 1;
  return MX_SUCCESS;
}

MXReturnValue velocity_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if (!grad_residual_types(*in, "hylo_momentum_velocity")) return MX_FAIL;
  (*out)[0] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue velocity_shape(const Attrs&, std::vector<std::vector<unsigned int> >* in,
                             std::vector<std::vector<unsigned int> >* out) {
  if (!grad_residual_shapes(*in, "hylo_momentum_velocity")) return MX_FAIL;
  (*out)[0] = (*in)[0];
  return MX_SUCCESS;
}

MXReturnValue velocity_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                               std::vector<MXTensor>* out, const OpResource&) {
  float m;
  if (!parse_float(attrs, "momentum", false, &m)) return MX_FAIL;
  MXTensor& g = (*in)[0];
  const float* u = (*in)[1].data<float>();
  float* v = (*out)[0].data<float>();
  if (g.dtype == kFloat16)
    velocity_all<uint16_t>(g.data<uint16_t>(), u, v, g.size(), m);
  else
    velocity_all<float>(g.data<float>(), u, v, g.size(), m);
  return MX_SUCCESS;
}

// out = a - p * f, then p <- a (both float32, same shape). `out` may be `a`
// itself (called with out=a): each element reads a and p before writing.
void correct_all(const float* a, float* p, float* o, int64_t n, float f) {
  for (int64_t i = 0; i < n; ++i) {
    const float ai = a[i];
    const float scaled = p[i] * f;
    o[i] = ai - scaled;
    p[i] = ai;
  }
}

MXReturnValue correct_parse(const Attrs& attrs, int* nin, int* nout) {
  float f;
  if (!parse_float(attrs, "factor", false, &f)) return MX_FAIL;
  *nin = 2;
  *nout = 1;
  return MX_SUCCESS;
}

MXReturnValue correct_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if (in->size() != 2 || (*in)[0] != kFloat32 || (*in)[1] != kFloat32) {
    MX_ERROR_MSG << "hylo_momentum_correct: aggregate and previous must be float32";
    return MX_FAIL;
  }
  (*out)[0] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue correct_shape(const Attrs&, std::vector<std::vector<unsigned int> >* in,
                            std::vector<std::vector<unsigned int> >* out) {
  if (!expect_inputs(*in, 2, "hylo_momentum_correct")) return MX_FAIL;
  if ((*in)[0] != (*in)[1]) {
    MX_ERROR_MSG << "hylo_momentum_correct: aggregate and previous shapes differ";
    return MX_FAIL;
  }
  (*out)[0] = (*in)[0];
  return MX_SUCCESS;
}

MXReturnValue mutate_previous(const Attrs&, std::vector<int>* idx) {
  idx->push_back(1);  // previous <- aggregate, in place
  return MX_SUCCESS;
}

MXReturnValue correct_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                              std::vector<MXTensor>* out, const OpResource&) {
  float f;
  if (!parse_float(attrs, "factor", false, &f)) return MX_FAIL;
  correct_all((*in)[0].data<float>(), (*in)[1].data<float>(), (*out)[0].data<float>(),
              (*in)[0].size(), f);
  return MX_SUCCESS;
}

// ===================================================== residual row bound
// Each row i of the residual r (O rows of F float32 values; kvstore.stages
// BoundedResidual) is cut to at most `bound` times the L2 norm of row i of u, the
// step's input (float32 | float16, same shape). Each sum of squares is taken in
// double over kLanes fixed lanes (element j goes to lane j % kLanes, each lane adds
// in order), then the lanes are added as a fixed tree: the compiler may vectorize
// across lanes but not reorder within one (-ffp-contract=off, no -ffast-math), so
// every ISA build gives the same bits, and one row costs a pass at memory speed
// instead of a chain of dependent adds. A row over the bound is multiplied by
// float(sqrt(bound * bound * su) / sqrt(sr)), one IEEE float32 multiply per element.
// A row whose input is zero is emptied; a row holding a NaN compares false and is
// left as it is. Returns the number of rows cut.
const int kLanes = 8;

inline double lane_tree(const double* a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

inline void add_squares(const float* x, int64_t len, int64_t first, double* acc) {
  // element x[j] is element first + j of its row: lane (first + j) % kLanes.
  // first is a multiple of kLanes (kChunk is), so lanes line up with j.
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const double v = x[j + l];
      acc[l] += v * v;
    }
  for (; j < len; ++j) {
    const double v = x[j];
    acc[(first + j) % kLanes] += v * v;
  }
}

// One row ri of `width` values against the same row ui of the input; true if cut.
template <typename T>
bool bound_row(float* ri, const T* ui, int64_t width, double bound) {
  float buf[kChunk];
  double ar[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  double au[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  add_squares(ri, width, 0, ar);
  for (int64_t lo = 0; lo < width; lo += kChunk) {
    const int64_t len = std::min(kChunk, width - lo);
    add_squares(as_float(ui + lo, len, buf), len, lo, au);
  }
  const double sr = lane_tree(ar);
  const double allowed = bound * bound * lane_tree(au);
  if (!(sr > allowed)) return false;
  const float scale = static_cast<float>(std::sqrt(allowed) / std::sqrt(sr));
  for (int64_t j = 0; j < width; ++j) ri[j] *= scale;
  return true;
}

template <typename T>
int64_t bound_rows_all(float* r, const T* u, int64_t rows, int64_t width, double bound) {
  int64_t cut = 0;
  for (int64_t i = 0; i < rows; ++i) cut += bound_row(r + i * width, u + i * width, width, bound);
  return cut;
}

MXReturnValue bound_parse(const Attrs& attrs, int* nin, int* nout) {
  float b;
  if (!parse_float(attrs, "bound", false, &b)) return MX_FAIL;
  *nin = 2;
  *nout = 1;
  return MX_SUCCESS;
}

MXReturnValue bound_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if (in->size() != 2 || (*in)[0] != kFloat32 ||
      ((*in)[1] != kFloat32 && (*in)[1] != kFloat16)) {
    MX_ERROR_MSG << "hylo_bound_rows: residual must be float32, input float32 or float16";
    return MX_FAIL;
  }
  (*out)[0] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue bound_shape(const Attrs&, std::vector<std::vector<unsigned int> >* in,
                          std::vector<std::vector<unsigned int> >* out) {
  if (!expect_inputs(*in, 2, "hylo_bound_rows")) return MX_FAIL;
  if ((*in)[0] != (*in)[1]) {
    MX_ERROR_MSG << "hylo_bound_rows: residual and input shapes differ";
    return MX_FAIL;
  }
  (*out)[0] = std::vector<unsigned int>{1};
  return MX_SUCCESS;
}

MXReturnValue bound_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                            std::vector<MXTensor>* out, const OpResource&) {
  float b;
  if (!parse_float(attrs, "bound", false, &b)) return MX_FAIL;
  MXTensor& r = (*in)[0];
  MXTensor& u = (*in)[1];
  const int64_t n = r.size();
  const int64_t rows = r.shape.size() > 1 ? static_cast<int64_t>(r.shape[0]) : 1;
  const int64_t width = rows ? n / rows : 0;
  int64_t cut;
  if (u.dtype == kFloat16)
    cut = bound_rows_all<uint16_t>(r.data<float>(), u.data<uint16_t>(), rows, width, b);
  else
    cut = bound_rows_all<float>(r.data<float>(), u.data<float>(), rows, width, b);
  (*out)[0].data<float>()[0] = static_cast<float>(cut);
  return MX_SUCCESS;
}

MXReturnValue mutate_first(const Attrs&, std::vector<int>* idx) {
  idx->push_back(0);  // the residual, cut in place
  return MX_SUCCESS;
}

// ===================================================== a fused bucket's aggregate
// hylo_split_sections(x f32 (n,); offsets "(o_0, .., o_{k-1})", o_0 = 0, ascending)
// -> k outputs, output i = x[o_i : o_{i+1}] (the last to n): one memcpy each. The
// store writes a bucket's pulled sum into its member layers' gradients with it;
// MXNet's _split_v2 finds each element's section by a scan over the sections, a cost
// of n times k (1.9 ms CPU for 33K elements in 100 sections, against microseconds).
bool parse_offsets(const Attrs& attrs, std::vector<int64_t>* offsets) {
  std::string s;
  if (!get_attr(attrs, "offsets", &s)) return false;
  offsets->clear();
  int64_t cur = 0;
  bool in_num = false;
  for (size_t i = 0; i <= s.size(); ++i) {
    const char c = i < s.size() ? s[i] : ',';
    if (c >= '0' && c <= '9') {
      cur = cur * 10 + (c - '0');
      in_num = true;
      if (cur > (int64_t(1) << 40)) break;
    } else if (c == ',' || c == ')' || c == ']' || c == ' ' || c == '(' || c == '[' ||
               c == 'L') {
      if (in_num) offsets->push_back(cur);
      cur = 0;
      in_num = false;
    } else {
      offsets->clear();
      break;
    }
  }
  bool ok = !offsets->empty() && (*offsets)[0] == 0;
  for (size_t i = 1; ok && i < offsets->size(); ++i) ok = (*offsets)[i] > (*offsets)[i - 1];
  if (!ok) {
    MX_ERROR_MSG << "attribute 'offsets' must be ascending ints from 0, got '" << s << "'";
    return false;
  }
  return true;
}

MXReturnValue split_parse(const Attrs& attrs, int* nin, int* nout) {
  std::vector<int64_t> offsets;
  if (!parse_offsets(attrs, &offsets)) return MX_FAIL;
  *nin = 1;
  *nout = static_cast<int>(offsets.size());
  return MX_SUCCESS;
}

MXReturnValue split_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if ((*in)[0] != kFloat32) {
    MX_ERROR_MSG << "hylo_split_sections: x must be float32";
    return MX_FAIL;
  }
  for (size_t i = 0; i < out->size(); ++i) (*out)[i] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue split_shape(const Attrs& attrs, std::vector<std::vector<unsigned int> >* in,
                          std::vector<std::vector<unsigned int> >* out) {
  std::vector<int64_t> offsets;
  if (!parse_offsets(attrs, &offsets) || !expect_inputs(*in, 1, "hylo_split_sections"))
    return MX_FAIL;
  if ((*in)[0].size() != 1 || static_cast<int64_t>((*in)[0][0]) <= offsets.back()) {
    MX_ERROR_MSG << "hylo_split_sections: x must be 1-D with more than " << offsets.back()
                 << " elements";
    return MX_FAIL;
  }
  const int64_t n = (*in)[0][0];
  for (size_t i = 0; i < offsets.size(); ++i) {
    const int64_t end = i + 1 < offsets.size() ? offsets[i + 1] : n;
    (*out)[i] = dims({end - offsets[i]});
  }
  return MX_SUCCESS;
}

MXReturnValue split_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                            std::vector<MXTensor>* out, const OpResource&) {
  std::vector<int64_t> offsets;
  if (!parse_offsets(attrs, &offsets)) return MX_FAIL;
  const float* x = (*in)[0].data<float>();
  for (size_t i = 0; i < out->size(); ++i)
    std::memcpy((*out)[i].data<float>(), x + offsets[i], (*out)[i].size() * sizeof(float));
  return MX_SUCCESS;
}

// ===================================================== fused 2-bit encode
// hylo_encode_2bit: what a 2-bit layer's stages do to its gradient in a step
// (kvstore.stages: momentum correction's velocity, the codec, the residual's row
// bound) as one operation and two passes over memory, bitwise the composition
//   u' = hylo_momentum_velocity(g, u; momentum)          (with 'momentum')
//   codes, stats = hylo_quantize_2bit(u', r; threshold[, value])   (r settled)
//   (stats[2] is the mean |a| of the elements sent, also where 'value' is given:
//   the residual is settled with 'value', the mean is reported)
//   stats[3] = hylo_bound_rows(r, u'; bound)   (with 'bound', if stats[1] == 0)
// Pass 1 (quantize_all<.., kVelocity>) forms u' and quantizes it chunk by chunk
// in L1, leaving r <- a; pass 2 walks the rows: it settles each row's r <- a - q
// and cuts the row to its bound while the row is in cache. A step with a
// non-finite element settles r and is not bounded (the caller undoes it and
// raises). That was four operations and six to seven passes, one of them into
// a freshly allocated array.
struct EncodeAttrs {
  float t = 0.f, value = 0.f, momentum = 0.f, bound = 0.f;
  bool value_given = false, velocity = false, bounded = false;
};

bool parse_encode(const Attrs& attrs, EncodeAttrs* e) {
  if (!parse_threshold(attrs, &e->t) ||
      !parse_optional_float(attrs, "value", &e->value_given, &e->value))
    return false;
  e->velocity = attrs.count("momentum") > 0;  // any finite float
  if (e->velocity && !parse_float(attrs, "momentum", false, &e->momentum)) return false;
  e->bounded = attrs.count("bound") > 0;
  if (e->bounded && !parse_float(attrs, "bound", false, &e->bound)) return false;
  if (e->bounded && e->bound < 0.f) {
    MX_ERROR_MSG << "attribute 'bound' must be >= 0";
    return false;
  }
  return true;
}

MXReturnValue encode_parse(const Attrs& attrs, int* nin, int* nout) {
  EncodeAttrs e;
  if (!parse_encode(attrs, &e)) return MX_FAIL;
  *nin = e.velocity ? 3 : 2;    // grad, residual[, velocity]
  *nout = e.velocity ? 3 : 2;   // codes, stats[, the new velocity]
  return MX_SUCCESS;
}

MXReturnValue encode_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  const std::vector<int> gr(in->begin(), in->begin() + 2);
  if (!grad_residual_types(gr, "hylo_encode_2bit")) return MX_FAIL;
  if (in->size() == 3 && (*in)[2] != kFloat32) {
    MX_ERROR_MSG << "hylo_encode_2bit: velocity must be float32";
    return MX_FAIL;
  }
  (*out)[0] = kInt32;
  (*out)[1] = kFloat32;
  if (out->size() == 3) (*out)[2] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue encode_shape(const Attrs&, std::vector<std::vector<unsigned int> >* in,
                           std::vector<std::vector<unsigned int> >* out) {
  const std::vector<std::vector<unsigned int> > gr(in->begin(), in->begin() + 2);
  if (!grad_residual_shapes(gr, "hylo_encode_2bit")) return MX_FAIL;
  if (in->size() == 3 && (*in)[2] != (*in)[0]) {
    MX_ERROR_MSG << "hylo_encode_2bit: grad and velocity shapes differ";
    return MX_FAIL;
  }
  const int64_t n = shape_size((*in)[0]);
  (*out)[0] = dims({(n + 15) / 16});
  (*out)[1] = dims({4});
  if (out->size() == 3) (*out)[2] = (*in)[0];
  return MX_SUCCESS;
}

// Pass 2: row by row, settle r <- r - q up to the row's end (whole code words:
// a word that spans two rows is settled with the first) and cut the row to
// `bound` times the norm of the same row of x. Returns the rows cut.
template <typename T>
int64_t settle_and_bound(const uint32_t* codes, float* r, const T* x, int64_t rows,
                         int64_t width, float value, double bound) {
  const int64_t n = rows * width;
  int64_t settled = 0, cut = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t hi = (i + 1) * width;
    if (hi > settled) {
      const int64_t to = std::min(n, (hi + 15) / 16 * 16);
      settle_all(codes + settled / 16, r + settled, to - settled, value);
      settled = to;
    }
    cut += bound_row(r + i * width, x + i * width, width, bound);
  }
  return cut;
}

template <typename T>
void encode_any(const T* g, float* r, const float* u, float* velocity_out, uint32_t* codes,
                int64_t n, int64_t rows, const EncodeAttrs& e, float* stats) {
  const float mean = e.velocity
      ? quantize_all<T, true, false, true>(g, r, codes, n, e.t, 0.f, 0.f, stats, u,
                                           velocity_out, e.momentum)
      : quantize_all<T, true, false>(g, r, codes, n, e.t, 0.f, 0.f, stats);
  const float v = e.value_given ? e.value : mean;
  stats[2] = mean;
  stats[3] = 0.f;
  if (!e.bounded || stats[1] != 0.f) {
    settle_all(codes, r, n, v);
    return;
  }
  const int64_t width = rows ? n / rows : 0;
  const int64_t cut = e.velocity
      ? settle_and_bound<float>(codes, r, velocity_out, rows, width, v, e.bound)
      : settle_and_bound<T>(codes, r, g, rows, width, v, e.bound);
  stats[3] = static_cast<float>(cut);
}

MXReturnValue encode_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                             std::vector<MXTensor>* out, const OpResource&) {
  EncodeAttrs e;
  if (!parse_encode(attrs, &e)) return MX_FAIL;
  MXTensor& g = (*in)[0];
  float* r = (*in)[1].data<float>();
  const float* u = e.velocity ? (*in)[2].data<float>() : nullptr;
  float* velocity_out = e.velocity ? (*out)[2].data<float>() : nullptr;
  uint32_t* codes = (*out)[0].data<uint32_t>();
  float* stats = (*out)[1].data<float>();
  const int64_t n = g.size();
  const int64_t rows = g.shape.size() > 1 ? static_cast<int64_t>(g.shape[0]) : 1;
  if (g.dtype == kFloat16)
    encode_any(g.data<uint16_t>(), r, u, velocity_out, codes, n, rows, e, stats);
  else
    encode_any(g.data<float>(), r, u, velocity_out, codes, n, rows, e, stats);
  return MX_SUCCESS;
}

// ===================================================== integer sums of 2-bit codes
// A shared-scale codec (kvstore/codec_shared.py) quantizes every worker with the
// same value v, so the aggregate of W workers is v times an integer sum in [-W, W]
// per element. hylo_sum_2bit adds the W workers' codes as integers and packs the
// sums in base B = 2W + 1: d = digits_per_group(W) sums per little-endian uint16,
// group value sum_i (s_i + W) * B^i (a short last group padded with sums of 0).
// hylo_decode_sums reads them back as float32(s) * v, one rounding per element.
// The format is mxhylo/ops/sums.py's, the numpy oracle; integer arithmetic only,
// so every ISA build writes the same bytes and the same floats.
const int kMaxSumWorkers = 127;  // 2W + 1 <= 255: a group holds at least 2 sums

int digits_per_group(int workers) {
  const int64_t base = 2 * workers + 1;
  int d = 0;
  for (int64_t p = base; p <= 65536; p *= base) ++d;
  return d;
}

// Byte b of a code word holds 4 codes; kBiased[b] holds them as 4 bytes c + 1 in
// {0, 1, 2}, LSB first (code 1 is +1, 2 is -1, 0 and 3 (never written) 0). Adding W
// such words adds W workers' codes 4 elements at a time: each byte ends at s + W in
// [0, 2W] <= 254, so no byte carries into the next, and s + W is the base-B digit.
struct BiasedCodes {
  uint32_t t[256];
  BiasedCodes() {
    for (int b = 0; b < 256; ++b) {
      t[b] = 0;
      for (int j = 0; j < 4; ++j) {
        const int c = (b >> (2 * j)) & 3;
        t[b] |= static_cast<uint32_t>(1 + (c == 1) - (c == 2)) << (8 * j);
      }
    }
  }
};
const BiasedCodes kBiased;

// Digits s + W of elements e0 .. e0 + m - 1 (e0 a multiple of 16) into acc, read as
// bytes: byte j of acc[i] is element 4i + j (little-endian, as every MXNet CPU
// target is); rows of `codes` are the workers' code words.
void sum_block(const uint32_t* codes, int64_t words, int workers, int64_t e0, int64_t m,
               uint32_t* acc) {
  const int64_t w0 = e0 / 16, nw = (m + 15) / 16;
  const uint32_t* t = kBiased.t;
  for (int64_t q = 0; q < nw; ++q) {  // a word's 16 sums stay in registers
    const uint32_t* cw = codes + w0 + q;
    uint32_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (int w = 0; w < workers; ++w) {
      const uint32_t x = cw[w * words];
      a0 += t[x & 0xff];
      a1 += t[(x >> 8) & 0xff];
      a2 += t[(x >> 16) & 0xff];
      a3 += t[x >> 24];
    }
    acc[4 * q] = a0;
    acc[4 * q + 1] = a1;
    acc[4 * q + 2] = a2;
    acc[4 * q + 3] = a3;
  }
}

// Groups of D digits (D known when compiled, so the loop unrolls) -> little-endian
// uint16 sum_i digit_i * B^i.
template <int D>
void pack_groups(const uint8_t* dig, int64_t groups, uint32_t base, uint8_t* o) {
  uint32_t power[D];
  power[0] = 1;
  for (int i = 1; i < D; ++i) power[i] = power[i - 1] * base;
  for (int64_t g = 0; g < groups; ++g) {
    uint32_t value = 0;
    for (int i = 0; i < D; ++i) value += dig[g * D + i] * power[i];
    o[2 * g] = static_cast<uint8_t>(value & 0xff);
    o[2 * g + 1] = static_cast<uint8_t>(value >> 8);
  }
}

bool parse_size(const Attrs& attrs, int64_t* n) {
  if (!parse_int(attrs, "size", n)) return false;
  if (*n < 1) {
    MX_ERROR_MSG << "attribute 'size' must be >= 1";
    return false;
  }
  return true;
}

MXReturnValue sum_parse(const Attrs& attrs, int* nin, int* nout) {
  int64_t n;
  if (!parse_size(attrs, &n)) return MX_FAIL;
  *nin = 1;
  *nout = 1;
  return MX_SUCCESS;
}

MXReturnValue sum_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if ((*in)[0] != kInt32) {
    MX_ERROR_MSG << "hylo_sum_2bit: codes must be int32";
    return MX_FAIL;
  }
  (*out)[0] = kUint8;
  return MX_SUCCESS;
}

MXReturnValue sum_shape(const Attrs& attrs, std::vector<std::vector<unsigned int> >* in,
                        std::vector<std::vector<unsigned int> >* out) {
  int64_t n;
  if (!expect_inputs(*in, 1, "hylo_sum_2bit") || !parse_size(attrs, &n)) return MX_FAIL;
  const std::vector<unsigned int>& c = (*in)[0];
  if (c.size() != 2 || c[0] < 1 || c[0] > kMaxSumWorkers ||
      static_cast<int64_t>(c[1]) != (n + 15) / 16) {
    MX_ERROR_MSG << "hylo_sum_2bit: codes must have shape (W, " << (n + 15) / 16
                 << ") for " << n << " elements, 1 <= W <= " << kMaxSumWorkers;
    return MX_FAIL;
  }
  const int64_t d = digits_per_group(static_cast<int>(c[0]));
  (*out)[0] = dims({2 * ((n + d - 1) / d)});
  return MX_SUCCESS;
}

// The packed sums of elements [0, n) of `workers` rows of code words (row stride
// `words` words) into bytes [0, 2 ceil(n/d)).
void sum_codes(const uint32_t* codes, int64_t words, int workers, int64_t n, uint8_t* bytes) {
  const int d = digits_per_group(workers);
  const uint32_t base = 2 * workers + 1;
  // blocks of whole groups and whole code words, their digits kept in L1
  const int64_t block = 16 * d * 64;
  uint32_t acc[16 * 16 * 64 / 4 + 4];
  uint8_t* dig = reinterpret_cast<uint8_t*>(acc);
  for (int64_t e0 = 0; e0 < n; e0 += block) {
    const int64_t m = std::min(block, n - e0);
    sum_block(codes, words, workers, e0, m, acc);
    const int64_t groups = (m + d - 1) / d;
    for (int64_t i = m; i < groups * d; ++i) dig[i] = static_cast<uint8_t>(workers);  // sums of 0
    uint8_t* o = bytes + 2 * (e0 / d);
    switch (d) {  // digits_per_group gives these for W = 1 .. 127
      case 2: pack_groups<2>(dig, groups, base, o); break;
      case 3: pack_groups<3>(dig, groups, base, o); break;
      case 4: pack_groups<4>(dig, groups, base, o); break;
      case 5: pack_groups<5>(dig, groups, base, o); break;
      case 6: pack_groups<6>(dig, groups, base, o); break;
      default: pack_groups<10>(dig, groups, base, o); break;
    }
  }
}

MXReturnValue sum_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                          std::vector<MXTensor>* out, const OpResource&) {
  int64_t n;
  if (!parse_size(attrs, &n)) return MX_FAIL;
  sum_codes((*in)[0].data<uint32_t>(), (*in)[0].shape[1], static_cast<int>((*in)[0].shape[0]),
            n, (*out)[0].data<uint8_t>());
  return MX_SUCCESS;
}

MXReturnValue decode_sums_parse(const Attrs& attrs, int* nin, int* nout) {
  int64_t workers;
  std::vector<unsigned int> shape;
  if (!parse_shape(attrs, &shape) ||
      !parse_int(attrs, "workers", &workers))
    return MX_FAIL;
  if (workers < 1 || workers > kMaxSumWorkers) {
    MX_ERROR_MSG << "hylo_decode_sums: workers must be in [1, " << kMaxSumWorkers << "]";
    return MX_FAIL;
  }
  *nin = 2;
  *nout = 1;
  return MX_SUCCESS;
}

MXReturnValue decode_sums_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if ((*in)[0] != kUint8 || (*in)[1] != kFloat32) {
    MX_ERROR_MSG << "hylo_decode_sums: packed sums must be uint8, the scale float32";
    return MX_FAIL;
  }
  (*out)[0] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue decode_sums_shape(const Attrs& attrs, std::vector<std::vector<unsigned int> >* in,
                                std::vector<std::vector<unsigned int> >* out) {
  std::vector<unsigned int> shape;
  int64_t workers;
  if (!expect_inputs(*in, 2, "hylo_decode_sums") || !parse_shape(attrs, &shape) ||
      !parse_int(attrs, "workers", &workers))
    return MX_FAIL;
  const int64_t n = shape_size(shape), d = digits_per_group(static_cast<int>(workers));
  if ((*in)[0].size() != 1 || static_cast<int64_t>((*in)[0][0]) != 2 * ((n + d - 1) / d)) {
    MX_ERROR_MSG << "hylo_decode_sums: packed sums of " << n << " elements of " << workers
                 << " workers must have shape (" << 2 * ((n + d - 1) / d) << ",)";
    return MX_FAIL;
  }
  if ((*in)[1].size() != 1 || (*in)[1][0] < 1) {
    MX_ERROR_MSG << "hylo_decode_sums: the scale must be a 1-D array of at least 1 value";
    return MX_FAIL;
  }
  (*out)[0] = shape;
  return MX_SUCCESS;
}

// The packed sums of `workers` workers -> o[e] = float32(s_e) * v; NaN for a group
// hylo_sum_2bit never writes. Built once per pulled array (the table), then decode()
// over all its bytes or block by block (hylo_decode_sums and the host-side decode of
// a pulled 'sum' chunk).
struct SumsDecoder {
  int workers, d, k;
  uint32_t base, low, limit;
  uint64_t m;
  std::vector<float> value;
  float v;

  SumsDecoder(int workers_, float v_) : workers(workers_), v(v_) {
    d = digits_per_group(workers);
    k = (d + 1) / 2;
    base = 2 * workers + 1;
    low = 1;  // D = B^k: a group x is hi * D + lo, lo's k digits, then hi's d - k
    for (int i = 0; i < k; ++i) low *= base;
    limit = low * (d - k == k ? low : low / base);  // B^d
    // value[j * k + i] = float32(digit i of j - W) * v for every j < D: each element one
    // rounding, as float32(s) * v is; lo and hi (< B^(d-k) <= D for a written group)
    // are rows of it
    value.resize(static_cast<size_t>(low) * k);
    for (uint32_t j = 0; j < low; ++j) {
      uint32_t x = j;
      for (int i = 0; i < k; ++i, x /= base)
        value[j * k + i] = static_cast<float>(static_cast<int>(x % base) - workers) * v;
    }
    // x / D for x < 2^16 by one multiply: with m = ceil(2^32 / D), e = m * D - 2^32 < D
    // <= 2^16, the error x * e / (D * 2^32) < 1 / D never reaches the next quotient
    m = ((uint64_t(1) << 32) + low - 1) / low;
  }

  // n elements from the start of a group
  void decode(const uint8_t* bytes, int64_t n, float* o) const {
    const int64_t full = n / d;
    const float* table = value.data();
    for (int64_t g = 0; g < full; ++g) {
      const uint32_t x = bytes[2 * g] | (static_cast<uint32_t>(bytes[2 * g + 1]) << 8);
      float* dst = o + g * d;
      if (x >= limit) {  // never written by hylo_sum_2bit
        for (int i = 0; i < d; ++i) dst[i] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const uint32_t hi = static_cast<uint32_t>((x * m) >> 32), lo = x - hi * low;
      const float* a = table + lo * k;
      const float* b = table + hi * k;
      for (int i = 0; i < k; ++i) dst[i] = a[i];
      for (int i = 0; i < d - k; ++i) dst[k + i] = b[i];
    }
    if (full * d < n) {  // the last group, short
      uint32_t x = bytes[2 * full] | (static_cast<uint32_t>(bytes[2 * full + 1]) << 8);
      const bool written = x < limit;
      for (int64_t e = full * d; e < n; ++e, x /= base)
        o[e] = written ? static_cast<float>(static_cast<int>(x % base) - workers) * v
                       : std::numeric_limits<float>::quiet_NaN();
    }
  }
};

MXReturnValue decode_sums_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                                  std::vector<MXTensor>* out, const OpResource&) {
  int64_t workers64;
  if (!parse_int(attrs, "workers", &workers64)) return MX_FAIL;
  const float v = (*in)[1].data<float>()[0];  // the pulled header's first value
  SumsDecoder(static_cast<int>(workers64), v)
      .decode((*in)[0].data<uint8_t>(), (*out)[0].size(), (*out)[0].data<float>());
  return MX_SUCCESS;
}

// ===================================================== bytes in float32 carriers
// The parameter server moves and sums float32 values; a payload's bytes travel 30
// bits per value, 15 bytes in 4 values (mxhylo/kvstore/wire.py's pack_bytes and
// unpack_bytes, the numpy oracle). Each value is a normal float32: bit 29 of the 30
// to the sign, bits 23-28 to the exponent field plus one (1..64), bits 0-22 to the
// mantissa, so a server's sum with other workers' zeros leaves it bit for bit.
const uint32_t kWord30 = (1u << 30) - 1;

inline uint32_t carry_bits(uint32_t w) {
  return ((w >> 29) << 31) | ((((w >> 23) & 0x3Fu) + 1) << 23) | (w & 0x7FFFFFu);
}

inline void pack_group(uint64_t lo, uint64_t hi, uint32_t* values) {  // hi: 56 bits
  values[0] = carry_bits(static_cast<uint32_t>(lo) & kWord30);
  values[1] = carry_bits(static_cast<uint32_t>(lo >> 30) & kWord30);
  values[2] = carry_bits(static_cast<uint32_t>((lo >> 60) | (hi << 4)) & kWord30);
  values[3] = carry_bits(static_cast<uint32_t>(hi >> 26) & kWord30);
}

void pack_carriers(const uint8_t* bytes, int64_t nbytes, uint32_t* values) {
  int64_t at = 0, v = 0;
  for (; at + 16 <= nbytes; at += 15, v += 4) {  // whole groups: 16-byte loads
    uint64_t lo, hi;
    std::memcpy(&lo, bytes + at, 8);
    std::memcpy(&hi, bytes + at + 8, 8);
    pack_group(lo, hi & 0x00FFFFFFFFFFFFFFull, values + v);
  }
  for (; at < nbytes; at += 15, v += 4) {  // the last one or two, zero-padded
    uint8_t g[16] = {0};
    std::memcpy(g, bytes + at, static_cast<size_t>(std::min<int64_t>(15, nbytes - at)));
    uint64_t lo, hi;
    std::memcpy(&lo, g, 8);
    std::memcpy(&hi, g + 8, 8);
    pack_group(lo, hi, values + v);
  }
}

// The inverse; returns how many of the values pack_carriers never writes (exponent
// field outside 1..64): their bytes are written all the same, and the caller refuses
// the payload.
inline void unpack_group(const uint32_t* values, uint64_t* lo, uint64_t* hi, int64_t* bad) {
  uint64_t w[4];
  for (int j = 0; j < 4; ++j) {
    const uint32_t b = values[j], e = (b >> 23) & 0xFFu;
    *bad += (e < 1) | (e > 64);
    w[j] = ((b >> 31) << 29) | (((e - 1) & 0x3Fu) << 23) | (b & 0x7FFFFFu);
  }
  *lo = w[0] | (w[1] << 30) | (w[2] << 60);
  *hi = (w[2] >> 4) | (w[3] << 26);
}

int64_t unpack_carriers(const uint32_t* values, int64_t nbytes, uint8_t* bytes) {
  int64_t bad = 0, at = 0, v = 0;
  uint64_t lo, hi;
  for (; at + 16 <= nbytes; at += 15, v += 4) {  // 16-byte stores: the next group
    unpack_group(values + v, &lo, &hi, &bad);    // overwrites the 16th
    std::memcpy(bytes + at, &lo, 8);
    std::memcpy(bytes + at + 8, &hi, 8);
  }
  for (; at < nbytes; at += 15, v += 4) {
    unpack_group(values + v, &lo, &hi, &bad);
    uint8_t g[16];
    std::memcpy(g, &lo, 8);
    std::memcpy(g + 8, &hi, 8);
    std::memcpy(bytes + at, g, static_cast<size_t>(std::min<int64_t>(15, nbytes - at)));
  }
  return bad;
}

int64_t carrier_values(int64_t nbytes) { return 4 * ((nbytes + 14) / 15); }

MXReturnValue unpack_bytes_parse(const Attrs& attrs, int* nin, int* nout) {
  int64_t nbytes;
  if (!parse_int(attrs, "nbytes", &nbytes)) return MX_FAIL;
  *nin = 1;
  *nout = 2;
  return MX_SUCCESS;
}

MXReturnValue unpack_bytes_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if ((*in)[0] != kFloat32) {
    MX_ERROR_MSG << "hylo_unpack_bytes: values must be float32";
    return MX_FAIL;
  }
  (*out)[0] = kUint8;
  (*out)[1] = kFloat32;
  return MX_SUCCESS;
}

// values (R, m) or (m,), m >= carrier_values(nbytes): each row's first values carry
// nbytes -> bytes (R, nbytes) (or (nbytes,)), bad f32 (R,): values per row that no
// pack_bytes writes
MXReturnValue unpack_bytes_shape(const Attrs& attrs, std::vector<std::vector<unsigned int> >* in,
                                 std::vector<std::vector<unsigned int> >* out) {
  int64_t nbytes;
  if (!expect_inputs(*in, 1, "hylo_unpack_bytes") || !parse_int(attrs, "nbytes", &nbytes))
    return MX_FAIL;
  const std::vector<unsigned int>& v = (*in)[0];
  if (v.empty() || v.size() > 2 || nbytes < 1 ||
      static_cast<int64_t>(v.back()) < carrier_values(nbytes)) {
    MX_ERROR_MSG << "hylo_unpack_bytes: values must be (m,) or (rows, m) with m >= "
                 << carrier_values(nbytes) << " to carry " << nbytes << " bytes";
    return MX_FAIL;
  }
  (*out)[0] = v.size() == 2 ? dims({v[0], nbytes}) : dims({nbytes});
  (*out)[1] = dims({v.size() == 2 ? v[0] : 1});
  return MX_SUCCESS;
}

MXReturnValue unpack_bytes_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                                   std::vector<MXTensor>* out, const OpResource&) {
  int64_t nbytes;
  if (!parse_int(attrs, "nbytes", &nbytes)) return MX_FAIL;
  MXTensor& v = (*in)[0];
  const int64_t rows = v.shape.size() == 2 ? v.shape[0] : 1, m = v.shape.back();
  const uint32_t* values = v.data<uint32_t>();
  uint8_t* bytes = (*out)[0].data<uint8_t>();
  float* bad = (*out)[1].data<float>();
  for (int64_t r = 0; r < rows; ++r)
    bad[r] = static_cast<float>(unpack_carriers(values + r * m, nbytes, bytes + r * nbytes));
  return MX_SUCCESS;
}

// ===================================================== the servers' sum, on host arrays
// A server adds the workers' codes inside ps-lite's request callback, on numpy arrays
// (mxhylo/kvstore/wire.py sum_values): one call, on the calling thread, unpacks every
// worker's carried code bytes, sums them and packs the sums into carriers, block by
// block in L1. Bitwise what unpack_bytes, sum_2bit and pack_bytes compose to (the
// tests compare), without handing each step to an MXNet engine thread: on a busy
// machine every hand-off waits for a core.
void sum_carried(const float* slots, int64_t rows, int64_t stride, int64_t offset,
                 int64_t n, float* out, int64_t* bad) {
  const int workers = static_cast<int>(rows), d = digits_per_group(workers);
  // a block of 1920 d elements: 480 d code bytes (32 d carrier groups) in, 1920 sums
  // groups = 3840 bytes (256 carrier groups) out; d <= 10
  const int64_t block = 1920 * d, in_bytes = block / 4, out_bytes = 2 * (block / d);
  std::vector<uint32_t> codes(static_cast<size_t>(rows) * (in_bytes / 4));
  std::vector<uint8_t> packed(static_cast<size_t>(out_bytes));
  for (int64_t w = 0; w < rows; ++w) bad[w] = 0;
  for (int64_t e0 = 0; e0 < n; e0 += block) {
    const int64_t m = std::min(block, n - e0);
    const int64_t nw = (m + 15) / 16, b0 = e0 / 4;  // words, and the first code byte
    for (int64_t w = 0; w < rows; ++w) {
      const uint32_t* values = reinterpret_cast<const uint32_t*>(slots + w * stride + offset);
      uint8_t* dst = reinterpret_cast<uint8_t*>(codes.data() + w * (in_bytes / 4));
      bad[w] += unpack_carriers(values + 4 * (b0 / 15), 4 * nw, dst);
    }
    sum_codes(codes.data(), in_bytes / 4, workers, m, packed.data());
    const int64_t nbytes = 2 * ((m + d - 1) / d);
    pack_carriers(packed.data(), nbytes,
                  reinterpret_cast<uint32_t*>(out) + 4 * (2 * (e0 / d) / 15));
  }
}

// A 'gather' pull of a 2-bit chunk, on host arrays: each worker's carried code bytes
// (mxhylo/kvstore/wire.py push_slot) decoded and added in rank order, block by block
// in L1, on the calling thread. Bitwise out = 0, then dequantize_2bit(...,
// accumulate=True) of each worker's payload in order (the tests compare): one pass
// where that was W engine operations, W host-to-NDArray copies and W unpackings.
void decode_carried(const float* slots, int64_t rows, int64_t stride, int64_t offset,
                    const float* value, int64_t n, float* out, int64_t* bad) {
  const int64_t block = 3840;  // 960 code bytes = 64 carrier groups: groups align
  std::vector<uint32_t> codes(block / 16);
  for (int64_t w = 0; w < rows; ++w) bad[w] = 0;
  for (int64_t e0 = 0; e0 < n; e0 += block) {
    const int64_t m = std::min(block, n - e0);
    const int64_t nw = (m + 15) / 16, b0 = e0 / 4;  // words, and the first code byte
    if (rows == 0)
      for (int64_t i = 0; i < m; ++i) out[e0 + i] = 0.f;
    for (int64_t w = 0; w < rows; ++w) {
      const uint32_t* values = reinterpret_cast<const uint32_t*>(slots + w * stride + offset);
      bad[w] += unpack_carriers(values + 4 * (b0 / 15), 4 * nw,
                                reinterpret_cast<uint8_t*>(codes.data()));
      // the first worker's codes written, not added to zeros: +0 + q is q bit for bit
      // (q is never -0), and the block is not cleared first
      if (w == 0)
        dequantize_all<0>(codes.data(), out + e0, m, value[w]);
      else
        dequantize_all<1>(codes.data(), out + e0, m, value[w]);
    }
  }
}

// An allgather of 2-bit payloads, on host arrays (mxhylo/kvstore/transport_horovod.py):
// each worker's code words where the gathered bytes hold them, decoded and added in rank
// order, block by block in L1, on the calling thread. Bitwise out = 0, then
// dequantize_2bit(..., accumulate=True) of each worker's payload in order, as
// decode_carried but on raw words (no carriers): one pass where that was W copies into
// NDArrays and W engine operations, each a pass over out.
void decode_words(const uint8_t* data, const int64_t* offsets, int64_t rows,
                  const float* value, int64_t n, float* out) {
  const int64_t block = 3840;  // whole code words: 240 of 16 codes
  for (int64_t e0 = 0; e0 < n; e0 += block) {
    const int64_t m = std::min(block, n - e0);
    if (rows == 0)
      for (int64_t i = 0; i < m; ++i) out[e0 + i] = 0.f;
    for (int64_t w = 0; w < rows; ++w) {  // the first written (as in decode_carried)
      const uint32_t* codes = reinterpret_cast<const uint32_t*>(data + offsets[w]);
      if (w == 0)
        dequantize_all<0>(codes + e0 / 16, out + e0, m, value[w]);
      else
        dequantize_all<1>(codes + e0 / 16, out + e0, m, value[w]);
    }
  }
}

// A 'sum' pull on host arrays: the packed sums carried in `values` (wire.py
// sum_values) unpacked block by block in L1 and decoded as float32(s) * v, on the
// calling thread. Bitwise unpack_bytes then decode_sums (the tests compare): one pass
// where that was a copy of the pulled values and two engine operations. Returns how
// many carrier values no pack_bytes writes.
int64_t decode_carried_sums(const float* values, int64_t n, int workers, float v, float* out) {
  const SumsDecoder sums(workers, v);
  const int d = sums.d;
  // 3840 groups a block: 7680 packed bytes = 512 carrier groups, so blocks align
  const int64_t block = 3840 * static_cast<int64_t>(d);
  std::vector<uint8_t> bytes(7680);
  int64_t bad = 0;
  for (int64_t e0 = 0; e0 < n; e0 += block) {
    const int64_t m = std::min(block, n - e0);
    const int64_t nbytes = 2 * ((m + d - 1) / d), b0 = 2 * (e0 / d);
    bad += unpack_carriers(reinterpret_cast<const uint32_t*>(values) + 4 * (b0 / 15), nbytes,
                           bytes.data());
    sums.decode(bytes.data(), m, out + e0);
  }
  return bad;
}

}  // namespace

// ---------------------------------------------------------------- registry
REGISTER_OP(hylo_quantize_2bit)
    .setParseAttrs(quantize_parse)
    .setInferType(quantize_type)
    .setInferShape(quantize_shape)
    .setMutateInputs(mutate_residual)
    .setForward(quantize_forward, "cpu");

REGISTER_OP(hylo_l1_stats)
    .setParseAttrs(stats_parse)
    .setInferType(stats_type)
    .setInferShape(stats_shape)
    .setForward(stats_forward, "cpu");

REGISTER_OP(hylo_dequantize_2bit)
    .setParseAttrs(deq_parse)
    .setInferType(deq_type)
    .setInferShape(deq_shape)
    .setForward(deq_forward, "cpu");

REGISTER_OP(hylo_dequantize_2bit_add)
    .setParseAttrs(deq_add_parse)
    .setInferType(deq_type)
    .setInferShape(deq_inplace_shape<1>)
    .setForward(deq_inplace_forward<1>, "cpu");

REGISTER_OP(hylo_settle_2bit)
    .setParseAttrs(deq_add_parse)
    .setInferType(deq_type)
    .setInferShape(deq_inplace_shape<2>)
    .setForward(deq_inplace_forward<2>, "cpu");

REGISTER_OP(hylo_select_kernels)
    .setParseAttrs(select_parse)
    .setInferType(select_type)
    .setInferShape(select_shape)
    .setMutateInputs(mutate_residual)
    .setForward(select_forward, "cpu");

REGISTER_OP(hylo_scatter_kernels)
    .setParseAttrs(scatter_parse)
    .setInferType(scatter_type)
    .setInferShape(scatter_shape)
    .setForward(scatter_forward, "cpu");

REGISTER_OP(hylo_scatter_kernels_add)
    .setParseAttrs(scatter_add_parse)
    .setInferType(scatter_type)
    .setInferShape(scatter_add_shape)
    .setForward(scatter_add_forward, "cpu");

REGISTER_OP(hylo_momentum_velocity)
    .setParseAttrs(velocity_parse)
    .setInferType(velocity_type)
    .setInferShape(velocity_shape)
    .setForward(velocity_forward, "cpu");

REGISTER_OP(hylo_split_sections)
    .setParseAttrs(split_parse)
    .setInferType(split_type)
    .setInferShape(split_shape)
    .setForward(split_forward, "cpu");

REGISTER_OP(hylo_encode_2bit)
    .setParseAttrs(encode_parse)
    .setInferType(encode_type)
    .setInferShape(encode_shape)
    .setMutateInputs(mutate_residual)
    .setForward(encode_forward, "cpu");

REGISTER_OP(hylo_bound_rows)
    .setParseAttrs(bound_parse)
    .setInferType(bound_type)
    .setInferShape(bound_shape)
    .setMutateInputs(mutate_first)
    .setForward(bound_forward, "cpu");

REGISTER_OP(hylo_momentum_correct)
    .setParseAttrs(correct_parse)
    .setInferType(correct_type)
    .setInferShape(correct_shape)
    .setMutateInputs(mutate_previous)
    .setForward(correct_forward, "cpu");

REGISTER_OP(hylo_sum_2bit)
    .setParseAttrs(sum_parse)
    .setInferType(sum_type)
    .setInferShape(sum_shape)
    .setForward(sum_forward, "cpu");

REGISTER_OP(hylo_decode_sums)
    .setParseAttrs(decode_sums_parse)
    .setInferType(decode_sums_type)
    .setInferShape(decode_sums_shape)
    .setForward(decode_sums_forward, "cpu");

REGISTER_OP(hylo_unpack_bytes)
    .setParseAttrs(unpack_bytes_parse)
    .setInferType(unpack_bytes_type)
    .setInferShape(unpack_bytes_shape)
    .setForward(unpack_bytes_forward, "cpu");

MXReturnValue initialize(int version) {
  if (version < 10900) {
    MX_ERROR_MSG << "mxhylo ops need MXNet >= 1.9.0, found " << version;
    return MX_FAIL;
  }
  return MX_SUCCESS;
}

// Plain C entry points, reached through ctypes on the same loaded library.
extern "C" {
// on != 0: AVX-512 kernels if compiled in; returns whether they are now used.
__attribute__((visibility("default"))) int hylo_set_simd(int on) {
  g_simd = on ? 1 : 0;
#if defined(__AVX512F__)
  return g_simd;
#else
  return 0;
#endif
}
// An MXNet engine callback (EngineSyncFunc, pushed by mxhylo/kvstore/readiness.py):
// the engine calls it once the arrays it was pushed with are written. param packs
// a pipe's write end (bits 48-63) and an 8-byte record to write there (bits 0-47:
// generation << 32 | index). A write of 8 bytes to a pipe is atomic; it needs no
// Python (no GIL), so the engine thread running backward never waits for Python.
__attribute__((visibility("default"))) void hylo_notify_ready(void* rctx, void* param) {
  (void)rctx;
  const uint64_t packed = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(param));
  const int fd = static_cast<int>(packed >> 48);
  const uint64_t record = packed & 0xFFFFFFFFFFFFull;
  const char* bytes = reinterpret_cast<const char*>(&record);
  size_t left = sizeof(record);
  while (left > 0) {
    const ssize_t n = write(fd, bytes, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // the reader is gone: its bound reports the missing record
    }
    bytes += n;
    left -= static_cast<size_t>(n);
  }
}
// A worker's slot of a 'slots' chunk (mxhylo/kvstore/wire.py push_slot): nbytes bytes
// into carrier values, on host memory the caller owns, on the calling thread.
__attribute__((visibility("default"))) void hylo_pack_carriers(const uint8_t* bytes,
                                                               int64_t nbytes, float* values) {
  pack_carriers(bytes, nbytes, reinterpret_cast<uint32_t*>(values));
}
// mxhylo.ops.sum_carried_2bit (see sum_carried): slots float32 (rows, stride), the code
// bytes carried from column `offset`; out float32, the packed sums carried; bad
// (rows,): per row, values no pack_bytes writes.
__attribute__((visibility("default"))) void hylo_sum_carried_2bit(
    const float* slots, int64_t rows, int64_t stride, int64_t offset, int64_t n, float* out,
    int64_t* bad) {
  sum_carried(slots, rows, stride, offset, n, out, bad);
}
// mxhylo.ops.decode_carried_2bit (see decode_carried): slots float32 (rows, stride),
// the code bytes carried from column `offset`; value (rows,): what each row's codes
// were sent with; out float32 (n,); bad (rows,): per row, values no pack_bytes writes.
__attribute__((visibility("default"))) void hylo_decode_carried_2bit(
    const float* slots, int64_t rows, int64_t stride, int64_t offset, const float* value,
    int64_t n, float* out, int64_t* bad) {
  decode_carried(slots, rows, stride, offset, value, n, out, bad);
}
// mxhylo.ops.decode_gathered_2bit (see decode_words): data the gathered bytes; offsets
// (rows,): where row w's code words start, multiples of 4; value (rows,): what each
// row's codes were sent with; out float32 (n,).
__attribute__((visibility("default"))) void hylo_decode_words_2bit(
    const uint8_t* data, const int64_t* offsets, int64_t rows, const float* value, int64_t n,
    float* out) {
  decode_words(data, offsets, rows, value, n, out);
}
// mxhylo.ops.decode_carried_sums (see decode_carried_sums): values float32, the packed
// sums of n elements for `workers` workers carried; out float32 (n,); returns the
// carrier values no pack_bytes writes.
__attribute__((visibility("default"))) int64_t hylo_decode_carried_sums(
    const float* values, int64_t n, int64_t workers, float v, float* out) {
  return decode_carried_sums(values, n, static_cast<int>(workers), v, out);
}
// What the compiler targeted: "key=0|1 ..." (mxhylo.ops.build.build_info()).
__attribute__((visibility("default"))) const char* hylo_build_info() {
  return "avx512f="
#if defined(__AVX512F__)
         "1"
#else
         "0"
#endif
         " avx2="
#if defined(__AVX2__)
         "1"
#else
         "0"
#endif
         " f16c="
#if defined(__F16C__)
         "1"
#else
         "0"
#endif
         " fma="
#if defined(__FMA__)
         "1"
#else
         "0"
#endif
         " openmp="
#if defined(_OPENMP)
         "1"
#else
         "0"
#endif
         " simd_kernels="
#if defined(__AVX512F__)
         "1";
#else
         "0";
#endif
}
}
