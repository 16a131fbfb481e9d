//! The CPU Adam time of a step alone: each mode's kernels with nothing else running.

use std::time::{Duration, Instant};

use superoffload::kernels::{self, AdamBuffers, AdamHyper, Floats, FloatsMut, MomentsMut, Pool, UpdateOptions};
use superoffload_bench::median;

use crate::Args;
use crate::workload::{gauss, state_buffer};

/// Median ms of each mode's CPU Adam work for one step: the kernels the session runs, on the
/// pool, on buffers of the same sizes, with nothing else running.
pub fn cpu_adam_alone(pool: &Pool, a: &Args, grads: &[Vec<f32>], reps: usize) -> Result<[f64; 4], String> {
    let n = a.elems;
    let mut p: Vec<Vec<f32>> = (0..a.layers).map(|k| state_buffer(n, |i| 0.02 * gauss(300 + k as u64, i))).collect();
    let mut m: Vec<Vec<f32>> = (0..a.layers).map(|_| state_buffer(n, |_| 0.0)).collect();
    let mut v: Vec<Vec<f32>> = (0..a.layers).map(|_| state_buffer(n, |_| 0.0)).collect();
    let err = |e: superoffload::error::Error| e.to_string();
    let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    let hp0 = AdamHyper { lr: 1e-4, ..AdamHyper::default() };
    for rep in 0..reps + 1 {
        let hp = AdamHyper { step: rep as u64 + 1, ..hp0 };
        let mut t = [Duration::ZERO; 4];
        // Each kind of pass goes over every layer before the next kind starts, so a layer's
        // buffers are not still in cache from the previous pass (as in a session, where the
        // other layers' work comes in between).
        // Speculative step: the update (the sums of squares are taken at hand-over, on the
        // training thread).
        let spec_opts = UpdateOptions { grad_scale: 1.0, ..UpdateOptions::default() };
        let t0 = Instant::now();
        for k in 0..a.layers {
            kernels::update(pool, &hp, bufs(&mut p[k], &mut m[k], &mut v[k], &grads[k]), &spec_opts).map_err(err)?;
        }
        let spec = t0.elapsed();
        // Rescale at step() (clip factor 0.5).
        let t0 = Instant::now();
        for k in 0..a.layers {
            kernels::rescale(pool, &hp, bufs(&mut p[k], &mut m[k], &mut v[k], &grads[k]), 1.0, 0.5).map_err(err)?;
        }
        let rescale = t0.elapsed();
        for k in 0..a.layers {
            kernels::rollback(pool, &hp, bufs(&mut p[k], &mut m[k], &mut v[k], &grads[k]), 0.5).map_err(err)?;
        }
        // No speculation: the update at step().
        let t0 = Instant::now();
        let plain = UpdateOptions { grad_scale: 0.5, ..UpdateOptions::default() };
        for k in 0..a.layers {
            kernels::update(pool, &hp, bufs(&mut p[k], &mut m[k], &mut v[k], &grads[k]), &plain).map_err(err)?;
        }
        let nospec = t0.elapsed();
        t[0] = spec;
        t[1] = spec + rescale;
        t[2] = nospec;
        t[3] = nospec;
        if rep > 0 {
            for (i, d) in t.iter().enumerate() {
                times[i].push(d.as_secs_f64() * 1e3);
            }
        }
    }
    Ok([median(&times[0]), median(&times[1]), median(&times[2]), median(&times[3])])
}

fn bufs<'a>(p: &'a mut [f32], m: &'a mut [f32], v: &'a mut [f32], g: &'a [f32]) -> AdamBuffers<'a> {
    AdamBuffers {
        param: FloatsMut::F32(p),
        grad: Floats::F32(g),
        moments: MomentsMut::F32 { exp_avg: m, exp_avg_sq: v },
        copy_out: None,
    }
}
