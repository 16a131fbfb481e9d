//! What the caller's side hands the CPU-Adam thread: the preparation of a step and the step.

use std::sync::Arc;

use super::subgroup::SubGroup;
use super::tickets::Ticket;
use super::types::{GroupHparams, StepArgs};

/// Zero-filling, late-gradient merging and the sums of squares the decision needs.
pub(crate) struct PreparePlan {
    pub serial: u64,
    /// The unscale factor `1 / S` of this step.
    pub scale: f32,
    pub entries: Vec<PrepareEntry>,
}

pub(crate) struct PrepareEntry {
    pub sg: Arc<SubGroup>,
    /// Indices (within the sub-group) of slices that received no gradient this step: they
    /// become zeros.
    pub unseen: Vec<usize>,
}

/// What `step()` hands the CPU-Adam thread.
pub(crate) struct StepPlan {
    pub serial: u64,
    pub loss_scale: f32,
    pub args: StepArgs,
    /// Hyperparameters of every group as of `step()`.
    pub groups: Vec<GroupHparams>,
    /// Sub-groups in forward order, each with its final ticket.
    pub subgroups: Vec<(Arc<SubGroup>, Ticket)>,
    pub decide_ticket: Ticket,
    pub step_ticket: Ticket,
    /// `None` when `local_grad_sumsq` already ran the preparation.
    pub prepare: Option<PreparePlan>,
    pub speculative: u32,
    pub late_gradients: u32,
    pub forward_wait_s: f64,
}
