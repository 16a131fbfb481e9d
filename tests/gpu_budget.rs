//! The automatic GPU budget (`SessionOptions::GPU_BUDGET_AUTO`): after the warm-up steps the
//! session measures the device's free memory through its transport, less the headroom, and
//! the automatic split places the first sub-groups within it as the exposed time asks; a
//! host session refuses it.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use superoffload::error::{Error, Result, Status};
use superoffload::kernels::{DType, Floats, Isa, Pool, PoolOptions};
use superoffload::session::{
    Borrowed, DevicePass, GroupHparams, HostState, NormSource, Placement, Session, SessionOptions, SliceDesc, StepArgs,
    SubGroupDesc, Transport,
};

const GIB: usize = 1 << 30;
/// Device bytes per element of a device-placed sub-group with f32 state and gradient.
const DEVICE_BYTES_PER_ELEMENT: usize = 16;
const SUBGROUP_NUMEL: usize = 1000;
const SUBGROUPS: usize = 5;
/// Steps before the budget is measured (`policy::AUTO_BUDGET_AFTER`).
const WARM_UP: u64 = 3;

/// A device that reports `free` of `total` bytes and keeps placed sub-groups "on the device"
/// (their state is not touched: these tests look at placement, not at the weights). It
/// refuses placements after the first `accepts`. Each step it reports `exposed` seconds of
/// waiting for the optimizer (a second: more than any split here could hide). It records the
/// addresses of the buffers the session pins, and with `refuses_moments` refuses, while the
/// sub-groups register, the second and third pin of every three (a placeable sub-group's
/// moments, after its master weights). With `held` set and the hold armed, the final pass of
/// that sub-group waits (up to [`HOLD_LIMIT`]) until a sub-group has been placed.
struct ReportedMemory {
    free: usize,
    total: usize,
    accepts: usize,
    exposed: f64,
    placed: AtomicUsize,
    pins: Mutex<Vec<usize>>,
    refuses_moments: bool,
    pin_calls: AtomicUsize,
    held: Option<u32>,
    hold_armed: AtomicBool,
    hold_timed_out: AtomicBool,
}

/// How long a held final pass waits for a placement before it gives up.
const HOLD_LIMIT: Duration = Duration::from_secs(5);

impl ReportedMemory {
    fn new(free: usize, total: usize) -> ReportedMemory {
        ReportedMemory {
            free,
            total,
            accepts: usize::MAX,
            exposed: 1.0,
            placed: AtomicUsize::new(0),
            pins: Mutex::default(),
            refuses_moments: false,
            pin_calls: AtomicUsize::new(0),
            held: None,
            hold_armed: AtomicBool::new(false),
            hold_timed_out: AtomicBool::new(false),
        }
    }
}

impl Transport for ReportedMemory {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn pin(&self, ptr: *mut u8, _: usize) -> Result<()> {
        let call = self.pin_calls.fetch_add(1, Ordering::Relaxed);
        if self.refuses_moments && call < 3 * SUBGROUPS && !call.is_multiple_of(3) {
            return Err(Error::new(Status::CudaError, "cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY"));
        }
        self.pins.lock().unwrap().push(ptr as usize);
        Ok(())
    }
    fn unpin(&self, ptr: *mut u8) {
        self.pins.lock().unwrap().retain(|&p| p != ptr as usize);
    }
    fn master_write(&self, sg: u32) -> Result<()> {
        if self.held == Some(sg) && self.hold_armed.swap(false, Ordering::SeqCst) {
            let start = Instant::now();
            while self.placed.load(Ordering::SeqCst) == 0 {
                if start.elapsed() > HOLD_LIMIT {
                    self.hold_timed_out.store(true, Ordering::SeqCst);
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        Ok(())
    }
    transport_without_publishing!(pieces);
    fn gradient_ready(&self, _: u32) -> Result<()> {
        Ok(())
    }
    fn set_placement(&self, _: u32, placement: Placement, _: HostState<'_>) -> Result<()> {
        if placement == Placement::Device && self.placed.fetch_add(1, Ordering::Relaxed) >= self.accepts {
            return Err(Error::new(Status::CudaError, "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"));
        }
        Ok(())
    }
    fn device_step(&self, _: u32, _: &[DevicePass], _: bool) -> Result<()> {
        Ok(())
    }
    fn download_state(&self, _: u32, _: HostState<'_>) -> Result<()> {
        Ok(())
    }
    fn device_memory(&self) -> Result<(usize, usize)> {
        Ok((self.free, self.total))
    }
    fn exposed_wait_s(&self) -> f64 {
        self.exposed
    }
}

/// A session of [`SUBGROUPS`] sub-groups with the automatic budget over `transport`; the
/// masters are returned with it (they must outlive it).
fn session(transport: Arc<ReportedMemory>) -> (Session, Vec<Vec<f32>>) {
    session_with_budget(transport, SessionOptions::GPU_BUDGET_AUTO)
}

fn session_with_budget(transport: Arc<ReportedMemory>, gpu_budget_bytes: usize) -> (Session, Vec<Vec<f32>>) {
    let pool =
        Arc::new(Pool::new(&PoolOptions { num_threads: 1, isa: Some(Isa::best()), ..Default::default() }).unwrap());
    let opts = SessionOptions { pool: Some(pool), gpu_budget_bytes, ..SessionOptions::default() };
    let s = Session::with_transport(opts, Some(transport)).unwrap();
    s.add_group(GroupHparams::default()).unwrap();
    let mut masters = vec![vec![0.5f32; SUBGROUP_NUMEL]; SUBGROUPS];
    for (k, m) in masters.iter_mut().enumerate() {
        // SAFETY: the heap buffer of `m` is returned with the session and outlives its work.
        let master = unsafe { Borrowed::new("m", m.as_mut_ptr().cast(), m.len(), DType::F32) }.unwrap();
        let slices = vec![SliceDesc { name: format!("sg{k}"), offset: 0, numel: m.len() }];
        s.add_subgroup(SubGroupDesc::new(0, master, slices)).unwrap();
    }
    (s, masters)
}

fn run_step(s: &Session) {
    let ticket = submit_step(s);
    s.wait(ticket, None).unwrap();
}

/// Hands over every sub-group's gradient and submits the step; its ticket.
fn submit_step(s: &Session) -> superoffload::session::Ticket {
    let grad = vec![1e-3f32; SUBGROUP_NUMEL];
    for k in 0..SUBGROUPS {
        s.grad_copy(k as u32, Floats::F32(&grad)).unwrap();
    }
    s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false }).unwrap()
}

/// Runs the warm-up steps and begins the next one; returns the trace.
fn warm_up_and_begin(s: &Session, name: &str) -> String {
    s.trace(true);
    for _ in 0..WARM_UP {
        s.begin_step(None, 1).unwrap();
        assert_eq!((s.device_subgroups(), s.gpu_budget()), (0, None), "chosen before the warm-up ended");
        run_step(s);
    }
    s.begin_step(None, 1).unwrap();
    let path = std::env::temp_dir().join(format!("so-gpu-budget-{}-{name}.json", std::process::id()));
    s.save_trace(&path).unwrap();
    let trace = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    trace
}

#[test]
fn with_time_exposed_the_first_subgroups_that_fit_go_to_the_device_after_the_warm_up() {
    // 16 GiB device: the headroom is 1 GiB; what is free beyond it holds three sub-groups
    // and most of a fourth.
    let room = 3 * SUBGROUP_NUMEL * DEVICE_BYTES_PER_ELEMENT + 15_000;
    let transport = Arc::new(ReportedMemory::new(GIB + room, 16 * GIB));
    let (s, _masters) = session(transport.clone());
    let trace = warm_up_and_begin(&s, "fits");
    assert_eq!(s.gpu_budget(), Some(room), "free less the headroom");
    assert_eq!(s.device_subgroups(), 3, "{trace}");
    assert!(trace.contains("automatic GPU budget") && trace.contains("the first 3 of 5 sub-groups"), "{trace}");
    run_step(&s);
    assert_eq!(s.step_result(s.last_ticket(), None).unwrap().device_stepped, 3);
    assert_eq!(transport.placed.load(Ordering::Relaxed), 3, "placed once, all at once");
}

#[test]
fn the_callers_limit_caps_what_the_budget_counts_as_free() {
    // The device shows 16 GiB free; the caller's allocator works under a cap that leaves 1 GiB
    // (the headroom's minimum) and two sub-groups: the budget takes the limit, not the device.
    let room = 2 * SUBGROUP_NUMEL * DEVICE_BYTES_PER_ELEMENT;
    let (s, _masters) = session(Arc::new(ReportedMemory::new(16 * GIB, 16 * GIB)));
    s.limit_device_memory(Some(GIB + room));
    let trace = warm_up_and_begin(&s, "limited");
    assert_eq!((s.gpu_budget(), s.device_subgroups()), (Some(room), 2));
    assert!(trace.contains("the caller's limit") && trace.contains("the first 2 of 5 sub-groups"), "{trace}");
    run_step(&s);
    s.limit_device_memory(None);
    assert_eq!(s.gpu_budget(), Some(room), "a chosen budget stays");
}

#[test]
fn less_free_memory_than_the_headroom_places_nothing() {
    let (s, _masters) = session(Arc::new(ReportedMemory::new(GIB - 1, 16 * GIB)));
    let trace = warm_up_and_begin(&s, "full");
    assert_eq!((s.gpu_budget(), s.device_subgroups()), (Some(0), 0));
    assert!(trace.contains("automatic GPU budget 0.00 GiB") && !trace.contains("automatic split"), "{trace}");
    run_step(&s);
}

#[test]
fn a_refused_placement_ends_the_placement_but_not_the_step() {
    let transport = Arc::new(ReportedMemory { accepts: 2, ..ReportedMemory::new(GIB + SUBGROUPS * 16_000, 16 * GIB) });
    let (s, _masters) = session(transport);
    let trace = warm_up_and_begin(&s, "refused");
    assert_eq!(s.device_subgroups(), 2);
    assert!(trace.contains("the first 2 of 5") && trace.contains("sub-group 2 could not be placed"), "{trace}");
    assert_eq!(s.gpu_budget(), Some(2 * SUBGROUP_NUMEL * DEVICE_BYTES_PER_ELEMENT), "ends at what was placed");
    for _ in 0..6 {
        run_step(&s);
        s.begin_step(None, 1).unwrap();
    }
    run_step(&s);
    assert_eq!(s.device_subgroups(), 2, "not tried again");
}

#[test]
fn placing_the_first_sub_groups_does_not_wait_for_the_last_ones_final_pass() {
    // The split places at the beginning of a step, while the previous step's final passes may
    // still run. A placement waits for its own sub-group's passes only: here the last
    // sub-group's final pass cannot end before a sub-group has been placed.
    let last = SUBGROUPS as u32 - 1;
    let transport = Arc::new(ReportedMemory { held: Some(last), ..ReportedMemory::new(16 * GIB, 16 * GIB) });
    let (s, _masters) = session(transport.clone());
    for step in 0..WARM_UP {
        s.begin_step(None, 1).unwrap();
        if step + 1 < WARM_UP {
            run_step(&s);
        } else {
            transport.hold_armed.store(true, Ordering::SeqCst);
            submit_step(&s);
        }
    }
    s.begin_step(None, 1).unwrap();
    assert!(transport.placed.load(Ordering::SeqCst) > 0, "the split placed");
    assert!(!transport.hold_timed_out.load(Ordering::SeqCst), "a placement waited for the last sub-group's pass");
    assert!(!transport.hold_armed.load(Ordering::SeqCst), "the held pass ran");
    run_step(&s);
    assert_eq!(s.device_subgroups() as usize, SUBGROUPS);
}

#[test]
fn host_sessions_refuse_the_automatic_budget() {
    let opts = SessionOptions { gpu_budget_bytes: SessionOptions::GPU_BUDGET_AUTO, ..SessionOptions::default() };
    let e = Session::new(opts).err().expect("a host session has no device to measure");
    assert_eq!(e.status, Status::Unsupported);
    let s = Session::new(SessionOptions { gpu_budget_bytes: 0, ..SessionOptions::default() }).unwrap();
    assert_eq!(s.gpu_budget(), Some(0), "0: everything offloaded");
}

#[test]
fn the_moments_of_the_sub_groups_the_split_may_place_are_pinned_at_registration() {
    // Pinned moments let a placement copy them beside the step. The split places the first
    // sub-groups in forward order within the budget, or with the automatic budget within the
    // device's total memory: those, and only those, have their moments pinned (every
    // sub-group's master weights are, as before).
    let device_bytes = SUBGROUP_NUMEL * DEVICE_BYTES_PER_ELEMENT;
    for (budget, total, placeable) in [
        (SessionOptions::GPU_BUDGET_AUTO, 2 * device_bytes + device_bytes / 2, 2),
        (SessionOptions::GPU_BUDGET_AUTO, 16 * GIB, SUBGROUPS),
        (3 * device_bytes, 16 * GIB, 3),
        (0, 16 * GIB, 0),
    ] {
        let transport = Arc::new(ReportedMemory::new(total, total));
        let (s, masters) = session_with_budget(transport.clone(), budget);
        let pins = transport.pins.lock().unwrap().clone();
        let is_master = |p: &usize| masters.iter().any(|m| m.as_ptr() as usize == *p);
        assert_eq!(pins.iter().filter(|p| is_master(p)).count(), SUBGROUPS, "budget {budget}");
        assert_eq!(pins.iter().filter(|p| !is_master(p)).count(), 2 * placeable, "budget {budget}, total {total}");
        drop(s);
        assert!(transport.pins.lock().unwrap().is_empty(), "every pin undone with the session");
    }
}

#[test]
fn moments_that_cannot_be_pinned_stay_pageable_and_the_sub_group_registers() {
    // Pinned moments only make a placement faster: a refused pin leaves them pageable.
    let transport = Arc::new(ReportedMemory { refuses_moments: true, ..ReportedMemory::new(16 * GIB, 16 * GIB) });
    let (s, masters) = session(transport.clone());
    let pins = transport.pins.lock().unwrap().clone();
    assert_eq!(pins.len(), SUBGROUPS, "the master weights alone");
    assert!(pins.iter().all(|p| masters.iter().any(|m| m.as_ptr() as usize == *p)));
    assert_eq!(transport.pin_calls.load(Ordering::Relaxed), 3 * SUBGROUPS, "each moment tried");
    let trace = warm_up_and_begin(&s, "pageable");
    assert_eq!(s.device_subgroups() as usize, SUBGROUPS, "placed all the same: {trace}");
    run_step(&s);
}
