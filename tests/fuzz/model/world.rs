//! The world's lifecycle: sessions created with good and bad options, destroyed, and the
//! calls on a NULL session.

use std::collections::BTreeMap;
use std::path::PathBuf;

use superoffload::kernels::{AdamMode, DType};

use super::{Check, Opts, Phase, Scaler, Sess, Stats, World, dtype_from_raw, judge};
use crate::fuzz::api::{self, Session, Status};
use crate::fuzz::ops::*;

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

    pub(super) fn scratch_path(&self) -> PathBuf {
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

    pub(super) fn create(&mut self, spec: &CreateSpec) -> Check {
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
