//! The simulated model: many small slices (parameters) in sub-groups, and their random
//! sizes and gradients.

use crate::Args;

/// A splitmix64 generator: the same sizes and gradients on every run.
pub struct Rng(pub u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    /// A gradient element, uniform in [-0.005, 0.005).
    pub fn small(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.01
    }
}

/// Slices in registration (forward) order: (sub-group, offset in it, length).
pub struct Model {
    pub slices: Vec<(usize, usize, usize)>,
    /// Elements per sub-group.
    pub sg_numel: Vec<usize>,
}

/// `--slices` slices of sizes uniform in [`--min-elems`, `--max-elems`], spread contiguously
/// over `--subgroups` sub-groups.
pub fn model(a: &Args) -> Model {
    let mut rng = Rng(12345);
    let mut slices = Vec::with_capacity(a.slices);
    let mut sg_numel = vec![0usize; a.subgroups];
    for i in 0..a.slices {
        let sg = i * a.subgroups / a.slices;
        let n = rng.range(a.min, a.max);
        slices.push((sg, sg_numel[sg], n));
        sg_numel[sg] += n;
    }
    Model { slices, sg_numel }
}
