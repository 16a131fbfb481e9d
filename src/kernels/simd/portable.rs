//! Portable back-end: one f32 lane, plain Rust arithmetic. `f32::mul_add` is a fused
//! multiply-add on every target (in software where the hardware has none), which is what
//! keeps this path bit-identical to the vector ones.

use super::reduce_lanes;
use crate::kernels::driver;
use crate::kernels::dtype::Elem;
use crate::kernels::lanes::{LaneOp, Simd, StepChunk, SumsqOut};

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Portable;

/// Eight logical f64 lanes and the lane the next element goes to.
#[derive(Clone, Copy)]
pub(crate) struct PortableAcc {
    lanes: [f64; 8],
    next: usize,
}

impl Simd for Portable {
    const LANES: usize = 1;
    type F = f32;
    type Acc = PortableAcc;

    #[inline(always)]
    fn splat(self, x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn add(self, a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    fn sub(self, a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    fn mul(self, a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    fn div(self, a: f32, b: f32) -> f32 {
        a / b
    }
    #[inline(always)]
    fn sqrt(self, a: f32) -> f32 {
        a.sqrt()
    }
    #[inline(always)]
    fn mul_add(self, a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    fn max0(self, a: f32) -> f32 {
        if a < 0.0 { 0.0 } else { a }
    }
    #[inline(always)]
    fn load<E: Elem>(self, src: &[E]) -> f32 {
        src[0].to_f32()
    }
    #[inline(always)]
    fn store<E: Elem>(self, dst: &mut [E], v: f32) {
        dst[0] = E::from_f32(v);
    }
    #[inline(always)]
    fn acc_zero(self) -> PortableAcc {
        PortableAcc { lanes: [0.0; 8], next: 0 }
    }
    #[inline(always)]
    fn acc_add_squares(self, mut acc: PortableAcc, x: f32) -> PortableAcc {
        let x = x as f64;
        // x * x is exact in f64 (48 significant bits), so this equals the vector paths' FMA.
        acc.lanes[acc.next] += x * x;
        acc.next = (acc.next + 1) & 7;
        acc
    }
    #[inline(always)]
    fn acc_total(self, acc: PortableAcc) -> f64 {
        reduce_lanes(acc.lanes)
    }

    fn step_chunk<O: LaneOp, P: Elem, G: Elem, M: Elem, C: Elem>(self, op: &O, chunk: StepChunk<'_, P, G, M, C>) {
        driver::step_chunk(self, op, chunk)
    }

    fn sumsq_chunk<G: Elem>(self, scale: f32, grad: &[G], partials: &mut [f64]) {
        driver::sumsq_chunk(self, scale, grad, partials)
    }

    fn copy_chunk<D: Elem, G: Elem>(self, dst: &mut [D], src: &[G], accumulate: bool, sumsq: Option<SumsqOut<'_>>) {
        driver::copy_chunk(self, dst, src, accumulate, sumsq)
    }
}
