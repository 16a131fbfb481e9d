//! The simulated work of the training thread, and the data of the layers.

use std::time::Duration;

/// CPU time the calling thread has used.
pub fn thread_cpu() -> Duration {
    // SAFETY: a zeroed timespec is valid; clock_gettime fills it.
    unsafe {
        let mut t: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t);
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    }
}

/// Busy work on the training thread: `d` of its own CPU time, like real compute, so that
/// time the thread spends preempted (other processes on its core) adds to the wall time
/// instead of eating into the work, and can be subtracted (the "adj" columns).
pub fn spin(d: Duration) {
    if d.is_zero() {
        return;
    }
    let end = thread_cpu() + d;
    while thread_cpu() < end {
        std::hint::spin_loop();
    }
}

/// Roughly N(0, 1) (Irwin–Hall of four uniforms, rescaled): element `i` of stream `seed`.
pub fn gauss(seed: u64, i: usize) -> f32 {
    let mut z = (i as u64).wrapping_add(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let sum: u32 = (0..4).map(|k| ((z >> (16 * k)) & 0xFFFF) as u32).sum();
    ((sum as f32 + 2.0) / 65536.0 - 2.0) * 1.732_050_8
}

/// `n` elements of optimizer state (`value(i)` each), on the huge pages the Python layer's
/// state gets (`kernels::advise_huge_pages` before the first touch).
pub fn state_buffer(n: usize, value: impl Fn(usize) -> f32) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    superoffload::kernels::advise_huge_pages(v.as_mut_ptr().cast(), n * 4);
    v.extend((0..n).map(value));
    v
}
