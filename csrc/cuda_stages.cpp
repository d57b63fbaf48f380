// The stages on CUDA: picks an embedded Triton variant for the tensors at hand
// and launches it (cuda_driver.cpp).
#include "cuda_stages.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "cuda_driver.h"
#include "format.h"
#include "kernel_args.h"

namespace fused_ce {

namespace {

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// The assumptions of the "aligned" variants (fused_ce/_build/aot.py), checked on the actual tensors.
bool fits_aligned(const Problem& p, const KernelVariant& v, const at::Tensor* g) {
  const bool xw = p.x.stride(1) == 1 && p.w.stride(1) == 1 && aligned16(p.x) && aligned16(p.w) &&
                  p.x.stride(0) % 16 == 0 && p.w.stride(0) % 16 == 0 && p.D % 16 == 0 && p.D % v.block_d == 0;
  return xw && (g == nullptr || (aligned16(*g) && g->stride(0) % 16 == 0));
}

bool reads_stored_logits(const char* kernel) {
  return std::strncmp(kernel, "logit_partials", 14) == 0 || std::strncmp(kernel, "softmax_grad", 12) == 0;
}

// `out`: the kernel's output block (logit_grad) or its stored logits (logit_partials, softmax_grad).
const KernelVariant* select(const char* kernel, const Problem& p, const at::Tensor* out) {
  const char* dtype = cuda_kernel_dtype(p.x.scalar_type());
  if (dtype == nullptr) return nullptr;
  const int arch = device_arch(p.x.device().index());
  const KernelVariant* aligned = find_variant(kernel, dtype, "aligned", arch);
  if (aligned != nullptr) {
    const bool fits = reads_stored_logits(kernel)
                          ? out != nullptr && aligned16(*out) && out->stride(0) % 16 == 0 && p.V % 16 == 0
                          : fits_aligned(p, *aligned, out);
    if (fits) return aligned;
  }
  return find_variant(kernel, dtype, "general", arch);
}

// Kernels whose arguments are float32/int64 whatever the inputs: one variant per arch.
const KernelVariant* select_fixed(const char* kernel, const at::Device& device) {
  return find_variant(kernel, "fp32", "general", device_arch(device.index()));
}

const KernelVariant* select_elementwise(const char* kernel, const at::Tensor& t) {
  const char* dtype = cuda_kernel_dtype(t.scalar_type());
  if (dtype == nullptr) return nullptr;
  const int arch = device_arch(t.device().index());
  const bool fits = aligned16(t) && t.numel() % 16 == 0;
  const KernelVariant* aligned = fits ? find_variant(kernel, dtype, "aligned", arch) : nullptr;
  return aligned != nullptr ? aligned : find_variant(kernel, dtype, "general", arch);
}

int64_t cdiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The x and w parameters of the tl.dot kernels (spec.py, XW_PARAMS and the rest of their common list).
template <typename Args>
void set_xw(Args& a, const Problem& p) {
  a.x_ptr = p.x;
  a.w_ptr = p.w;
  a.b_ptr = p.bias;
  a.cw_ptr = p.class_weight;
  a.tgt_ptr = p.target;
  a.D = p.D;
  a.stride_xn = p.x.stride(0);
  a.stride_xd = p.x.stride(1);
  a.stride_wv = p.w.stride(0);
  a.stride_wd = p.w.stride(1);
  a.logit_scale = static_cast<float>(p.logit_scale);
  a.softcap = static_cast<float>(p.softcap.value_or(1.0));
  a.has_bias = p.bias.defined();
  a.has_class_weight = p.class_weight.defined();
  a.has_softcap = p.softcap.has_value();
}

}  // namespace

namespace {

// A flavor of a pass over stored logits (spec.py): the softcap and label smoothing are the "_transforms" flavors,
// compiled out of the others (their branches' registers cost the plain passes 18-33% of their speed).
const KernelVariant& stored_logits_flavor(std::string kernel, bool transforms, const Problem& p,
                                          const at::Tensor& logits) {
  if (transforms) kernel += "_transforms";
  const KernelVariant* v = select(kernel.c_str(), p, &logits);
  TORCH_CHECK(v != nullptr, "fused_ce: no embedded kernel ", kernel, " for this device");
  return *v;
}

}  // namespace

RowStats cuda_row_stats(const Problem& p, const StatsRequest& request) {
  const KernelVariant& v = *select("row_stats", p, nullptr);
  // Split the vocabulary so that there are several waves of programs even for
  // few rows; the splits' partials are combined below.
  const int64_t row_tiles = cdiv(p.N, v.block_n);
  const int64_t vocab_tiles = cdiv(p.V, v.block_v);
  const int64_t target_programs = 8 * int64_t{device_sm_count(p.x.device().index())};
  int64_t splits = std::clamp<int64_t>(cdiv(target_programs, row_tiles), 1, vocab_tiles);
  const int64_t cols_per_split = cdiv(vocab_tiles, splits) * v.block_v;
  splits = cdiv(p.V, cols_per_split);

  at::Tensor partial = at::empty({5, splits, p.N}, p.x.options().dtype(at::kFloat));
  const at::Tensor arg = request.argmax ? at::empty({splits, p.N}, p.target.options()) : at::Tensor();
  RowStatsArgs args;
  set_xw(args, p);
  args.m_ptr = partial[0];
  args.s_ptr = partial[1];
  args.zt_ptr = partial[2];
  args.wz_ptr = partial[3];
  args.t_ptr = partial[4];
  args.am_ptr = arg;
  args.N = p.N;
  args.V = p.V;
  args.cols_per_split = cols_per_split;
  args.has_smoothing = request.weighted_sums;
  args.has_entropy = request.entropy;
  args.has_argmax = request.argmax;
  launch(v, p.x.device(), args);

  return combine_row_stat_splits(partial, arg, p.target, request);
}

void cuda_logit_grad(const Problem& p, const GradCoefficients& c, int64_t v_begin, int64_t v_end,
                     const at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == p.x.scalar_type() && out.stride(1) == 1, "fused_ce: bad gradient buffer");
  const KernelVariant& v = *select("logit_grad", p, &out);
  // (the kernel's classes are p.w's rows: a vocabulary slice's targets taken relative to its first; ignored rows
  // have no coefficient, whatever their target)
  Problem columns = p;
  if (p.col_offset != 0) columns.target = p.target - p.col_offset;
  LogitGradArgs args;
  set_xw(args, columns);
  args.lse_ptr = c.lse;
  args.alpha_ptr = c.alpha;
  args.alpha_lse_ptr = c.alpha_lse;
  args.beta_ptr = c.beta;
  args.gamma_ptr = c.gamma;
  args.alpha_z_ptr = c.alpha_z;
  args.g_ptr = out;
  args.N = p.N;
  args.v_begin = v_begin;
  args.v_end = v_end;
  args.stride_gn = out.stride(0);
  args.has_smoothing = c.gamma.defined();
  args.has_alpha_z = c.alpha_z.defined();
  launch(v, p.x.device(), args);
}

namespace {

void check_stored_logits(const Problem& p, const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == p.x.scalar_type() && logits.stride(1) == 1 && logits.size(0) == p.N &&
                  logits.size(1) == p.V,
              "fused_ce: bad logits buffer");
}

void check_row_output(const Problem& p, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == p.N, "fused_ce: bad row buffer");
}

}  // namespace

void cuda_stats_from_logits(const Problem& p, const at::Tensor& logits, const RowStats& out) {
  TORCH_CHECK(p.col_offset == 0, "fused_ce: row stats need whole vocabulary rows");
  const StatsRequest request = out.request();
  check_stored_logits(p, logits);
  check_row_output(p, out.lse);
  check_row_output(p, out.target_gap);
  check_row_output(p, out.log_sum);
  if (request.weighted_sums) check_row_output(p, out.weighted_z_sum);
  if (request.entropy) check_row_output(p, out.entropy);
  TORCH_CHECK(!request.argmax || (out.argmax.scalar_type() == at::kLong && out.argmax.is_contiguous()),
              "fused_ce: bad row buffer");
  // the entropy's and argmax's terms are a flavor of their own (spec.py: registers the plain kernels keep free)
  const bool extras = request.entropy || request.argmax;
  const KernelVariant& tiles = stored_logits_flavor(extras ? "logit_partials_extras" : "logit_partials",
                                                    p.softcap.has_value() || request.weighted_sums, p, logits);
  const int64_t segments = cdiv(p.V, tiles.block_v);
  const at::Tensor partials = at::empty({request.entropy ? 4 : 3, p.N, segments}, p.x.options().dtype(at::kFloat));
  const at::Tensor arg = request.argmax ? at::empty({p.N, segments}, p.target.options()) : at::Tensor();
  const at::Tensor entropy_partials = request.entropy ? partials[3] : at::Tensor();
  // the parameters the two kernels share
  const auto transform = [&](auto& a) {
    a.logits_ptr = logits;
    a.pe_ptr = entropy_partials;
    a.pa_ptr = arg;
    a.stride_ln = logits.stride(0);
    a.segments = segments;
    a.logit_scale = static_cast<float>(p.logit_scale);
    a.softcap = static_cast<float>(p.softcap.value_or(1.0));
    a.has_softcap = p.softcap.has_value();
    a.has_smoothing = request.weighted_sums;
    a.has_entropy = request.entropy;
    a.has_argmax = request.argmax;
  };
  LogitPartialsArgs partial_args;
  transform(partial_args);
  partial_args.cw_ptr = p.class_weight;
  partial_args.pm_ptr = partials[0];
  partial_args.ps_ptr = partials[1];
  partial_args.pw_ptr = partials[2];
  partial_args.N = p.N;
  partial_args.V = p.V;
  partial_args.has_class_weight = p.class_weight.defined();
  launch(tiles, p.x.device(), partial_args);

  const KernelVariant& combine = *select(extras ? "combine_partials_extras" : "combine_partials", p, &logits);
  CombinePartialsArgs combine_args;
  transform(combine_args);
  combine_args.pm_ptr = partials[0];
  combine_args.ps_ptr = partials[1];
  combine_args.pw_ptr = partials[2];
  combine_args.tgt_ptr = p.target;
  combine_args.lse_ptr = out.lse;
  combine_args.gap_ptr = out.target_gap;
  combine_args.ls_ptr = out.log_sum;
  combine_args.wz_ptr = out.weighted_z_sum;
  combine_args.ent_ptr = out.entropy;
  combine_args.am_ptr = out.argmax;
  combine_args.N = p.N;
  launch(combine, p.x.device(), combine_args);
}

void cuda_softmax_grad(const Problem& p, const GradCoefficients& c, const at::Tensor& lse, const at::Tensor& logits,
                       bool smoothing, const at::Tensor& filter_mask, double filter_eps) {
  check_stored_logits(p, logits);
  check_row_output(p, lse);
  const bool transforms = p.softcap.has_value() || smoothing;
  const bool filter = filter_mask.defined();
  TORCH_CHECK(!filter || (!transforms && !c.alpha_z.defined() && filter_mask.scalar_type() == at::kInt &&
                          filter_mask.is_contiguous() && p.col_offset == 0),
              "fused_ce: softmax_grad marks filter tiles of a plain gradient's whole rows only");
  const KernelVariant& v = stored_logits_flavor(filter                ? "softmax_grad_filter"
                                                : c.alpha_z.defined() ? "softmax_grad_entropy"
                                                                      : "softmax_grad",
                                                transforms, p, logits);
  const int64_t segments = cdiv(p.V, v.block_v);
  SoftmaxGradArgs args;
  args.logits_ptr = logits;
  args.cw_ptr = p.class_weight;
  args.tgt_ptr = p.target;
  args.lse_ptr = lse;
  args.alpha_ptr = c.alpha;
  args.alpha_lse_ptr = c.alpha_lse;
  args.beta_ptr = c.beta;
  args.gamma_ptr = c.gamma;
  args.alpha_z_ptr = c.alpha_z;
  args.N = p.N;
  args.V = p.V;
  args.stride_ln = logits.stride(0);
  args.segments = segments;
  args.col_offset = p.col_offset;
  args.logit_scale = static_cast<float>(p.logit_scale);
  args.softcap = static_cast<float>(p.softcap.value_or(1.0));
  args.has_class_weight = p.class_weight.defined();
  args.has_softcap = p.softcap.has_value();
  args.has_smoothing = smoothing;
  args.mask_ptr = filter_mask;
  args.mask_cols = filter ? filter_mask.size(1) : 0;
  args.filter_scale = static_cast<float>(filter_eps * std::fabs(p.logit_scale));
  launch(v, p.x.device(), args);
}

at::Tensor cuda_prepare_rows(Problem& p, const at::Tensor& target, const LossOptions& o, GradCoefficients* unit,
                             at::Tensor* order) {
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous() && target.numel() == p.N,
              "fused_ce: bad target buffer");
  const KernelVariant& v = *select_fixed("prepare_rows", p.x.device());
  const auto f32 = p.x.options().dtype(at::kFloat);
  p.target = at::empty({p.N}, target.options());
  p.target_weight = at::empty({p.N}, f32);
  p.totals = at::empty({PrepareRowsArgs::Totals::kSize}, f32);
  const at::Tensor counts = at::empty({PrepareRowsArgs::Counts::kSize}, p.x.options().dtype(at::kInt));
  const at::Tensor coef = unit != nullptr ? at::empty({4, p.N}, f32) : at::Tensor();
  const auto row = [&](int i) { return coef.defined() ? coef[i] : at::Tensor(); };
  if (order != nullptr) *order = at::empty({p.N}, target.options());
  PrepareRowsArgs args;
  args.tgt_ptr = target;
  args.cw_ptr = p.class_weight;
  args.tgt_out_ptr = p.target;
  args.wt_ptr = p.target_weight;
  args.totals_ptr = p.totals;
  args.counts_ptr = counts;
  args.alpha_ptr = row(0);
  args.alpha_lse_ptr = row(1);
  args.beta_ptr = row(2);
  args.gamma_ptr = row(3);
  args.order_ptr = order != nullptr ? *order : at::Tensor();
  args.N = p.N;
  args.V = p.V;
  args.ignore_index = o.ignore_index;
  args.label_smoothing = static_cast<float>(o.label_smoothing);
  args.z_loss = static_cast<float>(o.z_loss);
  args.has_class_weight = p.class_weight.defined();
  args.mean = o.reduction_kind == Reduction::Mean;
  args.write_coefficients = unit != nullptr;
  args.write_order = order != nullptr;
  launch(v, p.x.device(), args);
  // gamma only with label smoothing (GradCoefficients)
  if (unit != nullptr)
    *unit = GradCoefficients{at::Tensor(), row(0), row(1), row(2), o.smoothing() ? row(3) : at::Tensor(), at::Tensor()};
  return counts;
}

at::Tensor cuda_assemble_loss(const Problem& p, const RowStats& s, const LossOptions& o) {
  TORCH_CHECK(p.totals.defined() && p.target_weight.defined(), "fused_ce: rows not prepared on the device");
  const KernelVariant& v = *select_fixed("assemble_loss", p.x.device());
  const auto f32 = [](const at::Tensor& t) { return t.defined() ? t.to(at::kFloat).contiguous() : t; };
  const at::Tensor lse = f32(s.lse), gap = f32(s.target_gap), log_sum = f32(s.log_sum), wz = f32(s.weighted_z_sum);
  TORCH_CHECK(!o.smoothing() || wz.defined(), "fused_ce: label smoothing needs the weighted logit sums");
  at::Tensor loss = at::empty({o.scalar() ? 1 : p.N}, p.x.options().dtype(at::kFloat));
  AssembleLossArgs args;
  args.lse_ptr = lse;
  args.gap_ptr = gap;
  args.ls_ptr = log_sum;
  args.wz_ptr = wz;
  args.tgt_ptr = p.target;
  args.wt_ptr = p.target_weight;
  args.totals_ptr = p.totals;
  args.loss_ptr = loss;
  args.N = p.N;
  args.V = p.V;
  args.label_smoothing = static_cast<float>(o.label_smoothing);
  args.z_loss = static_cast<float>(o.z_loss);
  args.has_smoothing = o.smoothing();
  args.reduction = static_cast<int>(o.reduction_kind);
  launch(v, p.x.device(), args);
  return loss;
}

bool cuda_scale_(const at::Tensor& grad, const at::Tensor& scale) {
  if (cuda_kernels_disabled() || !grad.is_contiguous() || scale.scalar_type() != at::kFloat ||
      scale.device() != grad.device()) {
    return false;
  }
  const KernelVariant* v = select_elementwise("scale", grad);
  if (v == nullptr) return false;
  ScaleArgs args;
  args.g_ptr = grad;
  args.scale_ptr = scale;
  args.numel = grad.numel();
  const int64_t programs = 4 * int64_t{device_sm_count(grad.device().index())};
  launch(*v, grad.device(), args, programs);
  return true;
}

void cuda_distill_rows(DistillSweep sweep, const Problem& p, const LossOptions& o, const DistillBlock& b) {
  const char* dtype = cuda_kernel_dtype(b.zs.scalar_type());
  const int arch = device_arch(b.zs.device().index());
  const auto rows_aligned = [](const at::Tensor& t) { return aligned16(t) && t.stride(0) % 16 == 0; };
  const bool aligned = rows_aligned(b.zs) && (!b.zt.defined() || rows_aligned(b.zt)) && p.V % 16 == 0;
  const KernelVariant* v = aligned ? find_variant("distill_rows", dtype, "aligned", arch) : nullptr;
  if (v == nullptr) v = find_variant("distill_rows", dtype, "general", arch);
  TORCH_CHECK(v != nullptr, o.caller, ": no distill_rows kernel for sm_", num(arch));
  const at::Tensor& zt = b.zt.defined() ? b.zt : b.zs;  // (not read without the teacher's head)
  const Teacher& t = p.teacher;
  DistillRowsArgs args;
  args.zs_ptr = b.zs;
  args.zt_ptr = zt;
  args.stats_ptr = b.stats;
  args.coef_ptr = b.coef;
  args.tgt_ptr = b.target;
  args.N = b.zs.size(0);
  args.V = p.V;
  args.stride_s = b.zs.stride(0);
  args.stride_t = zt.stride(0);
  args.inv_t = static_cast<float>(1.0 / o.temperature);
  args.s_scale = static_cast<float>(o.logit_scale);
  args.s_softcap = static_cast<float>(o.softcap.value_or(1.0));
  args.t_scale = static_cast<float>(t.logit_scale);
  args.t_softcap = static_cast<float>(t.softcap.value_or(1.0));
  args.log_1mb = static_cast<float>(o.beta < 1.0 ? std::log1p(-o.beta) : 0.0);
  args.log_b = static_cast<float>(o.beta > 0.0 ? std::log(o.beta) : 0.0);
  args.stage = static_cast<int32_t>(sweep);
  // the kernel's codes: forward KL 0, reverse KL 1, JSD 2, top k 3 (distill_rows.py)
  args.divergence = static_cast<int32_t>(t.divergence) - static_cast<int32_t>(Divergence::ForwardKL);
  args.has_teacher = b.zt.defined();
  args.hard = o.hard_label_weight > 0.0;
  args.has_s_softcap = o.softcap.has_value();
  args.has_t_softcap = t.softcap.has_value();
  launch(*v, b.zs.device(), args);
}

}  // namespace fused_ce
