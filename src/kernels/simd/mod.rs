//! Vector back-ends. Each implements the same few lane operations (`Simd`, in `lanes.rs`);
//! the Adam math (`math.rs`) and the loops (`driver.rs`) are written once against them.
//!
//! Bit-identity across back-ends rests on three rules every implementation keeps:
//! every operation is a single IEEE-rounded f32 operation (`mul_add` is a fused
//! multiply-add), conversions follow `dtype.rs` bit for bit, and the f64 sum of squares
//! uses eight logical lanes (element `i` goes to lane `i % 8`, lanes reduced by the
//! fixed tree in [`reduce_lanes`]).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod portable;

/// The reduction tree of the eight logical f64 lanes: `(a0+a4, a1+a5, a2+a6, a3+a7)`, then
/// pairs two apart, then the last two. Back-ends that reduce in registers follow it exactly.
#[inline(always)]
pub(crate) fn reduce_lanes(a: [f64; 8]) -> f64 {
    let s4 = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}
