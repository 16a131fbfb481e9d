//! Buffers the caller lends a host session: the weights' copy (`SubGroupDesc::copy`), which a
//! final pass writes first, and the gradient buffers, which the state pass after it reads until
//! `wait_settled` says it ended.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use superoffload::error::{Result, Status};
use superoffload::kernels::{DType, Floats, Isa, bf16};
use superoffload::session::{
    Borrowed, GroupHparams, NormSource, Session, SessionOptions, SliceDesc, Speculation, StepArgs, SubGroupDesc,
};

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("superoffload-test-{}-{name}.json", std::process::id()))
}

/// What a sub-group's caller lends the session beside its master weights.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lend {
    Nothing,
    Copy,
    CopyAndGradient,
}

/// A sub-group's buffers, leaked so that they outlive the session. The tests read the master
/// weights and the copy only after a step's ticket, and write the gradient only after
/// `wait_settled`.
#[derive(Debug)]
struct Buffers {
    master: &'static [f32],
    copy: Option<&'static [bf16]>,
    grad: Option<&'static mut [bf16]>,
}

/// A host session with one param group of default hyperparameters, whose sub-groups are one
/// slice each, `w0`, `w1`, ... in the order they are added.
struct Fixture {
    session: Session,
    subgroups: usize,
}

impl Fixture {
    fn new(threads: usize, options: SessionOptions) -> Fixture {
        let session =
            Session::new(SessionOptions { pool: Some(Arc::new(pool(Isa::best(), threads))), ..options }).unwrap();
        session.add_group(GroupHparams::default()).unwrap();
        Fixture { session, subgroups: 0 }
    }

    /// Registers the next sub-group over `master` (f32) with bf16 buffers for what `lend` says.
    fn add_subgroup(&mut self, master: Vec<f32>, lend: Lend) -> Result<Buffers> {
        let n = master.len();
        let master = Box::leak(master.into_boxed_slice());
        // SAFETY: leaked, so valid for the rest of the process; read only as `Buffers` says.
        let m = unsafe { Borrowed::new("m", master.as_mut_ptr().cast(), n, DType::F32) }.unwrap();
        let slices = vec![SliceDesc { name: format!("w{}", self.subgroups), offset: 0, numel: n }];
        let mut desc = SubGroupDesc::new(0, m, slices);
        let mut copy = None;
        if lend != Lend::Nothing {
            let buffer = Box::leak(vec![bf16::ZERO; n].into_boxed_slice());
            // SAFETY: as for `m`.
            desc.copy = Some(unsafe { Borrowed::new("c", buffer.as_mut_ptr().cast(), n, DType::Bf16) }.unwrap());
            copy = Some(&*buffer);
        }
        let mut grad = None;
        if lend == Lend::CopyAndGradient {
            let buffer = Box::leak(vec![bf16::ZERO; n].into_boxed_slice());
            // SAFETY: as for `m`.
            desc.grad = Some(unsafe { Borrowed::new("g", buffer.as_mut_ptr().cast(), n, DType::Bf16) }.unwrap());
            grad = Some(buffer);
        }
        self.session.add_subgroup(desc)?;
        self.subgroups += 1;
        Ok(Buffers { master, copy, grad })
    }
}

/// A caller that lends both the copy and the gradient buffers, and writes each sub-group's next
/// gradient once `wait_settled` says that sub-group's state pass ended, without waiting for the
/// step's ticket: the same bits as session-owned buffers stepped one step at a time.
#[test]
fn a_lent_gradient_buffer_is_written_once_its_subgroup_settles() {
    let (subgroups, n) = (6, 1 << 16);
    let mk = |lend: Lend| {
        let mut fixture = Fixture::new(
            2,
            SessionOptions {
                grad_dtype: DType::Bf16,
                accum_dtype: DType::Bf16,
                moment_dtype: DType::Bf16,
                copy_dtype: Some(DType::Bf16),
                speculation: Speculation::On,
                ..SessionOptions::default()
            },
        );
        let buffers: Vec<Buffers> = (0..subgroups)
            .map(|k| {
                let master = (0..n).map(|i| ((i * 3 + k) % 17) as f32 * 0.01 - 0.08).collect();
                fixture.add_subgroup(master, lend).unwrap()
            })
            .collect();
        (fixture.session, buffers)
    };
    let gradient = |step: usize, k: usize| -> Vec<bf16> {
        (0..n).map(|i| bf16::from_f32(((i * 7 + step * 5 + k) % 13) as f32 * 1e-2 - 0.06)).collect()
    };
    let (own, own_buffers) = mk(Lend::Nothing);
    let (lent, mut lent_buffers) = mk(Lend::CopyAndGradient);
    let mut last = 0;
    for step in 0..8 {
        let max_norm = if step % 3 == 1 { 0.1 } else { 0.0 };
        let args = StepArgs { max_norm, norm: NormSource::Local, overflow: false };
        own.begin_step(None, 1).unwrap();
        lent.begin_step(None, 1).unwrap();
        for k in (0..subgroups).rev() {
            let g = gradient(step, k);
            own.grad_copy(k as u32, Floats::Bf16(&g)).unwrap();
            lent.wait_settled(k as u32, None).unwrap();
            lent_buffers[k].grad.as_mut().unwrap().copy_from_slice(&g);
            lent.grad_written(k as u32).unwrap();
        }
        let t = own.step(args).unwrap();
        own.wait(t, None).unwrap();
        last = lent.step(args).unwrap();
    }
    lent.wait(last, None).unwrap();
    for k in 0..subgroups {
        let (own_master, lent_master) = (own_buffers[k].master, lent_buffers[k].master);
        let same = own_master.iter().zip(lent_master).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "master weights of sub-group {k}");
        let (a, b) = (own.moments(k as u32).unwrap(), lent.moments(k as u32).unwrap());
        assert!(a == b, "moments of sub-group {k}");
    }
    assert_eq!(lent.wait_settled(0, Some(Duration::ZERO)), Ok(()), "settled after the step's ticket");
}

/// The passes that write the master weights and moments after a lent copy run in the order the
/// sub-groups' gradients completed, which is about the order the next backward needs their
/// gradient buffers in: here sub-group 0 (like the root group FSDP2 gathers first, whose
/// output layer backward reaches first) and then the rest in backward order.
#[test]
fn state_passes_follow_the_order_gradients_completed_in() {
    let (subgroups, n) = (6usize, 4096);
    let mut fixture = Fixture::new(
        1,
        SessionOptions { copy_dtype: Some(DType::Bf16), speculation: Speculation::Off, ..SessionOptions::default() },
    );
    for _ in 0..subgroups {
        fixture.add_subgroup(vec![0.01; n], Lend::Copy).unwrap();
    }
    let s = fixture.session;
    let arrival = [0, 5, 4, 3, 2, 1];
    s.trace(true);
    s.begin_step(None, 1).unwrap();
    for &k in &arrival {
        s.grad_copy(k, Floats::F32(&vec![0.01; n])).unwrap();
    }
    let t = s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap();
    s.wait(t, None).unwrap();
    let path = temp_path("state-order").with_extension("json");
    s.save_trace(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let field = |line: &str, key: &str| -> Option<String> {
        let at = line.find(key)? + key.len();
        Some(line[at..].chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect())
    };
    let mut passes: Vec<(f64, u32)> = text
        .lines()
        .filter_map(|line| {
            let id = field(line, "\"name\":\"state, sub-group ")?.parse().ok()?;
            Some((field(line, "\"ts\":")?.parse().ok()?, id))
        })
        .collect();
    passes.sort_by(|a, b| a.0.total_cmp(&b.0));
    let order: Vec<u32> = passes.iter().map(|&(_, id)| id).collect();
    assert_eq!(order, arrival, "the state passes' order");
}

/// A host session that keeps its weights' copy in the caller's buffer (`SubGroupDesc::copy`)
/// steps the same bits as one that keeps its own, with bf16 moments (the copy steps ahead)
/// and clipping on some steps; the lent copy is the master weights rounded, from registration
/// on, whenever the step's ticket is complete. Without a copy dtype a lent copy is refused.
#[test]
fn a_lent_copy_holds_the_masters_rounded() {
    let n = 3000;
    let mk = |lend: Lend| {
        let mut fixture = Fixture::new(
            2,
            SessionOptions {
                grad_dtype: DType::Bf16,
                moment_dtype: DType::Bf16,
                copy_dtype: Some(DType::Bf16),
                speculation: Speculation::On,
                ..SessionOptions::default()
            },
        );
        let master = (0..n).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
        let buffers = fixture.add_subgroup(master, lend).unwrap();
        (fixture.session, buffers)
    };
    let rounded = |master: &[f32], copy: &[bf16]| master.iter().zip(copy).all(|(m, c)| bf16::from_f32(*m) == *c);
    let (own, Buffers { master: m1, .. }) = mk(Lend::Nothing);
    let (lent, Buffers { master: m2, copy, .. }) = mk(Lend::Copy);
    let copy = copy.unwrap();
    assert!(rounded(m2, copy), "written at registration");
    for step in 0..6 {
        let g: Vec<bf16> = (0..n).map(|i| bf16::from_f32(((i * 7 + step) % 13) as f32 * 1e-2 - 0.06)).collect();
        for s in [&own, &lent] {
            s.begin_step(None, 1).unwrap();
            s.grad_copy(0, Floats::Bf16(&g)).unwrap();
            let max_norm = if step % 2 == 1 { 0.1 } else { 0.0 };
            let t = s.step(StepArgs { max_norm, norm: NormSource::Local, overflow: false }).unwrap();
            s.wait(t, None).unwrap();
        }
        assert!(m1.iter().zip(m2.iter()).all(|(a, b)| a.to_bits() == b.to_bits()), "step {step}");
        assert!(rounded(m2, copy), "step {step}");
    }

    let err = Fixture::new(1, SessionOptions::default()).add_subgroup(vec![0.0; 8], Lend::Copy).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
}
