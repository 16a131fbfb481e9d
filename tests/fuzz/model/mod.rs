//! The model: what the header says each call does, as a simple state machine, plus a plain
//! reference of the optimizer state. `World::apply` makes the operation's C calls and checks
//! every answer against the model: the status (any of the documented ones when several
//! refusals apply), out-parameters written only on success, nothing changed on refusal,
//! step counts, step results, and the weights and moments against the reference — bit for
//! bit where a sub-group was stepped exactly (not speculated, or its speculative step kept),
//! within the bounds of `tests/common` where a speculative step was rescaled, rolled back or
//! redone (after which the reference adopts the session's state for that sub-group).

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::PathBuf;

use superoffload::kernels::{AdamMode, DType};
use superoffload::session::{GroupHparams, LossScalerOptions};

use crate::common::Store;
use crate::fuzz::api::{self, Session, Status, Ticket, so_step_result};
use crate::fuzz::ckpt::Snapshot;
use crate::fuzz::mem::RawBuf;
use crate::fuzz::ops::{CreateSpec, ScalerSpec};
use crate::fuzz::reference::ApproxCheck;

pub type Check = Result<(), String>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!($($fmt)*));
        }
    };
}

mod backward;
mod checkpoint;
mod session;
mod settle;
mod step;
mod subgroups;
mod tickets;
mod world;

/// Status of a call against the statuses it may return: `errs` empty means it must succeed.
/// Returns whether it succeeded.
fn judge(what: &str, got: Status, errs: &[Status]) -> Result<bool, String> {
    if errs.is_empty() {
        ensure!(got == Status::Ok, "{what}: expected OK, got {got:?} ({})", api::last_error());
        Ok(true)
    } else {
        ensure!(errs.contains(&got), "{what}: expected one of {errs:?}, got {got:?} ({})", api::last_error());
        Ok(false)
    }
}

pub fn dtype_from_raw(raw: u32) -> Option<Option<DType>> {
    match raw {
        api::DT_NONE => Some(None),
        api::DT_F32 => Some(Some(DType::F32)),
        api::DT_BF16 => Some(Some(DType::Bf16)),
        api::DT_F16 => Some(Some(DType::F16)),
        _ => None,
    }
}

fn hp_of(a: [f64; 5]) -> GroupHparams {
    GroupHparams { lr: a[0], beta1: a[1], beta2: a[2], eps: a[3], weight_decay: a[4] }
}

pub fn hp_valid(g: &GroupHparams) -> bool {
    let finite_nonneg = |x: f64| x.is_finite() && x >= 0.0;
    finite_nonneg(g.lr)
        && finite_nonneg(g.eps)
        && finite_nonneg(g.weight_decay)
        && (0.0..1.0).contains(&g.beta1)
        && (0.0..1.0).contains(&g.beta2)
}

fn same_hp(a: &GroupHparams, b: &GroupHparams) -> bool {
    a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps && a.weight_decay == b.weight_decay
}

fn hp_bits_equal(a: &GroupHparams, b: &GroupHparams) -> bool {
    [a.lr, a.beta1, a.beta2, a.eps, a.weight_decay]
        .iter()
        .zip([b.lr, b.beta1, b.beta2, b.eps, b.weight_decay])
        .all(|(x, y)| x.to_bits() == y.to_bits())
}

fn unscale_of(s: f32) -> f32 {
    (1.0 / s as f64) as f32
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Phase {
    Idle,
    Backward { micro: u32, micro_steps: u32 },
    Prepared,
}

#[derive(Clone, Debug)]
pub struct Opts {
    pub mode: AdamMode,
    pub bias: bool,
    pub moment: DType,
    pub grad: DType,
    pub accum: DType,
    /// A `so_speculation` value.
    pub speculation: u32,
    pub limit: Option<usize>,
    pub copy: Option<DType>,
    pub spec: CreateSpec,
}

/// The built-in loss scaler, as documented (torch GradScaler plus hysteresis).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scaler {
    pub options: LossScalerOptions,
    pub scale: f32,
    pub tracker: u32,
    pub left: u32,
}

impl Scaler {
    fn new(s: &ScalerSpec) -> Scaler {
        Scaler { options: s.options, scale: s.options.init_scale, tracker: 0, left: s.options.hysteresis }
    }
    fn valid(o: &LossScalerOptions) -> bool {
        let pos = |x: f32| x.is_finite() && x > 0.0;
        pos(o.init_scale)
            && pos(o.min_scale)
            && o.growth_factor.is_finite()
            && o.growth_factor > 1.0
            && o.backoff_factor > 0.0
            && o.backoff_factor < 1.0
            && o.growth_interval >= 1
            && o.hysteresis >= 1
    }
    /// The verdict of one step (`skipped` counts as an overflow).
    pub fn update(&mut self, skipped: bool) {
        let o = &self.options;
        if skipped {
            self.tracker = 0;
            if self.left > 1 {
                self.left -= 1;
            } else {
                self.scale = (self.scale * o.backoff_factor).max(o.min_scale);
                self.left = o.hysteresis;
            }
        } else {
            self.tracker += 1;
            if self.tracker >= o.growth_interval {
                let grown = self.scale * o.growth_factor;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.tracker = 0;
                self.left = o.hysteresis;
            }
        }
    }
}

pub struct SliceM {
    pub name: String,
    pub sg: u32,
    pub range: Range<usize>,
    pub alive: bool,
    /// Micro-step index + 1 of its latest gradient this step; 0 for none.
    pub seen: u32,
}

#[derive(Clone, Debug)]
pub struct SpecM {
    pub hp: GroupHparams,
    pub g: Store,
    /// The speculative step goes through if it runs (the sums of squares of the scaled
    /// gradient's slices are finite).
    pub applied: bool,
    /// It is known to have been submitted (speculation on, or a ticket came back).
    pub certain: bool,
    /// It writes the weights' copy alone (no exact rollback): every outcome is exact.
    pub copy_ahead: bool,
}

pub struct SgM {
    pub id: u32,
    pub group: u32,
    pub numel: usize,
    pub master_dtype: DType,
    pub master: RawBuf,
    pub grad_buf: Option<RawBuf>,
    pub slices: Vec<u32>,
    pub covered: Vec<bool>,
    /// Mirror of the session's gradient buffer.
    pub g: Store,
    pub late: Option<(Store, Vec<Range<usize>>)>,
    pub late_merged: bool,
    /// Reference state; `known[i]` says whether element i of all three is known.
    pub p: Store,
    pub m: Store,
    pub v: Store,
    pub known: Vec<bool>,
    pub count: u64,
    pub count_prev: u64,
    /// An approximate step waiting for its observation.
    pub approx: Option<ApproxCheck>,
    pub slices_done: usize,
    pub submitted: Option<Option<SpecM>>,
    pub final_ticket: Ticket,
    pub final_waited: bool,
    pub host_bytes: usize,
    pub late_bytes: usize,
}

impl SgM {
    /// The caller's master weights hold the model's bit for bit wherever the model knows them.
    fn check_master(&self, when: &str) -> Check {
        let live = self.master.read(self.master_dtype, self.numel);
        for i in 0..self.numel {
            ensure!(
                !self.known[i] || live.bits(i) == self.p.bits(i),
                "sub-group {} element {i} changed{when}: {:e}, model {:e}",
                self.id,
                live.get(i),
                self.p.get(i)
            );
        }
        Ok(())
    }
}

pub struct PlanSg {
    pub id: u32,
    pub g_final: Store,
    pub spec: Option<SpecM>,
    pub late: bool,
}

pub struct Pending {
    pub ticket: Ticket,
    pub serial: u64,
    pub s: f32,
    pub unscale: f32,
    pub max_norm: f64,
    pub given: Option<f64>,
    pub overflow: bool,
    pub groups: Vec<GroupHparams>,
    pub plan: Vec<PlanSg>,
    pub own_norm: f64,
    pub all_finite: bool,
    pub certain: bool,
    pub predicted_skip: bool,
    pub scaler_applied: bool,
    /// A rescale, rollback or redo may happen (or the prediction is uncertain): the next
    /// step may begin only after the session's state was observed.
    pub needs_settle: bool,
    /// Speculative steps known to be submitted, and possibly submitted.
    pub spec_min: u32,
    pub spec_max: u32,
    pub late_count: u32,
}

/// Counters for the report.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub sessions: u64,
    pub steps: u64,
    pub skipped: u64,
    pub clipped: u64,
    pub kept: u64,
    pub rescaled: u64,
    pub rolled_back: u64,
    pub redone: u64,
    pub stepped: u64,
    pub late: u64,
    pub lazy: u64,
    pub saves: u64,
    pub loads_ok: u64,
    pub loads_refused: u64,
    pub refusals: u64,
    pub repartitions: u64,
    pub bound_checks: u64,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        self.sessions += o.sessions;
        self.steps += o.steps;
        self.skipped += o.skipped;
        self.clipped += o.clipped;
        self.kept += o.kept;
        self.rescaled += o.rescaled;
        self.rolled_back += o.rolled_back;
        self.redone += o.redone;
        self.stepped += o.stepped;
        self.late += o.late;
        self.lazy += o.lazy;
        self.saves += o.saves;
        self.loads_ok += o.loads_ok;
        self.loads_refused += o.loads_refused;
        self.refusals += o.refusals;
        self.repartitions += o.repartitions;
        self.bound_checks += o.bound_checks;
    }
}

pub struct Sess {
    pub h: Session,
    pub opts: Opts,
    pub groups: Vec<GroupHparams>,
    pub sgs: Vec<Option<SgM>>,
    pub slices: Vec<SliceM>,
    pub names: HashMap<String, u32>,
    pub phase: Phase,
    pub serial: u64,
    pub s: f32,
    pub scaler: Option<Scaler>,
    pub host_bytes: usize,
    pub spec_min: u32,
    pub spec_max: u32,
    pub late_count: u32,
    pub pending: Option<Pending>,
    pub step_tickets: Vec<Ticket>,
    pub outcomes: HashMap<Ticket, so_step_result>,
    /// Tickets hand-offs returned, with the statuses their work may end with.
    pub handoffs: Vec<(Ticket, Vec<Status>)>,
    /// Hand-offs whose work may fail but whose ticket was not asked for (NULL out_ticket):
    /// the ticket is after the latest one seen when it was issued.
    pub hidden: Vec<(Ticket, Vec<Status>)>,
    /// The largest ticket the session returned so far.
    pub last_seen: Ticket,
    pub refusals: u64,
    /// Where observations write their checkpoint.
    pub scratch: PathBuf,
}

pub struct FileEntry {
    pub bytes: Vec<u8>,
    pub snap: Snapshot,
}

pub struct World {
    pub sess: Option<Sess>,
    pub dir: PathBuf,
    pub files: BTreeMap<u8, FileEntry>,
    pub pool: Option<api::Pool>,
    pub stats: Stats,
    /// Check the moments through a checkpoint after every settled step.
    pub observe_every_step: bool,
}
