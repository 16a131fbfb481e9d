//! What happens before a step is decided: the speculative passes (in chunks, preemptible) and
//! the preparation (missing and late gradients, every sum of squares). The CPU-Adam thread
//! (`worker.rs`) runs them; the decision and what follows it are in `finalize.rs`.

use std::ops::Range;

use super::plans::PreparePlan;
use super::publish::{CopyTo, each_piece};
use super::scheduler::Lifecycle;
use super::shared::Shared;
use super::subgroup::{Applied, SpecKind, SubGroup, speculation_stands};
use super::subgroup_ops::{
    gradient_ready, master_write, restore_copy, slice_sumsq, speculative_verdict, subgroup_sumsq,
    unrun_speculation_outcome,
};
use super::transport::{DevicePass, HandedSumsq};
use super::types::Placement;
use crate::error::{Error, Result, Status};
use crate::kernels::{self, AdamBuffers, Resolution, UpdateOptions};

/// Elements of one chunk of a speculative pass: between two chunks the pass checks whether
/// more urgent work is waiting (about a millisecond of work on a many-core pool).
pub(crate) const SPECULATION_CHUNK: usize = 1 << 22;

/// The speculative step the session planned for `sg` at hand-off, in chunks; stops early
/// (keeping what it did) when a more urgent job is waiting. A device-placed sub-group's step
/// is queued on the device whole. A gradient the step could not be undone from
/// ([`speculation_stands`]) is not stepped (`None`: its ticket completes, and the final pass
/// steps the sub-group once); otherwise how far the step got and the elements this run stepped.
pub(crate) fn speculate(shared: &Shared, sg: &SubGroup) -> Result<Option<(usize, usize)>> {
    gradient_ready(shared, sg)?;
    let mut data = sg.data.lock().unwrap();
    let Applied::Speculative(mut spec) = data.work.applied else {
        unreachable!("sub-group {} speculates without a plan", sg.id)
    };
    let sumsq = subgroup_sumsq(shared, sg, &mut data, spec.scale)?;
    speculative_verdict(sg, sumsq)?;
    if !speculation_stands(sumsq) {
        return Ok(None);
    }
    if data.placement == Placement::Device {
        // The whole update, queued on the device beside the rest of the backward:
        // the final pass then only publishes it (or resolves it).
        let transport = shared.transport().expect("device placement has a transport");
        transport.device_step(sg.id, &[DevicePass::Update { hp: spec.hp, scale: spec.scale }], false)?;
        spec.done = sg.numel;
        data.work.applied = Applied::Speculative(spec);
        // No host pass ran: nothing for the policy to measure.
        return Ok(Some((spec.done, 0)));
    }
    master_write(shared, sg)?;
    let opts = UpdateOptions { grad_scale: spec.scale, ..Default::default() };
    // A pass resumed after a preparation preempted it goes on from where it stopped.
    let start_done = spec.done;
    let pool = &shared.pool;
    let mut step = |_: Range<usize>, b: AdamBuffers<'_>| match spec.kind {
        SpecKind::Full => kernels::update(pool, &spec.hp, b, &opts).map(drop),
        SpecKind::CopyAhead => kernels::update_copy(pool, &spec.hp, b, spec.scale),
    };
    while spec.done < sg.numel {
        if spec.done > start_done && shared.sched.should_yield(&|id| shared.gradient_landed(id)) {
            break;
        }
        let end = (spec.done + SPECULATION_CHUNK).min(sg.numel);
        each_piece(shared, sg, &mut data, spec.done..end, CopyTo::Session, &mut step)?;
        spec.done = end;
        data.work.applied = Applied::Speculative(spec);
    }
    Ok(Some((spec.done, spec.done - start_done)))
}

/// Zero-fills slices without a gradient, merges late gradients (undoing a speculative
/// step taken without them) and completes every sum of squares.
pub(crate) fn prepare(shared: &Shared, plan: &PreparePlan, elements: &mut u64) -> Result<()> {
    let pool = &shared.pool;
    for entry in &plan.entries {
        let sg = &entry.sg;
        let mut late = sg.late.lock().unwrap();
        let has_late = late.as_ref().is_some_and(|l| !l.ranges.is_empty());
        if has_late {
            // A queued speculative step would read a gradient about to change: it is
            // cancelled, and its ticket completes once the gradient copies it stood for
            // have landed (a caller may wait on it before step()).
            let cancelled = shared.sched.cancel_speculation(sg.id);
            let ready = gradient_ready(shared, sg);
            if let Some(ticket) = cancelled {
                let verdict = unrun_speculation_outcome(shared, sg, &mut sg.data.lock().unwrap());
                shared.complete(ticket, ready.clone().and(verdict));
            }
            ready?;
        }
        let mut data = sg.data.lock().unwrap();
        let device = data.placement == Placement::Device;
        for &index in &entry.unseen {
            let range = sg.slices[index].clone();
            match data.grad.as_mut().filter(|_| !device) {
                Some(grad) => grad.zero_range(range),
                None => shared
                    .transport()
                    .expect("a gradient on the device has a transport")
                    .device_zero_gradient(sg.id, range)?,
            }
            data.sumsq[index] = Some(HandedSumsq::Known(0.0));
        }
        if let Some(late) = late.as_mut().filter(|l| !l.ranges.is_empty()) {
            debug_assert!(!device, "a device-placed sub-group's transport refuses late gradients");
            // The late buffer stays allocated (and pinned) for the next late gradient.
            if let Applied::Speculative(spec) = data.work.applied {
                // The gradient the planned speculative step is taken with is about to
                // change: the step is undone (as a skipped step undoes it), wherever its
                // pass got, and taken anew at step().
                if spec.kind == SpecKind::CopyAhead {
                    // Only the copy stepped ahead: it is the master weights' again.
                    restore_copy(shared, sg, &mut data, spec.done)?;
                    data.work.applied = Applied::Nothing;
                } else if spec.done > 0 || speculation_stands(subgroup_sumsq(shared, sg, &mut data, plan.scale)?) {
                    master_write(shared, sg)?;
                    let (n, done) = (sg.numel, spec.done);
                    for (range, applied) in [(0..done, true), (done..n, false)] {
                        each_piece(shared, sg, &mut data, range, CopyTo::Session, &mut |_, b: AdamBuffers<'_>| {
                            kernels::resolve(pool, &spec.hp, spec.scale, Resolution::Rollback, applied, b)
                        })?;
                    }
                    *elements += n as u64;
                    data.work.applied = Applied::Undone;
                } else {
                    data.work.applied = Applied::Nothing;
                }
                if let Lifecycle::Speculated(pending) = shared.sched.lifecycle(sg.id) {
                    // A pass this preparation preempted is undone, not resumed: its
                    // ticket completes now rather than with step()'s final pass.
                    shared.sched.set_lifecycle(sg.id, Lifecycle::Complete);
                    if let Some(ticket) = pending {
                        shared.complete(ticket, Ok(()));
                    }
                }
            }
            let grad = data
                .grad
                .as_mut()
                .ok_or_else(|| Error::new(Status::Panic, "late gradients for a gradient kept on the device"))?;
            let merged: Vec<Range<usize>> = late.ranges.drain(..).collect();
            for range in &merged {
                kernels::copy_into(grad.range_mut(range.clone()), late.buffer.range(range.clone()), true, None)?;
            }
            for range in merged {
                if let Some(index) = sg.slices.iter().position(|r| *r == range) {
                    data.sumsq[index] = None;
                }
            }
        }
        if data.sumsq.iter().any(Option::is_none) {
            drop(data);
            gradient_ready(shared, sg)?;
            data = sg.data.lock().unwrap();
            for index in 0..sg.slices.len() {
                if data.sumsq[index].is_none() {
                    slice_sumsq(shared, sg, &mut data, index, plan.scale)?;
                }
            }
        }
    }
    Ok(())
}
