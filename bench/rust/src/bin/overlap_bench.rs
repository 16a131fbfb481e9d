//! `overlap_bench`: how well a session hides CPU Adam behind a (simulated) training loop.
//!
//! The training thread, pinned to a core outside the session pool's cores, runs L layers of
//! busy work (a fixed amount of its own CPU time per layer) per pass: a forward where layer k first waits for sub-group k's final ticket of
//! the previous step, then a backward (last layer first) that hands each layer's gradient to
//! the session (`grad_copy`, one slice per sub-group of P f32 elements) as soon as the layer
//! "finishes", then `step()`. Four modes run side by side, each with its own session on one
//! shared pool, in interleaved blocks of consecutive steps (so that machine noise hits all
//! of them alike; the first steps of each block refill the pipeline and are not counted):
//!
//! - `spec`: speculation on, no clipping: every speculative step is kept;
//! - `spec+clip`: speculation on, clipping on every step (max_norm = half the norm): every
//!   sub-group is rescaled at step(), in forward order, while the forward runs;
//! - `nospec`: speculation off ("step after backward"): all Adam work at step();
//! - `nospec+clip`: the same with clipping.
//!
//! Per mode: median step time (forward + backward + step(), one loop iteration), the
//! training thread's median wait for the optimizer per step, the median forward+backward
//! time without the waits (busy work and hand-offs), the backward time, the CPU Adam time of
//! a step alone (the kernels the session runs for that mode, on the same pool and
//! sub-group sizes, with no simulated compute and nothing else running), and the ratio
//! step / max(forward+backward, CPU Adam), which is 1 for perfect overlap.
//!
//! The target: a clipped step at most 1.15 x an unclipped one when the CPU Adam time of a
//! step is at most the forward time.
//!
//! With `--publish` each session has a transport that takes a bf16 copy of the weights and
//! sends it nowhere, as a CUDA session publishes to the GPU: a final pass may then publish
//! the copy first and write the master weights and moments after it, and the session chooses
//! for which sub-groups (`session/state_after.rs`). The previous step's result is read after
//! the backward, whose hand-offs waited for those state passes.

use superoffload_bench::*;

use std::any::Any;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use superoffload::kernels::{
    self, AdamBuffers, AdamHyper, DType, Floats, FloatsMut, MomentsMut, Pool, PoolOptions, UpdateOptions, bf16,
};
use superoffload::session::{
    Borrowed, GroupHparams, NormSource, Session, SessionOptions, SliceDesc, Speculation, StepArgs, SubGroupDesc,
    Ticket, Transport,
};

const USAGE: &str = "\
overlap_bench: step time of a simulated training loop with a superoffload session, with and
without speculation and clipping, next to the CPU Adam time alone

USAGE: overlap_bench [OPTIONS]

OPTIONS:
  --layers L        layers, one sub-group each (default 8)
  --elems P         f32 elements per layer (default 1m = 1048576; also 512k, 1e6, 1_000_000)
  --fwd-ms F        forward busy time per layer in ms (default 3)
  --bwd-ms B        backward busy time per layer in ms (default 6)
  --steps N         measured steps per mode (default 20)
  --block K         consecutive steps per mode per round; the first --refill of each block
                    are not measured (default 6)
  --refill R        steps per block that refill the pipeline, not measured (default 1)
  --pool-cores LIST cores of the session pool, e.g. 1 or 2-5 (default: every CPU this
                    process may run on except the training core)
  --train-core C    core of the training thread (default: the first CPU this process may
                    run on)
  --adam-thread W   where the sessions' CPU-Adam threads may run: pool (the pool's cores,
                    default), unpinned (any allowed CPU) or training (the training core,
                    what a session created by an already pinned training thread gets)
  --publish         give each session a transport that takes a bf16 copy of the weights
                    (and sends it nowhere), as a CUDA session does: final passes may
                    publish the copy before writing the master weights and moments
                    (the CPU Adam column stays that of one update per step)
  --json PATH       also write the results as JSON to PATH (- for stdout)
  -h, --help        this text

Memory: 16 x P x L bytes per mode (master, session gradient, two moments), 4 x P x L for
the gradients, 12 x P x L for the CPU Adam measurement: about 670 MB with the defaults.

The defaults (on a 2-core machine: the training thread on one core, a one-thread pool on
the other) put the CPU Adam time of a step somewhat below the forward time, the case the
1.15 target is about; --fwd-ms 0.5 --bwd-ms 1.5 shows the opposite case.";

struct Args {
    layers: usize,
    elems: usize,
    fwd: Duration,
    bwd: Duration,
    steps: usize,
    block: usize,
    refill: usize,
    cores: Cores,
    adam_thread: AdamThread,
    publish: bool,
    json: Option<String>,
}

/// Where the sessions' CPU-Adam threads may run (they inherit the creating thread's mask).
#[derive(Clone, Copy, PartialEq, Debug)]
enum AdamThread {
    Pool,
    Unpinned,
    Training,
}

fn parse_args(cli: &mut Cli) -> Result<Args, String> {
    let mut a = Args {
        layers: 8,
        elems: 1024 * 1024,
        fwd: Duration::from_millis(3),
        bwd: Duration::from_millis(6),
        steps: 20,
        block: 6,
        refill: 1,
        cores: Cores::default(),
        adam_thread: AdamThread::Pool,
        publish: false,
        json: None,
    };
    while let Some(flag) = cli.next_flag() {
        match flag.as_str() {
            "--layers" => a.layers = cli.count()?,
            "--elems" => a.elems = cli.count()?,
            "--fwd-ms" => a.fwd = cli.millis()?,
            "--bwd-ms" => a.bwd = cli.millis()?,
            "--steps" => a.steps = cli.count()?,
            "--block" => a.block = cli.count()?,
            "--refill" => a.refill = cli.count()?,
            "--adam-thread" => {
                a.adam_thread = cli.choice(&[
                    ("pool", AdamThread::Pool),
                    ("unpinned", AdamThread::Unpinned),
                    ("training", AdamThread::Training),
                ])?
            }
            "--publish" => a.publish = cli.switch()?,
            "--json" => a.json = Some(cli.value()?),
            f if a.cores.take_flag(cli, f)? => {}
            _ => return Err(cli.unknown()),
        }
    }
    if a.layers == 0 || a.elems == 0 || a.steps == 0 {
        return Err("--layers, --elems and --steps must be at least 1".into());
    }
    if a.block <= a.refill {
        return Err(format!("--block ({}) must be larger than --refill ({})", a.block, a.refill));
    }
    Ok(a)
}

// ---- threads and cores -------------------------------------------------------------------

/// CPU time the calling thread has used.
fn thread_cpu() -> Duration {
    // SAFETY: a zeroed timespec is valid; clock_gettime fills it.
    unsafe {
        let mut t: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t);
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    }
}

/// Busy work on the training thread: `d` of its own CPU time, like real compute, so that
/// time the thread spends preempted (other processes on its core) adds to the wall time
/// instead of eating into the work, and can be subtracted (the "adj" columns).
fn spin(d: Duration) {
    if d.is_zero() {
        return;
    }
    let end = thread_cpu() + d;
    while thread_cpu() < end {
        std::hint::spin_loop();
    }
}

fn gauss(seed: u64, i: usize) -> f32 {
    let mut z = (i as u64).wrapping_add(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let sum: u32 = (0..4).map(|k| ((z >> (16 * k)) & 0xFFFF) as u32).sum();
    ((sum as f32 + 2.0) / 65536.0 - 2.0) * 1.732_050_8
}

// ---- modes -------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Spec,
    SpecClip,
    NoSpec,
    NoSpecClip,
    Auto,
    AutoClip,
}

impl Kind {
    const ALL: [Kind; 6] = [Kind::Spec, Kind::SpecClip, Kind::NoSpec, Kind::NoSpecClip, Kind::Auto, Kind::AutoClip];
    fn name(self) -> &'static str {
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
    fn cpu_index(self) -> usize {
        match self {
            Kind::Spec | Kind::Auto => 0,
            Kind::SpecClip => 1,
            Kind::NoSpec => 2,
            Kind::NoSpecClip | Kind::AutoClip => 3,
        }
    }
}

/// One mode: its session, its master weights, what it measured.
struct Mode {
    kind: Kind,
    session: Session,
    _masters: Vec<Vec<f32>>,
    slices: Vec<u32>,
    finals: Vec<Ticket>,
    /// The step ticket whose result is still to be read.
    pending: Option<Ticket>,
    step_ms: Vec<f64>,
    wait_ms: Vec<f64>,
    busy_ms: Vec<f64>,
    fwd_ms: Vec<f64>,
    bwd_ms: Vec<f64>,
    handoff_ms: Vec<f64>,
    preempt_ms: Vec<f64>,
    /// Totals of the step results (every step, measured or not).
    kept: u64,
    rescaled: u64,
    stepped: u64,
    other: u64,
    steps: u64,
    clipped: u64,
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
    fn new(kind: Kind, pool: &Arc<Pool>, layers: usize, elems: usize, publish: bool) -> Result<Mode, String> {
        let options = SessionOptions {
            pool: Some(pool.clone()),
            speculation: kind.speculation(),
            copy_dtype: publish.then_some(DType::Bf16),
            ..SessionOptions::default()
        };
        let transport = publish.then(|| Arc::new(Publisher) as Arc<dyn Transport>);
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
        let forward = t0.elapsed();
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
        Ok([ms(step), ms(wait), ms(step - wait), ms(forward - wait), ms(backward), ms(handoff), ms(preempted)])
    }

    fn drain(&mut self) -> Result<(), String> {
        self.read_result()
    }
}

/// `n` elements of optimizer state (`value(i)` each), on the huge pages the Python layer's
/// state gets (`kernels::advise_huge_pages` before the first touch).
fn state_buffer(n: usize, value: impl Fn(usize) -> f32) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    superoffload::kernels::advise_huge_pages(v.as_mut_ptr().cast(), n * 4);
    v.extend((0..n).map(value));
    v
}

// ---- CPU Adam alone ----------------------------------------------------------------------

/// Median ms of each mode's CPU Adam work for one step: the kernels the session runs, on the
/// pool, on buffers of the same sizes, with nothing else running.
fn cpu_adam_alone(pool: &Pool, a: &Args, grads: &[Vec<f32>], reps: usize) -> Result<[f64; 4], String> {
    let n = a.elems;
    let mut p: Vec<Vec<f32>> = (0..a.layers).map(|k| state_buffer(n, |i| 0.02 * gauss(300 + k as u64, i))).collect();
    let mut m: Vec<Vec<f32>> = (0..a.layers).map(|_| state_buffer(n, |_| 0.0)).collect();
    let mut v: Vec<Vec<f32>> = (0..a.layers).map(|_| state_buffer(n, |_| 0.0)).collect();
    let err = |e: superoffload::error::Error| e.to_string();
    let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    let hp0 = AdamHyper { lr: 1e-4, ..AdamHyper::default() };
    for rep in 0..reps + 1 {
        let hp = AdamHyper { step: rep as u64 + 1, ..hp0 };
        let mut t = [Duration::ZERO; 4];
        // Each kind of pass goes over every layer before the next kind starts, so a layer's
        // buffers are not still in cache from the previous pass (as in a session, where the
        // other layers' work comes in between).
        // Speculative step: the update (the sums of squares are taken at hand-over, on the
        // training thread).
        let spec_opts = UpdateOptions { grad_scale: 1.0, ..UpdateOptions::default() };
        let t0 = Instant::now();
        for k in 0..a.layers {
            kernels::update(pool, &hp, bufs(&mut p[k], &mut m[k], &mut v[k], &grads[k]), &spec_opts).map_err(err)?;
        }
        let spec = t0.elapsed();
        // Rescale at step() (clip factor 0.5).
        let t0 = Instant::now();
        for k in 0..a.layers {
            kernels::rescale(pool, &hp, bufs(&mut p[k], &mut m[k], &mut v[k], &grads[k]), 1.0, 0.5).map_err(err)?;
        }
        let rescale = t0.elapsed();
        for k in 0..a.layers {
            kernels::rollback(pool, &hp, bufs(&mut p[k], &mut m[k], &mut v[k], &grads[k]), 0.5).map_err(err)?;
        }
        // No speculation: the update at step().
        let t0 = Instant::now();
        let plain = UpdateOptions { grad_scale: 0.5, ..UpdateOptions::default() };
        for k in 0..a.layers {
            kernels::update(pool, &hp, bufs(&mut p[k], &mut m[k], &mut v[k], &grads[k]), &plain).map_err(err)?;
        }
        let nospec = t0.elapsed();
        t[0] = spec;
        t[1] = spec + rescale;
        t[2] = nospec;
        t[3] = nospec;
        if rep > 0 {
            for (i, d) in t.iter().enumerate() {
                times[i].push(d.as_secs_f64() * 1e3);
            }
        }
    }
    Ok([median(&times[0]), median(&times[1]), median(&times[2]), median(&times[3])])
}

fn bufs<'a>(p: &'a mut [f32], m: &'a mut [f32], v: &'a mut [f32], g: &'a [f32]) -> AdamBuffers<'a> {
    AdamBuffers {
        param: FloatsMut::F32(p),
        grad: Floats::F32(g),
        moments: MomentsMut::F32 { exp_avg: m, exp_avg_sq: v },
        copy_out: None,
    }
}

fn median(xs: &[f64]) -> f64 {
    percentile(xs, 0.5)
}

fn percentile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let pos = q * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

fn run(a: Args) -> Result<(), String> {
    let (train_core, pool_cores) = a.cores.resolve()?;
    // The pool is created before the training thread pins itself: the library checks pool
    // cores against the calling thread's affinity mask. Each session's CPU-Adam thread
    // inherits the mask of the thread that creates the session: with --adam-thread pool
    // (the default) the sessions are created while this thread is restricted to the pool's
    // cores, so those threads stay off the training core.
    let pool = Arc::new(
        Pool::new(&PoolOptions { cores: Some(pool_cores.clone()), ..PoolOptions::default() })
            .map_err(|e| format!("pool: {e}"))?,
    );
    let grads: Vec<Vec<f32>> =
        (0..a.layers).map(|k| (0..a.elems).map(|i| 0.01 * gauss(200 + k as u64, i)).collect()).collect();
    let sumsq: f64 = grads.iter().flat_map(|g| g.iter()).map(|&x| x as f64 * x as f64).sum();
    let max_norm = 0.5 * sumsq.sqrt(); // clip coefficient ~0.5 on every clipped step
    let saved_mask = allowed_cpus();
    match a.adam_thread {
        AdamThread::Pool => pin_current_thread(&pool_cores)?,
        AdamThread::Training => pin_current_thread(&[train_core])?,
        AdamThread::Unpinned => {}
    }
    let mut modes: Vec<Mode> =
        Kind::ALL.iter().map(|&k| Mode::new(k, &pool, a.layers, a.elems, a.publish)).collect::<Result<_, _>>()?;
    pin_current_thread(&saved_mask)?;
    pin_current_thread(&[train_core])?;

    println!(
        "overlap_bench: {} layers x {} f32 elements ({:.1} MB of master weights), forward {:.2} ms + backward {:.2} ms per layer{}",
        a.layers,
        a.elems,
        (a.layers * a.elems * 4) as f64 / 1e6,
        a.fwd.as_secs_f64() * 1e3,
        a.bwd.as_secs_f64() * 1e3,
        if a.publish { ", a bf16 copy published" } else { "" }
    );
    println!(
        "training thread on core {train_core}; session pool: {} thread(s) on cores {:?}, {}; {} measured steps per mode in blocks of {} (first {} not measured)",
        pool.num_threads(),
        pool_cores,
        pool.isa().name(),
        a.steps,
        a.block,
        a.refill
    );

    let cpu = cpu_adam_alone(&pool, &a, &grads, 5)?;

    // Interleaved blocks.
    let per_block = a.block - a.refill;
    let rounds = a.steps.div_ceil(per_block);
    for round in 0..rounds {
        for mode in modes.iter_mut() {
            for i in 0..a.block {
                let r = mode.iterate(&a, &grads, max_norm)?;
                if i >= a.refill && mode.step_ms.len() < a.steps {
                    mode.step_ms.push(r[0]);
                    mode.wait_ms.push(r[1]);
                    mode.busy_ms.push(r[2]);
                    mode.fwd_ms.push(r[3]);
                    mode.bwd_ms.push(r[4]);
                    mode.handoff_ms.push(r[5]);
                    mode.preempt_ms.push(r[6]);
                }
            }
            // Let this mode's last step finish before the next mode starts.
            let last = mode.pending.unwrap_or(0);
            mode.session.wait_all(last, None).map_err(|e| e.to_string())?;
            mode.drain()?;
        }
        let _ = round;
    }

    // Table.
    let nominal_fwd = a.fwd.as_secs_f64() * 1e3 * a.layers as f64;
    println!();
    println!(
        "{:<12} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>8} {:>8} {:>6} {:>6}  kept/resc/stepped",
        "mode",
        "step",
        "p90",
        "wait",
        "preempt",
        "adj",
        "fwd+bwd",
        "fwd",
        "bwd",
        "hand-off",
        "CPU Adam",
        "ratio",
        "adj"
    );
    let mut json = String::new();
    write!(
        json,
        "{{\"layers\":{},\"elems\":{},\"fwd_ms_per_layer\":{},\"bwd_ms_per_layer\":{},\"publish\":{},\"train_core\":{},\"pool_cores\":{:?},\"modes\":[",
        a.layers,
        a.elems,
        json_num(a.fwd.as_secs_f64() * 1e3),
        json_num(a.bwd.as_secs_f64() * 1e3),
        a.publish,
        train_core,
        pool_cores
    )
    .unwrap();
    let mut medians = Vec::new();
    let mut adjusted = Vec::new();
    for (i, m) in modes.iter().enumerate() {
        let (step, p90, wait, preempt, busy, fwd, bwd, handoff) = (
            median(&m.step_ms),
            percentile(&m.step_ms, 0.9),
            median(&m.wait_ms),
            median(&m.preempt_ms),
            median(&m.busy_ms),
            median(&m.fwd_ms),
            median(&m.bwd_ms),
            median(&m.handoff_ms),
        );
        let step_adj = median(&m.step_ms.iter().zip(&m.preempt_ms).map(|(s, p)| s - p).collect::<Vec<_>>());
        let busy_adj = median(&m.busy_ms.iter().zip(&m.preempt_ms).map(|(s, p)| s - p).collect::<Vec<_>>());
        let cpu_i = cpu[m.kind.cpu_index()];
        let ratio = step / busy.max(cpu_i);
        let ratio_adj = step_adj / busy_adj.max(cpu_i);
        let per = |x: u64| x as f64 / m.steps.max(1) as f64;
        println!(
            "{:<12} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>8.2} {:>8.2} {:>6.3} {:>6.3}  {:.0}/{:.0}/{:.0}{}",
            m.kind.name(),
            step,
            p90,
            wait,
            preempt,
            step_adj,
            busy,
            fwd,
            bwd,
            handoff,
            cpu_i,
            ratio,
            ratio_adj,
            per(m.kept),
            per(m.rescaled),
            per(m.stepped),
            if m.other > 0 { format!(" ({} rolled back/redone/skipped!)", m.other) } else { String::new() }
        );
        if i > 0 {
            json.push(',');
        }
        write!(
            json,
            "{{\"mode\":\"{}\",\"step_ms\":{},\"step_p90_ms\":{},\"wait_ms\":{},\"preempted_ms\":{},\"step_adjusted_ms\":{},\"fwd_bwd_ms\":{},\"fwd_ms\":{},\"bwd_ms\":{},\"handoff_ms\":{},\"cpu_adam_ms\":{},\"ratio\":{},\"ratio_adjusted\":{},\"kept_per_step\":{},\"rescaled_per_step\":{},\"stepped_per_step\":{},\"clipped_steps\":{},\"steps\":{}}}",
            m.kind.name(),
            json_num(step),
            json_num(p90),
            json_num(wait),
            json_num(preempt),
            json_num(step_adj),
            json_num(busy),
            json_num(fwd),
            json_num(bwd),
            json_num(handoff),
            json_num(cpu_i),
            json_num(ratio),
            json_num(ratio_adj),
            json_num(per(m.kept)),
            json_num(per(m.rescaled)),
            json_num(per(m.stepped)),
            m.clipped,
            m.steps
        )
        .unwrap();
        medians.push(step);
        adjusted.push(step_adj);
    }
    println!(
        "(ms, medians over {} steps per mode. step: forward + backward + step(), one loop iteration; wait: the training",
        a.steps
    );
    println!(
        " thread waiting for the optimizer; preempt: the training thread off its CPU outside the waits (wall - thread CPU"
    );
    println!(
        " time: other processes on its core); adj: step - preempt; fwd+bwd: step - wait; bwd includes the hand-offs"
    );
    println!(
        " (time in grad_copy); CPU Adam: that mode's kernels alone for one step, nothing else running; ratio: step /"
    );
    println!(" max(fwd+bwd, CPU Adam), 1 = perfect overlap; adj: the same without the preempted time)");

    // Expected behaviour of each mode.
    let mut behaved = true;
    for m in &modes {
        let l = (a.layers as u64) * m.steps;
        let ok = match m.kind {
            // A speculative step that had not started at step() is cancelled and stepped once.
            Kind::Spec | Kind::Auto => m.kept + m.stepped == l,
            Kind::SpecClip => m.rescaled + m.stepped == l && m.clipped == m.steps,
            Kind::NoSpec => m.stepped == l,
            Kind::NoSpecClip | Kind::AutoClip => m.stepped + m.rescaled == l && m.clipped == m.steps,
        } && m.other == 0;
        if !ok {
            behaved = false;
            println!(
                "warning: mode {} did not behave as intended (kept {}, rescaled {}, stepped {}, other {}, clipped {} of {} steps)",
                m.kind.name(),
                m.kept,
                m.rescaled,
                m.stepped,
                m.other,
                m.clipped,
                m.steps
            );
        }
    }

    let clip_ratio = medians[1] / medians[0];
    let clip_ratio_adj = adjusted[1] / adjusted[0];
    let applies = cpu[0] <= nominal_fwd;
    let met = clip_ratio <= 1.15;
    let met_adj = clip_ratio_adj <= 1.15;
    let verdict = |m: bool| {
        if !applies {
            "does not apply: CPU Adam exceeds the forward"
        } else if m {
            "met"
        } else {
            "NOT met"
        }
    };
    println!();
    println!(
        "clipped / unclipped step, speculation on: {:.3} ({}), {:.3} without preempted time ({}); target <= 1.15 when CPU Adam {:.2} ms <= forward {:.2} ms",
        clip_ratio,
        verdict(met),
        clip_ratio_adj,
        verdict(met_adj),
        cpu[0],
        nominal_fwd
    );
    println!(
        "speculation off / on: {:.3} unclipped, {:.3} clipped ({:.3} and {:.3} without preempted time)",
        medians[2] / medians[0],
        medians[3] / medians[1],
        adjusted[2] / adjusted[0],
        adjusted[3] / adjusted[1]
    );
    println!(
        "automatic speculation / off: {:.3} unclipped, {:.3} clipped ({:.3} and {:.3} without preempted time)",
        medians[4] / medians[2],
        medians[5] / medians[3],
        adjusted[4] / adjusted[2],
        adjusted[5] / adjusted[3]
    );
    write!(
        json,
        "],\"clipped_over_unclipped\":{},\"clipped_over_unclipped_adjusted\":{},\"target\":1.15,\"target_applies\":{},\"target_met\":{},\"target_met_adjusted\":{},\"modes_behaved\":{}}}",
        json_num(clip_ratio),
        json_num(clip_ratio_adj),
        applies,
        met,
        met_adj,
        behaved
    )
    .unwrap();
    if let Some(path) = &a.json {
        write_json(path, &json)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    main_with("overlap_bench", USAGE, parse_args, run)
}
