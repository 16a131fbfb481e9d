//! Shared test support: a deterministic RNG, typed buffers of any dtype, and an f64
//! reference of the kernels that carries a rigorous first-order bound of f32 rounding.
#![allow(dead_code, reason = "every test file includes this module and uses a different part of it")]

use half::{bf16, f16};
use superoffload::kernels::{
    AdamBuffers, AdamHyper, AdamMode, CopyOutMut, DType, Floats, FloatsMut, GradRef, Isa, MomentsMut, ParamMut, Pool,
    PoolOptions,
};

/// splitmix64: small, fast, reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
    /// Roughly normal (sum of uniforms), scaled, with an occasional wide exponent.
    pub fn normalish(&mut self, scale: f64) -> f64 {
        let x: f64 = (0..4).map(|_| self.unit()).sum::<f64>() - 2.0;
        let spread = if self.next_u64().is_multiple_of(16) { 2f64.powi(self.range(-12.0, 6.0) as i32) } else { 1.0 };
        x * scale * spread
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// A buffer of one dtype. Equality is bit for bit (so -0 != 0 and NaN == the same NaN).
#[derive(Clone, Debug)]
pub enum Store {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl PartialEq for Store {
    fn eq(&self, other: &Store) -> bool {
        self.dtype() == other.dtype()
            && self.len() == other.len()
            && (0..self.len()).all(|i| self.bits(i) == other.bits(i))
    }
}

impl Store {
    pub fn from_f64(dtype: DType, values: impl Iterator<Item = f64>) -> Store {
        match dtype {
            DType::F32 => Store::F32(values.map(|x| x as f32).collect()),
            DType::Bf16 => Store::Bf16(values.map(|x| bf16::from_f32(x as f32)).collect()),
            DType::F16 => Store::F16(values.map(|x| f16::from_f32(x as f32)).collect()),
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            Store::F32(_) => DType::F32,
            Store::Bf16(_) => DType::Bf16,
            Store::F16(_) => DType::F16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Store::F32(v) => v.len(),
            Store::Bf16(v) => v.len(),
            Store::F16(v) => v.len(),
        }
    }
    pub fn get(&self, i: usize) -> f64 {
        match self {
            Store::F32(v) => v[i] as f64,
            Store::Bf16(v) => v[i].to_f32() as f64,
            Store::F16(v) => v[i].to_f32() as f64,
        }
    }
    pub fn set(&mut self, i: usize, x: f32) {
        match self {
            Store::F32(v) => v[i] = x,
            Store::Bf16(v) => v[i] = bf16::from_f32(x),
            Store::F16(v) => v[i] = f16::from_f32(x),
        }
    }
    pub fn bits(&self, i: usize) -> u32 {
        match self {
            Store::F32(v) => v[i].to_bits(),
            Store::Bf16(v) => v[i].to_bits() as u32,
            Store::F16(v) => v[i].to_bits() as u32,
        }
    }
    pub fn param(&mut self) -> ParamMut<'_> {
        match self {
            Store::F32(v) => ParamMut::F32(v),
            Store::Bf16(v) => ParamMut::Bf16(v),
            Store::F16(v) => ParamMut::F16(v),
        }
    }
    pub fn grad(&self) -> GradRef<'_> {
        match self {
            Store::F32(v) => GradRef::F32(v),
            Store::Bf16(v) => GradRef::Bf16(v),
            Store::F16(v) => GradRef::F16(v),
        }
    }
    pub fn floats(&self) -> Floats<'_> {
        match self {
            Store::F32(v) => Floats::F32(v),
            Store::Bf16(v) => Floats::Bf16(v),
            Store::F16(v) => Floats::F16(v),
        }
    }
    pub fn floats_mut(&mut self) -> FloatsMut<'_> {
        match self {
            Store::F32(v) => FloatsMut::F32(v),
            Store::Bf16(v) => FloatsMut::Bf16(v),
            Store::F16(v) => FloatsMut::F16(v),
        }
    }
    pub fn copy_out(&mut self) -> CopyOutMut<'_> {
        match self {
            Store::Bf16(v) => CopyOutMut::Bf16(v),
            Store::F16(v) => CopyOutMut::F16(v),
            Store::F32(_) => panic!("no f32 copy-out"),
        }
    }
}

/// Everything a step reads and writes.
#[derive(Clone, Debug, PartialEq)]
pub struct State {
    pub p: Store,
    pub g: Store,
    pub m: Store,
    pub v: Store,
    pub out: Option<Store>,
}

impl State {
    /// Random state: `warm` moments (else zeros), parameters ~ 1, gradients ~ `gscale`.
    pub fn random(
        rng: &mut Rng,
        n: usize,
        dtypes: (DType, DType, DType, Option<DType>),
        warm: bool,
        gscale: f64,
    ) -> State {
        let (pd, gd, md, od) = dtypes;
        let p = Store::from_f64(pd, (0..n).map(|_| rng.normalish(1.0)).collect::<Vec<_>>().into_iter());
        let g = Store::from_f64(gd, (0..n).map(|_| rng.normalish(gscale)).collect::<Vec<_>>().into_iter());
        let m = Store::from_f64(
            md,
            (0..n).map(|_| if warm { rng.normalish(0.1 * gscale) } else { 0.0 }).collect::<Vec<_>>().into_iter(),
        );
        let v = Store::from_f64(
            md,
            (0..n)
                .map(|_| if warm { (rng.normalish(gscale)).powi(2) * rng.range(0.0, 2.0) } else { 0.0 })
                .collect::<Vec<_>>()
                .into_iter(),
        );
        let out = od.map(|d| Store::from_f64(d, std::iter::repeat_n(-7.0, n)));
        State { p, g, m, v, out }
    }

    pub fn buffers(&mut self) -> AdamBuffers<'_> {
        let moments = match (&mut self.m, &mut self.v) {
            (Store::F32(m), Store::F32(v)) => MomentsMut::F32 { exp_avg: m, exp_avg_sq: v },
            (Store::Bf16(m), Store::Bf16(v)) => MomentsMut::Bf16 { exp_avg: m, exp_avg_sq: v },
            _ => panic!("moments must share a dtype of f32 or bf16"),
        };
        AdamBuffers {
            param: self.p.param(),
            grad: self.g.grad(),
            moments,
            copy_out: self.out.as_mut().map(Store::copy_out),
        }
    }

    pub fn len(&self) -> usize {
        self.p.len()
    }
}

pub const DTYPES: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];
pub const MOMENT_DTYPES: [DType; 2] = [DType::F32, DType::Bf16];
pub const COPY_DTYPES: [Option<DType>; 3] = [None, Some(DType::Bf16), Some(DType::F16)];

/// Every (param, grad, moments, copy-out) combination: 54.
pub fn all_dtype_combinations() -> Vec<(DType, DType, DType, Option<DType>)> {
    let mut all = Vec::new();
    for p in DTYPES {
        for g in DTYPES {
            for m in MOMENT_DTYPES {
                for o in COPY_DTYPES {
                    all.push((p, g, m, o));
                }
            }
        }
    }
    all
}

pub fn supported_isas() -> Vec<Isa> {
    let all = [Isa::Portable, Isa::Avx2, Isa::Avx512];
    let supported: Vec<Isa> = all.into_iter().filter(|i| i.is_supported()).collect();
    for isa in all {
        if !isa.is_supported() {
            eprintln!("note: instruction set {} is not supported by this CPU; its tests are skipped", isa.name());
        }
    }
    supported
}

pub fn pool(isa: Isa, threads: usize) -> Pool {
    Pool::new(&PoolOptions { num_threads: threads, cores: None, isa: Some(isa) }).unwrap()
}

pub fn random_hyper(rng: &mut Rng, mode: AdamMode) -> AdamHyper {
    AdamHyper {
        mode,
        lr: rng.range(1e-5, 1e-2),
        beta1: [0.9, 0.8, 0.95, rng.range(0.5, 0.99)][rng.below(4)],
        beta2: [0.999, 0.99, 0.95, rng.range(0.9, 0.9999)][rng.below(4)],
        eps: [1e-8, 1e-6, 1e-3][rng.below(3)],
        weight_decay: [0.0, 0.01, 0.1][rng.below(3)],
        bias_correction: rng.below(4) != 0,
        step: [1, 2, 3, 10, 1000][rng.below(5)],
    }
}

// ---------------------------------------------------------------------------------------
// f64 reference with rounding-error bounds.
//
// `T` is a value computed in f64 together with a first-order bound on how far an f32
// evaluation of the same expression, operation by operation, can be from it. Mirroring the
// exact operation sequence of `src/kernels/math.rs` gives element-wise bounds that are
// tight (a few ulps of the terms involved) and rigorous up to second-order terms.
// ---------------------------------------------------------------------------------------

/// Unit roundoff of f32.
pub const U: f64 = 1.0 / (1u64 << 24) as f64;

#[derive(Clone, Copy, Debug)]
pub struct T {
    pub v: f64,
    pub e: f64,
}

pub fn exact(x: f64) -> T {
    T { v: x, e: 0.0 }
}

/// One rounding of the result to f32.
fn rounded(v: f64, e: f64) -> T {
    // An unbounded input (a division by an interval holding zero) stays unbounded.
    let e = if e.is_nan() { f64::INFINITY } else { e };
    T { v, e: e + U * v.abs() }
}

pub fn add(a: T, b: T) -> T {
    rounded(a.v + b.v, a.e + b.e)
}
pub fn sub(a: T, b: T) -> T {
    rounded(a.v - b.v, a.e + b.e)
}
pub fn mul(a: T, b: T) -> T {
    rounded(a.v * b.v, a.v.abs() * b.e + b.v.abs() * a.e + a.e * b.e)
}
pub fn div(a: T, b: T) -> T {
    let q = a.v / b.v;
    let denom = b.v.abs() - b.e;
    let e = if denom > 0.0 { (a.e + q.abs() * b.e) / denom } else { f64::INFINITY };
    rounded(q, e)
}
pub fn sqrt(a: T) -> T {
    // sqrt is steepest below its argument, so the bound is taken there (not first-order:
    // near zero the error of v can be as large as v itself).
    let r = a.v.max(0.0).sqrt();
    let e = (r - (a.v - a.e).max(0.0).sqrt()).max((a.v + a.e).max(0.0).sqrt() - r);
    rounded(r, e)
}
pub fn fma(a: T, b: T, c: T) -> T {
    rounded(a.v * b.v + c.v, a.v.abs() * b.e + b.v.abs() * a.e + a.e * b.e + c.e)
}
pub fn max0(a: T) -> T {
    if a.v < 0.0 { T { v: 0.0, e: (a.v + a.e).max(0.0) } } else { a }
}

/// Rounding to a storage dtype (nothing for f32, whose rounding the last op counted).
pub fn store(dtype: DType, a: T) -> T {
    match dtype {
        DType::F32 => a,
        DType::Bf16 => T { v: a.v, e: a.e + (a.v.abs() + a.e) / 256.0 },
        DType::F16 => T { v: a.v, e: a.e + (a.v.abs() + a.e) / 2048.0 + 2f64.powi(-25) },
    }
}

/// The kernel's per-call constants, as the exact f32 values it uses.
pub struct Consts {
    pub b1: T,
    pub omb1: T,
    pub b2: T,
    pub omb2: T,
    pub eps: T,
    pub sqrt_bc2: T,
    pub step: T,
    pub decay: T,
    pub l2: Option<T>,
}

impl Consts {
    pub fn new(hp: &AdamHyper) -> Consts {
        // Each constant is the f64 expression of the hyperparameters, rounded once to f32.
        let (bc1, bc2) = hp.bias_corrections();
        let f32_of = |x: f64| exact(x as f32 as f64);
        let l2 = (hp.mode == AdamMode::L2 && hp.weight_decay != 0.0).then(|| f32_of(hp.weight_decay));
        Consts {
            b1: f32_of(hp.beta1),
            omb1: f32_of(1.0 - hp.beta1),
            b2: f32_of(hp.beta2),
            omb2: f32_of(1.0 - hp.beta2),
            eps: f32_of(hp.eps),
            sqrt_bc2: exact(bc2.sqrt() as f64),
            step: f32_of(hp.lr / bc1 as f64),
            decay: exact(hp.decay_factor() as f64),
            l2,
        }
    }

    fn denom(&self, v: T) -> T {
        add(div(sqrt(v), self.sqrt_bc2), self.eps)
    }
}

pub struct Ref {
    pub p: T,
    pub m: T,
    pub v: T,
}

fn neg(a: T) -> T {
    T { v: -a.v, e: a.e }
}

/// Reference of `kernels::update` on one element.
pub fn ref_update(k: &Consts, scale: f64, p: T, g: T, m: T, v: T) -> Ref {
    let g = mul(g, exact(scale));
    let ge = match k.l2 {
        Some(wd) => fma(wd, p, g),
        None => g,
    };
    let m = fma(k.omb1, ge, mul(k.b1, m));
    let v = fma(k.omb2, mul(ge, ge), mul(k.b2, v));
    let u = div(m, k.denom(v));
    let p = fma(neg(k.step), u, mul(p, k.decay));
    Ref { p, m, v }
}

/// Reference of `kernels::rollback` on one element.
pub fn ref_rollback(k: &Consts, scale: f64, p: T, g: T, m: T, v: T) -> Ref {
    let u = div(m, k.denom(v));
    let p = div(fma(k.step, u, p), k.decay);
    let g = mul(g, exact(scale));
    let ge = match k.l2 {
        Some(wd) => fma(wd, p, g),
        None => g,
    };
    let m = div(fma(neg(k.omb1), ge, m), k.b1);
    let v = max0(div(fma(neg(k.omb2), mul(ge, ge), v), k.b2));
    Ref { p, m, v }
}

/// Reference of `kernels::rescale` on one element (`old`, `new` the scales): the old
/// gradient's contribution taken out of the moments, the new one's put in.
pub fn ref_rescale(k: &Consts, old: f64, new: f64, p: T, g: T, m: T, v: T) -> Ref {
    let u_old = div(m, k.denom(v));
    let (ge_old, ge_new) = match k.l2 {
        Some(wd) => {
            let p_prev = fma(k.step, u_old, p);
            (fma(wd, p_prev, mul(g, exact(old))), fma(wd, p_prev, mul(g, exact(new))))
        }
        None => (mul(g, exact(old)), mul(g, exact(new))),
    };
    let m_prior = fma(neg(k.omb1), ge_old, m);
    let m_new = fma(k.omb1, ge_new, m_prior);
    let v_prior = fma(neg(k.omb2), mul(ge_old, ge_old), v);
    let v_new = max0(fma(k.omb2, mul(ge_new, ge_new), v_prior));
    let u_new = div(m_new, k.denom(v_new));
    let p = fma(neg(k.step), sub(u_new, u_old), p);
    Ref { p, m: m_new, v: v_new }
}

/// Checks `got` against `want` within `slack` times its bound plus a tiny absolute floor.
pub fn assert_close(what: &str, i: usize, got: f64, want: T, slack: f64) {
    let tol = slack * want.e + 1e-37;
    assert!(
        (got - want.v).abs() <= tol,
        "{what}[{i}]: got {got:e}, reference {:e}, |diff| {:e} > bound {tol:e}",
        want.v,
        (got - want.v).abs()
    );
}

/// Round to nearest even into bf16 / f16, via the half crate (an independent implementation).
pub fn round_to(dtype: DType, x: f32) -> u32 {
    match dtype {
        DType::Bf16 => {
            if x.is_nan() {
                0x7FC0
            } else {
                bf16::from_f32(x).to_bits() as u32
            }
        }
        DType::F16 => f16::from_f32(x).to_bits() as u32,
        DType::F32 => x.to_bits(),
    }
}

/// The hooks of a test transport that pins nothing: `as_any`, `pin`, `unpin`.
#[macro_export]
macro_rules! transport_without_pinning {
    () => {
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn pin(&self, _: *mut u8, _: usize) -> superoffload::error::Result<()> {
            Ok(())
        }
        fn unpin(&self, _: *mut u8) {}
    };
}

/// The hooks of a test transport that publishes nowhere: `master_write`, `publish_piece`,
/// `publish_filled` (which fills a scratch buffer: the session's pass runs in `fill`) and
/// `publish`; `(pieces)`: all but `master_write`, for a transport that watches the passes.
#[macro_export]
macro_rules! transport_without_publishing {
    () => {
        fn master_write(&self, _: u32) -> superoffload::error::Result<()> {
            Ok(())
        }
        $crate::transport_without_publishing!(pieces);
    };
    (pieces) => {
        fn publish_piece(
            &self,
            _: u32,
            _: usize,
            _: superoffload::kernels::Floats<'_>,
        ) -> superoffload::error::Result<()> {
            Ok(())
        }
        fn publish_filled(
            &self,
            _: u32,
            _: usize,
            len: usize,
            dtype: superoffload::kernels::DType,
            fill: &mut dyn FnMut(superoffload::kernels::FloatsMut<'_>) -> superoffload::error::Result<()>,
        ) -> superoffload::error::Result<()> {
            $crate::common::with_scratch(dtype, len, fill)
        }
        fn publish(&self, _: u32) -> superoffload::error::Result<()> {
            Ok(())
        }
    };
}

/// `publish_piece` and `publish_filled` of a test transport that receives bf16 pieces: each
/// piece, given from the session's memory or filled by its pass, goes to
/// `self.$receive(sg, offset, piece)`.
#[macro_export]
macro_rules! bf16_publication {
    ($receive:ident) => {
        fn publish_piece(
            &self,
            sg: u32,
            offset: usize,
            src: superoffload::kernels::Floats<'_>,
        ) -> superoffload::error::Result<()> {
            let superoffload::kernels::Floats::Bf16(piece) = src else { panic!("a bf16 copy is published") };
            self.$receive(sg, offset, piece);
            Ok(())
        }
        fn publish_filled(
            &self,
            sg: u32,
            offset: usize,
            len: usize,
            dtype: superoffload::kernels::DType,
            fill: &mut dyn FnMut(superoffload::kernels::FloatsMut<'_>) -> superoffload::error::Result<()>,
        ) -> superoffload::error::Result<()> {
            assert_eq!(dtype, superoffload::kernels::DType::Bf16, "a bf16 copy is published");
            let mut piece = vec![superoffload::kernels::bf16::ZERO; len];
            fill(superoffload::kernels::FloatsMut::Bf16(&mut piece))?;
            self.$receive(sg, offset, &piece);
            Ok(())
        }
    };
}

/// `publish_filled` for a test transport the session must never ask for it (it keeps a full
/// copy, or publishes f32 master weights): a call fails the test.
#[macro_export]
macro_rules! no_bounded_publication {
    ($why:literal) => {
        fn publish_filled(
            &self,
            _: u32,
            _: usize,
            _: usize,
            _: superoffload::kernels::DType,
            _: &mut dyn FnMut(superoffload::kernels::FloatsMut<'_>) -> superoffload::error::Result<()>,
        ) -> superoffload::error::Result<()> {
            panic!($why)
        }
    };
}

/// Runs `f` on a zeroed buffer of `len` elements of `dtype` (a publication slot of a test
/// transport).
pub fn with_scratch<T>(dtype: DType, len: usize, f: &mut dyn FnMut(FloatsMut<'_>) -> T) -> T {
    match dtype {
        DType::F32 => f(FloatsMut::F32(&mut vec![0.0; len])),
        DType::Bf16 => f(FloatsMut::Bf16(&mut vec![bf16::ZERO; len])),
        DType::F16 => f(FloatsMut::F16(&mut vec![f16::ZERO; len])),
    }
}
