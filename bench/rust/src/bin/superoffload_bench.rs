//! `superoffload-bench`: how fast the CPU Adam kernels run on this machine, next to the
//! Adam-shaped memory floor measured in the same run on the same buffers.
//!
//! Installed with the package, so it needs no Rust toolchain to run; std only plus the
//! crate. Run `superoffload-bench --help` for the flags.
//!
//! Method: every buffer is allocated untouched (zero pages from the OS), first written by the
//! pool's threads (a `memory_floor` pass), then filled with realistic random values (param
//! ~ N(0, 0.02²), gradient ~ N(0, 1), small first moment, second moment >= 1e-4) by as many
//! threads. Each repetition then runs every operation once, one after another, so that any
//! drift of the machine hits all of them alike:
//!
//! 1. f32 update (AdamW, wd 0.01, step t);
//! 2. its memory floor;
//! 3. rollback of that step;
//! 4. update with a bf16 gradient, grad_scale 0.5 and a bf16 copy-out;
//! 5. its floor, then an untimed rollback of 4;
//! 6. the same update split in two passes: the copy, then the state (the parameter and the
//!    moments; what a CUDA session's final pass leaves for later), then an untimed rollback;
//! 7. update with check_finite and the sum of squares;
//! 8. rescale of that step from scale 1 to 0.5; then t += 1.
//!
//! So the state advances one real step per repetition, the bias correction differs every
//! time, and rollback and rescale run on exactly the state they are meant for. The floors
//! run with a gradient scale of 2^-60, which leaves the state as it is (up to the last ulp
//! of near-zero values): the floor's arithmetic is trivial either way, and the optimiser
//! state stays realistic (the floor adds the scaled gradient to p, m and v).
//!
//! Reported per operation: median and minimum over `--iters` repetitions after `--warmup`,
//! Gparam/s, and the effective bandwidth at the bytes per element the operation must move.

use superoffload_bench::*;

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use half::bf16;
use superoffload::kernels::{
    self, AdamBuffers, AdamHyper, AdamMode, CopyOutMut, GradRef, Isa, MomentsMut, ParamMut, Pool, PoolOptions,
    UpdateOptions,
};

/// Gradient scale of the floor passes: keeps p, m and v as they are (see the module docs).
const FLOOR_SCALE: f32 = 1.0 / (1u64 << 60) as f32;

const USAGE: &str = "\
superoffload-bench: time the CPU Adam kernels against the memory floor, in one run

USAGE: superoffload-bench [OPTIONS]

OPTIONS:
  --n N           elements per buffer (default 1e8; 1e8 notation accepted)
  --threads T     pool threads (default: one per CPU this process may run on,
                  or one per listed core)
  --cores LIST    pin one thread per core, e.g. 0-15 or 0,2,4-7
  --isa ISA       auto | portable | avx2 | avx512 (default auto)
  --iters K       timed repetitions (default 10)
  --warmup W      untimed repetitions first (default 3)
  --pages P       huge | small: whether the buffers are advised to transparent huge
                  pages before their first touch, as the session's and the Python
                  layer's are (default huge)
  --json PATH     also write the results as JSON to PATH
  -h, --help      this text

Memory: 4 f32 and 2 bf16 buffers of N elements (20 bytes per element: 2 GB at 1e8).";

struct Args {
    n: usize,
    threads: Option<usize>,
    cores: Option<Vec<usize>>,
    isa: Option<Isa>,
    iters: usize,
    warmup: usize,
    huge_pages: bool,
    json: Option<String>,
}

fn parse_args(cli: &mut Cli) -> Result<Args, String> {
    let mut args = Args {
        n: 100_000_000,
        threads: None,
        cores: None,
        isa: None,
        iters: 10,
        warmup: 3,
        huge_pages: true,
        json: None,
    };
    while let Some(flag) = cli.next_flag() {
        match flag.as_str() {
            "--n" => args.n = cli.count()?,
            "--threads" => args.threads = Some(cli.count()?),
            "--cores" => args.cores = Some(cli.cores()?),
            "--isa" => {
                args.isa = cli.choice(&[
                    ("auto", None),
                    ("portable", Some(Isa::Portable)),
                    ("avx2", Some(Isa::Avx2)),
                    ("avx512", Some(Isa::Avx512)),
                ])?
            }
            "--iters" => args.iters = cli.count()?,
            "--warmup" => args.warmup = cli.count()?,
            "--pages" => args.huge_pages = cli.choice(&[("huge", true), ("small", false)])?,
            "--json" => args.json = Some(cli.value()?),
            _ => return Err(cli.unknown()),
        }
    }
    if args.n == 0 {
        return Err("--n must be at least 1".into());
    }
    if args.iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    if args.threads == Some(0) {
        return Err("--threads must be at least 1".into());
    }
    Ok(args)
}

// ---- data -------------------------------------------------------------------------------

/// The six buffers of the benchmark.
struct Data {
    p: Vec<f32>,
    g: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    g16: Vec<bf16>,
    c16: Vec<bf16>,
}

/// `n` zero bf16 elements whose pages the OS has not handed out yet (calloc'd, untouched).
fn untouched_bf16(n: usize) -> Vec<bf16> {
    let mut raw = std::mem::ManuallyDrop::new(vec![0u16; n]);
    let (ptr, len, cap) = (raw.as_mut_ptr(), raw.len(), raw.capacity());
    // SAFETY: bf16 is repr(transparent) over u16 (same size and alignment), every bit pattern
    // is a valid bf16, and the allocation is handed over exactly once.
    unsafe { Vec::from_raw_parts(ptr.cast::<bf16>(), len, cap) }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Roughly N(0, 1) (Irwin–Hall of four uniforms, rescaled), from element `i` of `stream`:
/// the same values whatever the thread count.
fn gauss(stream: u64, i: usize) -> f32 {
    let h = splitmix64((i as u64) ^ stream.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let sum: u32 = (0..4).map(|k| ((h >> (16 * k)) & 0xFFFF) as u32).sum();
    // Sum of four U(0,1): mean 2, variance 1/3.
    ((sum as f32 + 2.0) / 65536.0 - 2.0) * 1.732_050_8
}

fn alloc_and_fill(
    pool: &Pool,
    n: usize,
    fill_threads: usize,
    huge_pages: bool,
) -> Result<(Data, Duration, Duration), String> {
    let t0 = Instant::now();
    let mut d = Data {
        p: vec![0.0; n],
        g: vec![0.0; n],
        m: vec![0.0; n],
        v: vec![0.0; n],
        g16: untouched_bf16(n),
        c16: untouched_bf16(n),
    };
    if huge_pages {
        for f in [&mut d.p, &mut d.g, &mut d.m, &mut d.v] {
            kernels::advise_huge_pages(f.as_mut_ptr().cast(), n * 4);
        }
        for h in [&mut d.g16, &mut d.c16] {
            kernels::advise_huge_pages(h.as_mut_ptr().cast(), n * 2);
        }
    }
    // First touch by the pool's threads: two floor passes that between them write every
    // buffer (a read-only buffer would only map the shared zero page).
    kernels::memory_floor(
        pool,
        AdamBuffers {
            param: ParamMut::F32(&mut d.p),
            grad: GradRef::F32(&d.g),
            moments: MomentsMut::F32 { exp_avg: &mut d.m, exp_avg_sq: &mut d.v },
            copy_out: None,
        },
        1.0,
    )
    .map_err(|e| format!("first touch: {e}"))?;
    kernels::memory_floor(
        pool,
        AdamBuffers {
            param: ParamMut::F32(&mut d.g),
            grad: GradRef::F32(&d.p),
            moments: MomentsMut::Bf16 { exp_avg: &mut d.g16, exp_avg_sq: &mut d.c16 },
            copy_out: None,
        },
        1.0,
    )
    .map_err(|e| format!("first touch: {e}"))?;
    let touched = t0.elapsed();

    // Fill in parallel (the pages are already placed).
    let t1 = Instant::now();
    let chunk = n.div_ceil(fill_threads.max(1)).max(1);
    std::thread::scope(|scope| {
        let parts =
            d.p.chunks_mut(chunk)
                .zip(d.g.chunks_mut(chunk))
                .zip(d.m.chunks_mut(chunk))
                .zip(d.v.chunks_mut(chunk))
                .zip(d.g16.chunks_mut(chunk))
                .zip(d.c16.chunks_mut(chunk));
        for (k, (((((p, g), m), v), g16), c16)) in parts.enumerate() {
            scope.spawn(move || {
                let base = k * chunk;
                for j in 0..p.len() {
                    let i = base + j;
                    p[j] = 0.02 * gauss(1, i);
                    g[j] = gauss(2, i);
                    m[j] = 0.01 * gauss(3, i);
                    let s = gauss(4, i);
                    v[j] = 1e-4 + 0.01 * s * s;
                    g16[j] = bf16::from_f32(gauss(5, i));
                    c16[j] = bf16::from_f32(p[j]);
                }
            });
        }
    });
    Ok((d, touched, t1.elapsed()))
}

/// Elements of p, m, v (f32) and the bf16 copy that are not finite, counted in parallel.
fn count_non_finite(d: &Data, threads: usize) -> usize {
    let chunk = d.p.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> =
            d.p.chunks(chunk)
                .zip(d.m.chunks(chunk))
                .zip(d.v.chunks(chunk))
                .zip(d.c16.chunks(chunk))
                .map(|(((p, m), v), c)| {
                    scope.spawn(move || {
                        let f = |s: &[f32]| s.iter().filter(|x| !x.is_finite()).count();
                        f(p) + f(m) + f(v) + c.iter().filter(|x| !x.is_finite()).count()
                    })
                })
                .collect();
        handles.into_iter().map(|h| h.join().expect("scan thread")).sum()
    })
}

// ---- timing -----------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    UpdateF32,
    FloorF32,
    UpdateBf16,
    FloorBf16,
    SplitCopy,
    SplitState,
    Rollback,
    Rescale,
    UpdateChecked,
}

impl Op {
    const ALL: [Op; 9] = [
        Op::UpdateF32,
        Op::FloorF32,
        Op::UpdateBf16,
        Op::FloorBf16,
        Op::SplitCopy,
        Op::SplitState,
        Op::Rollback,
        Op::Rescale,
        Op::UpdateChecked,
    ];

    fn id(self) -> &'static str {
        match self {
            Op::UpdateF32 => "update_f32",
            Op::FloorF32 => "floor_f32",
            Op::UpdateBf16 => "update_bf16grad_bf16copy",
            Op::FloorBf16 => "floor_bf16grad_bf16copy",
            Op::SplitCopy => "split_copy_bf16grad_bf16copy",
            Op::SplitState => "split_state_bf16grad",
            Op::Rollback => "rollback_f32",
            Op::Rescale => "rescale_f32",
            Op::UpdateChecked => "update_f32_checkfinite_sumsq",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Op::UpdateF32 => "(a) update f32",
            Op::FloorF32 => "(b) floor f32",
            Op::UpdateBf16 => "(c) update bf16 grad+copy",
            Op::FloorBf16 => "(d) floor bf16 grad+copy",
            Op::SplitCopy => "(c1) split: copy pass",
            Op::SplitState => "(c2) split: state pass",
            Op::Rollback => "(e) rollback f32",
            Op::Rescale => "(f) rescale f32 1->0.5",
            Op::UpdateChecked => "(g) update check+sumsq",
        }
    }

    /// Bytes each element must move: reads, then writes.
    fn bytes_per_elt(self) -> usize {
        match self {
            // read p, g, m, v (16); write p, m, v (12)
            Op::UpdateF32 | Op::FloorF32 | Op::Rollback | Op::Rescale => 28,
            // read p 4, g 2, m 4, v 4; write p 4, m 4, v 4, copy 2
            Op::UpdateBf16 | Op::FloorBf16 => 28,
            // read p 4, g 2, m 4, v 4; write the copy 2
            Op::SplitCopy => 16,
            // read p 4, g 2, m 4, v 4; write p, m, v 12
            Op::SplitState => 26,
            // the finiteness check reads g once more before the step
            Op::UpdateChecked => 32,
        }
    }

    /// The operation it is compared with in the ratio column.
    fn baseline(self) -> Option<Op> {
        match self {
            Op::UpdateF32 => Some(Op::FloorF32),
            Op::UpdateBf16 => Some(Op::FloorBf16),
            Op::SplitCopy | Op::SplitState => Some(Op::UpdateBf16),
            Op::Rollback | Op::Rescale | Op::UpdateChecked => Some(Op::UpdateF32),
            Op::FloorF32 | Op::FloorBf16 => None,
        }
    }
}

struct Stats {
    median: f64,
    min: f64,
}

fn stats(samples: &[f64]) -> Stats {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let k = s.len();
    let median = if k % 2 == 1 { s[k / 2] } else { 0.5 * (s[k / 2 - 1] + s[k / 2]) };
    Stats { median, min: s[0] }
}

fn hyper(step: u64) -> AdamHyper {
    AdamHyper { mode: AdamMode::AdamW, lr: 1e-3, weight_decay: 0.01, step, ..AdamHyper::default() }
}

fn f32_bufs<'a>(d: &'a mut Data) -> AdamBuffers<'a> {
    AdamBuffers {
        param: ParamMut::F32(&mut d.p),
        grad: GradRef::F32(&d.g),
        moments: MomentsMut::F32 { exp_avg: &mut d.m, exp_avg_sq: &mut d.v },
        copy_out: None,
    }
}

fn bf16_bufs<'a>(d: &'a mut Data, copy: bool) -> AdamBuffers<'a> {
    AdamBuffers {
        param: ParamMut::F32(&mut d.p),
        grad: GradRef::Bf16(&d.g16),
        moments: MomentsMut::F32 { exp_avg: &mut d.m, exp_avg_sq: &mut d.v },
        copy_out: if copy { Some(CopyOutMut::Bf16(&mut d.c16)) } else { None },
    }
}

fn timed(f: impl FnOnce() -> superoffload::error::Result<()>) -> Result<f64, String> {
    let t = Instant::now();
    f().map_err(|e| e.to_string())?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// Runs `warmup + iters` repetitions; returns the timed samples (ms) of each op, in
/// `Op::ALL` order.
fn run(pool: &Pool, d: &mut Data, warmup: usize, iters: usize) -> Result<Vec<Vec<f64>>, String> {
    let mut samples = vec![Vec::with_capacity(iters); Op::ALL.len()];
    let slot = |op: Op| Op::ALL.iter().position(|&o| o == op).unwrap();
    let bf16_opts = UpdateOptions { grad_scale: 0.5, ..UpdateOptions::default() };
    let checked = UpdateOptions { check_finite: true, grad_sumsq: true, ..UpdateOptions::default() };
    for (rep, step) in (0..warmup + iters).zip(1u64..) {
        let hp = hyper(step);
        let mut rec = Vec::with_capacity(Op::ALL.len());
        rec.push((
            Op::UpdateF32,
            timed(|| kernels::update(pool, &hp, f32_bufs(d), &UpdateOptions::default()).map(drop))?,
        ));
        rec.push((Op::FloorF32, timed(|| kernels::memory_floor(pool, f32_bufs(d), FLOOR_SCALE))?));
        rec.push((Op::Rollback, timed(|| kernels::rollback(pool, &hp, f32_bufs(d), 1.0))?));
        rec.push((Op::UpdateBf16, timed(|| kernels::update(pool, &hp, bf16_bufs(d, true), &bf16_opts).map(drop))?));
        rec.push((Op::FloorBf16, timed(|| kernels::memory_floor(pool, bf16_bufs(d, true), FLOOR_SCALE))?));
        kernels::rollback(pool, &hp, bf16_bufs(d, false), 0.5).map_err(|e| e.to_string())?;
        rec.push((Op::SplitCopy, timed(|| kernels::update_copy(pool, &hp, bf16_bufs(d, true), 0.5))?));
        rec.push((Op::SplitState, timed(|| kernels::update_state(pool, &hp, bf16_bufs(d, true), 0.5))?));
        kernels::rollback(pool, &hp, bf16_bufs(d, false), 0.5).map_err(|e| e.to_string())?;
        let mut sumsq = None;
        rec.push((
            Op::UpdateChecked,
            timed(|| {
                sumsq = kernels::update(pool, &hp, f32_bufs(d), &checked)?.grad_sumsq;
                Ok(())
            })?,
        ));
        if !sumsq.is_some_and(|s: f64| s.is_finite() && s > 0.0) {
            return Err(format!("update with check_finite returned sum of squares {sumsq:?}"));
        }
        rec.push((Op::Rescale, timed(|| kernels::rescale(pool, &hp, f32_bufs(d), 1.0, 0.5))?));
        if rep >= warmup {
            for (op, ms) in rec {
                samples[slot(op)].push(ms);
            }
        }
    }
    Ok(samples)
}

// ---- report -----------------------------------------------------------------------------

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model") || l.starts_with("Hardware"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string())
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

struct Row {
    op: Op,
    st: Stats,
    samples: Vec<f64>,
    gparam: f64,
    gbps: f64,
    ratio: Option<f64>,
}

fn main() -> ExitCode {
    main_with("superoffload-bench", USAGE, parse_args, real_main)
}

fn real_main(args: Args) -> Result<(), String> {
    let options = PoolOptions { num_threads: args.threads.unwrap_or(0), cores: args.cores.clone(), isa: args.isa };
    let pool = Pool::new(&options).map_err(|e| format!("cannot create the pool: {e}"))?;
    let n = args.n;

    let cpu = cpu_model();
    let cpus_available = std::thread::available_parallelism().map_or(1, |c| c.get());
    let pinning = match pool.cores() {
        Some(c) => format!("pinned to {}", superoffload::kernels::pool::format_core_list(c)),
        None => "unpinned".to_string(),
    };
    println!("superoffload-bench {}", env!("CARGO_PKG_VERSION"));
    println!("cpu:     {cpu} ({cpus_available} CPUs available to this process)");
    println!("pool:    isa {}, {} threads, {pinning}", pool.isa().name(), pool.num_threads());
    println!("size:    N = {n} ({:.3e}) elements; {:.2} GB in 4 f32 + 2 bf16 buffers", n as f64, (n * 20) as f64 / 1e9);
    println!("timing:  median and min of {} repetitions after {} warm-up, ops interleaved", args.iters, args.warmup);

    let (mut data, touch, fill) = alloc_and_fill(&pool, n, pool.num_threads(), args.huge_pages)?;
    println!(
        "setup:   {} pages, first touch on the pool {:.2} s, random fill {:.2} s",
        if args.huge_pages { "huge" } else { "small" },
        touch.as_secs_f64(),
        fill.as_secs_f64()
    );

    let samples = run(&pool, &mut data, args.warmup, args.iters)?;

    let non_finite = count_non_finite(&data, pool.num_threads());
    if non_finite != 0 {
        return Err(format!("{non_finite} elements of p, m, v or the bf16 copy are not finite after the runs"));
    }

    let medians: Vec<f64> = samples.iter().map(|s| stats(s).median).collect();
    let median_of = |op: Op| medians[Op::ALL.iter().position(|&o| o == op).unwrap()];
    let rows: Vec<Row> = Op::ALL
        .iter()
        .zip(samples)
        .map(|(&op, s)| {
            let st = stats(&s);
            let secs = st.median / 1e3;
            Row {
                op,
                gparam: n as f64 / secs / 1e9,
                gbps: (op.bytes_per_elt() * n) as f64 / secs / 1e9,
                ratio: op.baseline().map(|b| st.median / median_of(b)),
                st,
                samples: s,
            }
        })
        .collect();

    println!();
    println!(
        "{:<28} {:>9} {:>9} {:>9} {:>8} {:>6} {:>14}",
        "op", "ms(med)", "ms(min)", "Gparam/s", "GB/s", "B/elt", "ratio"
    );
    for r in &rows {
        let ratio = match (r.ratio, r.op.baseline()) {
            (Some(x), Some(Op::FloorF32 | Op::FloorBf16)) => format!("{x:.3} x floor"),
            (Some(x), Some(b)) => format!("{x:.3} x {}", b.label().split_once(' ').map_or("", |l| l.0)),
            _ => String::new(),
        };
        println!(
            "{:<28} {:>9.3} {:>9.3} {:>9.3} {:>8.2} {:>6} {:>14}",
            r.op.label(),
            r.st.median,
            r.st.min,
            r.gparam,
            r.gbps,
            r.op.bytes_per_elt(),
            ratio
        );
    }
    let ratio = |a: Op, b: Op| median_of(a) / median_of(b);
    let ratios = [
        ("update_f32_over_floor", "f32 update / floor (a/b)", ratio(Op::UpdateF32, Op::FloorF32)),
        ("update_bf16_over_floor", "bf16 update / floor (c/d)", ratio(Op::UpdateBf16, Op::FloorBf16)),
        ("rollback_over_update", "rollback / update (e/a)", ratio(Op::Rollback, Op::UpdateF32)),
        ("rescale_over_update", "rescale / update (f/a)", ratio(Op::Rescale, Op::UpdateF32)),
        ("checked_over_update", "check+sumsq / update (g/a)", ratio(Op::UpdateChecked, Op::UpdateF32)),
        ("bf16_update_over_f32_update", "bf16 update / f32 update (c/a)", ratio(Op::UpdateBf16, Op::UpdateF32)),
        ("split_copy_over_update", "split copy pass / update (c1/c)", ratio(Op::SplitCopy, Op::UpdateBf16)),
        ("split_state_over_update", "split state pass / update (c2/c)", ratio(Op::SplitState, Op::UpdateBf16)),
    ];
    println!();
    for (_, label, x) in &ratios {
        println!("{label:<32} {x:.3}");
    }
    println!("sanity:  no NaN or inf in p, m, v or the bf16 copy after {} steps", args.warmup + args.iters);

    if let Some(path) = &args.json {
        let mut j = String::new();
        let _ = write!(
            j,
            "{{\n  \"tool\": \"superoffload-bench\",\n  \"version\": {},\n",
            json_str(env!("CARGO_PKG_VERSION"))
        );
        let _ = writeln!(j, "  \"machine\": {{\"cpu\": {}, \"cpus_available\": {cpus_available}}},", json_str(&cpu));
        let cores_json = match pool.cores() {
            Some(c) => format!("[{}]", c.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
            None => "null".to_string(),
        };
        let _ = writeln!(
            j,
            "  \"pool\": {{\"isa\": {}, \"threads\": {}, \"pinned\": {}, \"cores\": {cores_json}}},",
            json_str(pool.isa().name()),
            pool.num_threads(),
            pool.cores().is_some()
        );
        let _ = write!(
            j,
            "  \"n\": {n},\n  \"iters\": {},\n  \"warmup\": {},\n  \"huge_pages\": {},\n",
            args.iters, args.warmup, args.huge_pages
        );
        let _ = write!(
            j,
            "  \"setup_s\": {{\"first_touch\": {}, \"fill\": {}}},\n  \"results\": [\n",
            json_num(touch.as_secs_f64()),
            json_num(fill.as_secs_f64())
        );
        for (k, r) in rows.iter().enumerate() {
            let samples = r.samples.iter().map(|&x| json_num(x)).collect::<Vec<_>>().join(", ");
            let _ = writeln!(
                j,
                "    {{\"op\": {}, \"label\": {}, \"ms_median\": {}, \"ms_min\": {}, \"gparam_per_s\": {}, \
                 \"gb_per_s\": {}, \"bytes_per_elt\": {}, \"compared_with\": {}, \"ratio\": {}, \"samples_ms\": [{samples}]}}{}",
                json_str(r.op.id()),
                json_str(r.op.label()),
                json_num(r.st.median),
                json_num(r.st.min),
                json_num(r.gparam),
                json_num(r.gbps),
                r.op.bytes_per_elt(),
                r.op.baseline().map_or("null".to_string(), |b| json_str(b.id())),
                r.ratio.map_or("null".to_string(), json_num),
                if k + 1 < rows.len() { "," } else { "" }
            );
        }
        j.push_str("  ],\n  \"ratios\": {");
        let body = ratios.iter().map(|(id, _, x)| format!("{}: {}", json_str(id), json_num(*x))).collect::<Vec<_>>();
        j.push_str(&body.join(", "));
        j.push_str("},\n  \"non_finite_after_runs\": 0\n}\n");
        std::fs::write(path, j).map_err(|e| format!("cannot write {path}: {e}"))?;
        println!("json:    {path}");
    }
    Ok(())
}
