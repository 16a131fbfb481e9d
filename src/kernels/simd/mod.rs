//! Vector back-ends. Each implements the same few lane operations; the Adam math
//! (`math.rs`) and the loops (`driver.rs`) are written once against [`Simd`].
//!
//! Bit-identity across back-ends rests on three rules every implementation keeps:
//! every operation is a single IEEE-rounded f32 operation (`mul_add` is a fused
//! multiply-add), conversions follow `dtype.rs` bit for bit, and the f64 sum of squares
//! uses eight logical lanes (element `i` goes to lane `i % 8`, lanes reduced by the
//! fixed tree in [`reduce_lanes`]).

use super::driver::{StepChunk, SumsqOut};
use super::dtype::Elem;
use super::math::LaneOp;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod portable;

/// The widest vector any back-end uses, in f32 lanes.
pub(crate) const MAX_LANES: usize = 16;

/// The lane operations of one instruction set. Implementors are zero-sized tokens that
/// can only be constructed when the CPU supports the instruction set.
pub(crate) trait Simd: Copy + Send + Sync + 'static {
    const LANES: usize;
    /// Whether the loops ask for their buffers ahead ([`crate::kernels::driver`]): they gain
    /// where they wait for memory (the vector back-ends), not where the arithmetic bounds them.
    const PREFETCH: bool = false;
    type F: Copy;
    type Acc: Copy;

    fn splat(self, x: f32) -> Self::F;
    fn add(self, a: Self::F, b: Self::F) -> Self::F;
    fn sub(self, a: Self::F, b: Self::F) -> Self::F;
    fn mul(self, a: Self::F, b: Self::F) -> Self::F;
    fn div(self, a: Self::F, b: Self::F) -> Self::F;
    fn sqrt(self, a: Self::F) -> Self::F;
    /// `a * b + c` with one rounding.
    fn mul_add(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `max(0, a)`, where a NaN stays NaN and -0 stays -0.
    fn max0(self, a: Self::F) -> Self::F;

    /// Loads `LANES` elements from the front of `src` (which must hold at least that many).
    fn load<E: Elem>(self, src: &[E]) -> Self::F;
    /// Stores `LANES` elements to the front of `dst`, rounding to nearest even.
    fn store<E: Elem>(self, dst: &mut [E], v: Self::F);
    /// [`Simd::store`] of values the CPU does not read again soon (the weights' copy, which the
    /// device reads): where the back-end can, a 16-byte aligned `dst` of a 16-bit dtype is
    /// written around the cache, sparing the read of every line it overwrites. The same bits;
    /// [`Simd::fence`] makes them visible to other threads.
    #[inline(always)]
    fn store_streaming<E: Elem>(self, dst: &mut [E], v: Self::F) {
        self.store(dst, v)
    }
    /// Orders the streaming stores before every later store (the end of a chunk).
    #[inline(always)]
    fn fence(self) {}

    fn acc_zero(self) -> Self::Acc;
    /// Adds the squares of the lanes of `x`, in f64, to the eight logical lanes.
    fn acc_add_squares(self, acc: Self::Acc, x: Self::F) -> Self::Acc;
    fn acc_total(self, acc: Self::Acc) -> f64;

    /// Runs one chunk of a step-shaped pass with this instruction set enabled.
    fn step_chunk<O: LaneOp, P: Elem, G: Elem, M: Elem, C: Elem>(self, op: &O, chunk: StepChunk<'_, P, G, M, C>);

    /// Runs one chunk of the read-only sum-of-squares pass.
    fn sumsq_chunk<G: Elem>(self, scale: f32, grad: &[G], partials: &mut [f64]);

    /// Copies (or adds) `src` into `dst`, converting dtypes; with `sumsq`, also the sum of
    /// squares of what was stored (the same partials as `sumsq_chunk` over `dst` afterwards).
    fn copy_chunk<D: Elem, G: Elem>(self, dst: &mut [D], src: &[G], accumulate: bool, sumsq: Option<SumsqOut<'_>>);
}

/// The reduction tree of the eight logical f64 lanes: `(a0+a4, a1+a5, a2+a6, a3+a7)`, then
/// pairs two apart, then the last two. Back-ends that reduce in registers follow it exactly.
#[inline(always)]
pub(crate) fn reduce_lanes(a: [f64; 8]) -> f64 {
    let s4 = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}
