//! Session behaviour: checkpoints, misuse, tickets, non-speculating sub-groups, in-place
//! gradients, destruction with work in flight.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use superoffload::error::Status;
use superoffload::kernels::{DType, Floats, Isa, bf16};
use superoffload::session::{
    Borrowed, GroupHparams, LossScalerOptions, NormSource, Session, SessionOptions, SliceDesc, Speculation, StepArgs,
    SubGroupDesc, TicketState,
};

/// A small model: named slices with fixed sizes, grouped into sub-groups by `partition`.
const SLICES: &[(&str, usize)] =
    &[("emb", 3000), ("l0.w", 2048), ("l0.b", 64), ("l1.w", 2048), ("l1.b", 64), ("head", 1001)];

struct Model {
    session: Session,
    /// One master buffer per sub-group (the session borrows them).
    masters: Vec<Vec<f32>>,
    /// Sub-group and offset of each slice.
    place: Vec<(usize, usize)>,
}

fn options(scaler: bool) -> SessionOptions {
    SessionOptions {
        pool: Some(Arc::new(pool(Isa::best(), 2))),
        grad_dtype: DType::Bf16,
        loss_scaler: scaler.then_some(LossScalerOptions {
            init_scale: 256.0,
            growth_interval: 3,
            ..Default::default()
        }),
        ..SessionOptions::default()
    }
}

/// `partition` lists, per sub-group, the slice indices it holds.
fn model(partition: &[&[usize]], opts: SessionOptions, seed: u64) -> Model {
    let session = Session::new(opts).unwrap();
    session.add_group(GroupHparams { weight_decay: 0.05, ..GroupHparams::default() }).unwrap();
    session.add_group(GroupHparams { lr: 3e-4, ..GroupHparams::default() }).unwrap();
    let mut rng = Rng::new(seed);
    let initial: Vec<Vec<f32>> =
        SLICES.iter().map(|(_, n)| (0..*n).map(|_| rng.normalish(0.3) as f32).collect()).collect();
    let mut masters = Vec::new();
    let mut place = vec![(0, 0); SLICES.len()];
    for (sg, members) in partition.iter().enumerate() {
        let mut master = Vec::new();
        for &i in *members {
            place[i] = (sg, master.len());
            master.extend_from_slice(&initial[i]);
        }
        masters.push(master);
    }
    for (sg, members) in partition.iter().enumerate() {
        let slices = members
            .iter()
            .map(|&i| SliceDesc { name: SLICES[i].0.into(), offset: place[i].1, numel: SLICES[i].1 })
            .collect();
        // SAFETY: `masters` lives as long as the session (both are fields of Model, and
        // the Vecs are never reallocated).
        let master =
            unsafe { Borrowed::new("master", masters[sg].as_mut_ptr().cast(), masters[sg].len(), DType::F32) }.unwrap();
        let group = u32::from(members.contains(&5));
        session.add_subgroup(SubGroupDesc::new(group, master, slices)).unwrap();
    }
    Model { session, masters, place }
}

impl Model {
    /// One training step with gradients drawn from `seed` and `step`.
    fn step(&mut self, seed: u64, step: u64, max_norm: f64) {
        self.step_with(seed, step, max_norm, false)
    }

    /// As `step`; with `let_speculate`, waits for the speculative steps before `step()` (so
    /// that none is cancelled).
    fn step_with(&mut self, seed: u64, step: u64, max_norm: f64, let_speculate: bool) {
        let s = &self.session;
        s.begin_step(None, 1).unwrap();
        let scale = s.loss_scale();
        let mut rng = Rng::new(seed * 1000 + step);
        let mut speculative = Vec::new();
        for (name, n) in SLICES.iter().rev() {
            let g: Vec<bf16> = (0..*n).map(|_| bf16::from_f32((rng.normalish(0.01) * scale as f64) as f32)).collect();
            speculative.extend(s.grad_copy(s.slice_id(name).unwrap(), Floats::Bf16(&g)).unwrap());
        }
        if let_speculate {
            for t in speculative {
                s.wait(t, None).unwrap();
            }
        }
        let t = s.step(StepArgs { max_norm, norm: NormSource::Local, overflow: false }).unwrap();
        s.wait(t, None).unwrap();
    }

    /// Every slice's master weights and moments, by name (independent of the partition).
    fn state(&self) -> Vec<(Vec<u32>, Vec<u32>, Vec<u32>)> {
        let moments: Vec<_> = (0..self.masters.len()).map(|sg| self.session.moments(sg as u32).unwrap()).collect();
        SLICES
            .iter()
            .enumerate()
            .map(|(i, (_, n))| {
                let (sg, off) = self.place[i];
                let bits = |v: &[f32]| v[off..off + n].iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (bits(&self.masters[sg]), bits(&moments[sg].0), bits(&moments[sg].1))
            })
            .collect()
    }
}

const PARTITION_A: &[&[usize]] = &[&[0], &[1, 2], &[3, 4], &[5]];
const PARTITION_B: &[&[usize]] = &[&[0, 1, 2, 3, 4], &[5]];

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("superoffload-test-{}-{name}.safetensors", std::process::id()))
}

#[test]
fn checkpoint_resume_is_bit_exact() {
    // With the loss scaler, the same partition; clipping that triggers with and without
    // speculation, and none.
    for (speculation, max_norm) in
        [(Speculation::Off, 0.05), (Speculation::On, 0.05), (Speculation::On, 0.0), (Speculation::Auto, 0.0)]
    {
        let opts = || SessionOptions { speculation, ..options(true) };
        let n = 6;
        let mut straight = model(PARTITION_A, opts(), 1);
        for step in 1..=2 * n {
            straight.step(7, step, max_norm);
        }
        let mut first = model(PARTITION_A, opts(), 1);
        for step in 1..=n {
            first.step(7, step, max_norm);
        }
        let path = temp_path("resume");
        first.session.save(&path).unwrap();
        let mut resumed = model(PARTITION_A, opts(), 99);
        resumed.session.load(&path).unwrap();
        for step in n + 1..=2 * n {
            resumed.step(7, step, max_norm);
        }
        assert!(resumed.state() == straight.state(), "N + save + load + N == 2N ({speculation:?}, {max_norm})");
        assert_eq!(resumed.session.loss_scale(), straight.session.loss_scale());
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn checkpoint_loads_into_a_different_partition() {
    // Without clipping, per-element results do not depend on the partition.
    let n = 5;
    let mut straight = model(PARTITION_A, options(false), 2);
    for step in 1..=2 * n {
        straight.step(3, step, 0.0);
    }
    let mut first = model(PARTITION_A, options(false), 2);
    for step in 1..=n {
        first.step(3, step, 0.0);
    }
    let path = temp_path("partition");
    first.session.save(&path).unwrap();
    let mut other = model(PARTITION_B, options(false), 5);
    other.session.load(&path).unwrap();
    for step in n + 1..=2 * n {
        other.step(3, step, 0.0);
    }
    assert!(other.state() == straight.state());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn bad_checkpoints_are_refused_and_change_nothing() {
    let mut m = model(PARTITION_A, options(false), 3);
    m.step(1, 1, 0.0);
    let path = temp_path("bad");
    m.session.save(&path).unwrap();
    m.step(1, 2, 0.0);
    let before = m.state();
    let good = std::fs::read(&path).unwrap();

    let mut corrupt = good.clone();
    let at = corrupt.len() - 100;
    corrupt[at] ^= 0x10;
    let truncated = good[..good.len() / 2].to_vec();
    for (what, bytes) in [("corrupt", corrupt), ("truncated", truncated), ("empty", Vec::new())] {
        std::fs::write(&path, &bytes).unwrap();
        let err = m.session.load(&path).unwrap_err();
        assert_eq!(err.status, Status::BadCheckpoint, "{what}: {err}");
        assert!(m.state() == before, "{what}: the session changed");
    }
    // A checkpoint of another model: its slices do not match.
    let other = Session::new(options(false)).unwrap();
    other.add_group(GroupHparams::default()).unwrap();
    other.add_group(GroupHparams::default()).unwrap();
    let mut w = vec![0.0f32; 10];
    // SAFETY: `w` lives until the end of the test, after `drop(other)`, and nothing else
    // touches it meanwhile.
    let master = unsafe { Borrowed::new("w", w.as_mut_ptr().cast(), 10, DType::F32) }.unwrap();
    let slices = vec![SliceDesc { name: "unrelated".into(), offset: 0, numel: 10 }];
    other.add_subgroup(SubGroupDesc::new(0, master, slices)).unwrap();
    other.save(&path).unwrap();
    let err = m.session.load(&path).unwrap_err();
    assert_eq!(err.status, Status::BadCheckpoint);
    assert!(err.message.contains("lacks slice"), "{}", err.message);
    assert!(m.state() == before);
    let err = m.session.load(std::path::Path::new("/nonexistent/ckpt")).unwrap_err();
    assert_eq!(err.status, Status::Io);
    drop(other);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn misuse_gets_a_status_and_changes_nothing() {
    let m = model(PARTITION_A, options(false), 4);
    let s = &m.session;
    let g = vec![bf16::ZERO; 64];
    let err = |r: superoffload::error::Result<Option<u64>>| r.unwrap_err().status;
    assert_eq!(err(s.grad_copy(2, Floats::Bf16(&g))), Status::InvalidState, "gradient before begin_step");
    assert_eq!(
        s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap_err().status,
        Status::InvalidState
    );
    s.begin_step(None, 1).unwrap();
    assert_eq!(s.begin_step(None, 1).unwrap_err().status, Status::InvalidState, "begin twice");
    assert_eq!(s.next_micro_step().unwrap_err().status, Status::InvalidState, "beyond the micro-steps");
    assert_eq!(err(s.grad_copy(99, Floats::Bf16(&g))), Status::NotFound);
    assert_eq!(err(s.grad_copy(2, Floats::Bf16(&g[..10]))), Status::InvalidArgument, "wrong size");
    assert_eq!(err(s.grad_copy(2, Floats::F32(&[0.0; 64]))), Status::InvalidArgument, "wrong dtype");
    assert_eq!(err(s.grad_written(2)), Status::InvalidArgument, "session-owned buffer written in place");
    assert_eq!(s.slice_id("nope").unwrap_err().status, Status::NotFound);
    let mut w = vec![0.0f32; 100];
    // SAFETY: `w` is never registered: every `add_subgroup` below with it is refused.
    let master = unsafe { Borrowed::new("w", w.as_mut_ptr().cast(), 100, DType::F32) }.unwrap();
    let desc = |slices: Vec<SliceDesc>| SubGroupDesc::new(0, master, slices);
    let sl = |name: &str, offset, numel| SliceDesc { name: name.into(), offset, numel };
    assert_eq!(s.add_subgroup(desc(vec![sl("x", 0, 10)])).unwrap_err().status, Status::InvalidState, "during backward");
    s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap();
    assert_eq!(
        s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap_err().status,
        Status::InvalidState,
        "step twice"
    );
    assert_eq!(s.add_subgroup(desc(vec![sl("x", 0, 60), sl("y", 50, 10)])).unwrap_err().status, Status::Aliasing);
    assert_eq!(s.add_subgroup(desc(vec![sl("x", 95, 10)])).unwrap_err().status, Status::InvalidArgument);
    assert_eq!(s.add_subgroup(desc(vec![sl("emb", 0, 10)])).unwrap_err().status, Status::InvalidArgument, "name taken");
    assert_eq!(
        s.add_subgroup(SubGroupDesc { group: 7, ..desc(vec![sl("x", 0, 1)]) }).unwrap_err().status,
        Status::NotFound
    );
    // SAFETY: `m.masters[0]` is alive (the model owns it) and this registration is refused.
    let taken = unsafe { Borrowed::new("m", m.masters[0].as_ptr().cast_mut().cast(), 10, DType::F32) }.unwrap();
    let overlapping = SubGroupDesc::new(0, taken, vec![sl("x", 0, 10)]);
    assert_eq!(
        s.add_subgroup(overlapping).unwrap_err().status,
        Status::Aliasing,
        "master shared with another sub-group"
    );
    assert_eq!(
        s.set_group_hparams(0, GroupHparams { beta1: 1.0, ..GroupHparams::default() }).unwrap_err().status,
        Status::InvalidArgument
    );

    let amsgrad = Session::new(SessionOptions { amsgrad: true, ..SessionOptions::default() }).err().unwrap();
    assert_eq!(amsgrad.status, Status::Unsupported);
    assert!(amsgrad.message.contains("AMSGrad"));
    let limited = Session::new(SessionOptions { host_memory_limit: Some(1000), ..SessionOptions::default() }).unwrap();
    limited.add_group(GroupHparams::default()).unwrap();
    let e = limited.add_subgroup(desc(vec![sl("x", 0, 100)])).unwrap_err();
    assert_eq!(e.status, Status::OutOfResources);
    assert!(e.message.contains("host-memory limit of 1000 bytes leaves 200 B"), "{}", e.message);
    assert_eq!(limited.host_bytes(), 0, "nothing stays allocated");
}

#[test]
fn sub_groups_that_cannot_speculate_step_at_step_time() {
    // bf16 master weights and beta1 = 0 both rule out rollback, hence speculation.
    let s = Session::new(SessionOptions { pool: Some(Arc::new(pool(Isa::best(), 1))), ..SessionOptions::default() })
        .unwrap();
    s.add_group(GroupHparams::default()).unwrap();
    s.add_group(GroupHparams { beta1: 0.0, ..GroupHparams::default() }).unwrap();
    let mut a = vec![bf16::from_f32(0.5); 300];
    let mut b = vec![0.25f32; 300];
    let mut c = vec![0.75f32; 300];
    let reg = |buf: *mut f32, dtype, group, name: &str| {
        // SAFETY: `a`, `b`, `c` hold 300 elements of their dtype and stay alive while the session
        // works on them: the step's result is awaited before the end of the test.
        let master = unsafe { Borrowed::new(name, buf.cast(), 300, dtype) }.unwrap();
        s.add_subgroup(SubGroupDesc::new(group, master, vec![SliceDesc { name: name.into(), offset: 0, numel: 300 }]))
            .unwrap()
    };
    reg(a.as_mut_ptr().cast(), DType::Bf16, 0, "a");
    reg(b.as_mut_ptr(), DType::F32, 1, "b");
    reg(c.as_mut_ptr(), DType::F32, 0, "c");
    s.begin_step(None, 1).unwrap();
    for name in ["a", "b"] {
        let ticket = s.grad_copy(s.slice_id(name).unwrap(), Floats::F32(&[0.1; 300])).unwrap();
        assert_eq!(ticket, None, "{name} cannot speculate: nothing is queued");
    }
    s.grad_copy(s.slice_id("c").unwrap(), Floats::F32(&[0.1; 300])).unwrap().expect("c speculates");
    let t = s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap();
    let r = s.step_result(t, None).unwrap();
    // c's speculative step is kept, whether its pass ran or was cancelled at step() and
    // folded into the final pass.
    assert_eq!((r.speculative, r.kept, r.stepped), (1, 1, 2), "{r:?}");
    assert!(a[0].to_f32() < 0.5 && b[0] < 0.25 && c[0] < 0.75);
}

#[test]
fn speculation_on_equals_off_without_clipping() {
    let mut on = model(PARTITION_A, options(false), 6);
    let mut off = model(PARTITION_A, SessionOptions { speculation: Speculation::Off, ..options(false) }, 6);
    for step in 1..=4 {
        on.step(11, step, 0.0);
        off.step(11, step, 0.0);
    }
    assert!(on.state() == off.state());
}

#[test]
fn tickets_report_progress_errors_and_timeouts() {
    let s = Session::new(SessionOptions { pool: Some(Arc::new(pool(Isa::Portable, 1))), ..SessionOptions::default() })
        .unwrap();
    s.add_group(GroupHparams::default()).unwrap();
    let n = 1 << 24;
    let mut big = vec![0.5f32; n];
    let mut small = vec![0.5f32; 16];
    for (name, buf) in [("big", &mut big), ("small", &mut small)] {
        let len = buf.len();
        // SAFETY: `big` and `small` stay alive while the session works on them: the last step's
        // result is awaited before the end of the test.
        let master = unsafe { Borrowed::new(name, buf.as_mut_ptr().cast(), len, DType::F32) }.unwrap();
        s.add_subgroup(SubGroupDesc::new(0, master, vec![SliceDesc { name: name.into(), offset: 0, numel: len }]))
            .unwrap();
    }
    s.begin_step(None, 1).unwrap();
    let g = vec![0.01f32; n];
    let t_big = s.grad_copy(0, Floats::F32(&g)).unwrap().unwrap();
    let mut poisoned = [0.01f32; 16];
    poisoned[3] = f32::INFINITY;
    let t_small = s.grad_copy(1, Floats::F32(&poisoned)).unwrap().unwrap();
    assert!(t_small > t_big, "tickets increase in submission order");
    assert_eq!(s.ticket_state(t_small).unwrap(), TicketState::Pending, "queued behind the big step");
    assert_eq!(s.wait(t_small, Some(Duration::from_millis(1))).unwrap_err().status, Status::Timeout);
    let e = s.wait(t_small, None).unwrap_err();
    assert_eq!(e.status, Status::NonFinite, "the error reaches the ticket: {e}");
    assert!(matches!(s.ticket_state(t_small).unwrap(), TicketState::Failed(_)));
    assert!(s.wait(t_big, None).is_ok());
    assert_eq!(s.wait_all(t_small, None).unwrap_err().status, Status::NonFinite);
    assert_eq!(s.ticket_state(t_small + 1000).unwrap_err().status, Status::NotFound);
    let t = s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap();
    let r = s.step_result(t, None).unwrap();
    assert!(r.skipped && r.rolled_back == 1, "{r:?}");
    assert_eq!(small, [0.5; 16], "the refused step changed nothing");
    assert!(big.iter().all(|&x| x == 0.5), "the big speculative step was rolled back exactly here");
    let finals: Vec<u64> = (0..2).map(|sg| s.final_ticket(sg).unwrap()).collect();
    assert!(finals[0] < finals[1] && finals[1] < t, "final tickets in forward order, before the step ticket");
    // A stream waiting on a final ticket waits for its sub-group's publication alone.
    assert_eq!((s.final_ticket_of(finals[0]), s.final_ticket_of(finals[1])), (Some(0), Some(1)));
    assert_eq!((s.final_ticket_of(t), s.final_ticket_of(t_big)), (None, None), "not final tickets");
    // The session stays usable.
    s.begin_step(None, 1).unwrap();
    s.grad_copy(0, Floats::F32(&g)).unwrap();
    s.grad_copy(1, Floats::F32(&[0.01; 16])).unwrap();
    let t = s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap();
    assert!(!s.step_result(t, None).unwrap().skipped);
    assert_eq!(s.step_count(0).unwrap(), 1);
    assert_eq!(s.final_ticket_of(finals[0]), None, "no longer the latest final ticket");
    assert_eq!(s.final_ticket_of(s.final_ticket(0).unwrap()), Some(0));
}

#[test]
fn in_place_gradients_equal_copied_ones() {
    let mk = |in_place: bool| {
        let s =
            Session::new(SessionOptions { pool: Some(Arc::new(pool(Isa::best(), 1))), ..SessionOptions::default() })
                .unwrap();
        s.add_group(GroupHparams::default()).unwrap();
        let master = Box::leak(vec![0.5f32; 1000].into_boxed_slice());
        let grad = Box::leak(vec![0.0f32; 1000].into_boxed_slice());
        // SAFETY: `master` and `grad` are leaked, so valid for the rest of the process; the test
        // writes `grad` only while the session does not read it (after a step's wait, before the
        // hand-off of the last micro-step).
        let m = unsafe { Borrowed::new("m", master.as_mut_ptr().cast(), 1000, DType::F32) }.unwrap();
        // SAFETY: as for `m`.
        let g = in_place.then(|| unsafe { Borrowed::new("g", grad.as_mut_ptr().cast(), 1000, DType::F32) }.unwrap());
        let slices = vec![
            SliceDesc { name: "a".into(), offset: 0, numel: 600 },
            SliceDesc { name: "b".into(), offset: 600, numel: 400 },
        ];
        s.add_subgroup(SubGroupDesc { grad: g, ..SubGroupDesc::new(0, m, slices) }).unwrap();
        (s, master, grad)
    };
    let (copied, m1, _) = mk(false);
    let (written, m2, grad) = mk(true);
    for step in 0..3 {
        let g: Vec<f32> = (0..1000).map(|i| ((i * 7 + step) % 13) as f32 * 1e-3).collect();
        copied.begin_step(None, 2).unwrap();
        written.begin_step(None, 2).unwrap();
        for micro in 0..2 {
            if micro == 1 {
                copied.next_micro_step().unwrap();
                written.next_micro_step().unwrap();
            }
            copied.grad_copy(0, Floats::F32(&g[..600])).unwrap();
            copied.grad_copy(1, Floats::F32(&g[600..])).unwrap();
            // In place, the caller accumulates (as torch does into .grad).
            for i in 0..1000 {
                grad[i] = if micro == 0 { g[i] } else { grad[i] + g[i] };
            }
            written.grad_written(0).unwrap();
            written.grad_written(1).unwrap();
        }
        for s in [&copied, &written] {
            let t = s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap();
            s.wait(t, None).unwrap();
        }
        assert!(m1.iter().zip(m2.iter()).all(|(a, b)| a.to_bits() == b.to_bits()), "step {step}");
    }
}

#[test]
fn destroying_a_session_with_work_in_flight_completes_it() {
    let mut master = vec![0.5f32; 1 << 22];
    {
        let s =
            Session::new(SessionOptions { pool: Some(Arc::new(pool(Isa::best(), 2))), ..SessionOptions::default() })
                .unwrap();
        s.add_group(GroupHparams::default()).unwrap();
        let len = master.len();
        // SAFETY: `master` outlives the session, which is dropped at the end of this block.
        let m = unsafe { Borrowed::new("m", master.as_mut_ptr().cast(), len, DType::F32) }.unwrap();
        s.add_subgroup(SubGroupDesc::new(0, m, vec![SliceDesc { name: "w".into(), offset: 0, numel: len }])).unwrap();
        s.begin_step(None, 1).unwrap();
        s.grad_copy(0, Floats::F32(&vec![0.01; len])).unwrap();
        s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap();
        // Dropped here with the speculative step and the finalization possibly queued.
    }
    assert!(master.iter().all(|&x| x < 0.5), "the queued step completed before the session went away");
}

#[test]
fn the_timeline_records_hand_offs_steps_and_finalization() {
    let mut m = model(PARTITION_A, SessionOptions { speculation: Speculation::On, ..options(false) }, 9);
    m.session.trace(true);
    m.step_with(1, 1, 0.01, true);
    m.step_with(1, 2, 0.0, true);
    let path = temp_path("trace").with_extension("json");
    m.session.save_trace(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(text.starts_with("{\"displayTimeUnit\""), "{}", &text[..80.min(text.len())]);
    for expected in [
        "gradient emb",
        "speculative step, sub-group",
        "decide step 1",
        "\"outcome\":\"rescaled\"",
        "\"outcome\":\"kept\"",
        "wait for ticket",
    ] {
        assert!(text.contains(expected), "the trace lacks {expected:?}");
    }
    // Every event line is one JSON object; the whole is balanced.
    assert_eq!(text.matches('{').count(), text.matches('}').count());
    m.session.trace(false);
}
