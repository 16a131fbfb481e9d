//! What the hand-offs are compared with: plain copies of the same slices into buffers of the
//! same layout, and the cost of the timer itself.

use std::time::{Duration, Instant};

use superoffload_bench::{percentile, sorted};

use crate::model::Model;

/// Median plain-copy ns per slice, and per-step totals.
pub fn plain_copies(m: &Model, grads: &[Vec<f32>], steps: usize) -> (Vec<f64>, Vec<f64>) {
    let mut dst: Vec<Vec<f32>> = m.sg_numel.iter().map(|&n| vec![0.0; n]).collect();
    let mut per_slice: Vec<Vec<f64>> = vec![Vec::with_capacity(steps); grads.len()];
    let mut step_ms = Vec::new();
    for rep in 0..steps + 2 {
        let mut step = Duration::ZERO;
        for i in (0..grads.len()).rev() {
            let (sg, off, n) = m.slices[i];
            let t0 = Instant::now();
            dst[sg][off..off + n].copy_from_slice(&grads[i]);
            let dt = t0.elapsed();
            step += dt;
            if rep >= 2 {
                per_slice[i].push(dt.as_nanos() as f64);
            }
        }
        std::hint::black_box(&mut dst);
        if rep >= 2 {
            step_ms.push(step.as_secs_f64() * 1e3);
        }
    }
    (per_slice.into_iter().map(|v| percentile(&sorted(v), 0.5)).collect(), step_ms)
}

/// Median ns of an empty timed interval: what timing a call adds to its time.
pub fn timer_ns() -> f64 {
    let mut v = Vec::with_capacity(10_000);
    for _ in 0..10_000 {
        let t0 = Instant::now();
        let dt = t0.elapsed();
        v.push(dt.as_nanos() as f64);
    }
    percentile(&sorted(v), 0.5)
}
