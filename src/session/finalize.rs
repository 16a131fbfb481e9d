//! A step from its decision on: the decision (norm, skip, clip factor), each sub-group's final
//! pass — what it must do, decided from what the step applied and the step's verdict alone
//! (the table in ARCHITECTURE.md), and the pass that does it — and the state passes left for
//! later. The CPU-Adam thread (`worker.rs`) runs them and completes the step.

use std::ops::Range;
use std::sync::Arc;

use super::factors::{clip_coefficient, grad_factor, unscale_factor, usable_factor};
use super::plans::StepPlan;
use super::publish::{CopyTo, Pass, each_piece, write_and_publish, writes_copy};
use super::shared::Shared;
use super::state_after::take_from_prefix;
use super::subgroup::{Applied, SgData, SpecKind, SpecRecord, SubGroup, speculation_stands};
use super::subgroup_ops::{gradient_ready, master_write, restore_copy, subgroup_sumsq};
use super::transport::DevicePass;
use super::types::{GroupHparams, NormSource, Placement, SkipReason, StepResult};
use crate::error::Result;
use crate::kernels::{self, AdamBuffers, AdamHyper, DType, Resolution, UpdateOptions};

/// The step's verdict, as one sub-group sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Verdict {
    Skip,
    /// Stepped with `factor` and the hyperparameters `hp` (the group's as of `step()`).
    Step {
        factor: f32,
        hp: AdamHyper,
    },
}

/// What a final pass does to a sub-group's buffers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Action {
    /// Nothing to write.
    Leave,
    /// One update with the step's factor and hyperparameters.
    Update { factor: f32, hp: AdamHyper },
    /// The speculative step, made final: resolved where its update is applied, applied and
    /// resolved in one pass elsewhere.
    Resolve { spec: SpecRecord, resolution: Resolution },
    /// The copy that stepped ahead stands: the rest of the copy, then the master weights and
    /// moments of the same step.
    KeepCopy { spec: SpecRecord },
    /// The copy that stepped ahead is not the step's: it is written from the master weights
    /// again (the step is skipped).
    RestoreCopy { done: usize },
}

/// What a final pass did: drives the step result's counters and the trace label.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Outcome {
    #[default]
    Unchanged,
    Stepped,
    /// Stepped: the weights' copy written and published first, the master weights and
    /// moments by a pass of their own after it.
    SteppedStateAfter,
    Kept,
    Rescaled,
    Redone,
    RolledBack,
    SteppedOnDevice,
}

impl Outcome {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Outcome::Unchanged => "unchanged",
            Outcome::Stepped => "stepped",
            Outcome::SteppedStateAfter => "stepped, state after",
            Outcome::Kept => "kept",
            Outcome::Rescaled => "rescaled",
            Outcome::Redone => "redone",
            Outcome::RolledBack => "rolled back",
            Outcome::SteppedOnDevice => "stepped on the device",
        }
    }

    pub(crate) fn count(self, result: &mut StepResult) {
        let counter = match self {
            Outcome::Unchanged => return,
            Outcome::Stepped | Outcome::SteppedStateAfter => &mut result.stepped,
            Outcome::Kept => &mut result.kept,
            Outcome::Rescaled => &mut result.rescaled,
            Outcome::Redone => &mut result.redone,
            Outcome::RolledBack => &mut result.rolled_back,
            Outcome::SteppedOnDevice => &mut result.device_stepped,
        };
        *counter += 1;
    }
}

fn same_hyperparameters(a: &AdamHyper, b: &AdamHyper) -> bool {
    a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps && a.weight_decay == b.weight_decay
}

/// The final pass of a sub-group: a function of what the step applied, its verdict and
/// whether its gradient lets a speculative step stand ([`speculation_stands`]), never of
/// how far a speculative pass got.
pub(crate) fn decide(applied: Applied, verdict: Verdict, stands: bool) -> (Action, Outcome) {
    let applied = match applied {
        Applied::Speculative(spec) if !stands => {
            debug_assert_eq!(spec.done, 0, "a speculative pass never writes such a gradient");
            Applied::Nothing
        }
        other => other,
    };
    match (applied, verdict) {
        (Applied::Speculative(spec), verdict) if spec.kind == SpecKind::CopyAhead => match verdict {
            Verdict::Skip => (Action::RestoreCopy { done: spec.done }, Outcome::RolledBack),
            Verdict::Step { factor, hp } => {
                if !same_hyperparameters(&spec.hp, &hp) {
                    (Action::Update { factor, hp }, Outcome::Redone)
                } else if spec.scale != factor {
                    (Action::Update { factor, hp }, Outcome::Rescaled)
                } else {
                    (Action::KeepCopy { spec }, Outcome::Kept)
                }
            }
        },
        (Applied::Nothing, Verdict::Skip) => (Action::Leave, Outcome::Unchanged),
        (Applied::Nothing, Verdict::Step { factor, hp }) => (Action::Update { factor, hp }, Outcome::Stepped),
        (Applied::Undone, Verdict::Skip) => (Action::Leave, Outcome::RolledBack),
        (Applied::Undone, Verdict::Step { factor, hp }) => (Action::Update { factor, hp }, Outcome::Redone),
        (Applied::Speculative(spec), Verdict::Skip) => {
            (Action::Resolve { spec, resolution: Resolution::Rollback }, Outcome::RolledBack)
        }
        (Applied::Speculative(spec), Verdict::Step { factor, hp }) => {
            let (resolution, outcome) = if !same_hyperparameters(&spec.hp, &hp) {
                (Resolution::Redo { hp, scale: factor }, Outcome::Redone)
            } else if spec.scale != factor {
                (Resolution::Rescale(factor), Outcome::Rescaled)
            } else {
                (Resolution::Keep, Outcome::Kept)
            };
            (Action::Resolve { spec, resolution }, outcome)
        }
    }
}

/// The passes of an action over a device-placed sub-group: the same operations, one pass
/// each, as on the host. Its speculative update was queued whole at hand-off or not at all.
fn device_passes(action: Action) -> Vec<DevicePass> {
    match action {
        Action::Leave | Action::RestoreCopy { .. } => Vec::new(),
        Action::Update { factor, hp } => vec![DevicePass::Update { hp, scale: factor }],
        Action::KeepCopy { spec } => vec![DevicePass::Update { hp: spec.hp, scale: spec.scale }],
        Action::Resolve { spec, resolution } => {
            let (hp, scale) = (spec.hp, spec.scale);
            let mut passes = if spec.done == 0 { vec![DevicePass::Update { hp, scale }] } else { Vec::new() };
            match resolution {
                Resolution::Keep => {}
                Resolution::Rescale(factor) => {
                    passes.push(DevicePass::Rescale { hp, old_scale: scale, new_scale: factor })
                }
                Resolution::Rollback => passes.push(DevicePass::Rollback { hp, scale }),
                Resolution::Redo { hp: redo, scale: factor } => {
                    passes.push(DevicePass::Rollback { hp, scale });
                    passes.push(DevicePass::Update { hp: redo, scale: factor });
                }
            }
            passes
        }
    }
}

/// Elements `[0, done)` carry the speculative update; the rest are `[done, n)`.
fn resolve_elements(spec: &SpecRecord, resolution: Resolution, numel: usize) -> u64 {
    let resolved = if resolution == Resolution::Keep { 0 } else { spec.done };
    (resolved + (numel - spec.done)) as u64
}

/// What one final pass did, and the state pass it left for later.
#[derive(Default)]
pub(crate) struct FinalPass {
    pub outcome: Outcome,
    pub elements: u64,
    pub state_after: Option<(AdamHyper, f32)>,
}

/// The step's copy-ahead speculative passes ([`SpecKind::CopyAhead`]): how many were planned,
/// and how many had begun by the decision (the CPU-Adam thread, which decides, runs no pass
/// meanwhile; one not begun is cancelled).
fn copy_ahead_progress(plan: &StepPlan) -> (usize, usize) {
    plan.subgroups.iter().fold((0, 0), |(planned, begun), (sg, _)| match sg.data.lock().unwrap().work.applied {
        Applied::Speculative(spec) if spec.kind == SpecKind::CopyAhead => {
            (planned + 1, begun + usize::from(spec.done > 0))
        }
        _ => (planned, begun),
    })
}

/// The step's verdict from the local sum of squares `local` (NaN where it could not be read):
/// the norm, whether the step is skipped and with what factor, the loss scaler and the policy
/// told of it, and the step's queued speculative steps cancelled. Returns the step's result so
/// far and how many elements of its final passes may leave their state for after publication
/// (`None`: all).
pub(crate) fn decide_step(
    shared: &Shared,
    plan: &StepPlan,
    local: f64,
    prepare_elements: u64,
) -> (StepResult, Option<usize>) {
    let args = plan.args;
    let mut result = StepResult {
        serial: plan.serial,
        loss_scale: plan.loss_scale,
        speculative: plan.speculative,
        late_gradients: plan.late_gradients,
        forward_wait_s: plan.forward_wait_s,
        final_pass_elements: prepare_elements,
        ..StepResult::default()
    };
    result.global_norm = match args.norm {
        NormSource::Local => local.sqrt(),
        NormSource::Given(norm) => norm,
    };
    let clip = clip_coefficient(args.max_norm, result.global_norm);
    result.skip_reason = if args.overflow {
        SkipReason::Overflow
    } else if !local.is_finite() {
        SkipReason::NonFiniteGradient
    } else if !result.global_norm.is_finite() {
        SkipReason::NonFiniteNorm
    } else if !usable_factor(grad_factor(clip, plan.loss_scale)) {
        SkipReason::UnusableFactor
    } else {
        SkipReason::None
    };
    result.skipped = result.skip_reason != SkipReason::None;
    result.clip_coef = if result.skipped { 1.0 } else { clip };
    result.grad_factor = grad_factor(result.clip_coef, plan.loss_scale);
    if let Some(scaler) = shared.scaler.lock().unwrap().as_mut() {
        scaler.update(result.skipped);
        result.next_loss_scale = scaler.scale;
    } else {
        result.next_loss_scale = plan.loss_scale;
    }
    let unchanged = !result.skipped && result.grad_factor == unscale_factor(plan.loss_scale);
    let (copies_planned, copies_begun) = copy_ahead_progress(plan);
    let state_after = {
        let mut policy = shared.policy.lock().unwrap();
        policy.decided(unchanged);
        policy.copy_ahead_decided(copies_planned, copies_begun);
        policy.state_after_limit(plan.speculative > 0)
    };
    let subgroups: Vec<Arc<SubGroup>> = plan.subgroups.iter().map(|(sg, _)| sg.clone()).collect();
    result.cancelled = shared.sched.finalize_all(plan.serial, &subgroups);
    (result, state_after)
}

/// The master weights and moments of a sub-group whose final pass wrote only the weights'
/// copy: the second half of that step (`kernels::update_state`), from the buffers that
/// pass read and left as they were.
pub(crate) fn state_pass(shared: &Shared, sg: &SubGroup, hp: &AdamHyper, scale: f32) -> Result<()> {
    let mut data = sg.data.lock().unwrap();
    let pool = &shared.pool;
    each_piece(shared, sg, &mut data, 0..sg.numel, CopyTo::Nowhere, &mut |_, b| {
        kernels::update_state(pool, hp, b, scale)
    })
}

/// Whether a step's master weights and moments can be written after its copy is final:
/// there is a device to publish to and a copy to publish, and the gradient buffer is the
/// session's (a caller-provided one may be rewritten once the weights are final); or, in a
/// host session, the copy is the caller's (what the caller reads its weights from), whose
/// gradient buffer is read until the step's ticket (`so_subgroup_desc.copy`).
fn state_can_follow(shared: &Shared, sg: &SubGroup, data: &SgData) -> bool {
    match shared.transport() {
        Some(_) => data.grad.as_ref().is_none_or(|g| g.is_owned()) && writes_copy(sg, data, true),
        None => data.master.dtype() == DType::F32 && data.copy.as_ref().is_some_and(|c| !c.is_owned()),
    }
}

/// Makes one sub-group exact with the step's verdict ([`decide`]) and publishes it.
pub(crate) fn final_pass(
    shared: &Shared,
    sg: &SubGroup,
    group: GroupHparams,
    state_after: &mut Option<usize>,
    result: &StepResult,
    out: &mut FinalPass,
) -> Result<()> {
    let pool = &shared.pool;
    let mut data = sg.data.lock().unwrap();
    let n = sg.numel;
    let hp = sg.hyper(group, data.work.step_count + 1);
    let verdict = if result.skipped { Verdict::Skip } else { Verdict::Step { factor: result.grad_factor, hp } };
    let applied = data.work.applied;
    let stands = match applied {
        // A pass that wrote something had checked.
        Applied::Speculative(spec) if spec.done == 0 => {
            speculation_stands(subgroup_sumsq(shared, sg, &mut data, unscale_factor(result.loss_scale))?)
        }
        _ => true,
    };
    data.work.applied = Applied::Nothing;
    data.sumsq.fill(None);
    let (action, outcome) = decide(applied, verdict, stands);
    out.outcome = outcome;
    let reads_gradient = match action {
        Action::Leave | Action::RestoreCopy { .. } => result.skipped,
        Action::Resolve { spec, resolution } => resolution != Resolution::Keep || spec.done < n,
        Action::Update { .. } | Action::KeepCopy { .. } => true,
    };
    if reads_gradient {
        // The gradient is read below, or (skipped) this step's copies end here: none may
        // still land in the buffer when the next step's arrive.
        drop(data);
        gradient_ready(shared, sg)?;
        data = sg.data.lock().unwrap();
    }
    if data.placement == Placement::Device {
        let passes = device_passes(action);
        let publish = !result.skipped;
        // A speculative update that stands needs no pass, only its publication.
        if passes.is_empty() && !publish {
            return Ok(());
        }
        let transport = shared.transport().expect("device placement has a transport");
        transport.device_step(sg.id, &passes, publish)?;
        out.elements += (passes.len() * n) as u64;
        if publish {
            data.work.step_count += 1;
            out.outcome = Outcome::SteppedOnDevice;
        }
        return Ok(());
    }
    match action {
        Action::Leave => return Ok(()),
        Action::Resolve { spec, resolution } => {
            if reads_gradient {
                master_write(shared, sg)?;
            }
            let (done, skipped) = (spec.done, resolution == Resolution::Rollback);
            let resolve = |applied: bool| {
                move |_: Range<usize>, b: AdamBuffers<'_>| {
                    kernels::resolve(pool, &spec.hp, spec.scale, resolution, applied, b)
                }
            };
            // Where the speculative update is applied, a step that stands is final as it is.
            let kept = resolution == Resolution::Keep;
            let (mut on_applied, mut on_rest) = (resolve(true), resolve(false));
            let applied_part = if skipped {
                each_piece(shared, sg, &mut data, 0..done, CopyTo::Session, &mut on_applied)
            } else {
                write_and_publish(shared, sg, &mut data, 0..done, (!kept).then_some(&mut on_applied as &mut Pass<'_>))
            };
            if let Err(e) = applied_part {
                data.work.applied = Applied::Speculative(spec);
                return Err(e);
            }
            out.elements += resolve_elements(&spec, resolution, n);
            if skipped {
                // The model keeps its weights: those of a skipped step are never published.
                return each_piece(shared, sg, &mut data, done..n, CopyTo::Session, &mut on_rest);
            }
            write_and_publish(shared, sg, &mut data, done..n, Some(&mut on_rest))?;
        }
        Action::RestoreCopy { done } => {
            restore_copy(shared, sg, &mut data, done)?;
            out.elements += done as u64;
            // The model keeps its weights: those of a skipped step are never published.
            return Ok(());
        }
        Action::Update { factor, hp } => {
            master_write(shared, sg)?;
            // The next forward waits for the weights' copy alone: the pass can write the
            // copy, and the master weights and moments be written by a pass of their own
            // after publication, where the CPU has time for it (the policy).
            let defer = state_can_follow(shared, sg, &data) && take_from_prefix(state_after, n);
            let update = UpdateOptions { grad_scale: factor, ..Default::default() };
            let mut pass = |_: Range<usize>, b: AdamBuffers<'_>| {
                if defer {
                    kernels::update_copy(pool, &hp, b, factor)
                } else {
                    kernels::update(pool, &hp, b, &update).map(drop)
                }
            };
            write_and_publish(shared, sg, &mut data, 0..n, Some(&mut pass))?;
            out.elements += n as u64;
            if defer {
                out.state_after = Some((hp, factor));
                if out.outcome == Outcome::Stepped {
                    out.outcome = Outcome::SteppedStateAfter;
                }
            }
        }
        Action::KeepCopy { spec } => {
            if spec.done < n {
                master_write(shared, sg)?;
            }
            // The copy that stepped ahead is final where its pass got; the rest is written.
            write_and_publish(shared, sg, &mut data, 0..spec.done, None)?;
            let mut copy = |_: Range<usize>, b: AdamBuffers<'_>| kernels::update_copy(pool, &spec.hp, b, spec.scale);
            write_and_publish(shared, sg, &mut data, spec.done..n, Some(&mut copy))?;
            out.elements += (n - spec.done) as u64;
            // The state pass is due either way: after publication where it can be.
            if state_can_follow(shared, sg, &data) {
                out.state_after = Some((spec.hp, spec.scale));
            } else {
                each_piece(shared, sg, &mut data, 0..n, CopyTo::Nowhere, &mut |_, b| {
                    kernels::update_state(pool, &spec.hp, b, spec.scale)
                })?;
                out.elements += n as u64;
            }
        }
    }
    data.work.step_count += 1;
    match shared.transport() {
        Some(t) => t.publish(sg.id),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: usize = 100;

    fn spec(done: usize) -> SpecRecord {
        SpecRecord { kind: SpecKind::Full, hp: AdamHyper::default(), scale: 0.5, done }
    }

    fn step(factor: f32, lr: f64) -> Verdict {
        Verdict::Step { factor, hp: AdamHyper { lr, ..AdamHyper::default() } }
    }

    /// ARCHITECTURE.md's table of final passes, row by row; every row for a pass that ran to
    /// the end, was preempted half way and never started.
    #[test]
    fn final_passes_follow_the_table() {
        let lr = AdamHyper::default().lr;
        let update = |factor: f32, lr: f64| Action::Update { factor, hp: AdamHyper { lr, ..AdamHyper::default() } };
        assert_eq!(decide(Applied::Nothing, step(0.5, lr), true), (update(0.5, lr), Outcome::Stepped));
        assert_eq!(decide(Applied::Nothing, Verdict::Skip, true), (Action::Leave, Outcome::Unchanged));
        assert_eq!(decide(Applied::Undone, step(0.25, lr), true), (update(0.25, lr), Outcome::Redone));
        assert_eq!(decide(Applied::Undone, Verdict::Skip, true), (Action::Leave, Outcome::RolledBack));
        for done in [N, N / 2, 0] {
            let s = spec(done);
            let applied = Applied::Speculative(s);
            let resolve = |resolution| Action::Resolve { spec: s, resolution };
            assert_eq!(decide(applied, step(0.5, lr), true), (resolve(Resolution::Keep), Outcome::Kept));
            assert_eq!(decide(applied, step(0.25, lr), true), (resolve(Resolution::Rescale(0.25)), Outcome::Rescaled));
            assert_eq!(
                decide(applied, step(0.25, 2.0 * lr), true),
                (
                    resolve(Resolution::Redo { hp: AdamHyper { lr: 2.0 * lr, ..AdamHyper::default() }, scale: 0.25 }),
                    Outcome::Redone
                )
            );
            assert_eq!(decide(applied, Verdict::Skip, true), (resolve(Resolution::Rollback), Outcome::RolledBack));
        }
        let declined = Applied::Speculative(spec(0));
        assert_eq!(decide(declined, step(0.5, lr), false), (update(0.5, lr), Outcome::Stepped));
        assert_eq!(decide(declined, Verdict::Skip, false), (Action::Leave, Outcome::Unchanged));
        for sumsq in [f64::INFINITY, f64::NAN, 1e39] {
            assert!(!speculation_stands(sumsq), "{sumsq}");
        }
        assert!(speculation_stands(f32::MAX as f64));
    }

    /// A copy that stepped ahead is kept, or replaced by one update (the state never moved),
    /// or written from the master weights again; never rolled back.
    #[test]
    fn a_copy_ahead_is_kept_or_replaced() {
        let lr = AdamHyper::default().lr;
        let update = |factor: f32, lr: f64| Action::Update { factor, hp: AdamHyper { lr, ..AdamHyper::default() } };
        for done in [N, N / 2, 0] {
            let s = SpecRecord { kind: SpecKind::CopyAhead, ..spec(done) };
            let applied = Applied::Speculative(s);
            assert_eq!(decide(applied, step(0.5, lr), true), (Action::KeepCopy { spec: s }, Outcome::Kept));
            assert_eq!(decide(applied, step(0.25, lr), true), (update(0.25, lr), Outcome::Rescaled));
            assert_eq!(decide(applied, step(0.5, 2.0 * lr), true), (update(0.5, 2.0 * lr), Outcome::Redone));
            assert_eq!(decide(applied, Verdict::Skip, true), (Action::RestoreCopy { done }, Outcome::RolledBack));
        }
        let declined = Applied::Speculative(SpecRecord { kind: SpecKind::CopyAhead, ..spec(0) });
        assert_eq!(decide(declined, step(0.5, lr), false), (update(0.5, lr), Outcome::Stepped));
        assert_eq!(decide(declined, Verdict::Skip, false), (Action::Leave, Outcome::Unchanged));
    }

    #[test]
    fn elements_count_what_a_pass_reads() {
        assert_eq!(resolve_elements(&spec(N), Resolution::Keep, N), 0);
        assert_eq!(resolve_elements(&spec(N / 2), Resolution::Keep, N), (N / 2) as u64);
        assert_eq!(resolve_elements(&spec(N / 2), Resolution::Rescale(0.25), N), N as u64);
        assert_eq!(resolve_elements(&spec(0), Resolution::Rollback, N), N as u64);
    }
}
