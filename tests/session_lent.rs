//! Buffers the caller lends a host session: the weights' copy (`SubGroupDesc::copy`), which a
//! final pass writes first, and the gradient buffers, which the state pass after it reads until
//! `wait_settled` says it ended.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use superoffload::error::Status;
use superoffload::kernels::{DType, Floats, Isa, bf16};
use superoffload::session::{
    Borrowed, GroupHparams, NormSource, Session, SessionOptions, SliceDesc, Speculation, StepArgs, SubGroupDesc,
};

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("superoffload-test-{}-{name}.json", std::process::id()))
}

/// A caller that lends both the copy and the gradient buffers, and writes each sub-group's next
/// gradient once `wait_settled` says that sub-group's state pass ended, without waiting for the
/// step's ticket: the same bits as session-owned buffers stepped one step at a time.
#[test]
fn a_lent_gradient_buffer_is_written_once_its_subgroup_settles() {
    let (subgroups, n) = (6, 1 << 16);
    let mk = |lent: bool| {
        let s = Session::new(SessionOptions {
            pool: Some(Arc::new(pool(Isa::best(), 2))),
            grad_dtype: DType::Bf16,
            accum_dtype: DType::Bf16,
            moment_dtype: DType::Bf16,
            copy_dtype: Some(DType::Bf16),
            speculation: Speculation::On,
            ..SessionOptions::default()
        })
        .unwrap();
        s.add_group(GroupHparams::default()).unwrap();
        let (mut grads, mut masters) = (Vec::new(), Vec::new());
        for k in 0..subgroups {
            let master = Box::leak(
                (0..n).map(|i| ((i * 3 + k) % 17) as f32 * 0.01 - 0.08).collect::<Vec<f32>>().into_boxed_slice(),
            );
            // SAFETY: leaked, so valid for the rest of the process; the test reads the masters
            // only after a step's ticket.
            let m = unsafe { Borrowed::new("m", master.as_mut_ptr().cast(), n, DType::F32) }.unwrap();
            let slices = vec![SliceDesc { name: format!("w{k}"), offset: 0, numel: n }];
            let mut desc = SubGroupDesc::new(0, m, slices);
            if lent {
                let copy = Box::leak(vec![bf16::ZERO; n].into_boxed_slice());
                let grad = Box::leak(vec![bf16::ZERO; n].into_boxed_slice());
                // SAFETY: as for `m`; the test writes `grad` only after `wait_settled`.
                desc.copy = Some(unsafe { Borrowed::new("c", copy.as_mut_ptr().cast(), n, DType::Bf16) }.unwrap());
                // SAFETY: as for `c`.
                desc.grad = Some(unsafe { Borrowed::new("g", grad.as_mut_ptr().cast(), n, DType::Bf16) }.unwrap());
                grads.push(grad);
            }
            s.add_subgroup(desc).unwrap();
            masters.push(&*master);
        }
        (s, grads, masters)
    };
    let gradient = |step: usize, k: usize| -> Vec<bf16> {
        (0..n).map(|i| bf16::from_f32(((i * 7 + step * 5 + k) % 13) as f32 * 1e-2 - 0.06)).collect()
    };
    let (own, _, own_masters) = mk(false);
    let (lent, mut grads, lent_masters) = mk(true);
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
            grads[k].copy_from_slice(&g);
            lent.grad_written(k as u32).unwrap();
        }
        let t = own.step(args).unwrap();
        own.wait(t, None).unwrap();
        last = lent.step(args).unwrap();
    }
    lent.wait(last, None).unwrap();
    for k in 0..subgroups {
        let same = own_masters[k].iter().zip(lent_masters[k]).all(|(x, y)| x.to_bits() == y.to_bits());
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
    let s = Session::new(SessionOptions {
        pool: Some(Arc::new(pool(Isa::best(), 1))),
        copy_dtype: Some(DType::Bf16),
        speculation: Speculation::Off,
        ..SessionOptions::default()
    })
    .unwrap();
    s.add_group(GroupHparams::default()).unwrap();
    for k in 0..subgroups {
        let master = Box::leak(vec![0.01f32; n].into_boxed_slice());
        let copy = Box::leak(vec![bf16::ZERO; n].into_boxed_slice());
        // SAFETY: both are leaked, so valid for the rest of the process.
        let m = unsafe { Borrowed::new("m", master.as_mut_ptr().cast(), n, DType::F32) }.unwrap();
        // SAFETY: as for `m`.
        let c = unsafe { Borrowed::new("c", copy.as_mut_ptr().cast(), n, DType::Bf16) }.unwrap();
        let slices = vec![SliceDesc { name: format!("w{k}"), offset: 0, numel: n }];
        s.add_subgroup(SubGroupDesc { copy: Some(c), ..SubGroupDesc::new(0, m, slices) }).unwrap();
    }
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
    let mk = |lent: bool| {
        let s = Session::new(SessionOptions {
            pool: Some(Arc::new(pool(Isa::best(), 2))),
            grad_dtype: DType::Bf16,
            moment_dtype: DType::Bf16,
            copy_dtype: Some(DType::Bf16),
            speculation: Speculation::On,
            ..SessionOptions::default()
        })
        .unwrap();
        s.add_group(GroupHparams::default()).unwrap();
        let master = Box::leak((0..n).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect::<Vec<f32>>().into_boxed_slice());
        let copy = Box::leak(vec![bf16::ZERO; n].into_boxed_slice());
        // SAFETY: both are leaked, so valid for the rest of the process; the test reads them only
        // after a step's ticket.
        let m = unsafe { Borrowed::new("m", master.as_mut_ptr().cast(), n, DType::F32) }.unwrap();
        // SAFETY: as for `m`.
        let c = lent.then(|| unsafe { Borrowed::new("c", copy.as_mut_ptr().cast(), n, DType::Bf16) }.unwrap());
        let slices = vec![SliceDesc { name: "w".into(), offset: 0, numel: n }];
        s.add_subgroup(SubGroupDesc { copy: c, ..SubGroupDesc::new(0, m, slices) }).unwrap();
        (s, master, copy)
    };
    let rounded = |master: &[f32], copy: &[bf16]| master.iter().zip(copy).all(|(m, c)| bf16::from_f32(*m) == *c);
    let (own, m1, _) = mk(false);
    let (lent, m2, copy) = mk(true);
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

    let plain =
        Session::new(SessionOptions { pool: Some(Arc::new(pool(Isa::best(), 1))), ..SessionOptions::default() })
            .unwrap();
    plain.add_group(GroupHparams::default()).unwrap();
    let master = Box::leak(vec![0.0f32; 8].into_boxed_slice());
    let copy = Box::leak(vec![bf16::ZERO; 8].into_boxed_slice());
    // SAFETY: leaked, valid for the rest of the process.
    let m = unsafe { Borrowed::new("m", master.as_mut_ptr().cast(), 8, DType::F32) }.unwrap();
    // SAFETY: as for `m`.
    let c = unsafe { Borrowed::new("c", copy.as_mut_ptr().cast(), 8, DType::Bf16) }.unwrap();
    let slices = vec![SliceDesc { name: "w".into(), offset: 0, numel: 8 }];
    let err = plain.add_subgroup(SubGroupDesc { copy: Some(c), ..SubGroupDesc::new(0, m, slices) }).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
}
