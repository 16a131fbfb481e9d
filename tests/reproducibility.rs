//! Reproducible runs: the same inputs give the same bits whatever the timing. One schedule of
//! steps (clipping on some steps and on every step, loss scaling with an overflow skip, late
//! gradients, accumulation, a learning-rate change between backward and `step()`) runs again
//! and again with seeded random delays in the CPU-Adam thread (a transport whose hooks
//! pause and whose copies land late), in every chunk of the pool's passes, and between the
//! caller's hand-offs, on pools of 1, 2 and 7 threads and in host mode: every run must end
//! with the same master weights, moments and step results.
//!
//! The same holds for the final passes' layout (which of them publish the weights' copy
//! before writing the master weights and moments), which the session chooses by timing too.
//!
//! Needs the `fault-injection` feature (the pool's chunk hook, a forced layout): `cargo test
//! --features fault-injection --test reproducibility`.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Rng;
use superoffload::error::Result;
use superoffload::kernels::{DType, Floats, Isa, Pool, PoolOptions, bf16, pool::set_chunk_pause};
use superoffload::session::{
    Borrowed, GradientHome, GroupHparams, HostCopy, NormSource, Session, SessionOptions, SliceDesc, Speculation,
    StepArgs, StepResult, SubGroupDesc, Transport,
};

/// Sub-groups large enough that a speculative pass has several chunks to be preempted
/// between (`SPECULATION_CHUNK` is 4 Mi elements) and small enough for CI.
const SIZES: [usize; 3] = [4_500_000, 300_000, 1_200_000];
const RUNS: u64 = 8;

/// A seeded source of short pauses, shared by the threads that pause.
struct Jitter(Mutex<Rng>);

impl Jitter {
    fn pause(&self, max_us: u64) {
        let us = self.0.lock().unwrap().below(max_us as usize + 1) as u64;
        std::thread::sleep(Duration::from_micros(us));
    }

    fn chance(&self, p: f64) -> bool {
        self.0.lock().unwrap().unit() < p
    }
}

/// Copies that land late and hooks that pause, on the CPU-Adam thread; it keeps the weights'
/// copy as published piece by piece and as final after each publication, the way a device
/// would see them.
struct JitteryTransport {
    jitter: Arc<Jitter>,
    /// Each sub-group's master weights (address, length): read as a piece is published, to
    /// tell a copy published ahead of its master weights.
    masters: Vec<(usize, usize)>,
    pieces: Mutex<Vec<Vec<u16>>>,
    published: Arc<Mutex<Vec<Vec<u16>>>>,
    /// Per sub-group: whether a pass published a copy ahead of its master weights (the copy
    /// first, the state after).
    copy_first: Arc<Mutex<Vec<bool>>>,
}

impl JitteryTransport {
    fn record(&self, sg: u32, offset: usize, copy: &[bf16]) {
        let (addr, len) = self.masters[sg as usize];
        // SAFETY: the session publishes from the pass that holds the sub-group's data lock,
        // so nothing writes these master weights (alive for the whole run) meanwhile.
        let master = unsafe { std::slice::from_raw_parts(addr as *const f32, len) };
        let ahead = master[offset..offset + copy.len()].iter().zip(copy);
        if ahead.into_iter().any(|(&m, c)| bf16::from_f32(m).to_bits() != c.to_bits()) {
            self.copy_first.lock().unwrap()[sg as usize] = true;
        }
        let mut pieces = self.pieces.lock().unwrap();
        for (d, s) in pieces[sg as usize][offset..offset + copy.len()].iter_mut().zip(copy) {
            *d = s.to_bits();
        }
        self.jitter.pause(200);
    }
}

impl Transport for JitteryTransport {
    transport_without_pinning!();
    fn gradient_ready(&self, _: u32) -> Result<()> {
        self.jitter.pause(300);
        Ok(())
    }
    fn gradient_landed(&self, _: u32) -> bool {
        !self.jitter.chance(0.4)
    }
    fn master_write(&self, _: u32) -> Result<()> {
        self.jitter.pause(200);
        Ok(())
    }
    bf16_publication!(record);
    fn publish(&self, sg: u32) -> Result<()> {
        self.published.lock().unwrap()[sg as usize] = self.pieces.lock().unwrap()[sg as usize].clone();
        self.jitter.pause(100);
        Ok(())
    }
}

/// The chunk hook is a plain `fn`: its generator is a global, reseeded per run.
static CHUNK_RNG: AtomicU64 = AtomicU64::new(1);

fn chunk_pause() {
    let mut x = CHUNK_RNG.load(Ordering::Relaxed);
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    CHUNK_RNG.store(x, Ordering::Relaxed);
    std::thread::sleep(Duration::from_micros(x % 400));
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Setup {
    threads: usize,
    transport: bool,
    speculation: Speculation,
    moments: DType,
    /// Whether the session keeps its copy in full or publishes through bounded buffers.
    host_copy: HostCopy,
    /// A layout of the final passes forced on the session (`Session::force_state_after`).
    state_after: Option<Option<usize>>,
}

impl Setup {
    fn new(threads: usize, transport: bool, speculation: Speculation) -> Setup {
        Setup { threads, transport, speculation, moments: DType::F32, host_copy: HostCopy::Full, state_after: None }
    }
}

/// What a run ends with: the bits of every master weight and moment, each step's result
/// without what measures timing (`cancelled`, `final_pass_elements`, `forward_wait_s`), and
/// with a transport the weights' copy it was last given to publish and which sub-groups'
/// copies it was given ahead of their master weights.
#[derive(Debug, PartialEq)]
struct Outcome {
    masters: Vec<Vec<u32>>,
    moments: Vec<(Vec<u32>, Vec<u32>)>,
    results: Vec<StepResult>,
    published: Option<Vec<Vec<u16>>>,
    copy_first: Option<Vec<bool>>,
}

impl Outcome {
    /// Asserts that `again` ended with these master weights and moments, bit for bit.
    fn assert_same_state(&self, again: &Outcome, what: &str) {
        assert!(self.masters == again.masters, "{what}: the master weights differ");
        assert!(self.moments == again.moments, "{what}: the moments differ");
    }
}

struct Run {
    session: Session,
    masters: Vec<Vec<f32>>,
    jitter: Arc<Jitter>,
    results: Vec<StepResult>,
    published: Option<Arc<Mutex<Vec<Vec<u16>>>>>,
    copy_first: Arc<Mutex<Vec<bool>>>,
}

fn gradient(sg: usize, n: usize, step: u64, scale: f32) -> Vec<f32> {
    // Magnitudes that vary by step, so that a max_norm between them clips some steps.
    let amplitude = if step % 3 == 1 { 4e-3 } else { 1e-3 };
    (0..n)
        .map(|i| {
            let h = (i as u64).wrapping_mul(2_654_435_761).wrapping_add(step * 97 + sg as u64 * 13) % 1000;
            (h as f32 / 1000.0 - 0.5) * amplitude * scale
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

impl Run {
    fn new(setup: Setup, seed: u64) -> Run {
        let jitter = Arc::new(Jitter(Mutex::new(Rng::new(seed))));
        let pool = Pool::new(&PoolOptions { num_threads: setup.threads, isa: Some(Isa::best()), ..Default::default() });
        let options = SessionOptions {
            pool: Some(Arc::new(pool.unwrap())),
            speculation: setup.speculation,
            moment_dtype: setup.moments,
            copy_dtype: Some(DType::Bf16),
            host_copy: setup.host_copy,
            gradient_home: GradientHome::Host,
            ..SessionOptions::default()
        };
        let mut masters: Vec<Vec<f32>> =
            SIZES.iter().map(|&n| (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3).collect()).collect();
        let addresses: Vec<(usize, usize)> = masters.iter_mut().map(|m| (m.as_mut_ptr() as usize, m.len())).collect();
        let initial_copy = || masters.iter().map(|m| m.iter().map(|&x| bf16::from_f32(x).to_bits()).collect());
        let published = setup.transport.then(|| Arc::new(Mutex::new(initial_copy().collect::<Vec<Vec<u16>>>())));
        let copy_first = Arc::new(Mutex::new(vec![false; SIZES.len()]));
        let transport = published.as_ref().map(|published| {
            let pieces = Mutex::new(initial_copy().collect());
            let masters = addresses.clone();
            let (jitter, published, copy_first) = (jitter.clone(), published.clone(), copy_first.clone());
            Arc::new(JitteryTransport { jitter, masters, pieces, published, copy_first }) as Arc<dyn Transport>
        });
        let session = Session::with_transport(options, transport).unwrap();
        if let Some(limit) = setup.state_after {
            session.force_state_after(limit);
        }
        session.add_group(GroupHparams { weight_decay: 0.05, ..GroupHparams::default() }).unwrap();
        for (k, m) in masters.iter_mut().enumerate() {
            // SAFETY: the heap buffer of `m` moves with the run, which waits for every step
            // before it ends (the session is dropped first).
            let master = unsafe { Borrowed::new("m", m.as_mut_ptr().cast(), m.len(), DType::F32) }.unwrap();
            // Two slices each: a late gradient is for one of them.
            let half = m.len() / 2;
            let slices = vec![
                SliceDesc { name: format!("sg{k}.a"), offset: 0, numel: half },
                SliceDesc { name: format!("sg{k}.b"), offset: half, numel: m.len() - half },
            ];
            session.add_subgroup(SubGroupDesc::new(0, master, slices)).unwrap();
        }
        Run { session, masters, jitter, results: Vec::new(), published, copy_first }
    }

    fn hand_over(&self, step: u64, scale: f32) {
        // Backward order: the last sub-group's gradient arrives first.
        for k in (0..SIZES.len()).rev() {
            let g = gradient(k, SIZES[k], step, scale);
            let half = SIZES[k] / 2;
            for (slice, part) in [(1, &g[half..]), (0, &g[..half])] {
                let id = self.session.slice_id(&format!("sg{k}.{}", ["a", "b"][slice])).unwrap();
                self.session.grad_copy(id, Floats::F32(part)).unwrap();
                self.jitter.pause(500);
            }
        }
    }

    /// Step `step` of the schedule (from 1).
    fn step(&mut self, step: u64) {
        let s = &self.session;
        let loss_scale = if step.is_multiple_of(3) { 1024.0 } else { 1.0 };
        let micro_steps = if step == 5 { 2 } else { 1 };
        s.begin_step(Some(loss_scale), micro_steps).unwrap();
        for micro in 0..micro_steps {
            if micro > 0 {
                s.next_micro_step().unwrap();
            }
            self.hand_over(step + micro as u64 * 100, loss_scale);
        }
        if step == 4 || step == 8 {
            // A late gradient: the sub-group completed (and may have speculated) already.
            let g = gradient(7, SIZES[1] / 2, step, loss_scale);
            s.grad_copy(s.slice_id("sg1.a").unwrap(), Floats::F32(&g)).unwrap();
        }
        if step == 7 {
            // The schedule's learning rate moves between backward and step().
            s.set_group_hparams(0, GroupHparams { lr: 5e-4, weight_decay: 0.05, ..GroupHparams::default() }).unwrap();
        }
        self.jitter.pause(2000);
        let max_norm = match step {
            2..=4 => 1e-3, // every step of these clips
            _ => 1.5,      // clips the larger gradients only
        };
        let args = StepArgs { max_norm, norm: NormSource::Local, overflow: step == 6 };
        let ticket = s.step(args).unwrap();
        let mut result = s.step_result(ticket, None).unwrap();
        (result.cancelled, result.final_pass_elements, result.forward_wait_s) = (0, 0, 0.0);
        self.results.push(result);
        if let Some(published) = &self.published {
            for (k, (copy, master)) in published.lock().unwrap().iter().zip(&self.masters).enumerate() {
                let rounded: Vec<u16> = master.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
                assert!(*copy == rounded, "step {step}: sub-group {k}'s published copy is not its master weights");
            }
        }
    }

    fn finish(self) -> Outcome {
        let Run { session, masters, results, published, copy_first, .. } = self;
        let moments = (0..SIZES.len() as u32)
            .map(|k| {
                let (m, v) = session.moments(k).unwrap();
                (bits(&m), bits(&v))
            })
            .collect();
        drop(session);
        let copy_first = published.is_some().then(|| copy_first.lock().unwrap().clone());
        let published = published.map(|p| std::mem::take(&mut *p.lock().unwrap()));
        Outcome { masters: masters.iter().map(|m| bits(m)).collect(), moments, results, published, copy_first }
    }
}

const STEPS: u64 = 10;

fn run(setup: Setup, seed: u64) -> Outcome {
    CHUNK_RNG.store(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1, Ordering::Relaxed);
    let mut run = Run::new(setup, seed);
    for step in 1..=STEPS {
        run.step(step);
    }
    run.finish()
}

#[test]
fn speculation_is_invisible_in_the_bits() {
    set_chunk_pause(Some(chunk_pause));
    let setups = [(1, false), (2, true), (7, false), (7, true)]
        .map(|(threads, transport)| Setup::new(threads, transport, Speculation::On));
    let reference = run(setups[0], 1);
    let results = &reference.results;
    assert!(results.iter().any(|r| r.clip_coef < 1.0) && results.iter().any(|r| r.clip_coef == 1.0 && !r.skipped));
    assert!(results.iter().any(|r| r.skipped) && results.iter().any(|r| r.late_gradients > 0));
    assert!(results.iter().any(|r| r.rescaled > 0) && results.iter().any(|r| r.redone > 0));
    for (i, setup) in setups.into_iter().enumerate() {
        // Eight runs of each setup in all, each with its own delays.
        for seed in 2 + i as u64 * RUNS..(2 + i as u64 * RUNS) + RUNS - u64::from(i == 0) {
            let again = run(setup, seed);
            reference.assert_same_state(&again, &format!("{setup:?}, seed {seed}"));
            assert_eq!(reference.results, again.results, "{setup:?}, seed {seed}");
        }
    }
    set_chunk_pause(None);
}

/// A step's decisions, without the counters of how its passes ran.
fn decisions(r: &StepResult) -> StepResult {
    StepResult { speculative: 0, kept: 0, rescaled: 0, rolled_back: 0, redone: 0, stepped: 0, ..*r }
}

/// bf16 moments speculate on the weights' copy alone: the same bits as stepping after
/// backward (speculation off), in the masters, the moments and the published copy, whatever
/// the timing and whichever way the step goes (kept, clipped, skipped, a late gradient, a
/// learning rate changed before `step()`).
#[test]
fn bf16_moments_speculate_with_the_bits_of_stepping_after_backward() {
    set_chunk_pause(Some(chunk_pause));
    let bf16_moments =
        |threads, transport, speculation| Setup { moments: DType::Bf16, ..Setup::new(threads, transport, speculation) };
    let reference = run(bf16_moments(2, true, Speculation::Off), 1);
    let off = run(bf16_moments(1, false, Speculation::Off), 2);
    assert!(reference.masters == off.masters && reference.moments == off.moments);
    for (i, (threads, transport)) in [(1, false), (2, true), (7, true)].into_iter().enumerate() {
        let setup = bf16_moments(threads, transport, Speculation::On);
        for seed in 3 + i as u64 * 3..6 + i as u64 * 3 {
            let again = run(setup, seed);
            let counted = |f: fn(&StepResult) -> u32| again.results.iter().map(f).sum::<u32>();
            assert!(counted(|r| r.kept) > 0 && counted(|r| r.rescaled) > 0 && counted(|r| r.redone) > 0);
            assert!(counted(|r| r.rolled_back) > 0, "{setup:?}: the skipped step had a copy ahead");
            reference.assert_same_state(&again, &format!("{setup:?}, seed {seed}"));
            let decided: Vec<StepResult> = again.results.iter().map(decisions).collect();
            assert_eq!(reference.results.iter().map(decisions).collect::<Vec<_>>(), decided, "{setup:?}, seed {seed}");
            if transport {
                assert!(reference.published == again.published, "{setup:?}, seed {seed}: the published copies differ");
            }
        }
    }
    set_chunk_pause(None);
}

/// Stepping after backward, with the copy first for every sub-group, for none, and for a
/// prefix in forward order: the same bits, and each layout as forced.
#[test]
fn the_layout_of_the_final_passes_is_invisible_in_the_bits() {
    set_chunk_pause(Some(chunk_pause));
    let layout = |state_after| Setup { state_after: Some(state_after), ..Setup::new(2, true, Speculation::Off) };
    let reference = run(Setup::new(1, false, Speculation::Off), 1);
    let [a, b, c] = SIZES;
    for (seed, limit, copy_first) in [
        (2, None, [true, true, true]),
        (3, Some(0), [false, false, false]),
        (4, Some(a), [true, false, false]),
        (5, Some(a + b + c - 1), [true, true, false]),
        (6, Some(b), [false, false, false]),
    ] {
        for host_copy in [HostCopy::Full, HostCopy::Bounded] {
            let again = run(Setup { host_copy, ..layout(limit) }, seed);
            let what = format!("limit {limit:?}, {host_copy:?}");
            assert_eq!(again.copy_first.as_deref(), Some(&copy_first[..]), "{what}");
            reference.assert_same_state(&again, &what);
            assert_eq!(reference.results, again.results, "{what}");
        }
    }
    set_chunk_pause(None);
}

/// Without a full copy kept, each piece published is written by the final pass (or converted
/// from the master weights) into the transport's buffer: the same bits as with the copy, in
/// the masters, the moments and what the device is given, with speculation on.
#[test]
fn a_copy_written_piece_by_piece_publishes_the_same_bits() {
    set_chunk_pause(Some(chunk_pause));
    let reference = run(Setup::new(2, true, Speculation::On), 1);
    for seed in 2..5 {
        let again = run(Setup { host_copy: HostCopy::Bounded, ..Setup::new(2, true, Speculation::On) }, seed);
        reference.assert_same_state(&again, &format!("seed {seed}"));
        assert!(reference.published == again.published, "seed {seed}: the published copies differ");
        assert_eq!(reference.results, again.results, "seed {seed}");
    }
    set_chunk_pause(None);
}

#[test]
fn a_checkpoint_resumes_the_run_bit_for_bit() {
    let setup = Setup::new(2, true, Speculation::Auto);
    let uninterrupted = run(setup, 11);
    let path: PathBuf = std::env::temp_dir().join(format!("so-repro-{}.safetensors", std::process::id()));
    let mut first = Run::new(setup, 12);
    for step in 1..=STEPS / 2 {
        first.step(step);
    }
    first.session.save(&path).unwrap();
    let early = std::mem::take(&mut first.results);
    drop(first);
    let mut resumed = Run::new(setup, 13);
    resumed.session.load(&path).unwrap();
    std::fs::remove_file(&path).ok();
    for step in STEPS / 2 + 1..=STEPS {
        resumed.step(step);
    }
    let mut outcome = resumed.finish();
    outcome.results.splice(0..0, early);
    // Serials count the session's steps: the resumed session's restart from 1.
    let serials = |o: &mut Outcome| o.results.iter_mut().for_each(|r| r.serial = 0);
    let mut uninterrupted = uninterrupted;
    serials(&mut uninterrupted);
    serials(&mut outcome);
    uninterrupted.assert_same_state(&outcome, "resumed");
    assert_eq!(uninterrupted.results, outcome.results);
}
