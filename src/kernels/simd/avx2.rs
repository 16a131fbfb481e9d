//! AVX2 + FMA + F16C back-end: 8 f32 lanes. bf16 is converted with integer lane
//! arithmetic (the same bits as `dtype.rs`), f16 with F16C.

use core::arch::x86_64::*;

use crate::kernels::driver;
use crate::kernels::dtype::{BF16_NAN, DType, Elem};
use crate::kernels::lanes::{LaneOp, Simd, StepChunk, SumsqOut};

/// Proof that the running CPU has AVX2, FMA and F16C; only [`Avx2::detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2 {
    _proof: (),
}

impl Avx2 {
    pub(crate) fn detect() -> Option<Self> {
        let supported =
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        supported.then_some(Avx2 { _proof: () })
    }
}

/// Eight logical f64 lanes as two registers: lanes 0–3 and 4–7.
#[derive(Clone, Copy)]
pub(crate) struct Avx2Acc {
    lo: __m256d,
    hi: __m256d,
}

// SAFETY (whole impl): an `Avx2` exists only after `detect` saw AVX2, FMA and F16C, so
// every intrinsic below may execute. Loads and stores check the slice length first.
impl Simd for Avx2 {
    const LANES: usize = 8;
    const PREFETCH: bool = true;
    type F = __m256;
    type Acc = Avx2Acc;

    #[inline(always)]
    fn splat(self, x: f32) -> __m256 {
        // SAFETY: `self` exists only where AVX2, FMA and F16C is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    fn add(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: `self` exists only where AVX2, FMA and F16C is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: `self` exists only where AVX2, FMA and F16C is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: `self` exists only where AVX2, FMA and F16C is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: `self` exists only where AVX2, FMA and F16C is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    fn sqrt(self, a: __m256) -> __m256 {
        // SAFETY: `self` exists only where AVX2, FMA and F16C is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm256_sqrt_ps(a) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: `self` exists only where AVX2, FMA and F16C is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn max0(self, a: __m256) -> __m256 {
        // MAXPS returns its second operand when either is NaN or both are zeros.
        // SAFETY: `self` exists only where AVX2, FMA and F16C is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { _mm256_max_ps(_mm256_setzero_ps(), a) }
    }

    #[inline(always)]
    fn load<E: Elem>(self, src: &[E]) -> __m256 {
        assert!(src.len() >= 8);
        // SAFETY: AVX2, FMA and F16C is present (`self`); after the assert `src` holds at least 8
        // elements, exactly what the unaligned load reads.
        unsafe {
            match E::DTYPE {
                DType::F32 => _mm256_loadu_ps(src.as_ptr().cast()),
                DType::Bf16 => {
                    let halves = _mm_loadu_si128(src.as_ptr().cast());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
                }
                DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().cast())),
            }
        }
    }

    #[inline(always)]
    fn store<E: Elem>(self, dst: &mut [E], v: __m256) {
        assert!(dst.len() >= 8);
        // SAFETY: AVX2, FMA and F16C is present (`self`); after the assert `dst` holds at least 8
        // elements, exactly what the unaligned store writes.
        unsafe {
            match E::DTYPE {
                DType::F32 => _mm256_storeu_ps(dst.as_mut_ptr().cast(), v),
                DType::Bf16 | DType::F16 => _mm_storeu_si128(dst.as_mut_ptr().cast(), halves::<E>(v)),
            }
        }
    }

    #[inline(always)]
    fn store_streaming<E: Elem>(self, dst: &mut [E], v: __m256) {
        if E::DTYPE == DType::F32 || !(dst.as_ptr() as usize).is_multiple_of(16) {
            return self.store(dst, v);
        }
        assert!(dst.len() >= 8);
        // SAFETY: AVX2 is present (`self`); after the assert `dst` holds at least 8 two-byte
        // elements, the 16 bytes the store writes, at a 16-byte aligned address.
        unsafe { _mm_stream_si128(dst.as_mut_ptr().cast(), halves::<E>(v)) }
    }

    #[inline(always)]
    fn fence(self) {
        // SAFETY: SSE is part of every x86-64 CPU.
        unsafe { _mm_sfence() }
    }

    #[inline(always)]
    fn acc_zero(self) -> Avx2Acc {
        // SAFETY: `self` exists only where AVX2, FMA and F16C is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe { Avx2Acc { lo: _mm256_setzero_pd(), hi: _mm256_setzero_pd() } }
    }

    #[inline(always)]
    fn acc_add_squares(self, acc: Avx2Acc, x: __m256) -> Avx2Acc {
        // SAFETY: `self` exists only where AVX2, FMA and F16C is present (see `detect`); the
        // intrinsics work on registers only.
        unsafe {
            let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
            let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x));
            Avx2Acc {
                lo: _mm256_add_pd(acc.lo, _mm256_mul_pd(lo, lo)),
                hi: _mm256_add_pd(acc.hi, _mm256_mul_pd(hi, hi)),
            }
        }
    }

    #[inline(always)]
    fn acc_total(self, acc: Avx2Acc) -> f64 {
        let mut lanes = [0.0f64; 8];
        // SAFETY: AVX2, FMA and F16C is present (`self`); `lanes` holds the 8 f64 the two stores write.
        unsafe {
            _mm256_storeu_pd(lanes.as_mut_ptr(), acc.lo);
            _mm256_storeu_pd(lanes.as_mut_ptr().add(4), acc.hi);
        }
        super::reduce_lanes(lanes)
    }

    fn step_chunk<O: LaneOp, P: Elem, G: Elem, M: Elem, C: Elem>(self, op: &O, chunk: StepChunk<'_, P, G, M, C>) {
        // SAFETY: the token proves AVX2, FMA and F16C are available.
        unsafe { step_entry(self, op, chunk) }
    }

    fn sumsq_chunk<G: Elem>(self, scale: f32, grad: &[G], partials: &mut [f64]) {
        // SAFETY: the token proves AVX2, FMA and F16C are available.
        unsafe { sumsq_entry(self, scale, grad, partials) }
    }

    fn copy_chunk<D: Elem, G: Elem>(self, dst: &mut [D], src: &[G], accumulate: bool, sumsq: Option<SumsqOut<'_>>) {
        // SAFETY: the token proves AVX2, FMA and F16C are available.
        unsafe { copy_entry(self, dst, src, accumulate, sumsq) }
    }
}

/// Eight f32 lanes rounded to nearest even into a 16-bit dtype (`E`: bf16 with the bits of
/// `dtype.rs`, or f16).
#[inline(always)]
fn halves<E: Elem>(v: __m256) -> __m128i {
    // SAFETY: called from the back-end's methods only, whose token proves AVX2, FMA and F16C;
    // the intrinsics work on registers only.
    unsafe {
        if E::DTYPE == DType::F16 {
            return _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        }
        let bits = _mm256_castps_si256(v);
        let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, bias));
        let magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFF_FFFF));
        let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F80_0000));
        let out = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(BF16_NAN as i32), nan);
        // Pack within 128-bit halves, then gather the two low quadwords.
        let packed = _mm256_packus_epi32(out, out);
        _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b00_00_10_00>(packed))
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn step_entry<O: LaneOp, P: Elem, G: Elem, M: Elem, C: Elem>(s: Avx2, op: &O, chunk: StepChunk<'_, P, G, M, C>) {
    driver::step_chunk(s, op, chunk)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sumsq_entry<G: Elem>(s: Avx2, scale: f32, grad: &[G], partials: &mut [f64]) {
    driver::sumsq_chunk(s, scale, grad, partials)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn copy_entry<D: Elem, G: Elem>(
    s: Avx2,
    dst: &mut [D],
    src: &[G],
    accumulate: bool,
    sumsq: Option<SumsqOut<'_>>,
) {
    driver::copy_chunk(s, dst, src, accumulate, sumsq)
}
