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

KernelArgs common_args(const Problem& p) {
  KernelArgs a;
  a.ptr("x_ptr", p.x)
      .ptr("w_ptr", p.w)
      .ptr("b_ptr", p.bias)
      .ptr("cw_ptr", p.class_weight)
      .ptr("tgt_ptr", p.target)
      .i64("D", p.D)
      .i64("stride_xn", p.x.stride(0))
      .i64("stride_xd", p.x.stride(1))
      .i64("stride_wv", p.w.stride(0))
      .i64("stride_wd", p.w.stride(1))
      .f32("logit_scale", static_cast<float>(p.logit_scale))
      .f32("softcap", static_cast<float>(p.softcap.value_or(1.0)))
      .i32("has_bias", p.bias.defined())
      .i32("has_class_weight", p.class_weight.defined())
      .i32("has_softcap", p.softcap.has_value());
  return a;
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
  KernelArgs args = common_args(p);
  args.ptr("m_ptr", partial[0])
      .ptr("s_ptr", partial[1])
      .ptr("zt_ptr", partial[2])
      .ptr("wz_ptr", partial[3])
      .ptr("t_ptr", partial[4])
      .ptr("am_ptr", arg)
      .i64("N", p.N)
      .i64("V", p.V)
      .i64("cols_per_split", cols_per_split)
      .i32("has_smoothing", request.weighted_sums)
      .i32("has_entropy", request.entropy)
      .i32("has_argmax", request.argmax);
  launch(v, p.x.device(), row_tiles * splits, args);

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
  KernelArgs args = common_args(columns);
  args.ptr("lse_ptr", c.lse)
      .ptr("alpha_ptr", c.alpha)
      .ptr("alpha_lse_ptr", c.alpha_lse)
      .ptr("beta_ptr", c.beta)
      .ptr("gamma_ptr", c.gamma)
      .ptr("alpha_z_ptr", c.alpha_z)
      .ptr("g_ptr", out)
      .i64("N", p.N)
      .i64("v_begin", v_begin)
      .i64("v_end", v_end)
      .i64("stride_gn", out.stride(0))
      .i32("has_smoothing", c.gamma.defined())
      .i32("has_alpha_z", c.alpha_z.defined());
  launch(v, p.x.device(), cdiv(p.N, v.block_n) * cdiv(v_end - v_begin, v.block_v), args);
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
  const auto transform = [&](KernelArgs& a) -> KernelArgs& {
    return a.ptr("logits_ptr", logits)
        .ptr("pe_ptr", entropy_partials)
        .ptr("pa_ptr", arg)
        .i64("stride_ln", logits.stride(0))
        .i64("segments", segments)
        .f32("logit_scale", static_cast<float>(p.logit_scale))
        .f32("softcap", static_cast<float>(p.softcap.value_or(1.0)))
        .i32("has_softcap", p.softcap.has_value())
        .i32("has_smoothing", request.weighted_sums)
        .i32("has_entropy", request.entropy)
        .i32("has_argmax", request.argmax);
  };
  KernelArgs partial_args;
  transform(partial_args)
      .ptr("cw_ptr", p.class_weight)
      .ptr("pm_ptr", partials[0])
      .ptr("ps_ptr", partials[1])
      .ptr("pw_ptr", partials[2])
      .i64("N", p.N)
      .i64("V", p.V)
      .i32("has_class_weight", p.class_weight.defined());
  launch(tiles, p.x.device(), cdiv(p.N, tiles.block_n) * segments, partial_args);

  const KernelVariant& combine = *select(extras ? "combine_partials_extras" : "combine_partials", p, &logits);
  KernelArgs combine_args;
  transform(combine_args)
      .ptr("pm_ptr", partials[0])
      .ptr("ps_ptr", partials[1])
      .ptr("pw_ptr", partials[2])
      .ptr("tgt_ptr", p.target)
      .ptr("lse_ptr", out.lse)
      .ptr("gap_ptr", out.target_gap)
      .ptr("ls_ptr", out.log_sum)
      .ptr("wz_ptr", out.weighted_z_sum)
      .ptr("ent_ptr", out.entropy)
      .ptr("am_ptr", out.argmax)
      .i64("N", p.N);
  launch(combine, p.x.device(), cdiv(p.N, combine.block_n), combine_args);
}

void cuda_softmax_grad(const Problem& p, const GradCoefficients& c, const at::Tensor& lse, const at::Tensor& logits,
                       bool smoothing) {
  check_stored_logits(p, logits);
  check_row_output(p, lse);
  const KernelVariant& v = stored_logits_flavor(c.alpha_z.defined() ? "softmax_grad_entropy" : "softmax_grad",
                                                p.softcap.has_value() || smoothing, p, logits);
  const int64_t segments = cdiv(p.V, v.block_v);
  KernelArgs args;
  args.ptr("logits_ptr", logits)
      .ptr("cw_ptr", p.class_weight)
      .ptr("tgt_ptr", p.target)
      .ptr("lse_ptr", lse)
      .ptr("alpha_ptr", c.alpha)
      .ptr("alpha_lse_ptr", c.alpha_lse)
      .ptr("beta_ptr", c.beta)
      .ptr("gamma_ptr", c.gamma)
      .ptr("alpha_z_ptr", c.alpha_z)
      .i64("N", p.N)
      .i64("V", p.V)
      .i64("stride_ln", logits.stride(0))
      .i64("segments", segments)
      .i64("col_offset", p.col_offset)
      .f32("logit_scale", static_cast<float>(p.logit_scale))
      .f32("softcap", static_cast<float>(p.softcap.value_or(1.0)))
      .i32("has_class_weight", p.class_weight.defined())
      .i32("has_softcap", p.softcap.has_value())
      .i32("has_smoothing", smoothing);
  launch(v, p.x.device(), cdiv(p.N, v.block_n) * segments, args);
}

at::Tensor cuda_prepare_rows(Problem& p, const at::Tensor& target, const LossOptions& o, GradCoefficients* unit,
                             at::Tensor* order) {
  TORCH_CHECK(target.scalar_type() == at::kLong && target.is_contiguous() && target.numel() == p.N,
              "fused_ce: bad target buffer");
  const KernelVariant& v = *select_fixed("prepare_rows", p.x.device());
  const auto f32 = p.x.options().dtype(at::kFloat);
  p.target = at::empty({p.N}, target.options());
  p.target_weight = at::empty({p.N}, f32);
  p.totals = at::empty({3}, f32);
  const at::Tensor counts = at::empty({2}, p.x.options().dtype(at::kInt));
  const at::Tensor coef = unit != nullptr ? at::empty({4, p.N}, f32) : at::Tensor();
  const auto row = [&](int i) { return coef.defined() ? coef[i] : at::Tensor(); };
  if (order != nullptr) *order = at::empty({p.N}, target.options());
  KernelArgs args;
  args.ptr("tgt_ptr", target)
      .ptr("cw_ptr", p.class_weight)
      .ptr("tgt_out_ptr", p.target)
      .ptr("wt_ptr", p.target_weight)
      .ptr("totals_ptr", p.totals)
      .ptr("counts_ptr", counts)
      .ptr("alpha_ptr", row(0))
      .ptr("alpha_lse_ptr", row(1))
      .ptr("beta_ptr", row(2))
      .ptr("gamma_ptr", row(3))
      .ptr("order_ptr", order != nullptr ? *order : at::Tensor())
      .i64("N", p.N)
      .i64("V", p.V)
      .i64("ignore_index", o.ignore_index)
      .f32("label_smoothing", static_cast<float>(o.label_smoothing))
      .f32("z_loss", static_cast<float>(o.z_loss))
      .i32("has_class_weight", p.class_weight.defined())
      .i32("mean", o.reduction_kind == Reduction::Mean)
      .i32("write_coefficients", unit != nullptr)
      .i32("write_order", order != nullptr);
  launch(v, p.x.device(), 1, args);
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
  KernelArgs args;
  args.ptr("lse_ptr", lse)
      .ptr("gap_ptr", gap)
      .ptr("ls_ptr", log_sum)
      .ptr("wz_ptr", wz)
      .ptr("tgt_ptr", p.target)
      .ptr("wt_ptr", p.target_weight)
      .ptr("totals_ptr", p.totals)
      .ptr("loss_ptr", loss)
      .i64("N", p.N)
      .i64("V", p.V)
      .f32("label_smoothing", static_cast<float>(o.label_smoothing))
      .f32("z_loss", static_cast<float>(o.z_loss))
      .i32("has_smoothing", o.smoothing())
      .i32("reduction", static_cast<int>(o.reduction_kind));
  launch(v, p.x.device(), 1, args);
  return loss;
}

bool cuda_scale_(const at::Tensor& grad, const at::Tensor& scale) {
  if (cuda_kernels_disabled() || !grad.is_contiguous() || scale.scalar_type() != at::kFloat ||
      scale.device() != grad.device()) {
    return false;
  }
  const KernelVariant* v = select_elementwise("scale", grad);
  if (v == nullptr) return false;
  KernelArgs args;
  args.ptr("g_ptr", grad).ptr("scale_ptr", scale).i64("numel", grad.numel());
  const int64_t programs = 4 * int64_t{device_sm_count(grad.device().index())};
  launch(*v, grad.device(), std::clamp<int64_t>(cdiv(grad.numel(), v->block_v), 1, programs), args);
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
  KernelArgs args;
  args.ptr("zs_ptr", b.zs)
      .ptr("zt_ptr", zt)
      .ptr("stats_ptr", b.stats)
      .ptr("coef_ptr", b.coef)
      .ptr("tgt_ptr", b.target)
      .i64("N", b.zs.size(0))
      .i64("V", p.V)
      .i64("stride_s", b.zs.stride(0))
      .i64("stride_t", zt.stride(0))
      .f32("inv_t", static_cast<float>(1.0 / o.temperature))
      .f32("s_scale", static_cast<float>(o.logit_scale))
      .f32("s_softcap", static_cast<float>(o.softcap.value_or(1.0)))
      .f32("t_scale", static_cast<float>(t.logit_scale))
      .f32("t_softcap", static_cast<float>(t.softcap.value_or(1.0)))
      .f32("log_1mb", static_cast<float>(o.beta < 1.0 ? std::log1p(-o.beta) : 0.0))
      .f32("log_b", static_cast<float>(o.beta > 0.0 ? std::log(o.beta) : 0.0))
      .i32("stage", static_cast<int32_t>(sweep))
      // the kernel's codes: forward KL 0, reverse KL 1, JSD 2, top k 3 (distill_rows.py)
      .i32("divergence", static_cast<int32_t>(t.divergence) - static_cast<int32_t>(Divergence::ForwardKL))
      .i32("has_teacher", b.zt.defined())
      .i32("hard", o.hard_label_weight > 0.0)
      .i32("has_s_softcap", o.softcap.has_value())
      .i32("has_t_softcap", t.softcap.has_value());
  launch(*v, b.zs.device(), b.zs.size(0), args);
}

}  // namespace fused_ce
