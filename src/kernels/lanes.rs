//! What the loops (`driver.rs`), the Adam math (`math.rs`) and the instruction-set back-ends
//! (`simd/`) share: the lane operations of an instruction set, an operation over lanes and the
//! slices of one chunk of a pass. It imports none of them, so each of them depends on it alone.

use super::dtype::Elem;

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

/// New lane values of one vector block. `g` is the scaled gradient (before any L2 term),
/// whose squares feed the optional sum of squares.
pub(crate) struct Lanes<F> {
    pub p: F,
    pub m: F,
    pub v: F,
    pub g: F,
}

/// A pass over `(p, g, m, v)` lanes.
pub(crate) trait LaneOp: Sync {
    fn apply<S: Simd>(&self, s: S, p: S::F, g: S::F, m: S::F, v: S::F) -> Lanes<S::F>;
}

/// Which buffers a step-shaped pass writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stores {
    /// The parameter, its copy and the moments.
    All,
    /// The parameter's copy only; the parameter and the moments keep their values.
    Copy,
    /// The parameter and the moments; the copy keeps its value.
    State,
}

/// The slices of one thread's share of a step-shaped pass.
pub(crate) struct StepChunk<'a, P, G, M, C> {
    pub stores: Stores,
    pub p: &'a mut [P],
    pub g: &'a [G],
    pub m: &'a mut [M],
    pub v: &'a mut [M],
    pub out: Option<&'a mut [C]>,
    /// One entry per block of this chunk, when the sum of squares is wanted.
    pub partials: Option<&'a mut [f64]>,
}

/// Where a copy also writes the sum of squares of what it stored: one partial per
/// [`BLOCK`] of the destination, of `scale · x`.
pub(crate) struct SumsqOut<'a> {
    pub scale: f32,
    pub partials: &'a mut [f64],
}
