//! The model: what the header says each call does, as a simple state machine, plus a plain
//! reference of the optimizer state. `World::apply` makes the operation's C calls and checks
//! every answer against the model: the status (any of the documented ones when several
//! refusals apply), out-parameters written only on success, nothing changed on refusal,
//! step counts, step results, and the weights and moments against the reference — bit for
//! bit where a sub-group was stepped exactly (not speculated, or its speculative step kept),
//! within the bounds of `tests/common` where a speculative step was rescaled, rolled back or
//! redone (after which the reference adopts the session's state for that sub-group).

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, c_char, c_void};
use std::ops::Range;
use std::path::{Path, PathBuf};

use superoffload::kernels::{AdamMode, DType};
use superoffload::session::{GroupHparams, LossScalerOptions};

use crate::common::{Rng, Store};
use crate::fuzz::api::{self, Session, Status, Ticket, so_step_result};
use crate::fuzz::ckpt::{self, Snapshot};
use crate::fuzz::mem::{RawBuf, put, set_bits, store_bytes, sub, zeros};
use crate::fuzz::ops::*;
use crate::fuzz::reference::{self, Approx, ApproxCheck};

pub type Check = Result<(), String>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!($($fmt)*));
        }
    };
}

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

/// torch's clip coefficient, written out here (not the library's function).
pub fn clip_coefficient(max_norm: f64, norm: f64) -> f64 {
    if max_norm > 0.0 { (max_norm / (norm + 1e-6)).min(1.0) } else { 1.0 }
}

pub fn grad_factor(clip: f64, loss_scale: f32) -> f32 {
    (clip / loss_scale as f64) as f32
}

fn unscale_of(s: f32) -> f32 {
    (1.0 / s as f64) as f32
}

/// Gradient values of a fill, in `dtype`.
pub fn fill_values(fill: &Fill, n: usize, scale: f64, dtype: DType) -> Store {
    let mut rng = Rng::new(fill.seed);
    let mut v: Vec<f64> = (0..n).map(|_| rng.normalish(fill.magnitude) * scale).collect();
    if n > 0 {
        match fill.special {
            Special::None => {}
            Special::Nan(i) => v[i % n] = f64::NAN,
            Special::Inf(i) => v[i % n] = f64::INFINITY,
            Special::NegInf(i) => v[i % n] = f64::NEG_INFINITY,
            Special::Huge(i) => v[i % n] = 1e30,
        }
    }
    Store::from_f64(dtype, v.into_iter())
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

impl World {
    pub fn new(dir: PathBuf) -> World {
        std::fs::create_dir_all(&dir).unwrap();
        World {
            sess: None,
            dir,
            files: BTreeMap::new(),
            pool: None,
            stats: Stats::default(),
            observe_every_step: false,
        }
    }

    pub fn slot_path(&self, k: u8) -> PathBuf {
        self.dir.join(format!("slot{k}.safetensors"))
    }

    fn scratch_path(&self) -> PathBuf {
        self.dir.join("observe.safetensors")
    }

    /// Settles and destroys the session (end of a sequence).
    pub fn finish(&mut self) -> Check {
        if self.sess.as_ref().is_some_and(|s| s.phase != Phase::Idle) {
            let args = ArgsSpec {
                null_args: false,
                bad_size: false,
                null_out: false,
                max_norm: 0.0,
                norm_source: api::NORM_LOCAL,
                given: 0.0,
                overflow: false,
            };
            self.apply(&Op::Step(args))?;
        }
        if self.sess.is_some() {
            self.apply(&Op::Settle)?;
            self.apply(&Op::Observe)?;
            self.apply(&Op::Destroy)?;
        }
        Ok(())
    }

    /// Destroys whatever is left without checking (after a failure).
    pub fn abandon(&mut self) {
        if let Some(s) = self.sess.take() {
            unsafe { s.h.destroy() };
        }
    }

    pub fn apply(&mut self, op: &Op) -> Check {
        match op {
            Op::Create(spec) => self.create(spec),
            Op::NullHandle => null_handle(),
            _ if self.sess.is_none() => Ok(()),
            Op::Destroy => self.destroy(),
            Op::Repartition { seed } => self.repartition(*seed),
            Op::Save(target) => self.save(*target),
            Op::Load(source) => self.load(*source),
            Op::Observe => self.observe_op(),
            Op::AddSubgroup(spec) => self.sess.as_mut().unwrap().add_subgroup(spec, &mut self.stats),
            _ => {
                let observe = self.observe_every_step;
                let scratch = self.scratch_path();
                let s = self.sess.as_mut().unwrap();
                s.apply(op, &mut self.stats, &scratch, observe)
            }
        }
    }

    fn create(&mut self, spec: &CreateSpec) -> Check {
        if self.sess.is_some() {
            // One session at a time: the old one is settled and destroyed first.
            self.apply(&Op::Destroy)?;
        }
        if matches!(spec.pool, PoolSpec::Shared | PoolSpec::Both) && self.pool.is_none() {
            self.pool = Some(api::Pool::new(2));
        }
        let pool = self.pool.as_ref().map_or(std::ptr::null(), |p| p.raw());
        let (st, out) = create_raw(spec, pool);
        let errs = create_errors(spec);
        let ok = judge("so_session_create", st, &errs)?;
        if !ok {
            ensure!(out == sentinel_session(), "so_session_create wrote its out-parameter on failure");
            self.stats.refusals += 1;
            return Ok(());
        }
        ensure!(!out.is_null(), "so_session_create returned NULL");
        self.stats.sessions += 1;
        let dt = |raw: u32| dtype_from_raw(raw).flatten().unwrap();
        let opts = if spec.null_options {
            Opts {
                mode: AdamMode::AdamW,
                bias: true,
                moment: DType::F32,
                grad: DType::F32,
                accum: DType::F32,
                speculation: api::SPEC_AUTO,
                limit: None,
                copy: None,
                spec: spec.clone(),
            }
        } else {
            Opts {
                mode: if spec.mode == api::MODE_L2 { AdamMode::L2 } else { AdamMode::AdamW },
                bias: spec.bias_correction,
                moment: dt(spec.moment),
                grad: dt(spec.grad),
                accum: dt(spec.accum),
                speculation: spec.speculation,
                limit: (spec.limit != 0).then_some(spec.limit as usize),
                copy: dtype_from_raw(spec.copy).flatten(),
                spec: spec.clone(),
            }
        };
        let scaler = if spec.null_options { None } else { spec.scaler.as_ref().map(Scaler::new) };
        self.sess = Some(Sess::new(Session(out), opts, scaler, self.scratch_path()));
        Ok(())
    }

    fn destroy(&mut self) -> Check {
        let scratch = self.scratch_path();
        let mut s = self.sess.take().unwrap();
        let idle = s.phase == Phase::Idle;
        if idle && let Err(e) = s.settle(&mut self.stats, &scratch, None, false) {
            self.sess = Some(s);
            return Err(e);
        }
        unsafe { s.h.destroy() };
        api::count_call();
        if idle {
            // Destroying changes no weights; the buffers are the caller's again.
            for sg in s.sgs.iter().flatten() {
                sg.check_master(" at destroy")?;
            }
        }
        Ok(())
    }

    fn observe_op(&mut self) -> Check {
        let scratch = self.scratch_path();
        let s = self.sess.as_mut().unwrap();
        if s.phase != Phase::Idle {
            let st = s.h.save_path(&scratch);
            api::count_call();
            judge("so_session_save during a step", st, &[Status::InvalidState])?;
            self.stats.refusals += 1;
            return Ok(());
        }
        s.settle(&mut self.stats, &scratch, None, true)
    }

    fn save(&mut self, target: SaveTarget) -> Check {
        let path = match target {
            SaveTarget::Slot(k) => self.slot_path(k),
            SaveTarget::MissingDir => self.dir.join("no such dir").join("x.safetensors"),
            SaveTarget::Directory => self.dir.clone(),
            _ => PathBuf::new(),
        };
        let s = self.sess.as_mut().unwrap();
        let st = match target {
            SaveTarget::Null => unsafe { s.h.save(std::ptr::null()) },
            SaveTarget::NonUtf8 => {
                let p = CString::new(vec![b'/', b't', 0xff, 0xfe]).unwrap();
                unsafe { s.h.save(p.as_ptr()) }
            }
            _ => s.h.save_path(&path),
        };
        api::count_call();
        let mut errs = Vec::new();
        match target {
            SaveTarget::Null => errs.push(Status::NullArgument),
            SaveTarget::NonUtf8 => errs.push(Status::InvalidArgument),
            SaveTarget::MissingDir | SaveTarget::Directory => errs.push(Status::Io),
            SaveTarget::Slot(_) => {}
        }
        if s.phase != Phase::Idle {
            errs.push(Status::InvalidState);
        }
        if !judge("so_session_save", st, &errs)? {
            self.stats.refusals += 1;
            if s.phase == Phase::Idle && s.pending.is_none() {
                s.check_quiet()?;
            }
            return Ok(());
        }
        self.stats.saves += 1;
        let (bytes, snap) = ckpt::read(&path).map_err(|e| format!("the saved checkpoint does not parse: {e}"))?;
        // A save is an observation: the file holds the moments the reference is checked against.
        s.settle(&mut self.stats, &path, Some(&snap), true)?;
        if let SaveTarget::Slot(k) = target {
            self.files.insert(k, FileEntry { bytes, snap });
        }
        Ok(())
    }

    fn load(&mut self, source: LoadSource) -> Check {
        let scratch = self.scratch_path();
        {
            let s = self.sess.as_mut().unwrap();
            if s.phase == Phase::Idle {
                s.settle(&mut self.stats, &scratch, None, false)?;
            }
        }
        let corrupt = self.dir.join("corrupt.safetensors");
        // (path, the snapshot it holds if it is a good file, the snapshot it came from if corrupted)
        let (path, good, origin): (Option<PathBuf>, Option<&Snapshot>, Option<&Snapshot>) = match source {
            LoadSource::Slot(k) => (Some(self.slot_path(k)), self.files.get(&k).map(|f| &f.snap), None),
            LoadSource::Truncated(k, seed) | LoadSource::Flipped(k, seed) => match self.files.get(&k) {
                Some(f) => {
                    let mut bytes = f.bytes.clone();
                    if matches!(source, LoadSource::Truncated(..)) {
                        bytes.truncate((seed % bytes.len() as u64) as usize);
                    } else {
                        let bit = seed % (bytes.len() as u64 * 8);
                        bytes[(bit / 8) as usize] ^= 1 << (bit % 8);
                    }
                    std::fs::write(&corrupt, &bytes).unwrap();
                    (Some(corrupt.clone()), None, Some(&f.snap))
                }
                None => {
                    std::fs::write(&corrupt, b"not a checkpoint").unwrap();
                    (Some(corrupt.clone()), None, None)
                }
            },
            LoadSource::Garbage(seed) => {
                let mut rng = Rng::new(seed);
                let n = rng.below(3000);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                std::fs::write(&corrupt, &bytes).unwrap();
                (Some(corrupt.clone()), None, None)
            }
            LoadSource::Empty => {
                std::fs::write(&corrupt, b"").unwrap();
                (Some(corrupt.clone()), None, None)
            }
            LoadSource::Missing => (Some(self.dir.join("missing.safetensors")), None, None),
            LoadSource::Directory => (Some(self.dir.clone()), None, None),
            LoadSource::Null => (None, None, None),
        };
        let s = self.sess.as_mut().unwrap();
        let st = match &path {
            Some(p) => s.h.load_path(p),
            None => unsafe { s.h.load(std::ptr::null()) },
        };
        api::count_call();
        let mut errs = Vec::new();
        let mut ok_state: Option<&Snapshot> = None;
        match source {
            LoadSource::Null => errs.push(Status::NullArgument),
            LoadSource::Missing | LoadSource::Directory => errs.push(Status::Io),
            LoadSource::Slot(_) => match good {
                None => errs.push(Status::Io),
                Some(snap) => match s.load_verdict(snap) {
                    Ok(()) => ok_state = Some(snap),
                    Err(e) => errs.push(e),
                },
            },
            _ => errs.push(Status::BadCheckpoint),
        }
        if s.phase != Phase::Idle {
            errs.push(Status::InvalidState);
            ok_state = None;
            if errs.len() == 1 {
                // A load that would succeed is refused during a step.
            }
        }
        if st == Status::Ok && ok_state.is_none() && s.phase == Phase::Idle {
            // A corrupted file loaded: acceptable only if the corruption changed nothing
            // the checkpoint means (the state must then be the original's).
            if let Some(orig) = origin
                && s.load_verdict(orig).is_ok()
            {
                s.apply_snapshot(orig);
                self.stats.loads_ok += 1;
                return s.check_loaded(orig);
            }
        }
        if !judge(&format!("so_session_load({source:?})"), st, &errs)? {
            self.stats.loads_refused += 1;
            self.stats.refusals += 1;
            if s.phase == Phase::Idle {
                s.drained();
                s.check_quiet()?;
            }
            return Ok(());
        }
        let snap = ok_state.unwrap();
        self.stats.loads_ok += 1;
        s.apply_snapshot(snap);
        s.check_loaded(snap)
    }

    fn repartition(&mut self, seed: u64) -> Check {
        let scratch = self.scratch_path();
        let (snap, opts_spec, groups) = {
            let s = self.sess.as_mut().unwrap();
            if s.phase != Phase::Idle {
                return Ok(());
            }
            s.settle(&mut self.stats, &scratch, None, true)?;
            let (_, snap) = ckpt::read(&scratch)?;
            (snap, s.opts.spec.clone(), s.groups.clone())
        };
        // The live slices in registration order, with their master dtype and step.
        let old = self.sess.as_ref().unwrap();
        let mut order: Vec<(String, usize, DType, u64, u32)> = Vec::new();
        for sg in old.sgs.iter().flatten() {
            for &sl in &sg.slices {
                let info = &old.slices[sl as usize];
                order.push((info.name.clone(), info.range.len(), sg.master_dtype, sg.count, sg.group));
            }
        }
        self.apply(&Op::Destroy)?;
        let mut spec = opts_spec;
        spec.null_out = false;
        self.create(&spec)?;
        let s = self.sess.as_mut().unwrap();
        for g in &groups {
            let hp = HpSpec { hp: [g.lr, g.beta1, g.beta2, g.eps, g.weight_decay], bad: HpBad::None };
            s.apply(&Op::AddGroup { hp, null_out: false }, &mut self.stats, &scratch, false)?;
        }
        let mut rng = Rng::new(seed);
        let mut i = 0;
        while i < order.len() {
            let mut j = i + 1;
            // Only slices of one dtype, group and step count can share a sub-group.
            while j < order.len()
                && order[j].2 == order[i].2
                && order[j].3 == order[i].3
                && order[j].4 == order[i].4
                && rng.below(3) != 0
            {
                j += 1;
            }
            let mut offset = 0;
            let slices = order[i..j]
                .iter()
                .map(|(name, n, ..)| {
                    let sl = SliceSpec { name: NameSpec::Named(name.clone()), offset, numel: *n };
                    offset += n;
                    sl
                })
                .collect();
            let raw = match order[i].2 {
                DType::F32 => api::DT_F32,
                DType::Bf16 => api::DT_BF16,
                DType::F16 => api::DT_F16,
            };
            let sg = SgSpec {
                group: order[i].4,
                numel: offset,
                master_dtype: raw,
                slices,
                caller_grad: false,
                seed: rng.next_u64(),
                bad: SgBad::None,
                placement: api::PLACE_HOST,
            };
            s.add_subgroup(&sg, &mut self.stats)?;
            i = j;
        }
        let st = s.h.load_path(&scratch);
        api::count_call();
        let expected = s.load_verdict(&snap);
        match expected {
            Ok(()) => {
                judge("so_session_load into another partition", st, &[])?;
                s.apply_snapshot(&snap);
                self.stats.repartitions += 1;
                s.check_loaded(&snap)
            }
            Err(e) => {
                // A memory limit can refuse some sub-groups, so the layout differs.
                judge("so_session_load into another partition", st, &[e])?;
                Ok(())
            }
        }
    }
}

fn sentinel_session() -> *mut api::so_session {
    0x5EAD_0000usize as *mut api::so_session
}

static ONE_CORE: [u32; 1] = [0];

fn create_raw(spec: &CreateSpec, pool: *const superoffload::ffi::pool::so_pool) -> (Status, *mut api::so_session) {
    let mut o = api::session_options_default();
    o.struct_size = (o.struct_size as isize + spec.size_delta) as usize;
    o.mode = spec.mode;
    o.bias_correction = spec.bias_correction;
    o.moment_dtype = spec.moment;
    o.grad_dtype = spec.grad;
    o.accum_dtype = spec.accum;
    api::set_speculation(&mut o, spec.speculation);
    o.host_memory_limit = spec.limit;
    o.amsgrad = spec.amsgrad;
    o.copy_dtype = spec.copy;
    o.gpu_budget_bytes = spec.gpu_budget;
    let mut scaler = api::loss_scaler_options_default();
    if let Some(s) = &spec.scaler {
        if !s.size_ok {
            scaler.struct_size += 4;
        }
        scaler.init_scale = s.options.init_scale;
        scaler.growth_factor = s.options.growth_factor;
        scaler.backoff_factor = s.options.backoff_factor;
        scaler.growth_interval = s.options.growth_interval;
        scaler.hysteresis = s.options.hysteresis;
        scaler.min_scale = s.options.min_scale;
        o.loss_scaler = &scaler;
    }
    let cores: Vec<u32> = match &spec.pool {
        PoolSpec::Cores(c) => c.clone(),
        PoolSpec::Both => vec![0],
        _ => Vec::new(),
    };
    match &spec.pool {
        PoolSpec::Default => {}
        PoolSpec::Shared => o.pool = pool,
        PoolSpec::Cores(_) => {
            o.cores = cores.as_ptr();
            o.num_cores = cores.len();
        }
        PoolSpec::Both => {
            o.pool = pool;
            o.cores = cores.as_ptr();
            o.num_cores = cores.len();
        }
        PoolSpec::CoresNull => o.num_cores = 2,
        PoolSpec::CoresEmpty => o.cores = ONE_CORE.as_ptr(),
    }
    let mut out = sentinel_session();
    let st = unsafe {
        api::create(
            if spec.null_options { std::ptr::null() } else { &o },
            if spec.null_out { std::ptr::null_mut() } else { &mut out },
        )
    };
    api::count_call();
    (st, out)
}

fn create_errors(spec: &CreateSpec) -> Vec<Status> {
    let mut e = Vec::new();
    if spec.null_out {
        e.push(Status::NullArgument);
    }
    if spec.null_options {
        return e;
    }
    if spec.size_delta != 0 {
        e.push(Status::StructSize);
    }
    if spec.mode != api::MODE_ADAMW && spec.mode != api::MODE_L2 {
        e.push(Status::InvalidArgument);
    }
    for raw in [spec.moment, spec.grad, spec.accum] {
        if dtype_from_raw(raw).flatten().is_none() {
            e.push(Status::InvalidArgument);
        }
    }
    if dtype_from_raw(spec.copy).is_none() {
        e.push(Status::InvalidArgument);
    }
    if spec.speculation > api::SPEC_AUTO {
        e.push(Status::InvalidArgument);
    }
    if spec.amsgrad || spec.moment == api::DT_F16 || spec.copy == api::DT_F32 || spec.gpu_budget != 0 {
        e.push(Status::Unsupported);
    }
    if let Some(s) = &spec.scaler {
        if !s.size_ok {
            e.push(Status::StructSize);
        }
        if !Scaler::valid(&s.options) {
            e.push(Status::InvalidArgument);
        }
    }
    match &spec.pool {
        PoolSpec::Both | PoolSpec::CoresEmpty => e.push(Status::InvalidArgument),
        PoolSpec::CoresNull => e.push(Status::NullArgument),
        PoolSpec::Cores(c) => {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
            let mut sorted = c.clone();
            sorted.sort();
            sorted.dedup();
            if c.iter().any(|&x| x >= n) || sorted.len() != c.len() {
                e.push(Status::InvalidArgument);
            }
        }
        _ => {}
    }
    e
}

fn null_handle() -> Check {
    let h = Session(std::ptr::null_mut());
    let mut t = 0;
    let mut x = 0u32;
    let hp = api::group_hparams_default();
    let path = api::cstring("/nonexistent");
    let results = unsafe {
        [
            ("begin_step", h.begin_step(1.0, 1)),
            ("step", h.step(std::ptr::null(), &mut t)),
            ("add_group", h.add_group(&hp, &mut x)),
            ("save", h.save(path.as_ptr())),
            ("load", h.load(path.as_ptr())),
            ("ticket_wait", h.ticket_wait(1, 0)),
            ("ticket_query", h.ticket_query(1)),
            ("next_micro_step", h.next_micro_step()),
        ]
    };
    for (what, st) in results {
        api::count_call();
        ensure!(st == Status::NullArgument, "{what} on a NULL session: {st:?}");
    }
    unsafe { h.destroy() };
    Ok(())
}

impl Sess {
    fn new(h: Session, opts: Opts, scaler: Option<Scaler>, scratch: PathBuf) -> Sess {
        Sess {
            h,
            opts,
            groups: Vec::new(),
            sgs: Vec::new(),
            slices: Vec::new(),
            names: HashMap::new(),
            phase: Phase::Idle,
            serial: 0,
            s: 1.0,
            scaler,
            host_bytes: 0,
            spec_min: 0,
            spec_max: 0,
            late_count: 0,
            pending: None,
            step_tickets: Vec::new(),
            outcomes: HashMap::new(),
            handoffs: Vec::new(),
            hidden: Vec::new(),
            last_seen: 0,
            refusals: 0,
            scratch,
        }
    }

    pub fn live_sgs(&self) -> impl Iterator<Item = &SgM> {
        self.sgs.iter().flatten()
    }

    fn sg(&self, id: u32) -> Option<&SgM> {
        self.sgs.get(id as usize).and_then(Option::as_ref)
    }

    fn live_slice(&self, id: u32) -> Option<&SliceM> {
        self.slices.get(id as usize).filter(|s| s.alive)
    }

    /// Everything the session had queued is done (after a save or load, which drain).
    fn drained(&mut self) {
        for sg in self.sgs.iter_mut().flatten() {
            sg.final_waited = true;
        }
    }

    pub fn apply(&mut self, op: &Op, stats: &mut Stats, scratch: &Path, observe: bool) -> Check {
        match op {
            Op::AddGroup { hp, null_out } => self.add_group(hp, *null_out, stats),
            Op::SetGroup { group, hp } => self.set_group(*group, hp, stats),
            Op::GetGroup { group, bad } => self.get_group(*group, *bad, stats),
            Op::RemoveSubgroup { sg } => self.remove_subgroup(*sg, stats, scratch),
            Op::SetPlacement { sg, placement } => {
                let st = self.h.set_placement(*sg, *placement);
                api::count_call();
                let mut e = Vec::new();
                match *placement {
                    api::PLACE_HOST => {}
                    api::PLACE_DEVICE => e.push(Status::Unsupported),
                    _ => e.push(Status::InvalidArgument),
                }
                if self.phase != Phase::Idle {
                    e.push(Status::InvalidState);
                }
                if self.sg(*sg).is_none() {
                    e.push(Status::NotFound);
                }
                if !judge("so_session_set_placement", st, &e)? {
                    stats.refusals += 1;
                    return self.refused(stats);
                }
                self.check_quiet()
            }
            Op::SliceId { name } => self.slice_id(name, stats),
            Op::BeginStep { loss_scale, micro_steps, settle } => {
                self.begin_step(*loss_scale, *micro_steps, *settle, stats, scratch, observe)
            }
            Op::NextMicro => self.next_micro(stats),
            Op::GradCopy { slice, numel, fill, bad } => self.grad_copy(*slice, *numel, fill, *bad, stats),
            Op::GradWritten { slice, fill, add } => self.grad_written(*slice, fill, *add, stats),
            Op::LocalSumsq { timeout_ns, null_out } => self.local_sumsq(*timeout_ns, *null_out, stats),
            Op::Step(args) => self.step(args, stats),
            Op::StepResult { which, timeout_ns, bad_size } => {
                self.step_result_op(*which, *timeout_ns, *bad_size, stats, scratch, observe)
            }
            Op::Ticket { which, timeout_ns, how } => self.ticket_op(*which, *timeout_ns, *how),
            Op::StepCount { sg } => self.step_count(*sg),
            Op::LossScale => self.loss_scale_op(stats, scratch),
            Op::HostBytes => {
                let mut n = usize::MAX;
                let st = unsafe { self.h.host_bytes(&mut n) };
                api::count_call();
                judge("so_session_host_bytes", st, &[])?;
                ensure!(n == self.host_bytes, "host bytes {n}, model {}", self.host_bytes);
                Ok(())
            }
            Op::Settle => {
                if self.phase == Phase::Idle {
                    self.settle(stats, scratch, None, observe)?;
                    self.wait_finals()?;
                    self.check_quiet()?;
                }
                Ok(())
            }
            Op::Trace(on) => {
                let st = self.h.trace(*on);
                api::count_call();
                judge("so_session_trace", st, &[]).map(drop)
            }
            Op::TraceSave { bad_dir } => {
                let path = if *bad_dir {
                    scratch.with_file_name("no such dir").join("trace.json")
                } else {
                    scratch.with_file_name("trace.json")
                };
                let p = api::cstring(path.to_str().unwrap());
                let st = unsafe { self.h.trace_save(p.as_ptr()) };
                api::count_call();
                judge("so_session_trace_save", st, if *bad_dir { &[Status::Io] } else { &[] }).map(drop)
            }
            _ => unreachable!("handled by World"),
        }
    }

    // ----- groups -----------------------------------------------------------------------

    fn hp_struct(hp: &HpSpec) -> api::so_group_hparams {
        let mut h = api::group_hparams_default();
        h.lr = hp.hp[0];
        h.beta1 = hp.hp[1];
        h.beta2 = hp.hp[2];
        h.eps = hp.hp[3];
        h.weight_decay = hp.hp[4];
        if hp.bad == HpBad::Size {
            h.struct_size -= 8;
        }
        h
    }

    fn hp_errors(hp: &HpSpec) -> Vec<Status> {
        match hp.bad {
            HpBad::Null => vec![Status::NullArgument],
            HpBad::Size => vec![Status::StructSize],
            HpBad::None if !hp_valid(&hp_of(hp.hp)) => vec![Status::InvalidArgument],
            HpBad::None => vec![],
        }
    }

    fn add_group(&mut self, hp: &HpSpec, null_out: bool, stats: &mut Stats) -> Check {
        let h = Self::hp_struct(hp);
        let mut out = 0xDEAD_BEEFu32;
        let st = unsafe {
            self.h.add_group(
                if hp.bad == HpBad::Null { std::ptr::null() } else { &h },
                if null_out { std::ptr::null_mut() } else { &mut out },
            )
        };
        api::count_call();
        let mut errs = Self::hp_errors(hp);
        if null_out {
            errs.push(Status::NullArgument);
        }
        if !judge("so_session_add_group", st, &errs)? {
            stats.refusals += 1;
            ensure!(out == 0xDEAD_BEEF, "add_group wrote its out-parameter on failure");
            return self.refused(stats);
        }
        ensure!(out as usize == self.groups.len(), "add_group returned id {out}, model {}", self.groups.len());
        self.groups.push(hp_of(hp.hp));
        Ok(())
    }

    fn set_group(&mut self, group: u32, hp: &HpSpec, stats: &mut Stats) -> Check {
        let h = Self::hp_struct(hp);
        let st = unsafe { self.h.set_group(group, if hp.bad == HpBad::Null { std::ptr::null() } else { &h }) };
        api::count_call();
        let mut errs = Self::hp_errors(hp);
        if group as usize >= self.groups.len() {
            errs.push(Status::NotFound);
        }
        if !judge("so_session_set_group", st, &errs)? {
            stats.refusals += 1;
            return self.refused(stats);
        }
        self.groups[group as usize] = hp_of(hp.hp);
        Ok(())
    }

    fn get_group(&mut self, group: u32, bad: HpBad, stats: &mut Stats) -> Check {
        let mut out = api::group_hparams_default();
        out.lr = -77.0;
        if bad == HpBad::Size {
            out.struct_size += 8;
        }
        let st = unsafe { self.h.get_group(group, if bad == HpBad::Null { std::ptr::null_mut() } else { &mut out }) };
        api::count_call();
        let mut errs = Vec::new();
        match bad {
            HpBad::Null => errs.push(Status::NullArgument),
            HpBad::Size => errs.push(Status::StructSize),
            HpBad::None => {}
        }
        if group as usize >= self.groups.len() {
            errs.push(Status::NotFound);
        }
        if !judge("so_session_get_group", st, &errs)? {
            stats.refusals += 1;
            ensure!(out.lr == -77.0, "get_group wrote its out-parameter on failure");
            return Ok(());
        }
        let got = GroupHparams {
            lr: out.lr,
            beta1: out.beta1,
            beta2: out.beta2,
            eps: out.eps,
            weight_decay: out.weight_decay,
        };
        ensure!(
            hp_bits_equal(&got, &self.groups[group as usize]),
            "group {group}: {got:?} vs model {:?}",
            self.groups[group as usize]
        );
        Ok(())
    }

    // ----- sub-groups -------------------------------------------------------------------

    pub fn add_subgroup(&mut self, spec: &SgSpec, stats: &mut Stats) -> Check {
        let o = self.opts.clone();
        let mdt = dtype_from_raw(spec.master_dtype);
        let esize = mdt.flatten().map_or(4, DType::size);
        let master = RawBuf::new(spec.numel * esize + 64);
        let mut rng = Rng::new(spec.seed);
        let init = mdt.flatten().map(|d| {
            let s = Store::from_f64(d, (0..spec.numel).map(|_| rng.normalish(0.5)).collect::<Vec<_>>().into_iter());
            master.write(&s);
            s
        });
        let grad_buf = spec.caller_grad.then(|| {
            let b = RawBuf::new(spec.numel * o.accum.size() + 64);
            // Junk the session must zero for slices without a gradient (and keeps elsewhere).
            let junk =
                Store::from_f64(o.accum, (0..spec.numel).map(|_| rng.normalish(0.01)).collect::<Vec<_>>().into_iter());
            b.write(&junk);
            (b, junk)
        });
        let other = match spec.bad {
            SgBad::OverlapOther(k) => self.sg(k).map(|sg| sg.master.ptr()),
            _ => None,
        };
        let master_ptr: *mut c_void = match spec.bad {
            SgBad::NullMaster => std::ptr::null_mut(),
            SgBad::Misaligned => master.ptr().wrapping_add(1).cast(),
            SgBad::OverlapOther(_) => other.unwrap_or(master.ptr()).cast(),
            _ => master.ptr().cast(),
        };
        let grad_ptr: *mut c_void = match (&grad_buf, spec.bad) {
            (_, SgBad::GradOverlapsMaster) => master_ptr,
            (Some((b, _)), SgBad::GradMisaligned) => b.ptr().wrapping_add(1).cast(),
            (Some((b, _)), _) => b.ptr().cast(),
            (None, _) => std::ptr::null_mut(),
        };
        let names: Vec<Option<CString>> = spec
            .slices
            .iter()
            .map(|s| match &s.name {
                NameSpec::Named(n) => Some(CString::new(n.as_str()).unwrap()),
                NameSpec::NonUtf8 => Some(CString::new(vec![b'x', 0xff, 0xfe]).unwrap()),
                NameSpec::Null => None,
            })
            .collect();
        let raw_slices: Vec<api::so_slice_desc> = spec
            .slices
            .iter()
            .zip(&names)
            .map(|(s, n)| api::so_slice_desc {
                name: n.as_ref().map_or(std::ptr::null(), |c| c.as_ptr() as *const c_char),
                offset: s.offset,
                numel: s.numel,
            })
            .collect();
        let mut d = api::subgroup_desc_default();
        if spec.bad == SgBad::Size {
            d.struct_size += 16;
        }
        d.group = spec.group;
        d.master = master_ptr;
        d.master_dtype = spec.master_dtype;
        d.numel = if spec.bad == SgBad::HugeNumel { usize::MAX / 2 } else { spec.numel };
        d.grad = grad_ptr;
        d.slices = if spec.bad == SgBad::NullSlices { std::ptr::null() } else { raw_slices.as_ptr() };
        d.num_slices = if spec.bad == SgBad::ZeroSlices { 0 } else { raw_slices.len() };
        if spec.bad == SgBad::DeviceParam {
            d.device_param = 0x1000;
        }
        d.placement = spec.placement;
        let mut out = 0xDEAD_BEEFu32;
        let st = unsafe {
            self.h.add_subgroup(
                if spec.bad == SgBad::NullDesc { std::ptr::null() } else { &d },
                if spec.bad == SgBad::NullOut { std::ptr::null_mut() } else { &mut out },
            )
        };
        api::count_call();

        // Every refusal that applies.
        let mut e = Vec::new();
        match spec.bad {
            SgBad::NullDesc | SgBad::NullOut | SgBad::NullMaster | SgBad::NullSlices | SgBad::ZeroSlices => {
                e.push(Status::NullArgument)
            }
            SgBad::Size => e.push(Status::StructSize),
            SgBad::Misaligned | SgBad::GradMisaligned | SgBad::DeviceParam | SgBad::HugeNumel => {
                e.push(Status::InvalidArgument)
            }
            SgBad::GradOverlapsMaster => e.push(Status::Aliasing),
            SgBad::OverlapOther(_) if other.is_some() => e.push(Status::Aliasing),
            _ => {}
        }
        if mdt.flatten().is_none() {
            e.push(Status::InvalidArgument);
        }
        match spec.placement {
            api::PLACE_HOST => {}
            api::PLACE_DEVICE => e.push(Status::Unsupported),
            _ => e.push(Status::InvalidArgument),
        }
        if spec.slices.iter().any(|s| s.name == NameSpec::Null) {
            e.push(Status::NullArgument);
        }
        if spec.slices.iter().any(|s| s.name == NameSpec::NonUtf8) {
            e.push(Status::InvalidArgument);
        }
        if self.phase != Phase::Idle {
            e.push(Status::InvalidState);
        }
        if spec.group as usize >= self.groups.len() {
            e.push(Status::NotFound);
        }
        if spec.numel == 0 {
            e.push(Status::InvalidArgument);
        }
        if spec.slices.is_empty() {
            e.push(Status::NullArgument);
        }
        let mut seen_names: Vec<&str> = Vec::new();
        for (i, s) in spec.slices.iter().enumerate() {
            if let NameSpec::Named(n) = &s.name {
                if n.is_empty() || self.names.contains_key(n) || seen_names.contains(&n.as_str()) {
                    e.push(Status::InvalidArgument);
                }
                seen_names.push(n);
            }
            if s.numel == 0 || s.offset.checked_add(s.numel).is_none_or(|end| end > spec.numel) {
                e.push(Status::InvalidArgument);
            }
            for t in &spec.slices[i + 1..] {
                if s.numel > 0 && t.numel > 0 && s.offset < t.offset + t.numel && t.offset < s.offset + s.numel {
                    e.push(Status::Aliasing);
                }
            }
        }
        let bytes = 2 * spec.numel * o.moment.size()
            + if spec.caller_grad { 0 } else { spec.numel * o.accum.size() }
            + o.copy.map_or(0, |c| spec.numel * c.size());
        if o.limit.is_some_and(|l| self.host_bytes + bytes > l) {
            e.push(Status::OutOfResources);
        }
        if spec.bad == SgBad::HugeNumel {
            e.extend([Status::OutOfResources, Status::Aliasing]);
        }
        if !judge("so_session_add_subgroup", st, &e)? {
            stats.refusals += 1;
            ensure!(out == 0xDEAD_BEEF, "add_subgroup wrote its out-parameter on failure");
            return self.refused(stats);
        }
        let id = self.sgs.len() as u32;
        ensure!(out == id, "add_subgroup returned {out}, model {id}");
        let dtype = mdt.flatten().unwrap();
        let mut covered = vec![false; spec.numel];
        let mut slice_ids = Vec::new();
        for s in &spec.slices {
            let NameSpec::Named(name) = &s.name else { unreachable!() };
            let sid = self.slices.len() as u32;
            self.names.insert(name.clone(), sid);
            self.slices.push(SliceM {
                name: name.clone(),
                sg: id,
                range: s.offset..s.offset + s.numel,
                alive: true,
                seen: 0,
            });
            slice_ids.push(sid);
            covered[s.offset..s.offset + s.numel].fill(true);
        }
        let (grad_buf, mut g) = match grad_buf {
            Some((b, junk)) => (Some(b), junk),
            None => (None, zeros(o.accum, spec.numel)),
        };
        // Elements outside every slice are padding, zeroed at registration.
        let mut p = init.unwrap();
        for i in (0..spec.numel).filter(|&i| !covered[i]) {
            set_bits(&mut p, i, 0);
            set_bits(&mut g, i, 0);
        }
        self.host_bytes += bytes;
        self.sgs.push(Some(SgM {
            id,
            group: spec.group,
            numel: spec.numel,
            master_dtype: dtype,
            master,
            grad_buf,
            slices: slice_ids,
            covered,
            g,
            late: None,
            late_merged: false,
            p,
            m: zeros(o.moment, spec.numel),
            v: zeros(o.moment, spec.numel),
            known: vec![true; spec.numel],
            count: 0,
            count_prev: 0,
            approx: None,
            slices_done: 0,
            submitted: None,
            final_ticket: 0,
            final_waited: true,
            host_bytes: bytes,
            late_bytes: 0,
        }));
        Ok(())
    }

    fn remove_subgroup(&mut self, id: u32, stats: &mut Stats, scratch: &Path) -> Check {
        if self.phase == Phase::Idle {
            self.settle(stats, scratch, None, false)?;
        }
        let st = unsafe { self.h.remove_subgroup(id) };
        api::count_call();
        let mut e = Vec::new();
        if self.phase != Phase::Idle {
            e.push(Status::InvalidState);
        }
        if self.sg(id).is_none() {
            e.push(Status::NotFound);
        }
        if !judge("so_session_remove_subgroup", st, &e)? {
            stats.refusals += 1;
            return self.refused(stats);
        }
        self.drained();
        let sg = self.sgs[id as usize].take().unwrap();
        // It is the caller's again: the session left its weights as they were.
        sg.check_master(" by remove_subgroup")?;
        self.host_bytes -= sg.host_bytes + sg.late_bytes;
        for &sl in &sg.slices {
            let s = &mut self.slices[sl as usize];
            s.alive = false;
            self.names.remove(&s.name);
        }
        Ok(())
    }

    fn slice_id(&mut self, name: &NameSpec, stats: &mut Stats) -> Check {
        let c = match name {
            NameSpec::Named(n) => Some(CString::new(n.as_str()).unwrap()),
            NameSpec::NonUtf8 => Some(CString::new(vec![0xffu8]).unwrap()),
            NameSpec::Null => None,
        };
        let mut out = 0xDEAD_BEEFu32;
        let st = unsafe { self.h.slice_id(c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()), &mut out) };
        api::count_call();
        let errs = match name {
            NameSpec::Null => vec![Status::NullArgument],
            NameSpec::NonUtf8 => vec![Status::InvalidArgument, Status::NotFound],
            NameSpec::Named(n) if !self.names.contains_key(n) => vec![Status::NotFound],
            NameSpec::Named(_) => vec![],
        };
        if !judge("so_session_slice_id", st, &errs)? {
            stats.refusals += 1;
            ensure!(out == 0xDEAD_BEEF, "slice_id wrote its out-parameter on failure");
            return Ok(());
        }
        let NameSpec::Named(n) = name else { unreachable!() };
        ensure!(out == self.names[n], "slice {n}: id {out}, model {}", self.names[n]);
        Ok(())
    }

    // ----- one step ---------------------------------------------------------------------

    fn begin_step(
        &mut self,
        loss_scale: f32,
        micro_steps: u32,
        settle: bool,
        stats: &mut Stats,
        scratch: &Path,
        observe: bool,
    ) -> Check {
        if self.phase == Phase::Idle && self.pending.as_ref().is_some_and(|p| settle || p.needs_settle) {
            self.settle(stats, scratch, None, observe)?;
        }
        self.prune();
        if self.pending.is_some() {
            stats.lazy += 1;
        }
        let st = unsafe { self.h.begin_step(loss_scale, micro_steps) };
        api::count_call();
        let mut e = Vec::new();
        if self.phase != Phase::Idle {
            e.push(Status::InvalidState);
        }
        if micro_steps == 0 {
            e.push(Status::InvalidArgument);
        }
        let explicit = loss_scale != 0.0;
        // The reciprocal must be finite in f32 too (the unscale factor).
        if explicit && !(loss_scale.is_finite() && loss_scale > 0.0 && unscale_of(loss_scale).is_finite()) {
            e.push(Status::InvalidArgument);
        }
        let s = if explicit { loss_scale } else { self.scaler.map_or(1.0, |s| s.scale) };
        if !judge(&format!("so_session_begin_step({loss_scale}, {micro_steps})"), st, &e)? {
            stats.refusals += 1;
            return self.refused(stats);
        }
        self.s = s;
        self.serial += 1;
        self.phase = Phase::Backward { micro: 0, micro_steps };
        for sl in &mut self.slices {
            sl.seen = 0;
        }
        for sg in self.sgs.iter_mut().flatten() {
            sg.slices_done = 0;
            sg.submitted = None;
            sg.late_merged = false;
        }
        self.spec_min = 0;
        self.spec_max = 0;
        self.late_count = 0;
        Ok(())
    }

    fn next_micro(&mut self, stats: &mut Stats) -> Check {
        let st = unsafe { self.h.next_micro_step() };
        api::count_call();
        match self.phase {
            Phase::Backward { micro, micro_steps } if micro + 1 < micro_steps => {
                judge("so_session_next_micro_step", st, &[])?;
                self.phase = Phase::Backward { micro: micro + 1, micro_steps };
                Ok(())
            }
            _ => {
                judge("so_session_next_micro_step", st, &[Status::InvalidState])?;
                stats.refusals += 1;
                self.refused(stats)
            }
        }
    }

    /// Can the sub-group step speculatively with these hyperparameters, and does it write the
    /// copy alone (`Some(true)`: no exact rollback, but a copy to write ahead)?
    fn speculation(&self, sg: &SgM, g: &GroupHparams) -> Option<bool> {
        let o = &self.opts;
        let decay = match o.mode {
            AdamMode::AdamW => (1.0 - g.lr * g.weight_decay) as f32,
            AdamMode::L2 => 1.0,
        };
        if o.speculation == api::SPEC_OFF || sg.master_dtype != DType::F32 {
            return None;
        }
        let rollback = o.moment == DType::F32 && g.beta1 > 0.0 && g.beta2 > 0.0 && decay > 0.0;
        if rollback { Some(false) } else { o.copy.is_some().then_some(true) }
    }

    /// A gradient of the slice arrived in the current micro-step: returns whether it
    /// completed its sub-group (which then submits its speculative step or measurement).
    fn mark(&mut self, slice: u32) -> bool {
        let Phase::Backward { micro, micro_steps } = self.phase else { unreachable!() };
        let sl = &mut self.slices[slice as usize];
        let seen = std::mem::replace(&mut sl.seen, micro + 1);
        let sgid = sl.sg;
        if micro + 1 != micro_steps || seen == micro + 1 {
            return false;
        }
        let group = {
            let sg = self.sgs[sgid as usize].as_mut().unwrap();
            sg.slices_done += 1;
            if sg.slices_done < sg.slices.len() {
                return false;
            }
            self.groups[sg.group as usize]
        };
        let sg = self.sgs[sgid as usize].as_ref().unwrap();
        let certain = self.opts.speculation == api::SPEC_ON;
        let spec = self.speculation(sg, &group).map(|copy_ahead| {
            // Non-finite: the speculative step fails; squares beyond f32: it is declined.
            let applied = slices_sumsq(&self.slices, sg, unscale_of(self.s)) <= f32::MAX as f64;
            SpecM { hp: group, g: sg.g.clone(), applied, certain, copy_ahead }
        });
        if spec.is_some() {
            self.spec_min += certain as u32;
            self.spec_max += 1;
        }
        self.sgs[sgid as usize].as_mut().unwrap().submitted = Some(spec);
        true
    }

    fn grad_copy(&mut self, slice: u32, numel: usize, fill: &Fill, bad: GradBad, stats: &mut Stats) -> Check {
        let gdt = self.opts.grad;
        let values = fill_values(fill, numel, self.s as f64, gdt);
        let bytes = store_bytes(&values);
        // Aligned storage, or one byte off.
        let buf = RawBuf::new(bytes.len() + 8);
        let off = if bad == GradBad::Misaligned { 1 } else { 0 };
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.ptr().add(off), bytes.len()) };
        let ptr: *const c_void =
            if bad == GradBad::NullGrad { std::ptr::null() } else { buf.ptr().wrapping_add(off).cast() };
        let mut ticket: Ticket = 0xDEAD;
        let st = unsafe {
            self.h.grad_copy(
                slice,
                ptr,
                numel,
                if bad == GradBad::NullOutTicket { std::ptr::null_mut() } else { &mut ticket },
            )
        };
        api::count_call();
        let mut e = Vec::new();
        match bad {
            GradBad::NullGrad => e.push(Status::NullArgument),
            GradBad::Misaligned => e.push(Status::InvalidArgument),
            _ => {}
        }
        if !matches!(self.phase, Phase::Backward { .. }) {
            e.push(Status::InvalidState);
        }
        let target = self.live_slice(slice).map(|s| (s.sg, s.range.clone()));
        match &target {
            None => e.push(Status::NotFound),
            Some((_, r)) if r.len() != numel => e.push(Status::InvalidArgument),
            _ => {}
        }
        let late_alloc = target.as_ref().and_then(|(sgid, _)| {
            let sg = self.sg(*sgid).unwrap();
            (sg.submitted.is_some() && sg.late.is_none()).then_some(sg.numel * self.opts.accum.size())
        });
        if let (Some(more), Some(limit)) = (late_alloc, self.opts.limit)
            && self.host_bytes + more > limit
        {
            e.push(Status::OutOfResources);
        }
        if !judge(&format!("so_session_grad_copy(slice {slice}, {numel})"), st, &e)? {
            stats.refusals += 1;
            ensure!(ticket == 0xDEAD, "grad_copy wrote its ticket on failure");
            return self.refused(stats);
        }
        let (sgid, range) = target.unwrap();
        let accum = self.opts.accum;
        let sg = self.sgs[sgid as usize].as_mut().unwrap();
        if sg.submitted.is_some() {
            // Late: kept aside, merged at step().
            if sg.late.is_none() {
                sg.late = Some((zeros(accum, sg.numel), Vec::new()));
                sg.late_bytes = sg.numel * accum.size();
                self.host_bytes += sg.late_bytes;
            }
            let (buf, ranges) = sg.late.as_mut().unwrap();
            let seen = ranges.contains(&range);
            reference::copy_into(buf, range.clone(), &values, seen);
            if !seen {
                ranges.push(range);
            }
            self.late_count += 1;
            stats.late += 1;
            if bad != GradBad::NullOutTicket {
                ensure!(ticket == 0, "a late gradient returned ticket {ticket}");
            }
            return Ok(());
        }
        let accumulate = self.slices[slice as usize].seen > 0;
        reference::copy_into(&mut sg.g, range, &values, accumulate);
        let completes = self.mark(slice);
        self.after_handoff(slice, completes, bad != GradBad::NullOutTicket, ticket)
    }

    fn after_handoff(&mut self, slice: u32, completes: bool, has_out: bool, ticket: Ticket) -> Check {
        if has_out && !completes {
            ensure!(ticket == 0, "slice {slice}: a hand-off that completes nothing returned ticket {ticket}");
        }
        if !completes {
            return Ok(());
        }
        let sgid = self.slices[slice as usize].sg;
        let sg = self.sgs[sgid as usize].as_mut().unwrap();
        let Some(Some(spec)) = &mut sg.submitted else {
            // No speculative step: nothing queued, no ticket.
            ensure!(!has_out || ticket == 0, "slice {slice}: ticket {ticket} for a sub-group that cannot speculate");
            return Ok(());
        };
        // A speculative step that is cancelled before it runs (or declined) completes its
        // ticket with OK.
        let allowed = if spec.applied { vec![Status::Ok] } else { vec![Status::NonFinite, Status::Ok] };
        if !has_out {
            if allowed != [Status::Ok] {
                self.hidden.push((self.last_seen, allowed));
            }
            return Ok(());
        }
        if ticket == 0 {
            // The policy (speculation auto) did not speculate.
            ensure!(!spec.certain, "slice {slice}: speculation is on but the completing hand-off returned ticket 0");
            sg.submitted = Some(None);
            self.spec_max -= 1;
            return Ok(());
        }
        if !spec.certain {
            spec.certain = true;
            self.spec_min += 1;
        }
        self.seen_ticket(ticket);
        self.handoffs.push((ticket, allowed));
        Ok(())
    }

    fn seen_ticket(&mut self, t: Ticket) {
        self.last_seen = self.last_seen.max(t);
    }

    fn grad_written(&mut self, slice: u32, fill: &Fill, add: bool, stats: &mut Stats) -> Check {
        let target = self.live_slice(slice).map(|s| (s.sg, s.range.clone()));
        let backward = matches!(self.phase, Phase::Backward { .. });
        // The caller writes its buffer only while the session may not read it.
        if let (true, Some((sgid, range))) = (backward, &target) {
            let (writable, final_ticket, waited) = {
                let sg = self.sg(*sgid).unwrap();
                (sg.grad_buf.is_some() && sg.submitted.is_none(), sg.final_ticket, sg.final_waited)
            };
            if writable {
                if !waited {
                    let st = self.h.ticket_wait(final_ticket, -1);
                    api::count_call();
                    judge("so_ticket_wait(final ticket)", st, &[])?;
                    self.sgs[*sgid as usize].as_mut().unwrap().final_waited = true;
                }
                let accum = self.opts.accum;
                let s = self.s as f64;
                let sg = self.sgs[*sgid as usize].as_mut().unwrap();
                let values = fill_values(fill, range.len(), s, accum);
                reference::copy_into(&mut sg.g, range.clone(), &values, add);
                let part = sub(&sg.g, range.clone());
                let bytes = store_bytes(&part);
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        sg.grad_buf.as_ref().unwrap().ptr().add(range.start * accum.size()),
                        bytes.len(),
                    )
                };
            }
        }
        let mut ticket: Ticket = 0xDEAD;
        let st = unsafe { self.h.grad_written(slice, &mut ticket) };
        api::count_call();
        let mut e = Vec::new();
        if !backward {
            e.push(Status::InvalidState);
        }
        match &target {
            None => e.push(Status::NotFound),
            Some((sgid, _)) => {
                let sg = self.sg(*sgid).unwrap();
                if sg.grad_buf.is_none() {
                    e.push(Status::InvalidArgument);
                }
                if sg.submitted.is_some() {
                    e.push(Status::InvalidState);
                }
            }
        }
        if !judge(&format!("so_session_grad_written(slice {slice})"), st, &e)? {
            stats.refusals += 1;
            ensure!(ticket == 0xDEAD, "grad_written wrote its ticket on failure");
            return self.refused(stats);
        }
        let completes = self.mark(slice);
        self.after_handoff(slice, completes, true, ticket)
    }

    /// The preparation before the decision: zeros for slices without a gradient, late
    /// gradients merged.
    fn prepare(&mut self) {
        for sg in self.sgs.iter_mut().flatten() {
            for &sl in &sg.slices {
                let s = &self.slices[sl as usize];
                if s.seen == 0 {
                    let z = zeros(sg.g.dtype(), s.range.len());
                    put(&mut sg.g, s.range.start, &z);
                }
            }
            if let Some((buf, ranges)) = sg.late.as_mut()
                && !ranges.is_empty()
            {
                for r in ranges.drain(..) {
                    let part = sub(buf, r.clone());
                    reference::copy_into(&mut sg.g, r, &part, true);
                }
                sg.late_merged = true;
            }
        }
    }

    fn own_sumsq(&self) -> f64 {
        let unscale = unscale_of(self.s);
        self.live_sgs().map(|sg| slices_sumsq(&self.slices, sg, unscale)).sum()
    }

    fn local_sumsq(&mut self, timeout_ns: i64, null_out: bool, stats: &mut Stats) -> Check {
        let mut out = -7.0f64;
        let st = unsafe { self.h.local_grad_sumsq(timeout_ns, if null_out { std::ptr::null_mut() } else { &mut out }) };
        api::count_call();
        let mut e = Vec::new();
        if null_out {
            e.push(Status::NullArgument);
        }
        if self.phase == Phase::Idle {
            e.push(Status::InvalidState);
        }
        if !e.is_empty() {
            judge("so_session_local_grad_sumsq", st, &e)?;
            stats.refusals += 1;
            ensure!(out == -7.0, "local_grad_sumsq wrote its out-parameter on failure");
            return self.refused(stats);
        }
        if matches!(self.phase, Phase::Backward { .. }) {
            self.prepare();
            self.phase = Phase::Prepared;
        }
        if timeout_ns >= 0 && st == Status::Timeout {
            return Ok(());
        }
        judge("so_session_local_grad_sumsq", st, &[])?;
        let own = self.own_sumsq();
        ensure!(reference::norm_agrees(out, own, 1e-12), "local sum of squares {out:e}, reference {own:e}");
        Ok(())
    }

    fn step(&mut self, a: &ArgsSpec, stats: &mut Stats) -> Check {
        if self.phase != Phase::Idle && self.pending.is_some() {
            self.settle_lazy(stats)?;
        }
        let mut args = api::step_args_default();
        args.max_norm = a.max_norm;
        args.norm_source = a.norm_source;
        args.global_norm = a.given;
        args.overflow = a.overflow;
        if a.bad_size {
            args.struct_size += 8;
        }
        let mut ticket: Ticket = 0xDEAD;
        let st = unsafe {
            self.h.step(
                if a.null_args { std::ptr::null() } else { &args },
                if a.null_out { std::ptr::null_mut() } else { &mut ticket },
            )
        };
        api::count_call();
        let (max_norm, source, given, overflow) = if a.null_args {
            (0.0, api::NORM_LOCAL, 0.0, false)
        } else {
            (a.max_norm, a.norm_source, a.given, a.overflow)
        };
        let mut e = Vec::new();
        if a.null_out {
            e.push(Status::NullArgument);
        }
        if !a.null_args {
            if a.bad_size {
                e.push(Status::StructSize);
            }
            if source != api::NORM_LOCAL && source != api::NORM_GIVEN {
                e.push(Status::InvalidArgument);
            }
        }
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            e.push(Status::InvalidArgument);
        }
        if source == api::NORM_GIVEN && given < 0.0 {
            e.push(Status::InvalidArgument);
        }
        if self.phase == Phase::Idle {
            e.push(Status::InvalidState);
        }
        if !judge(&format!("so_session_step({a:?})"), st, &e)? {
            stats.refusals += 1;
            ensure!(ticket == 0xDEAD, "step wrote its ticket on failure");
            return self.refused(stats);
        }
        ensure!(ticket != 0, "step returned ticket 0");
        self.seen_ticket(ticket);
        if matches!(self.phase, Phase::Backward { .. }) {
            self.prepare();
        }
        self.phase = Phase::Idle;
        let given = (source == api::NORM_GIVEN).then_some(given);
        let unscale = unscale_of(self.s);
        let mut plan = Vec::new();
        let mut all_finite = true;
        let mut sumsq = 0.0;
        for sg in self.sgs.iter_mut().flatten() {
            let ss = slices_sumsq(&self.slices, sg, unscale);
            all_finite &= ss.is_finite();
            sumsq += ss;
            sg.count_prev = sg.count;
            sg.final_waited = false;
            plan.push(PlanSg {
                id: sg.id,
                g_final: sg.g.clone(),
                spec: sg.submitted.clone().flatten(),
                late: sg.late_merged,
            });
        }
        let own_norm = sumsq.sqrt();
        let groups = self.groups.clone();
        // Predict the decision at the own norm and at +-1e-11 relative: certain when all agree.
        let norms: Vec<f64> = match given {
            Some(n) => vec![n],
            None if own_norm.is_finite() && own_norm > 0.0 => {
                vec![own_norm * (1.0 - 1e-11), own_norm, own_norm * (1.0 + 1e-11)]
            }
            None => vec![own_norm],
        };
        let verdicts: Vec<(bool, bool)> = norms
            .iter()
            .map(|&n| {
                let d = decide(max_norm, n, given.is_some(), overflow, all_finite, self.s);
                (d.skip(), d.factor == unscale)
            })
            .collect();
        let certain = verdicts.iter().all(|v| *v == verdicts[0]);
        let (skip, kept_factor) = verdicts[0];
        let approx = plan.iter().any(|p| {
            let group = self.sgs[p.id as usize].as_ref().unwrap().group as usize;
            p.spec
                .as_ref()
                .is_some_and(|s| s.applied && (skip || p.late || !same_hp(&s.hp, &groups[group]) || !kept_factor))
        });
        let mut scaler_applied = false;
        if certain {
            if let Some(sc) = self.scaler.as_mut() {
                sc.update(skip);
            }
            scaler_applied = true;
        }
        for p in &plan {
            let t = self.h.final_of(p.id);
            api::count_call();
            let t = t.map_err(|st| format!("final_ticket({}) after step: {st:?}", p.id))?;
            ensure!(t != 0, "final ticket of sub-group {} is 0 after step()", p.id);
            self.seen_ticket(t);
            self.sgs[p.id as usize].as_mut().unwrap().final_ticket = t;
        }
        self.step_tickets.push(ticket);
        self.pending = Some(Pending {
            ticket,
            serial: self.serial,
            s: self.s,
            unscale,
            max_norm,
            given,
            overflow,
            groups,
            plan,
            own_norm,
            all_finite,
            certain,
            predicted_skip: skip,
            scaler_applied,
            needs_settle: !certain || approx || !unscale.is_finite(),
            spec_min: self.spec_min,
            spec_max: self.spec_max,
            late_count: self.late_count,
        });
        stats.steps += 1;
        Ok(())
    }

    /// Checks a step's result against the model; returns the per-sub-group outcome kinds
    /// (None: exact) and advances the scaler if the step did not.
    fn judge_result(&mut self, r: &so_step_result, stats: &mut Stats) -> Result<Vec<Option<Approx>>, String> {
        let p = self.pending.as_ref().unwrap();
        let ctx = format!("step {} result {r:?}", p.serial);
        ensure!(r.serial == p.serial, "{ctx}: serial, model {}", p.serial);
        ensure!(r.loss_scale.to_bits() == p.s.to_bits(), "{ctx}: loss scale, model {}", p.s);
        match p.given {
            Some(n) => ensure!(
                r.global_norm.to_bits() == n.to_bits() || (n.is_nan() && r.global_norm.is_nan()),
                "{ctx}: the given norm was {n}"
            ),
            None => ensure!(
                reference::norm_agrees(r.global_norm, p.own_norm, 1e-12),
                "{ctx}: global norm, reference {:e}",
                p.own_norm
            ),
        }
        let d = decide(p.max_norm, r.global_norm, p.given.is_some(), p.overflow, p.all_finite, p.s);
        let skip = d.skip();
        ensure!(r.skipped == skip, "{ctx}: skipped, model {skip} ({:?})", d.reasons);
        if skip {
            ensure!(d.reasons.contains(&r.skip_reason), "{ctx}: skip reason, model one of {:?}", d.reasons);
            ensure!(r.clip_coef == 1.0, "{ctx}: clip coefficient of a skipped step");
        } else {
            ensure!(r.skip_reason == api::SKIP_NONE, "{ctx}: skip reason of a step taken");
            ensure!(r.clip_coef.to_bits() == d.clip.to_bits(), "{ctx}: clip coefficient, model {}", d.clip);
        }
        let factor = grad_factor(r.clip_coef, p.s);
        ensure!(r.grad_factor.to_bits() == factor.to_bits(), "{ctx}: gradient factor, model {factor}");
        if p.certain {
            ensure!(skip == p.predicted_skip, "{ctx}: a certain prediction failed");
        }
        if !p.scaler_applied
            && let Some(sc) = self.scaler.as_mut()
        {
            sc.update(skip);
        }
        let next = self.scaler.map_or(p.s, |s| s.scale);
        ensure!(r.next_loss_scale.to_bits() == next.to_bits(), "{ctx}: next loss scale, model {next}");
        ensure!(
            (p.spec_min..=p.spec_max).contains(&r.speculative),
            "{ctx}: speculative, model {}..={}",
            p.spec_min,
            p.spec_max
        );
        ensure!(r.cancelled <= r.speculative, "{ctx}: more cancelled than speculative steps");
        ensure!(r.device_stepped == 0 && r.device_subgroups == 0, "{ctx}: device work in a host session");
        ensure!(r.forward_wait_s.is_finite() && r.forward_wait_s >= 0.0, "{ctx}: forward wait");
        ensure!(r.late_gradients == p.late_count, "{ctx}: late gradients, model {}", p.late_count);
        // Per sub-group: what its speculative step becomes if it ran; a speculative step that
        // did not run (not submitted by the policy, or cancelled at the decision, or at a late
        // gradient) leaves the sub-group to one exact pass ("stepped"), as if it never
        // speculated. A copy written ahead is exact whatever it becomes; a late gradient
        // writes it from the masters again, and the step is then one exact pass.
        let mut kinds = Vec::new();
        let mut n = [0u32; 5];
        for ps in &p.plan {
            let group = self.sgs[ps.id as usize].as_ref().unwrap().group as usize;
            let kind = match &ps.spec {
                Some(s) if s.applied && !(s.copy_ahead && ps.late) => {
                    let approx = |k| (!s.copy_ahead).then_some(k);
                    if skip {
                        n[2] += 1;
                        approx(Approx::RolledBack)
                    } else if ps.late || !same_hp(&s.hp, &p.groups[group]) {
                        n[3] += 1;
                        approx(Approx::Redone)
                    } else if factor == p.unscale {
                        n[0] += 1;
                        None
                    } else {
                        n[1] += 1;
                        approx(Approx::Rescaled)
                    }
                }
                _ => {
                    if !skip {
                        n[4] += 1;
                    }
                    None
                }
            };
            kinds.push(kind);
        }
        let a = [r.kept, r.rescaled, r.rolled_back, r.redone, r.stepped];
        let did_not_run: u32 = (0..4).map(|i| n[i].saturating_sub(a[i])).sum();
        let exact_passes = if skip { 0 } else { did_not_run - n[2].saturating_sub(a[2]) };
        ensure!(
            (0..4).all(|i| a[i] <= n[i]) && a[4] == n[4] + exact_passes,
            "{ctx}: kept/rescaled/rolled back/redone/stepped, model {n:?} (or fewer speculative, more stepped)"
        );
        let n = a;
        stats.skipped += skip as u64;
        stats.clipped += (!skip && r.clip_coef < 1.0) as u64;
        stats.kept += n[0] as u64;
        stats.rescaled += n[1] as u64;
        stats.rolled_back += n[2] as u64;
        stats.redone += n[3] as u64;
        stats.stepped += n[4] as u64;
        Ok(kinds)
    }

    /// Advances the reference over the pending step. Exact sub-groups get their new
    /// expected state; approximate ones an `ApproxCheck` (and unknown state until observed).
    fn advance(&mut self, r: &so_step_result, kinds: &[Option<Approx>]) -> Check {
        let p = self.pending.take().unwrap();
        let (mode, bias) = (self.opts.mode, self.opts.bias);
        for (ps, kind) in p.plan.iter().zip(kinds) {
            let Some(sg) = self.sgs[ps.id as usize].as_mut() else { continue };
            let now = p.groups[sg.group as usize];
            let count = sg.count;
            if !r.skipped {
                sg.count += 1;
            }
            match kind {
                None if r.skipped => {}
                None => {
                    let hp = reference::hyper(&now, mode, bias, count + 1);
                    reference::adam(&hp, &mut sg.p, &ps.g_final, &mut sg.m, &mut sg.v, r.grad_factor)?;
                }
                Some(k) => {
                    let spec = ps.spec.as_ref().unwrap();
                    let (mut p1, mut m1, mut v1) = (sg.p.clone(), sg.m.clone(), sg.v.clone());
                    if !r.skipped {
                        let hp = reference::hyper(&now, mode, bias, count + 1);
                        reference::adam(&hp, &mut p1, &ps.g_final, &mut m1, &mut v1, r.grad_factor)?;
                    }
                    sg.approx = Some(ApproxCheck {
                        kind: *k,
                        spec_hp: reference::hyper(&spec.hp, mode, bias, count + 1),
                        now_hp: reference::hyper(&now, mode, bias, count + 1),
                        unscale: p.unscale,
                        factor: r.grad_factor,
                        p0: sg.p.clone(),
                        m0: sg.m.clone(),
                        v0: sg.v.clone(),
                        known: sg.known.clone(),
                        g_spec: spec.g.clone(),
                        g_final: ps.g_final.clone(),
                        exact: [p1, m1, v1],
                    });
                    sg.known.fill(false);
                }
            }
        }
        Ok(())
    }

    /// The previous step's result while the next step's backward runs: exact outcomes only
    /// (the weights cannot be read now).
    fn settle_lazy(&mut self, stats: &mut Stats) -> Check {
        let t = self.pending.as_ref().unwrap().ticket;
        let r = self.h.step_result(t, -1);
        api::count_call();
        let r = r.map_err(|st| format!("step_result({t}) of the previous step: {st:?} ({})", api::last_error()))?;
        let kinds = self.judge_result(&r, stats)?;
        ensure!(kinds.iter().all(Option::is_none), "a step predicted exact was not: {kinds:?}");
        self.outcomes.insert(t, r);
        self.advance(&r, &kinds)
    }

    /// Settles the pending step, if any (between steps): its result, its final tickets, the
    /// weights; the moments through `snap` (a checkpoint just written) or, when needed or
    /// `observe`, a checkpoint written now.
    pub fn settle(&mut self, stats: &mut Stats, scratch: &Path, snap: Option<&Snapshot>, observe: bool) -> Check {
        assert_eq!(self.phase, Phase::Idle);
        if let Some(p) = &self.pending {
            let t = p.ticket;
            let r = self.h.step_result(t, -1);
            api::count_call();
            let r = r.map_err(|st| format!("step_result({t}): {st:?} ({})", api::last_error()))?;
            let kinds = self.judge_result(&r, stats)?;
            self.outcomes.insert(t, r);
            self.advance(&r, &kinds)?;
        }
        self.wait_finals()?;
        let need = self.live_sgs().any(|sg| sg.approx.is_some());
        let owned;
        let snap = match snap {
            Some(s) => Some(s),
            None if need || observe => {
                let st = self.h.save_path(scratch);
                api::count_call();
                judge("so_session_save (observation)", st, &[])?;
                owned = ckpt::read(scratch)?.1;
                Some(&owned)
            }
            None => None,
        };
        self.observe(snap, stats)
    }

    fn wait_finals(&mut self) -> Check {
        for sg in self.sgs.iter_mut().flatten() {
            if !sg.final_waited {
                let st = self.h.ticket_wait(sg.final_ticket, -1);
                api::count_call();
                judge(&format!("so_ticket_wait(final ticket of sub-group {})", sg.id), st, &[])?;
                sg.final_waited = true;
            }
        }
        Ok(())
    }

    /// Compares the session's state (masters read directly; moments, step counts, groups and
    /// scaler from `snap` if given) with the model, and adopts it where the model's state
    /// was approximate or unknown.
    fn observe(&mut self, snap: Option<&Snapshot>, stats: &mut Stats) -> Check {
        let moment = self.opts.moment;
        for sg in self.sgs.iter_mut().flatten() {
            let live = sg.master.read(sg.master_dtype, sg.numel);
            let mut file_m = sg.m.clone();
            let mut file_v = sg.v.clone();
            if let Some(snap) = snap {
                for &sl in &sg.slices {
                    let info = &self.slices[sl as usize];
                    let s =
                        snap.slices.get(&info.name).ok_or_else(|| format!("checkpoint lacks slice {}", info.name))?;
                    ensure!(
                        s.step == sg.count,
                        "slice {}: step {} in the checkpoint, model {}",
                        info.name,
                        s.step,
                        sg.count
                    );
                    ensure!(s.group == sg.group as f64, "slice {}: group {}", info.name, s.group);
                    ensure!(
                        s.master == sub(&live, info.range.clone()),
                        "slice {}: the checkpoint's master weights differ from the live ones",
                        info.name
                    );
                    ensure!(
                        s.exp_avg.dtype() == moment && s.exp_avg.len() == info.range.len(),
                        "slice {}: moment layout",
                        info.name
                    );
                    put(&mut file_m, info.range.start, &s.exp_avg);
                    put(&mut file_v, info.range.start, &s.exp_avg_sq);
                }
            }
            let covered = std::mem::take(&mut sg.covered);
            let has_snap = snap.is_some();
            let have_moments = |i: usize| has_snap && covered[i];
            if let Some(check) = sg.approx.take() {
                stats.bound_checks += 1;
                for i in 0..sg.numel {
                    let [ep, em, ev] = &check.exact;
                    let exact = check.known[i]
                        && live.bits(i) == ep.bits(i)
                        && (!have_moments(i) || (file_m.bits(i) == em.bits(i) && file_v.bits(i) == ev.bits(i)));
                    if exact {
                        // The speculative step did not run: one exact pass.
                        continue;
                    }
                    let Some([tp, tm, tv]) = check.expect(i) else { continue };
                    ensure!(
                        reference::within(live.get(i), tp),
                        "sub-group {} element {i} ({:?}): p {:e}, reference {:e} +- {:e}",
                        sg.id,
                        check.kind,
                        live.get(i),
                        tp.v,
                        reference::SLACK * tp.e
                    );
                    if have_moments(i) {
                        for (what, got, want) in [("m", file_m.get(i), tm), ("v", file_v.get(i), tv)] {
                            ensure!(
                                reference::within(got, want),
                                "sub-group {} element {i} ({:?}): {what} {got:e}, reference {:e} +- {:e}",
                                sg.id,
                                check.kind,
                                want.v,
                                reference::SLACK * want.e
                            );
                        }
                    }
                }
            } else {
                for i in 0..sg.numel {
                    if !sg.known[i] {
                        continue;
                    }
                    ensure!(
                        live.bits(i) == sg.p.bits(i),
                        "sub-group {} element {i}: p {:e} ({:#x}), reference {:e} ({:#x}) (step count {})",
                        sg.id,
                        live.get(i),
                        live.bits(i),
                        sg.p.get(i),
                        sg.p.bits(i),
                        sg.count
                    );
                    if have_moments(i) {
                        ensure!(
                            file_m.bits(i) == sg.m.bits(i) && file_v.bits(i) == sg.v.bits(i),
                            "sub-group {} element {i}: m {:e} v {:e}, reference m {:e} v {:e}",
                            sg.id,
                            file_m.get(i),
                            file_v.get(i),
                            sg.m.get(i),
                            sg.v.get(i)
                        );
                    }
                }
            }
            // Adopt: the masters are read, the moments known where the checkpoint has them.
            sg.p = live;
            for i in 0..sg.numel {
                if have_moments(i) {
                    sg.known[i] = true;
                }
            }
            sg.m = file_m;
            sg.v = file_v;
            sg.covered = covered;
            if let Some(b) = &sg.grad_buf {
                let real = b.read(sg.g.dtype(), sg.numel);
                ensure!(real == sg.g, "sub-group {}: the caller gradient buffer differs from the model's", sg.id);
            }
        }
        if let Some(snap) = snap {
            ensure!(snap.groups.len() == self.groups.len(), "checkpoint groups {}", snap.groups.len());
            for (i, g) in snap.groups.iter().enumerate() {
                ensure!(
                    hp_bits_equal(&hp_of(*g), &self.groups[i]),
                    "checkpoint group {i}: {g:?} vs {:?}",
                    self.groups[i]
                );
            }
            match (&snap.scaler, &self.scaler) {
                (None, None) => {}
                (Some(f), Some(m)) => ensure!(
                    f.scale.to_bits() == m.scale.to_bits()
                        && f.growth_tracker == m.tracker
                        && f.hysteresis_left == m.left,
                    "checkpoint scaler {f:?}, model {m:?}"
                ),
                (f, m) => return Err(format!("checkpoint scaler {f:?}, model {m:?}")),
            }
        }
        Ok(())
    }

    /// Forgets what no later check can need, so that long runs keep the model's memory flat:
    /// results of steps before the previous one, and hand-off tickets after the latest 64
    /// except those that decide what `so_ticket_wait_all` reports (failures up to and
    /// including the earliest certain one).
    fn prune(&mut self) {
        const KEEP: usize = 64;
        if self.step_tickets.len() > 2 {
            self.step_tickets.drain(..self.step_tickets.len() - 2);
            let keep = self.step_tickets.clone();
            self.outcomes.retain(|t, _| keep.contains(t));
        }
        let prune_list = |list: &mut Vec<(Ticket, Vec<Status>)>| {
            if list.len() <= 2 * KEEP {
                return;
            }
            let mut by_ticket: Vec<(Ticket, Vec<Status>)> = std::mem::take(list);
            by_ticket.sort_by_key(|e| e.0);
            let first_certain = by_ticket.iter().position(|e| !e.1.contains(&Status::Ok));
            let n = by_ticket.len();
            for (i, e) in by_ticket.into_iter().enumerate() {
                let decisive = first_certain.is_some_and(|f| i <= f) && e.1.iter().any(|s| *s != Status::Ok);
                if decisive || i + KEEP >= n {
                    list.push(e);
                }
            }
        };
        prune_list(&mut self.handoffs);
        prune_list(&mut self.hidden);
    }

    /// After a refusal: nothing changed. Every third refusal between steps also compares
    /// the moments (through a checkpoint).
    fn refused(&mut self, stats: &mut Stats) -> Check {
        self.check_quiet()?;
        self.refusals += 1;
        if self.phase == Phase::Idle && self.pending.is_none() && self.refusals.is_multiple_of(3) {
            let scratch = self.scratch.clone();
            self.settle(stats, &scratch, None, true)?;
        }
        Ok(())
    }

    /// Nothing changed: the weights that may be read now are the model's, and so are the
    /// caller gradient buffers.
    pub fn check_quiet(&self) -> Check {
        if self.pending.is_some() {
            return Ok(());
        }
        for sg in self.live_sgs() {
            let readable = sg.final_waited
                && sg.approx.is_none()
                && match self.phase {
                    Phase::Idle => true,
                    Phase::Backward { .. } => sg.submitted.is_none(),
                    Phase::Prepared => false,
                };
            if !readable {
                continue;
            }
            sg.check_master("")?;
            if let Some(b) = &sg.grad_buf {
                ensure!(b.read(sg.g.dtype(), sg.numel) == sg.g, "sub-group {}: caller gradient buffer changed", sg.id);
            }
        }
        Ok(())
    }

    // ----- results and tickets ----------------------------------------------------------

    fn step_result_op(
        &mut self,
        which: WhichTicket,
        timeout_ns: i64,
        bad_size: bool,
        stats: &mut Stats,
        scratch: &Path,
        observe: bool,
    ) -> Check {
        let latest = self.step_tickets.last().copied();
        let settles = which == WhichTicket::LatestStep
            && !bad_size
            && timeout_ns < 0
            && latest.is_some()
            && self.pending.as_ref().is_some_and(|p| Some(p.ticket) == latest);
        if settles {
            return if self.phase == Phase::Idle {
                self.settle(stats, scratch, None, observe)
            } else {
                self.settle_lazy(stats)
            };
        }
        let t = self.resolve(which);
        let mut r: so_step_result = unsafe { std::mem::zeroed() };
        r.struct_size = std::mem::size_of::<so_step_result>() + if bad_size { 8 } else { 0 };
        r.serial = 0xDEAD;
        let st = unsafe { self.h.step_result_raw(t, timeout_ns, &mut r) };
        api::count_call();
        let mut allowed = Vec::new();
        if bad_size {
            allowed.push(Status::StructSize);
        } else if t != 0 && Some(t) == latest {
            allowed.push(Status::Ok);
            if timeout_ns >= 0 {
                allowed.push(Status::Timeout);
            }
        } else {
            // Any other ticket (an earlier step's included) at once, without waiting.
            allowed.push(Status::NotFound);
        }
        ensure!(
            allowed.contains(&st),
            "step_result({which:?} = {t}): {st:?}, expected one of {allowed:?} ({})",
            api::last_error()
        );
        if st != Status::Ok {
            ensure!(r.serial == 0xDEAD, "step_result wrote its out-parameter on failure");
            return Ok(());
        }
        if let Some(o) = self.outcomes.get(&t) {
            ensure!(
                r.serial == o.serial && r.skipped == o.skipped && r.grad_factor.to_bits() == o.grad_factor.to_bits(),
                "step_result({t}) changed: serial {} skipped {} factor {}, earlier {o:?}",
                r.serial,
                r.skipped,
                r.grad_factor
            );
        } else if let Some(p) = &self.pending {
            ensure!(r.serial == p.serial, "step_result({t}): serial {}, model {}", r.serial, p.serial);
        }
        Ok(())
    }

    fn resolve(&self, which: WhichTicket) -> Ticket {
        match which {
            WhichTicket::LatestStep => self.step_tickets.last().copied().unwrap_or(0),
            WhichTicket::PreviousStep => self.step_tickets.len().checked_sub(2).map_or(0, |i| self.step_tickets[i]),
            WhichTicket::Final(sg) => self.sg(sg).map_or(0, |s| s.final_ticket),
            WhichTicket::HandOff(n) => {
                if self.handoffs.is_empty() {
                    0
                } else {
                    self.handoffs[n % self.handoffs.len()].0
                }
            }
            WhichTicket::Zero => 0,
            WhichTicket::Never => u64::MAX / 2,
        }
    }

    /// The statuses the work of `t` may end with (for a ticket that was issued).
    fn final_statuses(&self, t: Ticket) -> Vec<Status> {
        match self.handoffs.iter().find(|h| h.0 == t) {
            Some((_, allowed)) => allowed.clone(),
            None => vec![Status::Ok],
        }
    }

    /// What `so_ticket_wait_all(t)` may return: the earliest failure up to t.
    fn wait_all_statuses(&self, t: Ticket) -> Vec<Status> {
        // Ordering keys: a known ticket k is 2k, a hidden one issued after ticket k is 2k + 1.
        let mut entries: Vec<(u128, &Vec<Status>)> = self
            .handoffs
            .iter()
            .map(|(k, a)| (2 * *k as u128, a))
            .chain(self.hidden.iter().map(|(k, a)| (2 * *k as u128 + 1, a)))
            .filter(|(key, _)| *key <= 2 * t as u128)
            .collect();
        entries.sort_by_key(|e| e.0);
        let mut out = Vec::new();
        for (_, allowed) in entries {
            out.extend(allowed.iter().copied().filter(|s| *s != Status::Ok));
            if !allowed.contains(&Status::Ok) {
                return out;
            }
        }
        out.push(Status::Ok);
        out
    }

    fn ticket_op(&mut self, which: WhichTicket, timeout_ns: i64, how: WaitHow) -> Check {
        let t = self.resolve(which);
        let st = match how {
            WaitHow::Wait => self.h.ticket_wait(t, timeout_ns),
            WaitHow::Query => self.h.ticket_query(t),
            WaitHow::WaitAll => self.h.ticket_wait_all(t, timeout_ns),
        };
        api::count_call();
        let mut allowed = if t == 0 {
            vec![Status::Ok]
        } else if which == WhichTicket::Never {
            vec![Status::NotFound]
        } else {
            let mut a = match how {
                WaitHow::WaitAll => self.wait_all_statuses(t),
                _ => self.final_statuses(t),
            };
            match how {
                WaitHow::Query => a.push(Status::Pending),
                _ if timeout_ns >= 0 => a.push(Status::Timeout),
                _ => {}
            }
            a
        };
        allowed.dedup();
        ensure!(
            allowed.contains(&st),
            "ticket {how:?}({which:?} = {t}, {timeout_ns}): {st:?}, expected one of {allowed:?}"
        );
        if let WhichTicket::Final(sg) = which
            && st == Status::Ok
            && how != WaitHow::Query
            && let Some(s) = self.sgs.get_mut(sg as usize).and_then(Option::as_mut)
            && s.final_ticket == t
        {
            s.final_waited = true;
        }
        Ok(())
    }

    fn step_count(&mut self, sg: u32) -> Check {
        let mut n = u64::MAX;
        let st = unsafe { self.h.step_count(sg, &mut n) };
        api::count_call();
        let Some(s) = self.sg(sg) else {
            return judge("so_session_step_count", st, &[Status::NotFound]).map(drop);
        };
        judge("so_session_step_count", st, &[])?;
        let mut allowed = vec![s.count];
        if let Some(p) = &self.pending
            && p.plan.iter().any(|ps| ps.id == sg)
        {
            allowed.push(s.count + 1);
        }
        if !s.final_waited {
            allowed.push(s.count_prev);
        }
        ensure!(allowed.contains(&n), "step count of sub-group {sg}: {n}, model one of {allowed:?}");
        Ok(())
    }

    fn loss_scale_op(&mut self, stats: &mut Stats, scratch: &Path) -> Check {
        if self.phase == Phase::Idle && self.pending.as_ref().is_some_and(|p| !p.scaler_applied) {
            self.settle(stats, scratch, None, false)?;
        }
        let mut x = -1.0f32;
        let st = unsafe { self.h.loss_scale(&mut x) };
        api::count_call();
        judge("so_session_loss_scale", st, &[])?;
        let want = self.scaler.map_or(1.0, |s| s.scale);
        ensure!(x.to_bits() == want.to_bits(), "loss scale {x}, model {want}");
        Ok(())
    }

    // ----- checkpoints ------------------------------------------------------------------

    /// Whether `load` must accept `snap` (Ok) or with which status it must refuse it.
    pub fn load_verdict(&self, snap: &Snapshot) -> Result<(), Status> {
        let bad = Err(Status::BadCheckpoint);
        let mode = match self.opts.mode {
            AdamMode::AdamW => "adamw",
            AdamMode::L2 => "l2",
        };
        if snap.mode != mode
            || snap.bias_correction != self.opts.bias.to_string()
            || snap.moment_dtype != self.opts.moment.name()
        {
            return bad;
        }
        if snap.groups.len() != self.groups.len() || snap.scaler.is_some() != self.scaler.is_some() {
            return bad;
        }
        let mut slices = 0;
        for sg in self.live_sgs() {
            let mut step = None;
            for &sl in &sg.slices {
                let info = &self.slices[sl as usize];
                let Some(s) = snap.slices.get(&info.name) else { return bad };
                if s.group != sg.group as f64 || *step.get_or_insert(s.step) != s.step {
                    return bad;
                }
                let n = info.range.len();
                if s.master.dtype() != sg.master_dtype
                    || s.master.len() != n
                    || s.exp_avg.dtype() != self.opts.moment
                    || s.exp_avg.len() != n
                    || s.exp_avg_sq.dtype() != self.opts.moment
                    || s.exp_avg_sq.len() != n
                {
                    return bad;
                }
                slices += 1;
            }
        }
        if snap.tensors != 3 * slices {
            return bad;
        }
        Ok(())
    }

    pub fn apply_snapshot(&mut self, snap: &Snapshot) {
        self.groups = snap.groups.iter().map(|g| hp_of(*g)).collect();
        if let (Some(f), Some(m)) = (&snap.scaler, self.scaler.as_mut()) {
            *m = Scaler { options: f.options, scale: f.scale, tracker: f.growth_tracker, left: f.hysteresis_left };
        }
        self.drained();
        for sg in self.sgs.iter_mut().flatten() {
            for &sl in &sg.slices {
                let info = &self.slices[sl as usize];
                let s = &snap.slices[&info.name];
                put(&mut sg.p, info.range.start, &s.master);
                put(&mut sg.m, info.range.start, &s.exp_avg);
                put(&mut sg.v, info.range.start, &s.exp_avg_sq);
                sg.known[info.range.clone()].fill(true);
                sg.count = s.step;
                sg.count_prev = s.step;
            }
            sg.approx = None;
        }
    }

    /// After a load: the masters are the checkpoint's, and so are the step counts.
    pub fn check_loaded(&mut self, snap: &Snapshot) -> Check {
        self.check_quiet()?;
        for sg in self.live_sgs() {
            for &sl in &sg.slices {
                let info = &self.slices[sl as usize];
                let live = sub(&sg.master.read(sg.master_dtype, sg.numel), info.range.clone());
                ensure!(live == snap.slices[&info.name].master, "slice {}: loaded master weights differ", info.name);
            }
            let n = self.h.count_of(sg.id);
            api::count_call();
            ensure!(n == Ok(sg.count), "sub-group {}: step count after load {n:?}, model {}", sg.id, sg.count);
        }
        Ok(())
    }
}

/// The test's own sum of squares of a sub-group's gradient: its slices', in order (elements
/// outside every slice are not part of the norm).
pub fn slices_sumsq(slices: &[SliceM], sg: &SgM, unscale: f32) -> f64 {
    sg.slices.iter().map(|&sl| reference::sumsq(&sub(&sg.g, slices[sl as usize].range.clone()), unscale)).sum()
}

/// The decision of `step()` at a reported norm.
pub struct Decision {
    pub reasons: Vec<u32>,
    pub clip: f64,
    pub factor: f32,
}

impl Decision {
    pub fn skip(&self) -> bool {
        !self.reasons.is_empty()
    }
}

pub fn decide(max_norm: f64, norm: f64, given: bool, overflow: bool, all_finite: bool, s: f32) -> Decision {
    let clip = clip_coefficient(max_norm, norm);
    let factor = grad_factor(clip, s);
    let mut reasons = Vec::new();
    if overflow {
        reasons.push(api::SKIP_OVERFLOW);
    }
    if !all_finite {
        reasons.push(api::SKIP_NON_FINITE_GRADIENT);
    }
    if !norm.is_finite() {
        reasons.push(if given { api::SKIP_NON_FINITE_NORM } else { api::SKIP_NON_FINITE_GRADIENT });
    }
    if !(factor.is_finite() && factor > 0.0) {
        reasons.push(api::SKIP_UNUSABLE_FACTOR);
    }
    Decision { reasons, clip, factor }
}
