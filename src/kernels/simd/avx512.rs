//! AVX-512F back-end: 16 f32 lanes. bf16 is converted with integer lane arithmetic (the
//! same bits as `dtype.rs`), f16 with the AVX-512F forms of the F16C conversions.

use core::arch::x86_64::*;

use crate::kernels::driver;
use crate::kernels::dtype::{BF16_NAN, DType, Elem};
use crate::kernels::lanes::{LaneOp, Simd, StepChunk, SumsqOut};

/// Proof that the running CPU has AVX-512F; only [`Avx512::detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512 {
    _proof: (),
}

impl Avx512 {
    pub(crate) fn detect() -> Option<Self> {
        is_x86_feature_detected!("avx512f").then_some(Avx512 { _proof: () })
    }
}

// SAFETY (whole impl): an `Avx512` exists only after `detect` saw AVX-512F, so every
// AVX-512F intrinsic below may execute. Loads and stores check the slice length first.
impl Simd for Avx512 {
    const LANES: usize = 16;
    const PREFETCH: bool = true;
    type F = __m512;
    type Acc = __m512d;

    #[inline(always)]
    fn splat(self, x: f32) -> __m512 {
        // SAFETY: `self` exists only where AVX-512F is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: `self` exists only where AVX-512F is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: `self` exists only where AVX-512F is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: `self` exists only where AVX-512F is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: `self` exists only where AVX-512F is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    fn sqrt(self, a: __m512) -> __m512 {
        // SAFETY: `self` exists only where AVX-512F is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm512_sqrt_ps(a) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: `self` exists only where AVX-512F is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn max0(self, a: __m512) -> __m512 {
        // MAXPS returns its second operand when either is NaN or both are zeros.
        // SAFETY: `self` exists only where AVX-512F is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm512_max_ps(_mm512_setzero_ps(), a) }
    }

    #[inline(always)]
    fn load<E: Elem>(self, src: &[E]) -> __m512 {
        assert!(src.len() >= 16);
        // SAFETY: AVX-512F is present (`self`); after the assert `src` holds at least 16
        // elements, exactly what the unaligned load reads.
        unsafe {
            match E::DTYPE {
                DType::F32 => _mm512_loadu_ps(src.as_ptr().cast()),
                DType::Bf16 => {
                    let halves = _mm256_loadu_si256(src.as_ptr().cast());
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
                }
                DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(src.as_ptr().cast())),
            }
        }
    }

    #[inline(always)]
    fn store<E: Elem>(self, dst: &mut [E], v: __m512) {
        assert!(dst.len() >= 16);
        // SAFETY: AVX-512F is present (`self`); after the assert `dst` holds at least 16
        // elements, exactly what the unaligned stores write.
        unsafe {
            match E::DTYPE {
                DType::F32 => _mm512_storeu_ps(dst.as_mut_ptr().cast(), v),
                DType::Bf16 | DType::F16 => _mm256_storeu_si256(dst.as_mut_ptr().cast(), halves::<E>(v)),
            }
        }
    }

    #[inline(always)]
    fn store_streaming<E: Elem>(self, dst: &mut [E], v: __m512) {
        if E::DTYPE == DType::F32 || !(dst.as_ptr() as usize).is_multiple_of(16) {
            return self.store(dst, v);
        }
        assert!(dst.len() >= 16);
        // SAFETY: AVX-512F is present (`self`); after the assert `dst` holds at least 16
        // two-byte elements, the 32 bytes the two stores write, at a 16-byte aligned address.
        unsafe {
            let h = halves::<E>(v);
            let p: *mut __m128i = dst.as_mut_ptr().cast();
            _mm_stream_si128(p, _mm256_castsi256_si128(h));
            _mm_stream_si128(p.add(1), _mm256_extracti128_si256::<1>(h));
        }
    }

    #[inline(always)]
    fn fence(self) {
        // SAFETY: SSE is part of every x86-64 CPU.
        unsafe { _mm_sfence() }
    }

    #[inline(always)]
    fn acc_zero(self) -> __m512d {
        // SAFETY: `self` exists only where AVX-512F is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm512_setzero_pd() }
    }

    #[inline(always)]
    fn acc_add_squares(self, acc: __m512d, x: __m512) -> __m512d {
        // SAFETY: `self` exists only where AVX-512F is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe {
            let lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
            let hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))));
            let acc = _mm512_add_pd(acc, _mm512_mul_pd(lo, lo));
            _mm512_add_pd(acc, _mm512_mul_pd(hi, hi))
        }
    }

    #[inline(always)]
    fn acc_total(self, acc: __m512d) -> f64 {
        let mut lanes = [0.0f64; 8];
        // SAFETY: AVX-512F is present (`self`); `lanes` holds the 8 f64 the store writes.
        unsafe { _mm512_storeu_pd(lanes.as_mut_ptr(), acc) };
        super::reduce_lanes(lanes)
    }

    fn step_chunk<O: LaneOp, P: Elem, G: Elem, M: Elem, C: Elem>(self, op: &O, chunk: StepChunk<'_, P, G, M, C>) {
        // SAFETY: the token proves AVX-512F is available.
        unsafe { step_entry(self, op, chunk) }
    }

    fn sumsq_chunk<G: Elem>(self, scale: f32, grad: &[G], partials: &mut [f64]) {
        // SAFETY: the token proves AVX-512F is available.
        unsafe { sumsq_entry(self, scale, grad, partials) }
    }

    fn copy_chunk<D: Elem, G: Elem>(self, dst: &mut [D], src: &[G], accumulate: bool, sumsq: Option<SumsqOut<'_>>) {
        // SAFETY: the token proves AVX-512F is available.
        unsafe { copy_entry(self, dst, src, accumulate, sumsq) }
    }
}

/// Sixteen f32 lanes rounded to nearest even into a 16-bit dtype (`E`: bf16 with the bits of
/// `dtype.rs`, or f16).
#[inline(always)]
fn halves<E: Elem>(v: __m512) -> __m256i {
    // SAFETY: called from the back-end's methods only, whose token proves AVX-512F; the
    // intrinsics work on registers only.
    unsafe {
        if E::DTYPE == DType::F16 {
            return _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
        }
        let bits = _mm512_castps_si512(v);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
        let magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7F80_0000));
        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(BF16_NAN as i32)))
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn step_entry<O: LaneOp, P: Elem, G: Elem, M: Elem, C: Elem>(
    s: Avx512,
    op: &O,
    chunk: StepChunk<'_, P, G, M, C>,
) {
    driver::step_chunk(s, op, chunk)
}

#[target_feature(enable = "avx512f")]
unsafe fn sumsq_entry<G: Elem>(s: Avx512, scale: f32, grad: &[G], partials: &mut [f64]) {
    driver::sumsq_chunk(s, scale, grad, partials)
}

#[target_feature(enable = "avx512f")]
unsafe fn copy_entry<D: Elem, G: Elem>(
    s: Avx512,
    dst: &mut [D],
    src: &[G],
    accumulate: bool,
    sumsq: Option<SumsqOut<'_>>,
) {
    driver::copy_chunk(s, dst, src, accumulate, sumsq)
}
