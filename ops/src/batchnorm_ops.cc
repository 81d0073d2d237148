// BatchNorm split in two so that statistics can be summed over workers between
// them (mxhylo/sync_batchnorm.py): moments, then normalize with given statistics.
// Both have a backward, so autograd carries the gradient through the statistics.
// CPU, float32, x of any rank with the channel at `axis`: x viewed as
// (outer, C, inner), outer = prod(shape[:axis]), inner = prod(shape[axis+1:]);
// a statistic has x's rank with 1 everywhere but C at axis (it broadcasts).
//
//   hylo_bn_moments(x; axis) -> mean, centred (statistic shape)
//       mean_c = sum x / n, centred_c = sum (x - mean_c)^2, n = outer * inner;
//       both summed in 16 float lanes along a row of `inner` elements, in double
//       across rows (two passes).
//       backward: dx = dmean_c / n + 2 dcentred_c (x - mean_c)
//   hylo_bn_normalize(x, mean, var (statistic shape), gamma, beta (C,);
//                     axis, eps, fix_gamma) -> y = (x - mean_c) s_c + beta_c,
//       s_c = g_c / sqrt(var_c + eps), g = 1 with fix_gamma else gamma.
//       backward (r_c = 1/sqrt(var_c + eps), sums over the channel's elements, in
//       double): dx = dy s_c; dmean = -g r sum dy; dvar = -g r^3 sum dy (x - mean) / 2;
//       dgamma = r sum dy (x - mean) (0 with fix_gamma); dbeta = sum dy.
// The NDArray reference of both is the broadcast-operator formula in
// sync_batchnorm.py (the oracle in tests/unit/test_sync_batchnorm.py).

#include <cmath>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "mxnet/lib_api.h"

using namespace mxnet::ext;  // NOLINT

namespace {

typedef std::unordered_map<std::string, std::string> Attrs;
typedef std::vector<std::vector<unsigned int> > Shapes;

bool channel_axis(const Attrs& attrs, size_t ndim, size_t* axis) {
  auto it = attrs.find("axis");
  long a = it == attrs.end() ? 1 : std::stol(it->second);
  if (a < 0) a += static_cast<long>(ndim);
  if (a < 0 || a >= static_cast<long>(ndim)) {
    MX_ERROR_MSG << "hylo_bn: axis " << (it == attrs.end() ? "1" : it->second)
                 << " is out of range for an input of " << ndim << " dimensions";
    return false;
  }
  *axis = static_cast<size_t>(a);
  return true;
}

struct View {
  int64_t outer = 1, channels = 1, inner = 1;
};

View view_of(const std::vector<int64_t>& shape, size_t axis) {
  View v;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i < axis) v.outer *= shape[i];
    else if (i == axis) v.channels = shape[i];
    else v.inner *= shape[i];
  }
  return v;
}

std::vector<unsigned int> stat_shape(const std::vector<unsigned int>& x, size_t axis) {
  std::vector<unsigned int> s(x.size(), 1);
  s[axis] = x[axis];
  return s;
}

float attr_float(const Attrs& attrs, const char* name, float fallback) {
  auto it = attrs.find(name);
  return it == attrs.end() ? fallback : std::stof(it->second);
}

// Row sums in kLanes independent float lanes, added in a fixed order at the end:
// the compiler vectorizes the lanes (a single running sum would be one long
// dependency chain), and the order, hence every bit, is the same in every ISA build.
constexpr int kLanes = 16;

float lanes_total(const float* acc) {
  float t = 0;
  for (int l = 0; l < kLanes; ++l) t += acc[l];
  return t;
}

float row_sum(const float* p, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += p[i + l];
  float t = lanes_total(acc);
  for (; i < n; ++i) t += p[i];
  return t;
}

float row_centred_squares(const float* p, int64_t n, float m) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float d = p[i + l] - m;
      acc[l] += d * d;
    }
  float t = lanes_total(acc);
  for (; i < n; ++i) t += (p[i] - m) * (p[i] - m);
  return t;
}

// sum dy and sum dy (x - m) over a row, writing dx = dy s on the way
void row_normalize_backward(const float* dy, const float* x, float* dx, int64_t n, float m,
                            float s, float* sum_dy, float* sum_dyx) {
  float a[kLanes] = {0}, b[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float d = dy[i + l];
      a[l] += d;
      b[l] += d * (x[i + l] - m);
      dx[i + l] = d * s;
    }
  float ta = lanes_total(a), tb = lanes_total(b);
  for (; i < n; ++i) {
    ta += dy[i];
    tb += dy[i] * (x[i] - m);
    dx[i] = dy[i] * s;
  }
  *sum_dy = ta;
  *sum_dyx = tb;
}

// ------------------------------------------------------------------ moments

MXReturnValue moments_parse(const Attrs&, int* nin, int* nout) {
  *nin = 1;
  *nout = 2;
  return MX_SUCCESS;
}

MXReturnValue all_float32(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  for (int t : *in)
    if (t != kFloat32) {
      MX_ERROR_MSG << "hylo_bn: float32 inputs only";
      return MX_FAIL;
    }
  for (auto& t : *out) t = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue moments_shape(const Attrs& attrs, Shapes* in, Shapes* out) {
  size_t axis;
  if (!channel_axis(attrs, (*in)[0].size(), &axis)) return MX_FAIL;
  (*out)[0] = (*out)[1] = stat_shape((*in)[0], axis);
  return MX_SUCCESS;
}

MXReturnValue moments_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                              std::vector<MXTensor>* out, const OpResource&) {
  MXTensor& xt = (*in)[0];
  size_t axis;
  if (!channel_axis(attrs, xt.shape.size(), &axis)) return MX_FAIL;
  const View v = view_of(xt.shape, axis);
  const float* x = xt.data<float>();
  float* mean = (*out)[0].data<float>();
  float* centred = (*out)[1].data<float>();
  const double n = static_cast<double>(v.outer * v.inner);
  for (int64_t c = 0; c < v.channels; ++c) {
    double s = 0;
    for (int64_t o = 0; o < v.outer; ++o)
      s += row_sum(x + (o * v.channels + c) * v.inner, v.inner);
    const double m = n > 0 ? s / n : 0.0;
    const float mf = static_cast<float>(m);
    double q = 0;
    for (int64_t o = 0; o < v.outer; ++o)
      q += row_centred_squares(x + (o * v.channels + c) * v.inner, v.inner, mf);
    mean[c] = mf;
    centred[c] = static_cast<float>(q);
  }
  return MX_SUCCESS;
}

// inputs: dmean, dcentred, x, mean, centred; outputs: dx
MXReturnValue moments_backward(const Attrs& attrs, std::vector<MXTensor>* in,
                               std::vector<MXTensor>* out, const OpResource&) {
  MXTensor& xt = (*in)[2];
  size_t axis;
  if (!channel_axis(attrs, xt.shape.size(), &axis)) return MX_FAIL;
  const View v = view_of(xt.shape, axis);
  const float* dmean = (*in)[0].data<float>();
  const float* dcentred = (*in)[1].data<float>();
  const float* x = xt.data<float>();
  const float* mean = (*in)[3].data<float>();
  float* dx = (*out)[0].data<float>();
  const float inv_n = 1.0f / static_cast<float>(v.outer * v.inner);
  for (int64_t o = 0; o < v.outer; ++o)
    for (int64_t c = 0; c < v.channels; ++c) {
      const float a = dmean[c] * inv_n, b = 2.0f * dcentred[c], m = mean[c];
      const int64_t base = (o * v.channels + c) * v.inner;
      for (int64_t i = 0; i < v.inner; ++i) dx[base + i] = a + b * (x[base + i] - m);
    }
  return MX_SUCCESS;
}

// ---------------------------------------------------------------- normalize

MXReturnValue normalize_parse(const Attrs&, int* nin, int* nout) {
  *nin = 5;
  *nout = 1;
  return MX_SUCCESS;
}

MXReturnValue normalize_shape(const Attrs& attrs, Shapes* in, Shapes* out) {
  const std::vector<unsigned int>& x = (*in)[0];
  size_t axis;
  if (!channel_axis(attrs, x.size(), &axis)) return MX_FAIL;
  const std::vector<unsigned int> stat = stat_shape(x, axis);
  for (int i = 1; i < 3; ++i)
    if (!(*in)[i].empty() && (*in)[i] != stat) {
      MX_ERROR_MSG << "hylo_bn_normalize: mean and var must have the statistic shape "
                      "of x (1 but the channel axis)";
      return MX_FAIL;
    }
  for (int i = 3; i < 5; ++i)
    if (!(*in)[i].empty() && ((*in)[i].size() != 1 || (*in)[i][0] != x[axis])) {
      MX_ERROR_MSG << "hylo_bn_normalize: gamma and beta must be (" << x[axis] << ",)";
      return MX_FAIL;
    }
  (*out)[0] = x;
  return MX_SUCCESS;
}

bool fix_gamma_of(const Attrs& attrs) {
  auto it = attrs.find("fix_gamma");
  return it != attrs.end() && (it->second == "1" || it->second == "True" ||
                               it->second == "true");
}

MXReturnValue normalize_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                                std::vector<MXTensor>* out, const OpResource&) {
  MXTensor& xt = (*in)[0];
  size_t axis;
  if (!channel_axis(attrs, xt.shape.size(), &axis)) return MX_FAIL;
  const View v = view_of(xt.shape, axis);
  const float eps = attr_float(attrs, "eps", 1e-5f);
  const bool fix_gamma = fix_gamma_of(attrs);
  const float* x = xt.data<float>();
  const float* mean = (*in)[1].data<float>();
  const float* var = (*in)[2].data<float>();
  const float* gamma = (*in)[3].data<float>();
  const float* beta = (*in)[4].data<float>();
  float* y = (*out)[0].data<float>();
  std::vector<float> scale(v.channels);
  for (int64_t c = 0; c < v.channels; ++c)
    scale[c] = (fix_gamma ? 1.0f : gamma[c]) / std::sqrt(var[c] + eps);
  for (int64_t o = 0; o < v.outer; ++o)
    for (int64_t c = 0; c < v.channels; ++c) {
      const float s = scale[c], m = mean[c], b = beta[c];
      const int64_t base = (o * v.channels + c) * v.inner;
      for (int64_t i = 0; i < v.inner; ++i) y[base + i] = (x[base + i] - m) * s + b;
    }
  return MX_SUCCESS;
}

// inputs: dy, x, mean, var, gamma, beta, y; outputs: dx, dmean, dvar, dgamma, dbeta
MXReturnValue normalize_backward(const Attrs& attrs, std::vector<MXTensor>* in,
                                 std::vector<MXTensor>* out, const OpResource&) {
  MXTensor& xt = (*in)[1];
  size_t axis;
  if (!channel_axis(attrs, xt.shape.size(), &axis)) return MX_FAIL;
  const View v = view_of(xt.shape, axis);
  const float eps = attr_float(attrs, "eps", 1e-5f);
  const bool fix_gamma = fix_gamma_of(attrs);
  const float* dy = (*in)[0].data<float>();
  const float* x = xt.data<float>();
  const float* mean = (*in)[2].data<float>();
  const float* var = (*in)[3].data<float>();
  const float* gamma = (*in)[4].data<float>();
  float* dx = (*out)[0].data<float>();
  float* dmean = (*out)[1].data<float>();
  float* dvar = (*out)[2].data<float>();
  float* dgamma = (*out)[3].data<float>();
  float* dbeta = (*out)[4].data<float>();
  for (int64_t c = 0; c < v.channels; ++c) {
    const float r = 1.0f / std::sqrt(var[c] + eps);
    const float g = fix_gamma ? 1.0f : gamma[c];
    const float s = g * r, m = mean[c];
    double sdy = 0, sdyx = 0;
    for (int64_t o = 0; o < v.outer; ++o) {
      const int64_t base = (o * v.channels + c) * v.inner;
      float a, b;
      row_normalize_backward(dy + base, x + base, dx + base, v.inner, m, s, &a, &b);
      sdy += a;
      sdyx += b;
    }
    dbeta[c] = static_cast<float>(sdy);
    dgamma[c] = fix_gamma ? 0.0f : static_cast<float>(sdyx * r);
    dmean[c] = static_cast<float>(-s * sdy);
    dvar[c] = static_cast<float>(-0.5 * s * r * r * sdyx);
  }
  return MX_SUCCESS;
}

}  // namespace

REGISTER_OP(hylo_bn_moments)
    .setParseAttrs(moments_parse)
    .setInferType(all_float32)
    .setInferShape(moments_shape)
    .setForward(moments_forward, "cpu")
    .setBackward(moments_backward, "cpu");

REGISTER_OP(hylo_bn_normalize)
    .setParseAttrs(normalize_parse)
    .setInferType(all_float32)
    .setInferShape(normalize_shape)
    .setForward(normalize_forward, "cpu")
    .setBackward(normalize_backward, "cpu");
