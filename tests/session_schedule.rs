//! The CPU-Adam thread's schedule: priority by forward order, out-of-order tickets,
//! cancellation of speculative steps that had not started, preemption of one that had, and
//! the passes left after backward. A transport whose `gradient_ready` blocks until the test
//! opens a gate makes the interleaving deterministic: the first sub-group to complete holds
//! the CPU-Adam thread while the others queue behind it.

mod common;

use std::sync::{Arc, Condvar, Mutex};

use common::*;
use superoffload::error::Result;
use superoffload::kernels::{self, DType, Floats, Isa};
use superoffload::session::{
    Borrowed, GroupHparams, HandedSumsq, NormSource, Session, SessionOptions, SliceDesc, Speculation, StepArgs,
    StepResult, SubGroupDesc, Ticket, Transport,
};

/// Holds the CPU-Adam thread in `gradient_ready` until opened; logs ticket completions.
#[derive(Default)]
struct Gate {
    /// (the sub-group whose pass reached the gate first, the gate is open)
    state: Mutex<(Option<u32>, bool)>,
    changed: Condvar,
    done: Mutex<Vec<(u32, Ticket)>>,
}

impl Gate {
    fn open(&self) {
        self.state.lock().unwrap().1 = true;
        self.changed.notify_all();
    }

    /// Returns once the CPU-Adam thread is held at the gate: the sub-group it is stepping.
    fn wait_for_arrival(&self) -> usize {
        let mut state = self.state.lock().unwrap();
        loop {
            if let Some(sg) = state.0 {
                return sg as usize;
            }
            state = self.changed.wait(state).unwrap();
        }
    }
}

impl Transport for Gate {
    transport_without_pinning!();
    fn gradient_ready(&self, sg: u32) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        state.0.get_or_insert(sg);
        self.changed.notify_all();
        while !state.1 {
            state = self.changed.wait(state).unwrap();
        }
        Ok(())
    }
    transport_without_publishing!();
    fn ticket_done(&self, lane: u32, ticket: Ticket) {
        self.done.lock().unwrap().push((lane, ticket));
    }
}

struct Model {
    session: Session,
    masters: Vec<Vec<f32>>,
}

fn model(sizes: &[usize], speculation: Speculation, transport: Option<Arc<Gate>>) -> Model {
    let opts = SessionOptions { pool: Some(Arc::new(pool(Isa::best(), 2))), speculation, ..SessionOptions::default() };
    let session = Session::with_transport(opts, transport.map(|t| t as Arc<dyn Transport>)).unwrap();
    session.add_group(GroupHparams { weight_decay: 0.05, ..GroupHparams::default() }).unwrap();
    let mut masters: Vec<Vec<f32>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| (0..n).map(|i| ((i * 31 + k) % 97) as f32 * 1e-3 - 0.05).collect())
        .collect();
    for (k, m) in masters.iter_mut().enumerate() {
        // SAFETY: the masters live next to the session in Model and are never reallocated.
        let master = unsafe { Borrowed::new("m", m.as_mut_ptr().cast(), m.len(), DType::F32) }.unwrap();
        session
            .add_subgroup(SubGroupDesc::new(
                0,
                master,
                vec![SliceDesc { name: format!("l{k}"), offset: 0, numel: m.len() }],
            ))
            .unwrap();
    }
    Model { session, masters }
}

fn gradient(n: usize, k: usize, step: u64) -> Vec<f32> {
    (0..n).map(|i| ((i as u64 * 7 + k as u64 * 3 + step * 11) % 29) as f32 * 1e-3 - 0.014).collect()
}

impl Model {
    /// Hands the gradients over in reverse forward order (as backward produces them); the
    /// speculative tickets returned, by sub-group.
    fn backward(&self, step: u64) -> Vec<Option<Ticket>> {
        let s = &self.session;
        s.begin_step(Some(1.0), 1).unwrap();
        let mut tickets = vec![None; self.masters.len()];
        for k in (0..self.masters.len()).rev() {
            let g = gradient(self.masters[k].len(), k, step);
            tickets[k] = s
                .hand_off(k as u32, g.len(), "test", |h| {
                    Ok(kernels::copy_into(
                        h.dst.expect("a host gradient buffer"),
                        Floats::F32(&g),
                        h.accumulate,
                        h.sumsq_scale,
                    )?
                    .map(HandedSumsq::Known))
                })
                .unwrap();
        }
        tickets
    }

    fn step(&self, max_norm: f64) -> (Ticket, Vec<Ticket>) {
        let t = self.session.step(StepArgs { max_norm, norm: NormSource::Local, overflow: false }).unwrap();
        let finals = (0..self.masters.len()).map(|k| self.session.final_ticket(k as u32).unwrap()).collect();
        (t, finals)
    }

    fn result(&self, t: Ticket) -> StepResult {
        self.session.step_result(t, None).unwrap()
    }

    fn bits(&self, k: usize) -> Vec<u32> {
        self.masters[k].iter().map(|x| x.to_bits()).collect()
    }
}

const SIZES: [usize; 4] = [3000, 2000, 5000, 4000];

#[test]
fn the_first_sub_group_is_final_first_and_unstarted_speculation_is_cancelled() {
    for max_norm in [0.0, 1e-3] {
        let gate = Arc::new(Gate::default());
        let m = model(&SIZES, Speculation::On, Some(gate.clone()));
        let off = model(&SIZES, Speculation::Off, None);
        let spec = m.backward(1);
        assert!(spec.iter().all(Option::is_some), "every sub-group queued a speculative step");
        // One speculative step holds the thread (the first queued; or, if the thread took
        // its first job late, the first in forward order); the others are queued behind it.
        let held = gate.wait_for_arrival();
        let (t, finals) = m.step(max_norm);
        gate.open();
        let r = m.result(t);
        assert_eq!((r.speculative, r.cancelled), (4, 3), "{r:?}");
        // A cancelled speculative step is resolved as one that ran: the final pass takes it
        // and its resolution in one pass.
        if max_norm > 0.0 {
            assert_eq!((r.rescaled, r.stepped), (4, 0), "{r:?}");
        } else {
            assert_eq!((r.kept, r.stepped), (4, 0), "{r:?}");
        }
        off.backward(1);
        let (to, _) = off.step(max_norm);
        let ro = off.result(to);
        assert_eq!(r.global_norm.to_bits(), ro.global_norm.to_bits(), "the norm does not depend on the schedule");
        // Kept, the speculative steps are the after-backward steps bit for bit; rescaled,
        // those of a session whose speculative passes all ran before step().
        let whole = model(&SIZES, Speculation::On, None);
        for t in whole.backward(1).into_iter().flatten() {
            whole.session.wait(t, None).unwrap();
        }
        let (tw, _) = whole.step(max_norm);
        whole.result(tw);
        for k in 0..4 {
            let reference = if max_norm == 0.0 { &off } else { &whole };
            assert!(m.bits(k) == reference.bits(k), "max_norm {max_norm}: sub-group {k} (held: {held})");
        }
        // Final tickets complete in forward order (lanes 1..=4), sub-group 0 first, and each
        // cancelled speculative ticket completes with its sub-group's final pass.
        let done = gate.done.lock().unwrap().clone();
        let final_order: Vec<u32> = done.iter().filter(|(_, t)| finals.contains(t)).map(|&(lane, _)| lane).collect();
        assert_eq!(final_order, vec![1, 2, 3, 4]);
        for k in 0..4 {
            let pos = |t: Ticket| done.iter().position(|&(_, d)| d == t).unwrap();
            assert!(pos(spec[k].unwrap()) < pos(finals[k]), "sub-group {k}: speculative before final");
        }
        // Not more work after backward than the after-backward mode.
        assert!(r.final_pass_elements <= ro.final_pass_elements, "{r:?} vs {ro:?}");
    }
}

#[test]
fn a_preempted_speculative_step_is_completed_by_the_final_pass() {
    // Three chunks: step() arrives while the first runs; the pass stops after it.
    let n = 3 * (1 << 22);
    // The norm is about 28: 10 clips to about a third.
    for max_norm in [0.0, 10.0] {
        let gate = Arc::new(Gate::default());
        let m = model(&[n], Speculation::On, Some(gate.clone()));
        let off = model(&[n], Speculation::Off, None);
        m.backward(1);
        let held = gate.wait_for_arrival();
        let (t, _) = m.step(max_norm);
        gate.open();
        let r = m.result(t);
        off.backward(1);
        let (to, _) = off.step(max_norm);
        let ro = off.result(to);
        assert_eq!((held, r.cancelled), (0, 0), "{r:?}");
        // The same step with the speculative pass run to its end before step().
        let whole = model(&[n], Speculation::On, None);
        for t in whole.backward(1).into_iter().flatten() {
            whole.session.wait(t, None).unwrap();
        }
        let (tw, _) = whole.step(max_norm);
        whole.result(tw);
        assert!(m.bits(0) == whole.bits(0), "max_norm {max_norm}: preempted and completed passes write the same bits");
        if max_norm == 0.0 {
            assert_eq!(r.kept, 1, "{r:?}");
            assert!(m.bits(0) == off.bits(0), "kept part + completed part = the after-backward step");
        } else {
            assert_eq!(r.rescaled, 1, "{r:?}");
            let (a, b) = (&m.masters[0], &off.masters[0]);
            let worst = a.iter().zip(b).map(|(x, y)| ((x - y) / y.abs().max(1e-3)).abs()).fold(0.0f32, f32::max);
            assert!(worst < 1e-5, "rescaled within rounding of the direct step: {worst}");
        }
        // The preempted pass did one chunk: what is left after backward is the rest plus,
        // when clipped, the rescale of that chunk — never more than after-backward mode.
        assert!(r.final_pass_elements <= ro.final_pass_elements, "{r:?} vs {ro:?}");
    }
}

#[test]
fn automatic_speculation_stops_when_clipping_keeps_changing_the_factor() {
    let m = model(&SIZES, Speculation::Auto, None);
    let mut speculated = Vec::new();
    for step in 1..=12 {
        let tickets = m.backward(step);
        for t in tickets.iter().flatten() {
            m.session.wait(*t, None).unwrap();
        }
        let (t, _) = m.step(1e-3);
        let r = m.result(t);
        speculated.push(r.speculative);
    }
    assert!(speculated[0] > 0, "a new session speculates: {speculated:?}");
    assert!(speculated[8..].iter().all(|&s| s == 0), "clipped every step: {speculated:?}");
}

/// With an inf or NaN in a gradient, every ticket reports the same status whether the
/// speculative pass ran before `step()` or was cancelled by the decision: the step's tickets,
/// like its bits, depend on the inputs alone.
#[test]
fn a_non_finite_gradient_fails_the_same_tickets_whether_its_speculation_ran_or_was_cancelled() {
    let mut statuses = Vec::new();
    for cancelled in [false, true] {
        let gate = Arc::new(Gate::default());
        let m = model(&SIZES, Speculation::On, Some(gate.clone()));
        let s = &m.session;
        s.begin_step(Some(1.0), 1).unwrap();
        let mut tickets = vec![None; SIZES.len()];
        for k in (0..SIZES.len()).rev() {
            let mut g = gradient(SIZES[k], k, 1);
            if k == 0 {
                g[7] = f32::NAN;
            }
            if !cancelled && k == 0 {
                // The others' passes first, then sub-group 0's, before step().
                gate.open();
            }
            tickets[k] = s.grad_copy(k as u32, Floats::F32(&g)).unwrap();
        }
        let spec0 = tickets[0].expect("sub-group 0 speculates");
        if !cancelled {
            for t in tickets.iter().flatten() {
                let _ = s.wait(*t, None);
            }
        } else {
            // The thread is held at the gate by the first sub-group to complete: the decision
            // comes before sub-group 0's queued pass, which it cancels.
            gate.wait_for_arrival();
        }
        let (t, _) = m.step(0.0);
        gate.open();
        let result = m.result(t);
        assert_eq!(result.cancelled > 0, cancelled, "{result:?}");
        assert!(result.skipped);
        let status = |outcome: Result<()>| outcome.err().map(|e| (e.status, e.message));
        statuses.push((status(s.wait(spec0, None)), status(s.wait_all(t, None))));
    }
    assert_eq!(statuses[0], statuses[1], "ran, then cancelled");
    let (spec, all) = &statuses[0];
    assert_eq!(spec.as_ref().map(|s| s.0), Some(superoffload::error::Status::NonFinite), "{spec:?}");
    assert_eq!(all, spec, "wait_all reports the first failure");
}
