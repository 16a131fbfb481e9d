//! The modes: one session each, with or without speculation and clipping, driven by the
//! simulated training loop.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use superoffload::kernels::{DType, Floats, FloatsMut, Pool, bf16};
use superoffload::session::{
    Borrowed, GroupHparams, NormSource, Session, SessionOptions, SliceDesc, Speculation, StepArgs, SubGroupDesc,
    Ticket, Transport,
};

use crate::Args;
use crate::workload::{gauss, spin, state_buffer, thread_cpu};

/// A mode's settings: speculation on, off or automatic, with or without clipping.
#[derive(Clone, Copy, PartialEq)]
pub enum Kind {
    Spec,
    SpecClip,
    NoSpec,
    NoSpecClip,
    Auto,
    AutoClip,
}

impl Kind {
    pub const ALL: [Kind; 6] = [Kind::Spec, Kind::SpecClip, Kind::NoSpec, Kind::NoSpecClip, Kind::Auto, Kind::AutoClip];
    pub fn name(self) -> &'static str {
        match self {
            Kind::Spec => "spec",
            Kind::SpecClip => "spec+clip",
            Kind::NoSpec => "nospec",
            Kind::NoSpecClip => "nospec+clip",
            Kind::Auto => "auto",
            Kind::AutoClip => "auto+clip",
        }
    }
    fn speculation(self) -> Speculation {
        match self {
            Kind::Spec | Kind::SpecClip => Speculation::On,
            Kind::NoSpec | Kind::NoSpecClip => Speculation::Off,
            Kind::Auto | Kind::AutoClip => Speculation::Auto,
        }
    }
    fn clip(self) -> bool {
        matches!(self, Kind::SpecClip | Kind::NoSpecClip | Kind::AutoClip)
    }
    /// Which of the CPU Adam measurements (spec, spec+rescale, nospec, nospec) is this mode's
    /// work: automatic speculation speculates without clipping and stops with clipping on
    /// every step.
    pub fn cpu_index(self) -> usize {
        match self {
            Kind::Spec | Kind::Auto => 0,
            Kind::SpecClip => 1,
            Kind::NoSpec => 2,
            Kind::NoSpecClip | Kind::AutoClip => 3,
        }
    }
}

/// One mode: its session, its master weights, what it measured.
pub struct Mode {
    pub kind: Kind,
    session: Session,
    _masters: Vec<Vec<f32>>,
    slices: Vec<u32>,
    finals: Vec<Ticket>,
    /// The step ticket whose result is still to be read.
    pending: Option<Ticket>,
    pub step_ms: Vec<f64>,
    pub wait_ms: Vec<f64>,
    pub busy_ms: Vec<f64>,
    pub fwd_ms: Vec<f64>,
    pub bwd_ms: Vec<f64>,
    pub handoff_ms: Vec<f64>,
    pub preempt_ms: Vec<f64>,
    /// Totals of the step results (every step, measured or not).
    pub kept: u64,
    pub rescaled: u64,
    pub stepped: u64,
    pub other: u64,
    pub steps: u64,
    pub clipped: u64,
}

/// A transport with nowhere to send the weights: with it a session keeps a bf16 copy of them
/// and may publish the copy before writing the master weights and moments, as a CUDA
/// session does.
struct Publisher;

impl Transport for Publisher {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn pin(&self, _: *mut u8, _: usize) -> superoffload::error::Result<()> {
        Ok(())
    }
    fn unpin(&self, _: *mut u8) {}
    fn gradient_ready(&self, _: u32) -> superoffload::error::Result<()> {
        Ok(())
    }
    fn master_write(&self, _: u32) -> superoffload::error::Result<()> {
        Ok(())
    }
    fn publish_piece(&self, _: u32, _: usize, _: Floats<'_>) -> superoffload::error::Result<()> {
        Ok(())
    }
    fn publish_filled(
        &self,
        _: u32,
        _: usize,
        len: usize,
        _: DType,
        fill: &mut dyn FnMut(FloatsMut<'_>) -> superoffload::error::Result<()>,
    ) -> superoffload::error::Result<()> {
        fill(FloatsMut::Bf16(&mut vec![bf16::ZERO; len]))
    }
    fn publish(&self, _: u32) -> superoffload::error::Result<()> {
        Ok(())
    }
}

impl Mode {
    pub fn new(kind: Kind, pool: &Arc<Pool>, a: &Args) -> Result<Mode, String> {
        let (layers, elems) = (a.layers, a.elems);
        let options = SessionOptions {
            pool: Some(pool.clone()),
            speculation: kind.speculation(),
            copy_dtype: a.publish.then_some(DType::Bf16),
            moment_dtype: if a.bf16_moments { DType::Bf16 } else { DType::F32 },
            ..SessionOptions::default()
        };
        let transport = a.publish.then(|| Arc::new(Publisher) as Arc<dyn Transport>);
        let session = Session::with_transport(options, transport).map_err(|e| format!("session: {e}"))?;
        let group = session
            .add_group(GroupHparams { lr: 1e-4, ..GroupHparams::default() })
            .map_err(|e| format!("add_group: {e}"))?;
        let mut masters: Vec<Vec<f32>> =
            (0..layers).map(|k| state_buffer(elems, |i| 0.02 * gauss(100 + k as u64, i))).collect();
        let mut slices = Vec::new();
        for (k, master) in masters.iter_mut().enumerate() {
            // SAFETY: the masters live in this struct next to the session, which is dropped
            // first (field order), and nothing else touches them.
            let borrowed = unsafe { Borrowed::new("master", master.as_mut_ptr().cast(), elems, DType::F32) }
                .map_err(|e| e.to_string())?;
            let name = format!("layer{k}");
            session
                .add_subgroup(SubGroupDesc::new(
                    group,
                    borrowed,
                    vec![SliceDesc { name: name.clone(), offset: 0, numel: elems }],
                ))
                .map_err(|e| format!("add_subgroup: {e}"))?;
            slices.push(session.slice_id(&name).map_err(|e| e.to_string())?);
        }
        Ok(Mode {
            kind,
            session,
            _masters: masters,
            slices,
            finals: vec![0; layers],
            pending: None,
            step_ms: Vec::new(),
            wait_ms: Vec::new(),
            busy_ms: Vec::new(),
            fwd_ms: Vec::new(),
            bwd_ms: Vec::new(),
            handoff_ms: Vec::new(),
            preempt_ms: Vec::new(),
            kept: 0,
            rescaled: 0,
            stepped: 0,
            other: 0,
            steps: 0,
            clipped: 0,
        })
    }

    fn read_result(&mut self) -> Result<(), String> {
        if let Some(ticket) = self.pending.take() {
            let r = self.session.step_result(ticket, None).map_err(|e| format!("step_result: {e}"))?;
            self.kept += r.kept as u64;
            self.rescaled += r.rescaled as u64;
            self.stepped += r.stepped as u64;
            self.other += (r.rolled_back + r.redone) as u64 + u64::from(r.skipped);
            self.clipped += u64::from(r.clip_coef < 1.0);
            self.steps += 1;
        }
        Ok(())
    }

    /// One loop iteration: forward (waiting for each layer's final ticket), backward with
    /// hand-offs, step(). Returns (step, wait, busy, forward, backward, hand-offs, preempted)
    /// in ms, where preempted is the time the thread was off its CPU outside the waits
    /// (wall time minus thread CPU time): other processes or threads ran on its core.
    fn iterate(&mut self, a: &Args, grads: &[Vec<f32>], max_norm: f64) -> Result<[f64; 7], String> {
        let (t0, c0) = (Instant::now(), thread_cpu());
        let mut wait = Duration::ZERO;
        let mut wait_cpu = Duration::ZERO;
        for k in 0..a.layers {
            let (tw, cw) = (Instant::now(), thread_cpu());
            self.session.wait(self.finals[k], None).map_err(|e| format!("wait: {e}"))?;
            wait += tw.elapsed();
            wait_cpu += thread_cpu().saturating_sub(cw);
            spin(a.fwd);
        }
        let (forward, forward_wait) = (t0.elapsed(), wait);
        let tb = Instant::now();
        self.session.begin_step(Some(1.0), 1).map_err(|e| format!("begin_step: {e}"))?;
        let mut handoff = Duration::ZERO;
        for k in (0..a.layers).rev() {
            spin(a.bwd);
            let th = Instant::now();
            self.session.grad_copy(self.slices[k], Floats::F32(&grads[k])).map_err(|e| format!("grad_copy: {e}"))?;
            handoff += th.elapsed();
        }
        let backward = tb.elapsed();
        // The step ticket completes after the step's state passes (with --publish): by the
        // end of the backward, whose hand-offs waited for them, it normally has.
        let (tw, cw) = (Instant::now(), thread_cpu());
        self.read_result()?;
        wait += tw.elapsed();
        wait_cpu += thread_cpu().saturating_sub(cw);
        let args = StepArgs {
            max_norm: if self.kind.clip() { max_norm } else { 0.0 },
            norm: NormSource::Local,
            overflow: false,
        };
        self.pending = Some(self.session.step(args).map_err(|e| format!("step: {e}"))?);
        for k in 0..a.layers {
            self.finals[k] = self.session.final_ticket(k as u32).map_err(|e| e.to_string())?;
        }
        let step = t0.elapsed();
        let busy_cpu = thread_cpu().saturating_sub(c0).saturating_sub(wait_cpu);
        let preempted = (step - wait).saturating_sub(busy_cpu);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        Ok([ms(step), ms(wait), ms(step - wait), ms(forward - forward_wait), ms(backward), ms(handoff), ms(preempted)])
    }

    /// One block of consecutive steps of this mode: the first `--refill` are not measured;
    /// then the last step finishes before the next mode starts.
    pub fn run_block(&mut self, a: &Args, grads: &[Vec<f32>], max_norm: f64) -> Result<(), String> {
        for i in 0..a.block {
            let r = self.iterate(a, grads, max_norm)?;
            if i >= a.refill && self.step_ms.len() < a.steps {
                self.step_ms.push(r[0]);
                self.wait_ms.push(r[1]);
                self.busy_ms.push(r[2]);
                self.fwd_ms.push(r[3]);
                self.bwd_ms.push(r[4]);
                self.handoff_ms.push(r[5]);
                self.preempt_ms.push(r[6]);
            }
        }
        // Let this mode's last step finish before the next mode starts.
        let last = self.pending.unwrap_or(0);
        self.session.wait_all(last, None).map_err(|e| e.to_string())?;
        self.read_result()
    }
}
