// The SVE kernel set (kernels/cpu/isa/isa.h's SveKernels), compiled with -march=armv8-a+sve on
// aarch64 only. isa.cpp asks for the table only after getauxval(AT_HWCAP) reported SVE; building
// the table runs no SVE instruction (a constant of function addresses).
#include "kiln/kernels/cpu/isa/sve_common.h"

#if defined(__ARM_FEATURE_SVE)

namespace kiln::kernels::cpu::isa {
namespace {

int sve_vector_bits() { return static_cast<int>(svcntb()) * 8; }

constexpr SveKernels kTable = {
    .silu_f32 = sve_impl::silu_f32,
    .swiglu_f32 = sve_impl::swiglu_f32,
    .swiglu_grad_f32 = sve_impl::swiglu_grad_f32,
    .tile_abt = sve_impl::tile_abt,
    .tile_ax = sve_impl::tile_ax,
    .tile_atx = sve_impl::tile_atx,
    .row_dot = sve_impl::row_dot,
    .row_max = sve_impl::row_max,
    .row_exp_sum = sve_impl::row_exp_sum,
    .row_softmax_grad = sve_impl::row_softmax_grad,
    .rms_norm_rows_f32 = sve_impl::rms_norm_rows_f32,
    .rms_norm_backward_rows_f32 = sve_impl::rms_norm_backward_rows_f32,
    .adamw_f32 = sve_impl::adamw_f32,
    .adamw_bf16 = sve_impl::adamw_bf16,
    .f32_to_bf16 = sve_impl::f32_to_bf16,
    .bf16_to_f32 = sve_impl::bf16_to_f32,
    .lce_logits_max_f32 = sve_impl::lce_logits_max_f32,
    .lce_weighted_sum_f32 = sve_impl::lce_weighted_sum_f32,
    .lce_exp_sum_f32 = sve_impl::lce_exp_sum_f32,
    .lce_grad_row_f32 = sve_impl::lce_grad_row_f32,
    .vector_bits = sve_vector_bits,
};

}  // namespace

const SveKernels* sve_kernel_table() { return &kTable; }

}  // namespace kiln::kernels::cpu::isa
#endif
