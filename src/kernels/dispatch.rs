//! A pass spread over the pool: the instruction set's token chosen at run time, the buffer cut
//! into chunks of whole blocks, and each chunk dispatched from dtype-erased buffers to its
//! typed loop.

use half::bf16;

use super::buffers::{AdamBuffers, CopyOutMut, GradRef, MomentsMut, ParamMut};
use super::driver::BLOCK;
use super::dtype::Elem;
use super::lanes::{LaneOp, Simd, StepChunk, Stores};
use super::pool::Pool;
use crate::error::{Error, Result, Status};

/// Calls `$body` with `$s` bound to the token of instruction set `$isa`: a pool's, or
/// `$crate::kernels::Isa::best()` for work on the calling thread (which must not queue behind optimizer work on
/// a pool).
macro_rules! with_isa {
    ($isa:expr, $s:ident => $body:expr) => {
        match $isa {
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::Isa::Avx512 => {
                let $s = $crate::kernels::simd::avx512::Avx512::detect()
                    .ok_or_else($crate::kernels::dispatch::isa_vanished)?;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::Isa::Avx2 => {
                let $s =
                    $crate::kernels::simd::avx2::Avx2::detect().ok_or_else($crate::kernels::dispatch::isa_vanished)?;
                $body
            }
            #[cfg(not(target_arch = "x86_64"))]
            $crate::kernels::Isa::Avx512 | $crate::kernels::Isa::Avx2 => {
                return Err($crate::kernels::dispatch::isa_vanished())
            }
            $crate::kernels::Isa::Portable => {
                let $s = $crate::kernels::simd::portable::Portable;
                $body
            }
        }
    };
}
pub(super) use with_isa;

pub(super) fn isa_vanished() -> Error {
    Error::new(Status::Unsupported, "the pool's instruction set is not available on this CPU")
}

/// Runs a step-shaped pass writing `stores`; returns the sum of squares when `want_sumsq`.
pub(super) fn run_step_pass<O: LaneOp>(
    pool: &Pool,
    op: &O,
    bufs: AdamBuffers<'_>,
    want_sumsq: bool,
    stores: Stores,
) -> Result<Option<f64>> {
    let n = bufs.numel()?;
    let mut partials = want_sumsq.then(|| vec![0.0f64; n.div_ceil(BLOCK)]);
    let pass =
        Pass { pool, op, ranges: chunk_ranges(n, pool.num_threads()), partials: partials.as_deref_mut(), stores };
    with_isa!(pool.isa(), s => pass.dispatch_param(s, bufs));
    Ok(partials.map(|p| p.iter().sum()))
}

const CHUNKS_PER_THREAD: usize = 4;

/// Splits `n` elements into at most `CHUNKS_PER_THREAD × threads` contiguous ranges of whole
/// blocks, at least `MIN_BLOCKS_PER_CHUNK` blocks each (small buffers are not worth waking
/// every thread). Several chunks per thread let the pool's work stealing route around a
/// thread that shares its core with the training thread: with one chunk each, the pass
/// would last as long as that thread's share.
pub(super) fn chunk_ranges(n: usize, threads: usize) -> Vec<std::ops::Range<usize>> {
    const MIN_BLOCKS_PER_CHUNK: usize = 4;
    let blocks = n.div_ceil(BLOCK);
    let chunks = (blocks / MIN_BLOCKS_PER_CHUNK).clamp(1, CHUNKS_PER_THREAD * threads.max(1));
    let (base, extra) = (blocks / chunks, blocks % chunks);
    let mut ranges = Vec::with_capacity(chunks);
    let mut start_block = 0;
    for c in 0..chunks {
        let end_block = start_block + base + usize::from(c < extra);
        ranges.push(start_block * BLOCK..(end_block * BLOCK).min(n));
        start_block = end_block;
    }
    ranges
}

pub(super) fn run_sumsq<S: Simd, G: Elem>(
    pool: &Pool,
    s: S,
    scale: f32,
    grad: &[G],
    partials: &mut [f64],
    ranges: &[std::ops::Range<usize>],
) {
    let mut jobs = Vec::with_capacity(ranges.len());
    let mut partials = partials;
    for range in ranges {
        let (mine, rest) = std::mem::take(&mut partials).split_at_mut(range.len().div_ceil(BLOCK));
        partials = rest;
        let g = &grad[range.clone()];
        jobs.push(move || s.sumsq_chunk(scale, g, mine));
    }
    pool.run_all(jobs);
}

/// One step-shaped pass being dispatched from dtype-erased buffers to typed chunks.
struct Pass<'p, O> {
    pool: &'p Pool,
    op: &'p O,
    ranges: Vec<std::ops::Range<usize>>,
    partials: Option<&'p mut [f64]>,
    stores: Stores,
}

impl<O: LaneOp> Pass<'_, O> {
    fn dispatch_param<S: Simd>(self, s: S, bufs: AdamBuffers<'_>) {
        let AdamBuffers { param, grad, moments, copy_out } = bufs;
        match param {
            ParamMut::F32(p) => self.dispatch_grad(s, p, grad, moments, copy_out),
            ParamMut::Bf16(p) => self.dispatch_grad(s, p, grad, moments, copy_out),
            ParamMut::F16(p) => self.dispatch_grad(s, p, grad, moments, copy_out),
        }
    }

    fn dispatch_grad<S: Simd, P: Elem>(
        self,
        s: S,
        p: &mut [P],
        grad: GradRef<'_>,
        moments: MomentsMut<'_>,
        copy_out: Option<CopyOutMut<'_>>,
    ) {
        match grad {
            GradRef::F32(g) => self.dispatch_moments(s, p, g, moments, copy_out),
            GradRef::Bf16(g) => self.dispatch_moments(s, p, g, moments, copy_out),
            GradRef::F16(g) => self.dispatch_moments(s, p, g, moments, copy_out),
        }
    }

    fn dispatch_moments<S: Simd, P: Elem, G: Elem>(
        self,
        s: S,
        p: &mut [P],
        g: &[G],
        moments: MomentsMut<'_>,
        copy_out: Option<CopyOutMut<'_>>,
    ) {
        match moments {
            MomentsMut::F32 { exp_avg, exp_avg_sq } => self.dispatch_copy(s, p, g, exp_avg, exp_avg_sq, copy_out),
            MomentsMut::Bf16 { exp_avg, exp_avg_sq } => self.dispatch_copy(s, p, g, exp_avg, exp_avg_sq, copy_out),
        }
    }

    fn dispatch_copy<S: Simd, P: Elem, G: Elem, M: Elem>(
        self,
        s: S,
        p: &mut [P],
        g: &[G],
        m: &mut [M],
        v: &mut [M],
        copy_out: Option<CopyOutMut<'_>>,
    ) {
        match copy_out {
            None => self.run::<S, P, G, M, bf16>(s, p, g, m, v, None),
            Some(CopyOutMut::Bf16(out)) => self.run(s, p, g, m, v, Some(out)),
            Some(CopyOutMut::F16(out)) => self.run(s, p, g, m, v, Some(out)),
        }
    }

    fn run<S: Simd, P: Elem, G: Elem, M: Elem, C: Elem>(
        self,
        s: S,
        mut p: &mut [P],
        mut g: &[G],
        mut m: &mut [M],
        mut v: &mut [M],
        mut out: Option<&mut [C]>,
    ) {
        let Pass { pool, op, ranges, mut partials, stores } = self;
        let mut jobs = Vec::with_capacity(ranges.len());
        for range in &ranges {
            let len = range.len();
            let (cp, rest) = std::mem::take(&mut p).split_at_mut(len);
            p = rest;
            let (cg, rest) = g.split_at(len);
            g = rest;
            let (cm, rest) = std::mem::take(&mut m).split_at_mut(len);
            m = rest;
            let (cv, rest) = std::mem::take(&mut v).split_at_mut(len);
            v = rest;
            let cout = match out.take() {
                Some(o) => {
                    let (mine, rest) = o.split_at_mut(len);
                    out = Some(rest);
                    Some(mine)
                }
                None => None,
            };
            let cpartials = match partials.take() {
                Some(all) => {
                    let (mine, rest) = all.split_at_mut(len.div_ceil(BLOCK));
                    partials = Some(rest);
                    Some(mine)
                }
                None => None,
            };
            let chunk = StepChunk { stores, p: cp, g: cg, m: cm, v: cv, out: cout, partials: cpartials };
            jobs.push(move || s.step_chunk(op, chunk));
        }
        pool.run_all(jobs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_in_whole_blocks() {
        for &(n, threads) in &[(0, 4), (1, 4), (BLOCK * 4 - 1, 16), (BLOCK * 100 + 17, 16), (BLOCK * 7, 3)] {
            let ranges = chunk_ranges(n, threads);
            assert!(ranges.len() <= CHUNKS_PER_THREAD * threads.max(1));
            let mut next = 0;
            for r in &ranges {
                assert_eq!(r.start, next);
                assert_eq!(r.start % BLOCK, 0);
                next = r.end;
            }
            assert_eq!(next, n);
        }
    }
}
