//! The session under a transport whose gradient copies land asynchronously (as the CUDA
//! transport's device-to-host copies do) must give exactly the bits of host mode, and must
//! call the hooks in the order the protocol promises.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use superoffload::error::{Result, Status};
use superoffload::kernels::{self, DType, Floats, FloatsMut, Isa, Pool, PoolOptions, bf16};
use superoffload::session::{
    Borrowed, GroupHparams, HandedSumsq, HostCopy, NormSource, Session, SessionOptions, SliceDesc, Speculation,
    StepArgs, SubGroupDesc, Transport,
};

/// Copies land 2 ms after the hand-off, on another thread; `gradient_ready` waits for them.
#[derive(Default)]
struct DelayedCopies {
    pending: Mutex<HashMap<u32, Vec<JoinHandle<()>>>>,
    log: Mutex<Vec<String>>,
}

struct SendPtr(*mut u8);
// SAFETY: the session keeps the destination alive and untouched until gradient_ready.
unsafe impl Send for SendPtr {}

impl DelayedCopies {
    fn deliver(&self, sg: u32, dst: FloatsMut<'_>, src: Vec<bf16>) {
        let FloatsMut::Bf16(d) = dst else { panic!("bf16 accumulation expected") };
        assert_eq!(d.len(), src.len());
        let ptr = SendPtr(d.as_mut_ptr().cast());
        let handle = std::thread::spawn(move || {
            let ptr = ptr;
            std::thread::sleep(Duration::from_millis(2));
            // SAFETY: see SendPtr.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().cast::<u8>(), ptr.0, src.len() * 2) };
        });
        self.pending.lock().unwrap().entry(sg).or_default().push(handle);
    }
}

impl Transport for DelayedCopies {
    transport_without_pinning!();
    fn gradient_ready(&self, sg: u32) -> Result<()> {
        let handles = self.pending.lock().unwrap().remove(&sg).unwrap_or_default();
        for h in handles {
            h.join().unwrap();
        }
        Ok(())
    }
    fn master_write(&self, sg: u32) -> Result<()> {
        self.log.lock().unwrap().push(format!("write {sg}"));
        Ok(())
    }
    fn publish_piece(&self, sg: u32, _: usize, _: Floats<'_>) -> Result<()> {
        self.log.lock().unwrap().push(format!("piece {sg}"));
        Ok(())
    }
    fn publish_filled(
        &self,
        sg: u32,
        _: usize,
        len: usize,
        dtype: DType,
        fill: &mut dyn FnMut(FloatsMut<'_>) -> Result<()>,
    ) -> Result<()> {
        self.log.lock().unwrap().push(format!("piece {sg}"));
        common::with_scratch(dtype, len, fill)
    }
    fn publish(&self, sg: u32) -> Result<()> {
        self.log.lock().unwrap().push(format!("publish {sg}"));
        Ok(())
    }
}

const SIZES: [usize; 3] = [100_000, 70_001, 5_000];

fn build(transport: Option<Arc<dyn Transport>>, speculation: Speculation) -> (Session, Vec<Vec<f32>>) {
    build_sized(transport, speculation, &SIZES)
}

fn build_sized(
    transport: Option<Arc<dyn Transport>>,
    speculation: Speculation,
    sizes: &[usize],
) -> (Session, Vec<Vec<f32>>) {
    let pool =
        Arc::new(Pool::new(&PoolOptions { num_threads: 2, isa: Some(Isa::best()), ..Default::default() }).unwrap());
    let opts = SessionOptions {
        pool: Some(pool),
        grad_dtype: DType::Bf16,
        accum_dtype: DType::Bf16,
        // A device model in bf16: the final pass writes this copy and publishes it first.
        copy_dtype: Some(DType::Bf16),
        speculation,
        ..Default::default()
    };
    let s = Session::with_transport(opts, transport).unwrap();
    s.add_group(GroupHparams { weight_decay: 0.05, ..GroupHparams::default() }).unwrap();
    let mut masters: Vec<Vec<f32>> =
        sizes.iter().map(|&n| (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3).collect()).collect();
    for (k, m) in masters.iter_mut().enumerate() {
        // SAFETY: the heap buffer of `m` is returned with the session and outlives its work (each
        // test waits for every step).
        let master = unsafe { Borrowed::new("m", m.as_mut_ptr().cast(), m.len(), DType::F32) }.unwrap();
        let slices = vec![SliceDesc { name: format!("sg{k}"), offset: 0, numel: m.len() }];
        s.add_subgroup(SubGroupDesc::new(0, master, slices)).unwrap();
    }
    (s, masters)
}

#[test]
fn delayed_copies_give_host_mode_bits() {
    let transport = Arc::new(DelayedCopies::default());
    // Speculation off: every final pass is an update, which the device session splits into a
    // copy pass and a state pass (checked below). (Speculation on, host and transport
    // sessions agree too: tests/reproducibility.rs.)
    let (host, host_masters) = build(None, Speculation::Off);
    let (dev, dev_masters) = build(Some(transport.clone()), Speculation::Off);
    dev.trace(true);
    for step in 1..=6u64 {
        for s in [&host, &dev] {
            s.begin_step(Some(1.0), 1).unwrap();
        }
        for k in (0..SIZES.len()).rev() {
            let g: Vec<bf16> = (0..SIZES[k])
                .map(|i| bf16::from_f32(((i as u64 * 7 + step * 13) % 29) as f32 * 1e-3 - 0.014))
                .collect();
            host.grad_copy(k as u32, Floats::Bf16(&g)).unwrap();
            dev.hand_off(k as u32, g.len(), "test", |h| {
                // The sum of squares of what will land, taken from the source as a device
                // transport takes it from the device gradient.
                let sumsq = match h.sumsq_scale {
                    Some(scale) => Some(HandedSumsq::Known(kernels::grad_sumsq_here(Floats::Bf16(&g), scale)?)),
                    None => None,
                };
                transport.deliver(h.sg, h.dst.expect("a host gradient buffer"), g.clone());
                Ok(sumsq)
            })
            .unwrap();
        }
        let norm = if step % 2 == 1 { 5.0 } else { 0.5 };
        let args = StepArgs { max_norm: 1.0, norm: NormSource::Given(norm), overflow: step == 4 };
        for s in [&host, &dev] {
            let t = s.step(args).unwrap();
            s.wait(t, None).unwrap();
        }
        for k in 0..SIZES.len() {
            for i in 0..SIZES[k] {
                assert_eq!(host_masters[k][i].to_bits(), dev_masters[k][i].to_bits(), "step {step} sg {k} element {i}");
            }
        }
    }
    // With a device to publish to, final passes wrote the weights' copy first and the master
    // weights and moments in a pass of their own (and the next step's hand-offs waited for
    // it): the bits above cover it.
    let trace = std::env::temp_dir().join(format!("so-transport-trace-{}.json", std::process::id()));
    dev.save_trace(&trace).unwrap();
    let timeline = std::fs::read_to_string(&trace).unwrap();
    std::fs::remove_file(&trace).ok();
    assert!(timeline.contains("state, sub-group"), "no state pass ran");
    // Weights go to the device piece by piece, then the sub-group is published; nothing of a
    // skipped step (step 4) is.
    let log = transport.log.lock().unwrap();
    assert!(log.iter().any(|l| l.starts_with("publish")));
    for (i, l) in log.iter().enumerate() {
        if let Some(sg) = l.strip_prefix("publish ") {
            assert_eq!(log[..i].last(), Some(&format!("piece {sg}")), "publish without its pieces");
        }
    }
}

/// A transport whose gradient copies land at once, as the hand-off queues them: a hand-off
/// that did not wait for the previous step's state pass would overwrite the gradient
/// that pass still reads.
struct ImmediateCopies;

impl Transport for ImmediateCopies {
    transport_without_pinning!();
    transport_without_publishing!();
    fn gradient_ready(&self, _: u32) -> Result<()> {
        Ok(())
    }
}

#[test]
fn a_hand_off_waits_for_the_previous_steps_state_pass() {
    // State passes run in backward order: while the last (large) sub-group's runs, the
    // first's is queued, and its gradient is handed over first.
    const SIZES: [usize; 3] = [5_000, 2_000_000, 2_000_000];
    let (host, host_masters) = build_sized(None, Speculation::Off, &SIZES);
    let (dev, dev_masters) = build_sized(Some(Arc::new(ImmediateCopies)), Speculation::Off, &SIZES);
    let steps = 6u64;
    let mut dev_steps = Vec::new();
    let grads: Vec<Vec<Vec<bf16>>> = (1..=steps)
        .map(|step| {
            SIZES
                .iter()
                .map(|&n| {
                    (0..n).map(|i| bf16::from_f32(((i as u64 * 11 + step * 5) % 31) as f32 * 1e-3 - 0.015)).collect()
                })
                .collect()
        })
        .collect();
    for g in &grads {
        for s in [&host, &dev] {
            s.begin_step(Some(1.0), 1).unwrap();
        }
        for (k, g) in g.iter().enumerate() {
            host.grad_copy(k as u32, Floats::Bf16(g)).unwrap();
            dev.hand_off(k as u32, g.len(), "test", |h| {
                let Some(FloatsMut::Bf16(d)) = h.dst else { panic!("bf16 accumulation expected") };
                d.copy_from_slice(g);
                Ok(h.sumsq_scale
                    .map(|scale| HandedSumsq::Known(kernels::grad_sumsq_here(Floats::Bf16(g), scale).unwrap())))
            })
            .unwrap();
        }
        let args = StepArgs { max_norm: 0.5, norm: NormSource::Local, overflow: false };
        host.wait(host.step(args).unwrap(), None).unwrap();
        dev_steps.push(dev.step(args).unwrap());
        // Only the weights: the next hand-offs follow the final tickets at once.
        for k in 0..SIZES.len() {
            dev.wait(dev.final_ticket(k as u32).unwrap(), None).unwrap();
        }
    }
    // A hand-off that found the moments pending took the gradient as on time, not late.
    let last = dev.step_result(*dev_steps.last().unwrap(), None).unwrap();
    assert_eq!(last.late_gradients, 0, "{last:?}");
    for k in 0..SIZES.len() {
        let (host_m, host_v) = host.moments(k as u32).unwrap();
        let (dev_m, dev_v) = dev.moments(k as u32).unwrap();
        assert!(host_m == dev_m && host_v == dev_v, "sub-group {k}: moments differ");
        assert!(
            host_masters[k].iter().zip(&dev_masters[k]).all(|(a, b)| a.to_bits() == b.to_bits()),
            "sub-group {k}: weights differ"
        );
    }
}

/// With a low-precision copy, every piece published is the master rounded to nearest even
/// (after steps, rescales, redos and a checkpoint load alike).
#[derive(Default)]
struct CopyChecker {
    /// The master weights (address, length), read when a piece is published.
    master: Mutex<(usize, usize)>,
    published: Mutex<usize>,
}

impl Transport for CopyChecker {
    transport_without_pinning!();
    fn gradient_ready(&self, _: u32) -> Result<()> {
        Ok(())
    }
    fn master_write(&self, _: u32) -> Result<()> {
        Ok(())
    }
    fn publish_piece(&self, _: u32, offset: usize, src: Floats<'_>) -> Result<()> {
        let Floats::Bf16(c) = src else { panic!("a bf16 copy") };
        let (addr, len) = *self.master.lock().unwrap();
        // SAFETY: the session publishes from the pass that holds the sub-group's data lock
        // (or from a load between steps), so nothing writes the master weights meanwhile; the
        // test keeps them alive past the session.
        let m = unsafe { std::slice::from_raw_parts(addr as *const f32, len) };
        for (x, y) in m[offset..offset + c.len()].iter().zip(c) {
            assert_eq!(bf16::from_f32(*x).to_bits(), y.to_bits(), "copy of {x}");
        }
        *self.published.lock().unwrap() += 1;
        Ok(())
    }
    no_bounded_publication!("the session keeps a full copy here");
    fn publish(&self, _: u32) -> Result<()> {
        Ok(())
    }
}

#[test]
fn the_low_precision_copy_follows_the_master() {
    let checker = Arc::new(CopyChecker::default());
    let opts = SessionOptions {
        copy_dtype: Some(DType::Bf16),
        speculation: Speculation::On,
        host_copy: HostCopy::Full,
        ..SessionOptions::default()
    };
    let s = Session::with_transport(opts, Some(checker.clone() as Arc<dyn Transport>)).unwrap();
    s.add_group(GroupHparams::default()).unwrap();
    let mut master: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin()).collect();
    *checker.master.lock().unwrap() = (master.as_mut_ptr() as usize, master.len());
    // SAFETY: `master` is dropped after the session (the explicit drops at the end).
    let m = unsafe { Borrowed::new("m", master.as_mut_ptr().cast(), master.len(), DType::F32) }.unwrap();
    s.add_subgroup(SubGroupDesc::new(0, m, vec![SliceDesc { name: "w".into(), offset: 0, numel: 5000 }])).unwrap();
    for (step, max_norm) in [(1, 0.0), (2, 1e-3), (3, 0.0)] {
        s.begin_step(None, 1).unwrap();
        let g: Vec<f32> = (0..5000).map(|i| ((i + step) % 13) as f32 * 1e-2).collect();
        let spec = s.grad_copy(0, Floats::F32(&g)).unwrap().expect("a speculative step");
        s.wait(spec, None).unwrap();
        let t = s.step(StepArgs { max_norm, norm: NormSource::Local, overflow: false }).unwrap();
        s.wait(t, None).unwrap();
    }
    let path = std::env::temp_dir().join(format!("so-copy-{}.safetensors", std::process::id()));
    s.save(&path).unwrap();
    s.load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(*checker.published.lock().unwrap() >= 4, "published after each step and the load");
    drop(s);
    drop(master);
}

/// Records what each staging call covered and a checksum of what it was given.
#[derive(Default)]
struct PieceRecorder {
    /// (offset, len, checksum of the master elements staged) since the last publish.
    pieces: Mutex<Vec<(usize, usize, u64)>>,
    /// The pieces of each publication.
    published: Mutex<Vec<Vec<(usize, usize, u64)>>>,
}

fn checksum(values: &[f32]) -> u64 {
    values.iter().fold(0u64, |h, v| h.rotate_left(5) ^ u64::from(v.to_bits()))
}

impl Transport for PieceRecorder {
    transport_without_pinning!();
    fn gradient_ready(&self, _: u32) -> Result<()> {
        Ok(())
    }
    fn master_write(&self, _: u32) -> Result<()> {
        Ok(())
    }
    fn publish_piece(&self, _: u32, offset: usize, src: Floats<'_>) -> Result<()> {
        let Floats::F32(m) = src else { panic!("f32 master") };
        self.pieces.lock().unwrap().push((offset, m.len(), checksum(m)));
        Ok(())
    }
    no_bounded_publication!("f32 parameters are published from the master weights");
    fn publish(&self, _: u32) -> Result<()> {
        let pieces = std::mem::take(&mut *self.pieces.lock().unwrap());
        self.published.lock().unwrap().push(pieces);
        Ok(())
    }
}

/// A large sub-group's final pass is staged piece by piece (so the copies overlap the pass):
/// the pieces tile it in order, and each carried the elements at its own offset.
#[test]
fn a_final_pass_is_staged_in_pieces_that_tile_the_sub_group() {
    const N: usize = 9_000_000;
    let recorder = Arc::new(PieceRecorder::default());
    let opts = SessionOptions { speculation: Speculation::Off, ..SessionOptions::default() };
    let s = Session::with_transport(opts, Some(recorder.clone() as Arc<dyn Transport>)).unwrap();
    s.add_group(GroupHparams::default()).unwrap();
    let mut master: Vec<f32> = (0..N).map(|i| (i as f32 * 1e-3).sin()).collect();
    // SAFETY: `master` is dropped after the session (the explicit drops at the end).
    let m = unsafe { Borrowed::new("m", master.as_mut_ptr().cast(), N, DType::F32) }.unwrap();
    s.add_subgroup(SubGroupDesc::new(0, m, vec![SliceDesc { name: "w".into(), offset: 0, numel: N }])).unwrap();
    s.begin_step(None, 1).unwrap();
    let g: Vec<f32> = (0..N).map(|i| (i % 17) as f32 * 1e-2).collect();
    s.grad_copy(0, Floats::F32(&g)).unwrap();
    let t = s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap();
    s.wait(t, None).unwrap();
    let published = recorder.published.lock().unwrap().clone();
    drop(s);
    let [pieces] = &published[..] else { panic!("one publication, got {}", published.len()) };
    assert!(pieces.len() > 1, "staged in pieces: {pieces:?}");
    let mut end = 0;
    for &(offset, len, sum) in pieces {
        assert_eq!(offset, end, "pieces in order, without gaps or overlaps");
        assert_eq!(sum, checksum(&master[offset..offset + len]), "the piece at {offset} carried its own elements");
        end = offset + len;
    }
    assert_eq!(end, N);
    drop(master);
}

/// Sub-group 0's gradient copy lands only when the test opens the gate (as the first layer's
/// gradient, the last of backward, lands on a GPU long after the host handed it over and
/// called `step()`); the others land at once.
#[derive(Default)]
struct GatedFirst {
    open: Mutex<bool>,
    opened: Condvar,
    waited_closed: AtomicBool,
}

impl Transport for GatedFirst {
    transport_without_pinning!();
    fn gradient_ready(&self, sg: u32) -> Result<()> {
        let mut open = self.open.lock().unwrap();
        if sg == 0 && !*open {
            self.waited_closed.store(true, Ordering::Relaxed);
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
        }
        Ok(())
    }
    fn gradient_landed(&self, sg: u32) -> bool {
        sg != 0 || *self.open.lock().unwrap()
    }
    transport_without_publishing!();
}

impl GatedFirst {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

/// Opens the gate when dropped, so a failing check does not leave the session's destruction
/// waiting for a copy that never lands.
struct OpenOnDrop(Arc<GatedFirst>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// The CPU-Adam thread takes no job that would wait on a gradient still in flight: the
/// speculative steps of the sub-groups whose gradients landed run while the first one's is
/// pending (before: the first sub-group's job, highest in priority, waited for its copy and
/// held up every other), and the decision waits for the last gradient without blocking them.
#[test]
fn speculative_steps_run_while_an_earlier_gradient_is_in_flight() {
    let gate = Arc::new(GatedFirst::default());
    // Declared before the sessions, so dropped after them (also when a check fails).
    let (host_masters, dev_masters);
    let (host, dev);
    (host, host_masters) = build(None, Speculation::Off);
    (dev, dev_masters) = build(Some(gate.clone()), Speculation::On);
    let opener = OpenOnDrop(gate.clone());
    for s in [&host, &dev] {
        s.begin_step(Some(1.0), 1).unwrap();
    }
    let mut spec = Vec::new();
    for k in (0..SIZES.len()).rev() {
        let g: Vec<bf16> = (0..SIZES[k]).map(|i| bf16::from_f32(((i * 11 + k) % 31) as f32 * 1e-3 - 0.015)).collect();
        host.grad_copy(k as u32, Floats::Bf16(&g)).unwrap();
        let ticket = dev
            .hand_off(k as u32, g.len(), "test", |h| {
                let Some(FloatsMut::Bf16(d)) = h.dst else { panic!("bf16 accumulation expected") };
                d.copy_from_slice(&g);
                match h.sumsq_scale {
                    Some(scale) => Ok(Some(HandedSumsq::Known(kernels::grad_sumsq_here(Floats::Bf16(&g), scale)?))),
                    None => Ok(None),
                }
            })
            .unwrap();
        spec.push((k, ticket.expect("speculation on: a speculative ticket")));
    }
    // No clipping: the factor is known, only the gradients are not all there.
    let args = StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false };
    let host_step = host.step(args).unwrap();
    let dev_step = dev.step(args).unwrap();
    for &(k, ticket) in spec.iter().filter(|(k, _)| *k != 0) {
        let waited = dev.wait(ticket, Some(Duration::from_secs(10)));
        assert!(
            waited.is_ok(),
            "sub-group {k}'s speculative step, gradient landed, waited on sub-group 0's: {waited:?}"
        );
    }
    assert_eq!(
        dev.wait(dev_step, Some(Duration::from_millis(50))).map_err(|e| e.status),
        Err(Status::Timeout),
        "the step is decided before its last gradient landed"
    );
    assert!(!gate.waited_closed.load(Ordering::Relaxed), "the CPU-Adam thread blocked on a gradient in flight");
    drop(opener);
    host.wait(host_step, None).unwrap();
    dev.wait(dev_step, None).unwrap();
    let r = dev.step_result(dev_step, None).unwrap();
    assert!(r.kept >= 2 && r.kept + r.stepped == SIZES.len() as u32 && r.rescaled == 0, "{r:?}");
    for k in 0..SIZES.len() {
        for i in 0..SIZES[k] {
            assert_eq!(host_masters[k][i].to_bits(), dev_masters[k][i].to_bits(), "sg {k} element {i}");
        }
    }
}

/// Every gradient copy fails (as a faulted caller stream makes every CUDA call fail): the
/// deferred sums of squares cannot be read.
struct FailingCopies;

impl Transport for FailingCopies {
    transport_without_pinning!();
    fn gradient_ready(&self, _: u32) -> Result<()> {
        Err(superoffload::error::Error::new(Status::CudaError, "the copy failed"))
    }
    fn gradient_sumsq(&self, _: u32, _: usize) -> Result<f64> {
        Err(superoffload::error::Error::new(Status::CudaError, "the copy failed"))
    }
    transport_without_publishing!();
}

/// A step whose gradients never arrived fails with the transport's status and changes no
/// weight (before: the unreadable sum counted as non-finite, and the step's ticket said OK).
#[test]
fn a_failed_gradient_copy_fails_the_step_and_changes_nothing() {
    let (masters, s);
    (s, masters) = build(Some(Arc::new(FailingCopies)), Speculation::Off);
    let before: Vec<Vec<u32>> = masters.iter().map(|m| m.iter().map(|x| x.to_bits()).collect()).collect();
    s.begin_step(Some(1.0), 1).unwrap();
    for k in (0..SIZES.len()).rev() {
        s.hand_off(k as u32, SIZES[k], "test", |h| Ok(h.sumsq_scale.map(|_| HandedSumsq::Deferred))).unwrap();
    }
    let t = s.step(StepArgs { max_norm: 1.0, norm: NormSource::Local, overflow: false }).unwrap();
    assert_eq!(s.wait(t, None).map_err(|e| e.status), Err(Status::CudaError));
    let after: Vec<Vec<u32>> = masters.iter().map(|m| m.iter().map(|x| x.to_bits()).collect()).collect();
    assert!(before == after, "a failed step changed master weights");
}
