//! The loops every back-end runs, written once. A buffer is cut into blocks of
//! [`BLOCK`] elements; each block yields one f64 partial of the sum of squares, so that the
//! total (partials added in block order) is the same for every thread count. A block's
//! last partial vector is padded through a stack buffer and computed by the same vector
//! code, so no element takes a different (scalar) path.
//!
//! Everything here is `#[inline(always)]` and closure-free: it is inlined into each
//! back-end's `#[target_feature]` entry point, which is what lets the intrinsics inline.

use super::dtype::{DType, Elem};
use super::lanes::{LaneOp, MAX_LANES, Simd, StepChunk, Stores, SumsqOut};

/// Elements per sum-of-squares partial; chunk boundaries between threads are multiples
/// of it (and so of every vector width).
pub(crate) const BLOCK: usize = 8192;

#[inline(always)]
pub(crate) fn step_chunk<S: Simd, O: LaneOp, P: Elem, G: Elem, M: Elem, C: Elem>(
    s: S,
    op: &O,
    chunk: StepChunk<'_, P, G, M, C>,
) {
    let StepChunk { stores, p, g, m, v, mut out, mut partials } = chunk;
    let (state, copy) = (stores != Stores::Copy, stores != Stores::State);
    let n = p.len();
    let lanes = S::LANES;
    let mut start = 0;
    let mut block = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let mut acc = s.acc_zero();
        let mut i = start;
        while i + lanes <= end {
            prefetch_ahead::<S, _>(p, i);
            prefetch_ahead::<S, _>(g, i);
            prefetch_ahead::<S, _>(m, i);
            prefetch_ahead::<S, _>(v, i);
            let r = op.apply(
                s,
                s.load(&p[i..i + lanes]),
                s.load(&g[i..i + lanes]),
                s.load(&m[i..i + lanes]),
                s.load(&v[i..i + lanes]),
            );
            if state {
                s.store(&mut p[i..i + lanes], r.p);
                s.store(&mut m[i..i + lanes], r.m);
                s.store(&mut v[i..i + lanes], r.v);
            }
            if copy && let Some(out) = out.as_deref_mut() {
                s.store_streaming(&mut out[i..i + lanes], stored_param(s, r.p, &p[i..i + lanes]));
            }
            if partials.is_some() {
                acc = s.acc_add_squares(acc, r.g);
            }
            i += lanes;
        }
        if i < end {
            let len = end - i;
            let mut tp = [P::ZERO; MAX_LANES];
            let mut tg = [G::ZERO; MAX_LANES];
            let mut tm = [M::ZERO; MAX_LANES];
            let mut tv = [M::ZERO; MAX_LANES];
            tp[..len].copy_from_slice(&p[i..end]);
            tg[..len].copy_from_slice(&g[i..end]);
            tm[..len].copy_from_slice(&m[i..end]);
            tv[..len].copy_from_slice(&v[i..end]);
            let r = op.apply(s, s.load(&tp[..lanes]), s.load(&tg[..lanes]), s.load(&tm[..lanes]), s.load(&tv[..lanes]));
            if state {
                s.store(&mut tp[..lanes], r.p);
                p[i..end].copy_from_slice(&tp[..len]);
                s.store(&mut tm[..lanes], r.m);
                s.store(&mut tv[..lanes], r.v);
                m[i..end].copy_from_slice(&tm[..len]);
                v[i..end].copy_from_slice(&tv[..len]);
            }
            if copy && let Some(out) = out.as_deref_mut() {
                let mut to = [C::ZERO; MAX_LANES];
                s.store(&mut to[..lanes], stored_param(s, r.p, &tp[..lanes]));
                out[i..end].copy_from_slice(&to[..len]);
            }
            if partials.is_some() {
                // Padding lanes hold a zero gradient, which adds exactly nothing.
                acc = s.acc_add_squares(acc, r.g);
            }
        }
        if let Some(partials) = partials.as_deref_mut() {
            partials[block] = s.acc_total(acc);
        }
        start = end;
        block += 1;
    }
    if copy && out.is_some() {
        s.fence();
    }
}

/// How far ahead of its loop a pass asks for each buffer it reads, in elements (2 KiB of an
/// f32 buffer). With the hardware prefetcher alone a core reading four streams (and doing a
/// step's divisions between the loads) keeps too few lines in flight: on the 2-core machine
/// the passes take 12–24 % less time with it (docs/performance.md, "Prefetching in the CPU
/// passes"); further ahead, the lines leave the L1 before they are read.
const PREFETCH_AHEAD: usize = 512;

/// Asks for the line [`PREFETCH_AHEAD`] elements past `i` of `buf`, once per 64 bytes the
/// loop advances (it advances `S::LANES` elements at a time), where `S` prefetches.
#[inline(always)]
fn prefetch_ahead<S: Simd, E: Elem>(buf: &[E], i: usize) {
    let per_line = (64 / size_of::<E>()).max(S::LANES);
    if !S::PREFETCH || i % per_line >= S::LANES {
        return;
    }
    if let Some(x) = buf.get(i + PREFETCH_AHEAD) {
        prefetch(x);
    }
}

#[inline(always)]
fn prefetch<E>(x: &E) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of every x86-64 CPU; a prefetch loads nothing into registers and
    // never faults, and `x` is a live element.
    unsafe {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>((x as *const E).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// The parameter as it was stored: the copy-out rounds what the parameter buffer holds, so
/// that a bf16 or f16 parameter and its copy agree. For f32 parameters that is the value.
#[inline(always)]
fn stored_param<S: Simd, P: Elem>(s: S, value: S::F, stored: &[P]) -> S::F {
    if P::DTYPE == DType::F32 { value } else { s.load(stored) }
}

/// Sum of squares of `scale * g`, one partial per block, reading nothing else.
#[inline(always)]
pub(crate) fn sumsq_chunk<S: Simd, G: Elem>(s: S, scale: f32, g: &[G], partials: &mut [f64]) {
    let n = g.len();
    let lanes = S::LANES;
    let scale = s.splat(scale);
    let mut start = 0;
    let mut block = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let mut acc = s.acc_zero();
        let mut i = start;
        while i + lanes <= end {
            prefetch_ahead::<S, _>(g, i);
            acc = s.acc_add_squares(acc, s.mul(s.load(&g[i..i + lanes]), scale));
            i += lanes;
        }
        if i < end {
            let mut tg = [G::ZERO; MAX_LANES];
            tg[..end - i].copy_from_slice(&g[i..end]);
            acc = s.acc_add_squares(acc, s.mul(s.load(&tg[..lanes]), scale));
        }
        partials[block] = s.acc_total(acc);
        start = end;
        block += 1;
    }
}

/// `dst = src` or `dst += src`, through f32 lanes; with `sumsq`, the block partials of the
/// stored values (re-read from `dst`, so that they are the values as rounded there).
#[inline(always)]
pub(crate) fn copy_chunk<S: Simd, D: Elem, G: Elem>(
    s: S,
    dst: &mut [D],
    src: &[G],
    accumulate: bool,
    mut sumsq: Option<SumsqOut<'_>>,
) {
    let n = dst.len();
    let lanes = S::LANES;
    let scale = s.splat(sumsq.as_ref().map_or(1.0, |o| o.scale));
    let mut start = 0;
    let mut block = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let mut acc = s.acc_zero();
        let mut i = start;
        while i + lanes <= end {
            let mut x = s.load(&src[i..i + lanes]);
            if accumulate {
                x = s.add(s.load(&dst[i..i + lanes]), x);
            }
            s.store(&mut dst[i..i + lanes], x);
            if sumsq.is_some() {
                acc = s.acc_add_squares(acc, s.mul(s.load(&dst[i..i + lanes]), scale));
            }
            i += lanes;
        }
        if i < end {
            let len = end - i;
            let mut ts = [G::ZERO; MAX_LANES];
            let mut td = [D::ZERO; MAX_LANES];
            ts[..len].copy_from_slice(&src[i..end]);
            td[..len].copy_from_slice(&dst[i..end]);
            let mut x = s.load(&ts[..lanes]);
            if accumulate {
                x = s.add(s.load(&td[..lanes]), x);
            }
            s.store(&mut td[..lanes], x);
            dst[i..end].copy_from_slice(&td[..len]);
            if sumsq.is_some() {
                // Padding lanes hold zeros in both buffers, which add exactly nothing.
                acc = s.acc_add_squares(acc, s.mul(s.load(&td[..lanes]), scale));
            }
        }
        if let Some(out) = sumsq.as_mut() {
            out.partials[block] = s.acc_total(acc);
        }
        start = end;
        block += 1;
    }
}
