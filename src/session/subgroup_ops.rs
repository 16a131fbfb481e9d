//! What both phases of a step do to a sub-group: wait for its gradient copies, or for its
//! master weights to be free of the transport, read its sums of squares, and write its
//! weights' copy from the master weights again.

use std::sync::Arc;

use super::shared::Shared;
use super::subgroup::{Applied, SgData, SubGroup};
use super::trace::Lane;
use super::transport::HandedSumsq;
use crate::error::{Error, Result, Status};
use crate::kernels;

/// Waits until the sub-group's gradient copies have landed (a host wait on the device).
pub(crate) fn gradient_ready(shared: &Shared, sg: &SubGroup) -> Result<()> {
    let Some(t) = shared.transport() else { return Ok(()) };
    let _span = shared.tracer.span(Lane::CpuAdam, || format!("wait for gradient copies, sub-group {}", sg.id));
    t.gradient_ready(sg.id)
}

/// Waits until the sub-group's master weights may be written again: the device has read
/// the last publication from them.
pub(crate) fn master_write(shared: &Shared, sg: &SubGroup) -> Result<()> {
    shared.transport().map_or(Ok(()), |t| t.master_write(sg.id))
}

/// Writes the weights' copy of elements `[0, done)` from the master weights again, as
/// registration wrote it: what a copy that stepped ahead
/// ([`SpecKind::CopyAhead`](super::subgroup::SpecKind::CopyAhead)) holds when its step is not
/// taken.
pub(crate) fn restore_copy(shared: &Shared, sg: &SubGroup, data: &mut SgData, done: usize) -> Result<()> {
    let Some(copy) = data.copy.as_mut().filter(|_| done > 0) else { return Ok(()) };
    master_write(shared, sg)?;
    kernels::convert(&shared.pool, copy.range_mut(0..done), data.master.range(0..done))
}

/// What a speculative step's ticket reports whether or not its pass ran (cancelled,
/// undone): [`speculative_verdict`] of the gradient it was planned with, so that tickets,
/// like the bits, depend on the inputs alone. A sum that cannot be read is left to the
/// step's own passes to report.
pub(crate) fn unrun_speculation_outcome(shared: &Shared, sg: &SubGroup, data: &mut SgData) -> Result<()> {
    match data.work.applied {
        Applied::Speculative(spec) => match subgroup_sumsq(shared, sg, data, spec.scale) {
            Ok(sumsq) => speculative_verdict(sg, sumsq),
            Err(_) => Ok(()),
        },
        _ => Ok(()),
    }
}

/// The sum of squares of one slice as the hand-off (or the preparation) left it.
pub(crate) fn slice_sumsq(shared: &Shared, sg: &SubGroup, data: &mut SgData, index: usize, scale: f32) -> Result<f64> {
    match data.sumsq[index] {
        Some(HandedSumsq::Known(s)) => Ok(s),
        Some(HandedSumsq::Deferred) => {
            let s = shared
                .transport()
                .ok_or_else(|| Error::new(Status::Panic, "a deferred sum of squares without a transport"))?
                .gradient_sumsq(sg.id, index)?;
            data.sumsq[index] = Some(HandedSumsq::Known(s));
            Ok(s)
        }
        None => {
            let grad = data
                .grad
                .as_ref()
                .ok_or_else(|| Error::new(Status::Panic, "a gradient kept on the device without a sum of squares"))?;
            let s = kernels::grad_sumsq(&shared.pool, grad.range(sg.slices[index].clone()), scale)?;
            data.sumsq[index] = Some(HandedSumsq::Known(s));
            Ok(s)
        }
    }
}

/// The local sum of squares over `subgroups` (forward order, slices in order): what the
/// norm is made of. Every sum must be known (after the preparation).
pub(crate) fn local_sumsq<'a>(
    shared: &Shared,
    subgroups: impl Iterator<Item = &'a Arc<SubGroup>>,
    scale: f32,
) -> Result<f64> {
    let mut total = 0.0;
    for sg in subgroups {
        let mut data = sg.data.lock().unwrap();
        for index in 0..sg.slices.len() {
            total += match data.sumsq[index] {
                Some(HandedSumsq::Known(s)) => s,
                _ => slice_sumsq(shared, sg, &mut data, index, scale)?,
            };
        }
    }
    Ok(total)
}

/// The sum of squares of a sub-group's gradient (slices in order).
pub(crate) fn subgroup_sumsq(shared: &Shared, sg: &SubGroup, data: &mut SgData, scale: f32) -> Result<f64> {
    let mut total = 0.0;
    for index in 0..sg.slices.len() {
        total += slice_sumsq(shared, sg, data, index, scale)?;
    }
    Ok(total)
}

/// A speculative step's outcome for a gradient whose unscaled sum of squares is `sumsq`: an
/// inf or NaN element fails it (nothing is written), whether its pass runs or not.
pub(crate) fn speculative_verdict(sg: &SubGroup, sumsq: f64) -> Result<()> {
    if sumsq.is_finite() {
        return Ok(());
    }
    Err(Error::new(
        Status::NonFinite,
        format!(
            "speculative step of sub-group {}: the gradient has an inf or NaN element; nothing was modified",
            sg.id
        ),
    ))
}
