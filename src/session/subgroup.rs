//! A registered sub-group: its buffers, what this step applied to them, and late gradients.

use std::ops::Range;
use std::sync::Mutex;

use super::buffers::HostBuf;
use super::transport::{HandedSumsq, HostState, Transport};
use super::types::{GroupHparams, Placement};
use crate::error::Result;
use crate::kernels::{self, AdamHyper, AdamMode, DType, Pool};

/// Gradients that arrived after the sub-group completed.
pub(crate) struct LateGrads {
    pub buffer: HostBuf,
    pub ranges: Vec<Range<usize>>,
}

/// What a speculative step writes before the step is decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SpecKind {
    /// The whole update: the final pass keeps, rescales or rolls it back (f32 master
    /// weights and moments, an invertible step).
    Full,
    /// The weights' low-precision copy alone (`kernels::update_copy`): the master weights and
    /// moments keep their values until the step is decided, so nothing is ever undone. For
    /// sub-groups whose step cannot be rolled back exactly (bf16 moments).
    CopyAhead,
}

/// The speculative step of this step: what it writes, the hyperparameters and gradient
/// factor it is taken with, and how far it has been applied (elements `[0, done)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SpecRecord {
    pub kind: SpecKind,
    pub hp: AdamHyper,
    pub scale: f32,
    pub done: usize,
}

/// What this step has done to a sub-group's buffers so far. The session decides at hand-off,
/// from the inputs and the history of earlier steps alone, whether a sub-group speculates;
/// the final pass then writes the same bits however far a speculative pass got.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) enum Applied {
    /// Nothing: the step is one update with the final factor (or nothing, if skipped).
    #[default]
    Nothing,
    /// The step speculates: the final pass resolves the speculative update (kept, rescaled,
    /// rolled back or redone), applying it first to the elements it has not reached.
    Speculative(SpecRecord),
    /// A speculative step was undone for a late gradient: the step is taken anew.
    Undone,
}

/// Whether a planned speculative step is taken at all: a gradient with an inf or NaN
/// element, or whose squares (`sumsq`, of the unscaled gradient) exceed f32, is never
/// stepped speculatively (`exp_avg_sq` would become inf, which nothing can undo). The
/// speculative pass checks the same before it writes anything.
pub(crate) fn speculation_stands(sumsq: f64) -> bool {
    sumsq.is_finite() && sumsq <= f32::MAX as f64
}

/// The optimizer-side state of a sub-group (under its data lock).
#[derive(Default)]
pub(crate) struct SgWork {
    pub step_count: u64,
    pub applied: Applied,
}

/// The buffers of a sub-group, owned by whoever holds the lock: the CPU-Adam thread while
/// it steps the sub-group, the caller while it hands a gradient over.
pub(crate) struct SgData {
    pub master: HostBuf,
    pub exp_avg: HostBuf,
    pub exp_avg_sq: HostBuf,
    /// The gradient's host buffer; `None` where the transport keeps the gradient on the
    /// device (or before the sub-group is provisioned: `Registry::unprovisioned`).
    pub grad: Option<HostBuf>,
    /// Low-precision copy of the master weights, written by every pass that changes them,
    /// where the session keeps one in full (`HostCopy`).
    pub copy: Option<HostBuf>,
    pub work: SgWork,
    /// Per slice (in sub-group order): the sum of squares of this step's gradient, once
    /// handed over at the last micro-step.
    pub sumsq: Vec<Option<HandedSumsq>>,
    pub placement: Placement,
}

impl SgData {
    /// Writes the weights' copy, where the session keeps one, from the master weights (they
    /// were loaded or moved here, not stepped).
    pub(crate) fn copy_from_master(&mut self, pool: &Pool) -> Result<()> {
        match self.copy.as_mut() {
            Some(copy) => kernels::convert(pool, copy.floats_mut(), self.master.floats()),
            None => Ok(()),
        }
    }

    /// Brings a device-placed sub-group's state (`sg`'s, on `transport`) into these buffers.
    pub(crate) fn download_device_state(&mut self, sg: u32, transport: Option<&dyn Transport>) -> Result<()> {
        match (self.placement, transport) {
            (Placement::Device, Some(t)) => t.download_state(sg, self.host_state()),
            _ => Ok(()),
        }
    }

    pub(crate) fn host_state(&mut self) -> HostState<'_> {
        HostState {
            master: self.master.floats_mut(),
            exp_avg: self.exp_avg.floats_mut(),
            exp_avg_sq: self.exp_avg_sq.floats_mut(),
        }
    }
}

pub(crate) struct SubGroup {
    pub id: u32,
    pub group: u32,
    pub numel: usize,
    /// The ranges of its slices within it, in slice order.
    pub slices: Vec<Range<usize>>,
    pub mode: AdamMode,
    pub bias_correction: bool,
    /// f32 master weights and moments: a speculative update can be rolled back.
    pub speculative_dtypes: bool,
    /// The dtype the device is given the weights in: its parameter's, or without one the
    /// copy's (or the master weights') as kept.
    pub published_dtype: DType,
    pub data: Mutex<SgData>,
    pub late: Mutex<Option<LateGrads>>,
}

impl SubGroup {
    pub(crate) fn hyper(&self, g: GroupHparams, step: u64) -> AdamHyper {
        AdamHyper {
            mode: self.mode,
            lr: g.lr,
            beta1: g.beta1,
            beta2: g.beta2,
            eps: g.eps,
            weight_decay: g.weight_decay,
            bias_correction: self.bias_correction,
            step,
        }
    }

    /// How the sub-group can speculate, if at all: the whole update where it can be rolled
    /// back (f32 master weights and moments, nonzero betas and an invertible decay), else the
    /// weights' copy alone where a full copy is kept to write ahead (f32 master weights).
    pub(crate) fn speculation(&self, g: GroupHparams, data: &SgData) -> Option<SpecKind> {
        if self.speculative_dtypes && g.beta1 > 0.0 && g.beta2 > 0.0 && self.hyper(g, 1).decay_factor() > 0.0 {
            Some(SpecKind::Full)
        } else {
            (data.master.dtype() == DType::F32 && data.copy.is_some()).then_some(SpecKind::CopyAhead)
        }
    }
}
