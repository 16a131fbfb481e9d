//! `handoff_bench`: what one gradient hand-off costs the training thread.
//!
//! A training framework hands the session one gradient per parameter, thousands of times a
//! step, from its backward hooks; each call must stay in microseconds and must not allocate.
//! This benchmark registers many small slices (default 10,000 slices of 64-1024 f32 elements
//! in 300 sub-groups), hands all of them over each step in backward order, and times every
//! call, through the Rust API (`Session::grad_copy`) and the C API
//! (`superoffload::ffi::session::so_session_grad_copy`, the exported function itself), each
//! with its own session, on alternating steps. A third pass per step copies the same bytes
//! with a plain `copy_from_slice` into buffers of the same layout, timed the same way.
//!
//! Per call, overhead = hand-off time - the median plain-copy time of the same slice. Reported:
//! median, p99 and max overhead over all calls, separately for the calls that complete a
//! sub-group (which queue its speculative step on the CPU-Adam thread and return a ticket)
//! and the others. The target is <= 10 us per call.
//!
//! Allocations: a counting global allocator counts, per thread, every alloc, alloc_zeroed
//! and realloc. Reported: allocations made by the training thread inside the hand-offs of
//! a step where no sub-group gets a late gradient (the target is 0), which calls made them,
//! and, for information, allocations made by every other thread in the same window (the
//! CPU-Adam thread and the pool running speculative steps). One final step hands one slice
//! over twice (a late gradient) to show the allocation the library documents for that case.

use superoffload_bench::*;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use superoffload::error::Status;
use superoffload::ffi::session as c;
use superoffload::kernels::{DType, Floats, Pool, PoolOptions};
use superoffload::session::{
    Borrowed, GroupHparams, NormSource, Session, SessionOptions, SliceDesc, Speculation, StepArgs, SubGroupDesc,
};

// ---- counting allocator ------------------------------------------------------------------

struct Counting;

static ALL_ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD_ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn note_alloc() {
    ALL_ALLOCS.fetch_add(1, Ordering::Relaxed);
    let _ = THREAD_ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards to the system allocator, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc();
        // SAFETY: our caller meets `GlobalAlloc::alloc`'s contract, which is `System`'s too.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc();
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_alloc();
        // SAFETY: `ptr` came from `System` through this allocator, with `layout` (the caller's
        // contract of `realloc`).
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as in `realloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// (voluntary, involuntary) context switches of the calling thread so far: voluntary ones
/// mean it blocked (a contended lock, a wait), involuntary ones that it was preempted.
fn context_switches() -> (i64, i64) {
    // SAFETY: a zeroed rusage is valid; RUSAGE_THREAD fills it for this thread.
    unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut u);
        (u.ru_nvcsw as i64, u.ru_nivcsw as i64)
    }
}

fn my_allocs() -> u64 {
    THREAD_ALLOCS.with(Cell::get)
}

fn all_allocs() -> u64 {
    ALL_ALLOCS.load(Ordering::Relaxed)
}

// ---- arguments -------------------------------------------------------------------------------

const USAGE: &str = "\
handoff_bench: per-call cost and allocations of gradient hand-offs (Session::grad_copy and
so_session_grad_copy) for many small slices

USAGE: handoff_bench [OPTIONS]

OPTIONS:
  --slices N        slices (parameters) per step (default 10000)
  --subgroups G     sub-groups they are spread over, contiguously (default 300)
  --min-elems A     smallest slice, f32 elements (default 64)
  --max-elems B     largest slice (default 1024); sizes are uniform in [A, B]
  --steps S         measured steps per API (default 20)
  --warmup W        unmeasured steps per API first (default 3)
  --no-speculation  sessions without speculation (completing calls queue a sum of squares)
  --pool-cores LIST cores of the sessions' pools (default: every CPU this process may run
                    on except the training core)
  --train-core C    core of the training thread (default: the first allowed CPU)
  --json PATH       also write the results as JSON to PATH (- for stdout)
  -h, --help        this text";

struct Args {
    slices: usize,
    subgroups: usize,
    min: usize,
    max: usize,
    steps: usize,
    warmup: usize,
    speculation: bool,
    cores: Cores,
    json: Option<String>,
}

fn parse_args(cli: &mut Cli) -> Result<Args, String> {
    let mut a = Args {
        slices: 10_000,
        subgroups: 300,
        min: 64,
        max: 1024,
        steps: 20,
        warmup: 3,
        speculation: true,
        cores: Cores::default(),
        json: None,
    };
    while let Some(flag) = cli.next_flag() {
        match flag.as_str() {
            "--slices" => a.slices = cli.count()?,
            "--subgroups" => a.subgroups = cli.count()?,
            "--min-elems" => a.min = cli.count()?,
            "--max-elems" => a.max = cli.count()?,
            "--steps" => a.steps = cli.count()?,
            "--warmup" => a.warmup = cli.count()?,
            "--no-speculation" => a.speculation = !cli.switch()?,
            "--json" => a.json = Some(cli.value()?),
            f if a.cores.take_flag(cli, f)? => {}
            _ => return Err(cli.unknown()),
        }
    }
    if a.subgroups == 0 || a.slices < a.subgroups {
        return Err("need at least one sub-group and at least one slice per sub-group".into());
    }
    if a.min == 0 || a.min > a.max {
        return Err("need 1 <= --min-elems <= --max-elems".into());
    }
    if a.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    Ok(a)
}

// ---- helpers -----------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    fn small(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.01
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

fn c_check(what: &str, status: Status) -> Result<(), String> {
    if status == Status::Ok {
        return Ok(());
    }
    let mut buf = vec![0u8; 1024];
    // SAFETY: `buf` has `buf.len()` writable bytes.
    let n = unsafe { superoffload::ffi::version::so_last_error_message(buf.as_mut_ptr().cast(), buf.len()) };
    buf.truncate(n.min(1023));
    Err(format!("{what}: {:?}: {}", status, String::from_utf8_lossy(&buf)))
}

// ---- the model -------------------------------------------------------------------------------

/// Slices in registration (forward) order: (sub-group, offset in it, length).
struct Model {
    slices: Vec<(usize, usize, usize)>,
    sg_numel: Vec<usize>,
}

fn model(a: &Args) -> Model {
    let mut rng = Rng(12345);
    let mut slices = Vec::with_capacity(a.slices);
    let mut sg_numel = vec![0usize; a.subgroups];
    for i in 0..a.slices {
        let sg = i * a.subgroups / a.slices;
        let n = rng.range(a.min, a.max);
        slices.push((sg, sg_numel[sg], n));
        sg_numel[sg] += n;
    }
    Model { slices, sg_numel }
}

/// One API's session and what its steps measured.
struct Api {
    name: &'static str,
    rust: Option<Session>,
    c_session: *mut c::so_session,
    _masters: Vec<Vec<f32>>,
    ids: Vec<u32>,
    /// Per measured call: (slice index, ns, completed a sub-group, preempted during it).
    calls: Vec<(usize, f64, bool, bool)>,
    step_ms: Vec<f64>,
    /// Per measured step: allocations by the training thread inside the hand-offs.
    my_allocs: Vec<u64>,
    /// ... and by every other thread in the same window.
    other_allocs: Vec<u64>,
    /// Allocations by the training thread, per call kind: (completing, other).
    alloc_calls: (u64, u64),
    alloc_count: (u64, u64),
    /// Context switches of the training thread inside the measured hand-offs.
    switches: (i64, i64),
}

impl Api {
    fn new_rust(m: &Model, pool: &Arc<Pool>, speculation: bool) -> Result<Api, String> {
        let session = Session::new(SessionOptions {
            pool: Some(pool.clone()),
            speculation: if speculation { Speculation::On } else { Speculation::Off },
            ..SessionOptions::default()
        })
        .map_err(|e| e.to_string())?;
        let group =
            session.add_group(GroupHparams { lr: 1e-5, ..GroupHparams::default() }).map_err(|e| e.to_string())?;
        let mut masters: Vec<Vec<f32>> = m.sg_numel.iter().map(|&n| vec![0.01; n]).collect();
        for (sg, master) in masters.iter_mut().enumerate() {
            let slices = m
                .slices
                .iter()
                .enumerate()
                .filter(|(_, s)| s.0 == sg)
                .map(|(i, s)| SliceDesc { name: format!("p{i}"), offset: s.1, numel: s.2 })
                .collect();
            // SAFETY: the masters outlive the session (field order) and are not touched.
            let b = unsafe { Borrowed::new("master", master.as_mut_ptr().cast(), master.len(), DType::F32) }
                .map_err(|e| e.to_string())?;
            session.add_subgroup(SubGroupDesc::new(group, b, slices)).map_err(|e| e.to_string())?;
        }
        let ids = (0..m.slices.len())
            .map(|i| session.slice_id(&format!("p{i}")).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        Ok(Api::with("Session::grad_copy", Some(session), std::ptr::null_mut(), masters, ids))
    }

    fn new_c(m: &Model, cores: &[usize], speculation: bool) -> Result<Api, String> {
        let cores32: Vec<u32> = cores.iter().map(|&c| c as u32).collect();
        let mut opts = c::so_session_options_default();
        opts.cores = cores32.as_ptr();
        opts.num_cores = cores32.len();
        opts.speculation = speculation as u32;
        let mut session: *mut c::so_session = std::ptr::null_mut();
        // SAFETY: valid options and out-pointer.
        c_check("so_session_create", unsafe { c::so_session_create(&opts, &mut session) })?;
        let mut api = Api::with("so_session_grad_copy", None, session, Vec::new(), Vec::new());
        let mut hp = c::so_group_hparams_default();
        hp.lr = 1e-5;
        let mut group = 0u32;
        // SAFETY: a live session, a valid struct and out-pointer.
        c_check("so_session_add_group", unsafe { c::so_session_add_group(session, &hp, &mut group) })?;
        let mut masters: Vec<Vec<f32>> = m.sg_numel.iter().map(|&n| vec![0.01; n]).collect();
        let names: Vec<std::ffi::CString> =
            (0..m.slices.len()).map(|i| std::ffi::CString::new(format!("p{i}")).unwrap()).collect();
        for (sg, master) in masters.iter_mut().enumerate() {
            let slices: Vec<c::so_slice_desc> = m
                .slices
                .iter()
                .enumerate()
                .filter(|(_, s)| s.0 == sg)
                .map(|(i, s)| c::so_slice_desc { name: names[i].as_ptr(), offset: s.1, numel: s.2 })
                .collect();
            let mut d = c::so_subgroup_desc_default();
            d.group = group;
            d.master = master.as_mut_ptr().cast();
            d.numel = master.len();
            d.slices = slices.as_ptr();
            d.num_slices = slices.len();
            let mut id = 0u32;
            // SAFETY: `d`'s master (kept in `masters`, which `api` keeps alive) and slices (with
            // their names) are valid for the call and the master for the session's life.
            c_check("so_session_add_subgroup", unsafe { c::so_session_add_subgroup(session, &d, &mut id) })?;
        }
        for name in &names {
            let mut id = 0u32;
            // SAFETY: a live session, a NUL-terminated name and a valid out-pointer.
            c_check("so_session_slice_id", unsafe { c::so_session_slice_id(session, name.as_ptr(), &mut id) })?;
            api.ids.push(id);
        }
        api._masters = masters;
        Ok(api)
    }

    fn with(
        name: &'static str,
        rust: Option<Session>,
        c_session: *mut c::so_session,
        masters: Vec<Vec<f32>>,
        ids: Vec<u32>,
    ) -> Api {
        Api {
            name,
            rust,
            c_session,
            _masters: masters,
            ids,
            calls: Vec::new(),
            step_ms: Vec::new(),
            my_allocs: Vec::new(),
            other_allocs: Vec::new(),
            alloc_calls: (0, 0),
            alloc_count: (0, 0),
            switches: (0, 0),
        }
    }

    fn begin(&self) -> Result<(), String> {
        match &self.rust {
            Some(s) => s.begin_step(Some(1.0), 1).map_err(|e| e.to_string()),
            // SAFETY: `c_session` is live while `self` is.
            None => c_check("so_session_begin_step", unsafe { c::so_session_begin_step(self.c_session, 1.0, 1) }),
        }
    }

    /// One hand-off; returns whether it completed a sub-group (queued work).
    #[inline(always)]
    fn hand_off(&self, slice: u32, grad: &[f32]) -> Result<bool, String> {
        match &self.rust {
            Some(s) => s.grad_copy(slice, Floats::F32(grad)).map(|t| t.is_some()).map_err(|e| e.to_string()),
            None => {
                let mut ticket = 0u64;
                // SAFETY: `grad` holds `grad.len()` f32 elements.
                let st = unsafe {
                    c::so_session_grad_copy(self.c_session, slice, grad.as_ptr().cast(), grad.len(), &mut ticket)
                };
                c_check("so_session_grad_copy", st).map(|_| ticket != 0)
            }
        }
    }

    /// step(), then waits for its result; returns (speculative, kept, redone, late).
    fn finish(&self) -> Result<(u32, u32, u32, u32), String> {
        match &self.rust {
            Some(s) => {
                let t = s
                    .step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false })
                    .map_err(|e| e.to_string())?;
                let r = s.step_result(t, None).map_err(|e| e.to_string())?;
                Ok((r.speculative, r.kept, r.cancelled, r.late_gradients))
            }
            None => {
                let args = c::so_step_args_default();
                let mut ticket = 0u64;
                // SAFETY: a live session, valid args and out-pointer.
                c_check("so_session_step", unsafe { c::so_session_step(self.c_session, &args, &mut ticket) })?;
                // SAFETY: so_step_result is plain data; all-zero is a valid value.
                let mut r: c::so_step_result = unsafe { std::mem::zeroed() };
                r.struct_size = std::mem::size_of::<c::so_step_result>();
                // SAFETY: a live session and a result struct with its struct_size set.
                c_check("so_session_step_result", unsafe {
                    c::so_session_step_result(self.c_session, ticket, -1, &mut r)
                })?;
                Ok((r.speculative, r.kept, r.cancelled, r.late_gradients))
            }
        }
    }

    /// One step: every slice in backward order, timed per call.
    fn step(&mut self, grads: &[Vec<f32>], measure: bool, expected: usize) -> Result<(), String> {
        self.begin()?;
        let n = grads.len();
        let mut times = Vec::with_capacity(if measure { n } else { 0 });
        let (mut ac, mut ao, mut cc, mut co) = (0, 0, 0, 0);
        let (mine0, all0) = (my_allocs(), all_allocs());
        let cs0 = context_switches();
        for i in (0..n).rev() {
            let before = my_allocs();
            let preempt0 = if measure { context_switches().1 } else { 0 };
            let t0 = Instant::now();
            let completed = self.hand_off(self.ids[i], &grads[i])?;
            let dt = t0.elapsed();
            let preempted = measure && context_switches().1 != preempt0;
            let made = my_allocs() - before;
            if made > 0 {
                if completed {
                    ac += 1;
                    cc += made;
                } else {
                    ao += 1;
                    co += made;
                }
            }
            if measure {
                times.push((i, dt.as_nanos() as f64, completed, preempted));
            }
        }
        // The hand-offs' own time (the loop also runs the bookkeeping around each call).
        let step = Duration::from_nanos(times.iter().map(|t| t.1 as u64).sum());
        let cs1 = context_switches();
        let (mine, all) = (my_allocs() - mine0, all_allocs() - all0);
        // Without clipping each speculative step is kept, or cancelled (not started at step()).
        let (speculative, kept, cancelled, late) = self.finish()?;
        if late != 0 || ((kept + cancelled) as usize != expected && speculative as usize == expected) {
            return Err(format!(
                "{}: unexpected step result: speculative {speculative}, kept {kept}, cancelled {cancelled}, late {late}",
                self.name
            ));
        }
        if measure {
            self.calls.extend(times);
            self.step_ms.push(step.as_secs_f64() * 1e3);
            self.my_allocs.push(mine);
            self.other_allocs.push(all - mine);
            self.alloc_calls.0 += ac;
            self.alloc_calls.1 += ao;
            self.alloc_count.0 += cc;
            self.alloc_count.1 += co;
            self.switches.0 += cs1.0 - cs0.0;
            self.switches.1 += cs1.1 - cs0.1;
        }
        Ok(())
    }

    /// A step in which slice `late` is handed over a second time after its sub-group
    /// completed. Returns the allocations that late hand-off made, and the redone count.
    fn late_step(&mut self, grads: &[Vec<f32>], late: usize) -> Result<(u64, u32, Duration), String> {
        self.begin()?;
        for i in (0..grads.len()).rev() {
            self.hand_off(self.ids[i], &grads[i])?;
        }
        let before = my_allocs();
        let t0 = Instant::now();
        self.hand_off(self.ids[late], &grads[late])?;
        let dt = t0.elapsed();
        let made = my_allocs() - before;
        let (_, _, redone, late_count) = self.finish()?;
        if late_count != 1 {
            return Err(format!("{}: the late gradient was not counted ({late_count})", self.name));
        }
        Ok((made, redone, dt))
    }
}

impl Drop for Api {
    fn drop(&mut self) {
        if !self.c_session.is_null() {
            // SAFETY: created by so_session_create, destroyed once.
            unsafe { c::so_session_destroy(self.c_session) };
        }
    }
}

/// Median plain-copy ns per slice, and per-step totals.
fn plain_copies(m: &Model, grads: &[Vec<f32>], steps: usize) -> (Vec<f64>, Vec<f64>) {
    let mut dst: Vec<Vec<f32>> = m.sg_numel.iter().map(|&n| vec![0.0; n]).collect();
    let mut per_slice: Vec<Vec<f64>> = vec![Vec::with_capacity(steps); grads.len()];
    let mut step_ms = Vec::new();
    for rep in 0..steps + 2 {
        let mut step = Duration::ZERO;
        for i in (0..grads.len()).rev() {
            let (sg, off, n) = m.slices[i];
            let t0 = Instant::now();
            dst[sg][off..off + n].copy_from_slice(&grads[i]);
            let dt = t0.elapsed();
            step += dt;
            if rep >= 2 {
                per_slice[i].push(dt.as_nanos() as f64);
            }
        }
        std::hint::black_box(&mut dst);
        if rep >= 2 {
            step_ms.push(step.as_secs_f64() * 1e3);
        }
    }
    (per_slice.into_iter().map(|v| percentile(&sorted(v), 0.5)).collect(), step_ms)
}

fn timer_ns() -> f64 {
    let mut v = Vec::with_capacity(10_000);
    for _ in 0..10_000 {
        let t0 = Instant::now();
        let dt = t0.elapsed();
        v.push(dt.as_nanos() as f64);
    }
    percentile(&sorted(v), 0.5)
}

fn run(a: Args) -> Result<(), String> {
    let (train_core, pool_cores) = a.cores.resolve()?;
    let m = model(&a);
    let mut rng = Rng(777);
    let grads: Vec<Vec<f32>> = m.slices.iter().map(|s| (0..s.2).map(|_| rng.small()).collect()).collect();
    let total_elems: usize = m.sg_numel.iter().sum();

    // Pools and sessions are created while this thread may run on the pool's cores only, so
    // that the sessions' CPU-Adam threads (which inherit that mask) stay off the training
    // core; the pools check their cores against the calling thread's mask, so they come first.
    let pool = Arc::new(
        Pool::new(&PoolOptions { cores: Some(pool_cores.clone()), ..PoolOptions::default() })
            .map_err(|e| e.to_string())?,
    );
    pin_current_thread(&pool_cores)?;
    let mut rust_api = Api::new_rust(&m, &pool, a.speculation)?;
    let mut c_api = Api::new_c(&m, &pool_cores, a.speculation)?; // its own pool, on the same cores
    pin_current_thread(&[train_core])?;

    println!(
        "handoff_bench: {} slices of {}-{} f32 elements (mean {:.0}) in {} sub-groups, {:.1} MB of gradients per step",
        a.slices,
        a.min,
        a.max,
        total_elems as f64 / a.slices as f64,
        a.subgroups,
        (total_elems * 4) as f64 / 1e6
    );
    println!(
        "training thread on core {train_core}, pools on cores {pool_cores:?}; speculation {}; {} measured steps per API after {} warm-up",
        if a.speculation { "on" } else { "off" },
        a.steps,
        a.warmup
    );

    let expected = a.subgroups;
    for s in 0..a.warmup + a.steps {
        let measure = s >= a.warmup;
        rust_api.step(&grads, measure, expected)?;
        c_api.step(&grads, measure, expected)?;
    }
    let (copy_ns, copy_step_ms) = plain_copies(&m, &grads, a.steps);
    let timer = timer_ns();

    println!();
    println!(
        "{:<22} {:>8} {:>8} {:>9} {:>8} {:>8} {:>8} {:>9} {:>10} {:>18}",
        "per call (us)",
        "median",
        "p99",
        "max",
        "ovh mean",
        "ovh med",
        "ovh p99",
        "ovh max",
        "> 10 us",
        "not preempted"
    );
    let copy_sorted = sorted(copy_ns.iter().map(|x| x / 1e3).collect());
    println!(
        "{:<22} {:>8.3} {:>8.3} {:>9.3} {:>8} {:>8} {:>8} {:>9} {:>10} {:>18}",
        "plain copy",
        percentile(&copy_sorted, 0.5),
        percentile(&copy_sorted, 0.99),
        copy_sorted.last().copied().unwrap_or(f64::NAN),
        "-",
        "-",
        "-",
        "-",
        "-",
        "-"
    );
    let mut json = String::new();
    write!(
        json,
        "{{\"slices\":{},\"subgroups\":{},\"min_elems\":{},\"max_elems\":{},\"speculation\":{},\"steps\":{},\"timer_ns\":{},\"plain_copy_step_ms\":{},\"apis\":[",
        a.slices,
        a.subgroups,
        a.min,
        a.max,
        a.speculation,
        a.steps,
        json_num(timer),
        json_num(percentile(&sorted(copy_step_ms.clone()), 0.5))
    )
    .unwrap();
    let mut worst_p99: f64 = 0.0;
    let mut any_alloc = false;
    let mut summaries = Vec::new();
    for (k, api) in [&rust_api, &c_api].into_iter().enumerate() {
        let total = sorted(api.calls.iter().map(|c| c.1 / 1e3).collect());
        let ovh = |filter: &dyn Fn(bool) -> bool| {
            sorted(api.calls.iter().filter(|c| filter(c.2)).map(|c| (c.1 - copy_ns[c.0]) / 1e3).collect())
        };
        let over_unpreempted = |filter: &dyn Fn(bool) -> bool| {
            let calls: Vec<_> = api.calls.iter().filter(|c| filter(c.2) && !c.3).collect();
            let over = calls.iter().filter(|c| (c.1 - copy_ns[c.0]) / 1e3 > 10.0).count();
            let max = calls.iter().map(|c| (c.1 - copy_ns[c.0]) / 1e3).fold(0.0f64, f64::max);
            format!("{over}/{} max {max:.0}", calls.len())
        };
        let all = ovh(&|_| true);
        let completing = ovh(&|x| x);
        let other = ovh(&|x| !x);
        let row = |label: &str, t: Option<&Vec<f64>>, o: &Vec<f64>, unpreempted: String| {
            let (m, p, x) = match t {
                Some(t) => (
                    format!("{:.3}", percentile(t, 0.5)),
                    format!("{:.3}", percentile(t, 0.99)),
                    format!("{:.1}", t.last().copied().unwrap_or(f64::NAN)),
                ),
                None => ("".into(), "".into(), "".into()),
            };
            let mean = o.iter().sum::<f64>() / o.len().max(1) as f64;
            let over = o.iter().filter(|&&x| x > 10.0).count();
            println!(
                "{:<22} {:>8} {:>8} {:>9} {:>8.3} {:>8.3} {:>8.3} {:>9.1} {:>10} {:>18}",
                label,
                m,
                p,
                x,
                mean,
                percentile(o, 0.5),
                percentile(o, 0.99),
                o.last().copied().unwrap_or(f64::NAN),
                format!("{over}/{}", o.len()),
                unpreempted
            );
        };
        row(api.name, Some(&total), &all, over_unpreempted(&|_| true));
        row(
            &format!("  completing ({}/step)", completing.len() / a.steps.max(1)),
            None,
            &completing,
            over_unpreempted(&|x| x),
        );
        row("  other", None, &other, over_unpreempted(&|x| !x));
        worst_p99 = worst_p99.max(percentile(&all, 0.99));
        let mine_total: u64 = api.my_allocs.iter().sum();
        let other_total: u64 = api.other_allocs.iter().sum();
        any_alloc |= mine_total > 0;
        let step_med = percentile(&sorted(api.step_ms.clone()), 0.5);
        let step_min = sorted(api.step_ms.clone())[0];
        summaries.push(format!(
            "{}: time in the hand-offs of a step {:.2} ms median, {:.2} ms min (plain copies: {:.2} ms median); training-thread allocations in the hand-offs: {} per step \
             (total {} over {} steps: {} in {} completing calls, {} in {} other calls); other threads in the same window: {:.1} per step; \
             context switches of the training thread in the hand-offs: {:.2} voluntary (blocked) and {:.2} involuntary (preempted) per step",
            api.name,
            step_med,
            step_min,
            percentile(&sorted(copy_step_ms.clone()), 0.5),
            if api.my_allocs.iter().all(|&x| x == api.my_allocs[0]) { api.my_allocs[0].to_string() } else { format!("{:?}", api.my_allocs) },
            mine_total,
            a.steps,
            api.alloc_count.0,
            api.alloc_calls.0,
            api.alloc_count.1,
            api.alloc_calls.1,
            other_total as f64 / a.steps as f64,
            api.switches.0 as f64 / a.steps as f64,
            api.switches.1 as f64 / a.steps as f64
        ));
        if k > 0 {
            json.push(',');
        }
        write!(
            json,
            "{{\"api\":\"{}\",\"call_us_median\":{},\"call_us_p99\":{},\"overhead_us_median\":{},\"overhead_us_p99\":{},\"overhead_us_max\":{},\"overhead_us_mean\":{},\"calls_over_10us\":{},\"completing_overhead_us_median\":{},\"completing_overhead_us_p99\":{},\"other_overhead_us_median\":{},\"other_overhead_us_p99\":{},\"step_handoff_ms\":{},\"train_thread_allocs_per_step\":{},\"allocs_in_completing_calls\":{},\"allocs_in_other_calls\":{},\"other_thread_allocs_per_step\":{},\"voluntary_switches_per_step\":{},\"involuntary_switches_per_step\":{}}}",
            api.name,
            json_num(percentile(&total, 0.5)),
            json_num(percentile(&total, 0.99)),
            json_num(percentile(&all, 0.5)),
            json_num(percentile(&all, 0.99)),
            json_num(all.last().copied().unwrap_or(f64::NAN)),
            json_num(all.iter().sum::<f64>() / all.len().max(1) as f64),
            all.iter().filter(|&&x| x > 10.0).count(),
            json_num(percentile(&completing, 0.5)),
            json_num(percentile(&completing, 0.99)),
            json_num(percentile(&other, 0.5)),
            json_num(percentile(&other, 0.99)),
            json_num(step_med),
            json_num(mine_total as f64 / a.steps as f64),
            api.alloc_count.0,
            api.alloc_count.1,
            json_num(other_total as f64 / a.steps as f64),
            json_num(api.switches.0 as f64 / a.steps as f64),
            json_num(api.switches.1 as f64 / a.steps as f64)
        )
        .unwrap();
    }
    println!("(overhead = call time - median plain-copy time of the same slice; timer pair {timer:.0} ns, in both;");
    println!(
        " > 10 us: calls whose overhead exceeds 10 us, of all calls and of those during which the thread was not preempted)"
    );
    println!();
    for s in &summaries {
        println!("{s}");
    }

    // A late gradient: the documented allocation.
    let (late_allocs, redone, late_dt) = rust_api.late_step(&grads, 0)?;
    let late_sg_numel = m.sg_numel[m.slices[0].0];
    println!(
        "late gradient (slice 0 again after its sub-group of {} elements completed): {} allocation(s) on the training thread, {:.1} us; sub-groups redone at step(): {} (0 without speculation: nothing to undo)",
        late_sg_numel,
        late_allocs,
        late_dt.as_secs_f64() * 1e6,
        redone
    );
    let met = worst_p99 <= 10.0;
    println!();
    println!(
        "target: overhead <= 10 us per call (p99 of all calls): {} (worst p99 {:.3} us); no allocation on the training thread: {}",
        if met { "met" } else { "NOT met" },
        worst_p99,
        if any_alloc { "NOT met" } else { "met" }
    );
    write!(
        json,
        "],\"late_gradient_allocs\":{},\"late_gradient_redone\":{},\"target_us\":10,\"overhead_target_met\":{},\"no_alloc_target_met\":{}}}",
        late_allocs, redone, met, !any_alloc
    )
    .unwrap();
    if let Some(path) = &a.json {
        write_json(path, &json)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    main_with("handoff_bench", USAGE, parse_args, run)
}
