/**
 * @file superoffload/kernels.hpp
 * @brief The Adam kernels on raw buffers: Hparams, UpdateOptions, the typed AdamBuffers, and
 *        adam_update, adam_rollback, adam_rescale, grad_sumsq.
 *
 * Thread-safety of the kernels: any number of threads may call them at once on disjoint
 * buffers, on the same pool or on different ones; the buffers must not be accessed by
 * anything else during a call.
 */
#ifndef SUPEROFFLOAD_KERNELS_HPP
#define SUPEROFFLOAD_KERNELS_HPP

#include "error.hpp"
#include "pool.hpp"
#include "types.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

namespace superoffload {

/**
 * Hyperparameters of one step: `so_adam_hparams` (each field is documented there),
 * initialised by `so_adam_hparams_default()` (torch.optim.AdamW's, step 1). `mode` takes a
 * Mode (`hp.mode = Mode::L2`).
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct Hparams : detail::CStruct<so_adam_hparams, so_adam_hparams_default> {
    using CStruct::CStruct;
};

/**
 * Options of adam_update: `so_update_options` (`grad_scale`, `check_finite`; documented
 * there), initialised by `so_update_options_default()` (scale 1, no check), plus whether to
 * return the gradient's sum of squares, which C asks for with a pointer argument.
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct UpdateOptions : detail::CStruct<so_update_options, so_update_options_default> {
    using CStruct::CStruct;

    /** Return the f64 sum of squares of the scaled gradient (off by default). */
    bool compute_grad_sumsq = false;
};

/**
 * Typed buffers of one step: fills `so_adam_buffers` with the dtype codes of the element
 * types, so that a dtype mistake (a bf16 array passed as f32, moments of two types, f16
 * moments, an f32 copy-out) is a compile error. With class template argument deduction,
 * `AdamBuffers bufs(p, g, m, v, n)` picks the types from the pointers. The C struct is held
 * privately (its dtype fields must match the element types); raw() gives it.
 *
 * @tparam P parameter element (float, bf16, f16)
 * @tparam G gradient element (float, bf16, f16), independent of P
 * @tparam M element of both moments (float or bf16)
 *
 * Ownership: borrows every array; they must stay valid, hold `size()` elements each, be
 * disjoint, and not be accessed by anything else during a call that uses these buffers.
 * Thread-safety: a plain value of pointers.
 */
template <class P, class G = P, class M = float>
class AdamBuffers {
    static_assert(is_element_v<P>, "the parameter element must be float, superoffload::bf16 or superoffload::f16");
    static_assert(is_element_v<G>, "the gradient element must be float, superoffload::bf16 or superoffload::f16");
    static_assert(is_moment_element_v<M>, "the moments must be float or superoffload::bf16");

public:
    using param_type = P;  ///< Parameter element.
    using grad_type = G;   ///< Gradient element.
    using moment_type = M; ///< Moment element.

    /**
     * `numel` elements of each buffer, no parameter copy. Nothing is checked here; the library
     * checks NULL, alignment and overlap at the call. @note Never throws.
     */
    AdamBuffers(P* param, const G* grad, M* exp_avg, M* exp_avg_sq, std::size_t numel) noexcept
        : raw_(so_adam_buffers_default()) {
        raw_.numel = numel;
        raw_.param = param;
        raw_.grad = grad;
        raw_.exp_avg = exp_avg;
        raw_.exp_avg_sq = exp_avg_sq;
        raw_.param_dtype = dtype_of<P>::value;
        raw_.grad_dtype = dtype_of<G>::value;
        raw_.moment_dtype = dtype_of<M>::value;
        raw_.param_copy = nullptr;
        raw_.param_copy_dtype = DType::None;
    }

    /**
     * Also writes the updated parameter to `copy` (size() elements of bf16 or f16) in the same
     * pass. @return *this. @note Never throws.
     */
    template <class C>
    AdamBuffers& with_param_copy(C* copy) noexcept {
        static_assert(is_copy_element_v<C>, "the parameter copy must be superoffload::bf16 or superoffload::f16");
        raw_.param_copy = copy;
        raw_.param_copy_dtype = dtype_of<C>::value;
        return *this;
    }

    /** Drops the parameter copy. @return *this. @note Never throws. */
    AdamBuffers& without_param_copy() noexcept {
        raw_.param_copy = nullptr;
        raw_.param_copy_dtype = DType::None;
        return *this;
    }

    /** Elements in every buffer. @note Never throws. */
    [[nodiscard]] std::size_t size() const noexcept { return raw_.numel; }

    /** The dtype of the parameter copy (DType::None without one). @note Never throws. */
    [[nodiscard]] DType param_copy_dtype() const noexcept { return static_cast<DType>(raw_.param_copy_dtype); }

    /** The C struct, for the C functions or the raw overloads here. @note Never throws. */
    [[nodiscard]] const so_adam_buffers& raw() const noexcept { return raw_; }

private:
    so_adam_buffers raw_;
};

/**
 * AdamBuffers over four contiguous containers (anything with `data()` and `size()`, such
 * as std::vector), element types deduced from them.
 * @throws Error `SO_STATUS_INVALID_ARGUMENT` if the sizes differ.
 */
template <class PC, class GC, class MC1, class MC2>
[[nodiscard]] auto make_adam_buffers(PC& param, const GC& grad, MC1& exp_avg, MC2& exp_avg_sq)
    -> AdamBuffers<std::remove_pointer_t<decltype(param.data())>,
                   std::remove_const_t<std::remove_pointer_t<decltype(grad.data())>>,
                   std::remove_pointer_t<decltype(exp_avg.data())>> {
    const std::size_t n = param.size();
    if (grad.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n) {
        throw Error(SO_STATUS_INVALID_ARGUMENT, "superoffload::make_adam_buffers: sizes differ: param " +
                                                    std::to_string(n) + ", grad " + std::to_string(grad.size()) +
                                                    ", exp_avg " + std::to_string(exp_avg.size()) + ", exp_avg_sq " +
                                                    std::to_string(exp_avg_sq.size()));
    }
    return {param.data(), grad.data(), exp_avg.data(), exp_avg_sq.data(), n};
}

/**
 * One Adam step in one pass (`so_adam_update`), on untyped C buffers.
 * @return The f64 sum of squares of the scaled gradient if `options.compute_grad_sumsq`,
 *         else std::nullopt.
 * @throws Error `SO_STATUS_NON_FINITE` (with `check_finite`; nothing was modified), or an
 *         argument error (NULL, dtype, range, alignment, overlap; nothing was modified).
 * @note Thread-safety: any number of threads at once on disjoint buffers.
 */
inline std::optional<double> adam_update(PoolRef pool, const Hparams& hparams, const so_adam_buffers& buffers,
                                         const UpdateOptions& options = {}) {
    double sumsq = 0.0;
    check(so_adam_update(pool.raw(), &hparams, &buffers, &options, options.compute_grad_sumsq ? &sumsq : nullptr));
    if (options.compute_grad_sumsq) {
        return sumsq;
    }
    return std::nullopt;
}

/** @copydoc adam_update(PoolRef, const Hparams&, const so_adam_buffers&, const UpdateOptions&) */
template <class P, class G, class M>
std::optional<double> adam_update(PoolRef pool, const Hparams& hparams, const AdamBuffers<P, G, M>& buffers,
                                  const UpdateOptions& options = {}) {
    return adam_update(pool, hparams, buffers.raw(), options);
}

/**
 * Undoes one adam_update taken with the same gradient, `grad_scale` and hyperparameters
 * (`so_adam_rollback`), on untyped C buffers (f32 param and moments).
 * @throws Error `SO_STATUS_UNSUPPORTED` for non-f32 param or moments, or an argument error;
 *         nothing was modified.
 * @note Thread-safety: as adam_update.
 */
inline void adam_rollback(PoolRef pool, const Hparams& hparams, const so_adam_buffers& buffers,
                          float grad_scale = 1.0f) {
    check(so_adam_rollback(pool.raw(), &hparams, &buffers, grad_scale));
}

/**
 * @copydoc adam_rollback(PoolRef, const Hparams&, const so_adam_buffers&, float)
 * Typed form: only for float parameters and float moments (anything else does not compile).
 */
template <class P, class G, class M, std::enable_if_t<std::is_same_v<P, float> && std::is_same_v<M, float>, int> = 0>
void adam_rollback(PoolRef pool, const Hparams& hparams, const AdamBuffers<P, G, M>& buffers, float grad_scale = 1.0f) {
    adam_rollback(pool, hparams, buffers.raw(), grad_scale);
}

/**
 * Turns a step taken on `old_scale * g` into the step on `new_scale * g` from the same
 * starting state (`so_adam_rescale`), on untyped C buffers (f32 param and moments).
 * @throws Error `SO_STATUS_UNSUPPORTED` for non-f32 param or moments, or an argument error;
 *         nothing was modified.
 * @note Thread-safety: as adam_update.
 */
inline void adam_rescale(PoolRef pool, const Hparams& hparams, const so_adam_buffers& buffers, float old_scale,
                         float new_scale) {
    check(so_adam_rescale(pool.raw(), &hparams, &buffers, old_scale, new_scale));
}

/**
 * @copydoc adam_rescale(PoolRef, const Hparams&, const so_adam_buffers&, float, float)
 * Typed form: only for float parameters and float moments (anything else does not compile).
 */
template <class P, class G, class M, std::enable_if_t<std::is_same_v<P, float> && std::is_same_v<M, float>, int> = 0>
void adam_rescale(PoolRef pool, const Hparams& hparams, const AdamBuffers<P, G, M>& buffers, float old_scale,
                  float new_scale) {
    adam_rescale(pool, hparams, buffers.raw(), old_scale, new_scale);
}

/**
 * f64 sum of squares of `scale * grad` (`so_grad_sumsq`): the value adam_update reports for
 * the same gradient and scale. Not finite iff an element is inf or NaN.
 * @throws Error for a NULL `grad` with `numel > 0`, a bad dtype or scale.
 * @note Thread-safety: safe from any thread.
 */
[[nodiscard]] inline double grad_sumsq(PoolRef pool, const void* grad, DType dtype, std::size_t numel,
                                       float scale = 1.0f) {
    double out = 0.0;
    check(so_grad_sumsq(pool.raw(), grad, dtype, numel, scale, &out));
    return out;
}

/** @copydoc grad_sumsq(PoolRef, const void*, DType, std::size_t, float) Typed form. */
template <class G, std::enable_if_t<is_element_v<G>, int> = 0>
[[nodiscard]] double grad_sumsq(PoolRef pool, const G* grad, std::size_t numel, float scale = 1.0f) {
    return grad_sumsq(pool, static_cast<const void*>(grad), dtype_of<G>::value, numel, scale);
}

} // namespace superoffload

#endif // SUPEROFFLOAD_KERNELS_HPP
