//! Device-placed sub-groups over an emulated device: a transport that keeps their state in
//! host memory and steps it with the CPU kernels, whose operation sequence the device kernel
//! follows bit for bit (`src/cuda/ptx.rs`). It also keeps host-placed sub-groups' gradients
//! where the session leaves them on the device, and the model's parameters that every
//! sub-group is published into. The session's side of device placement runs here without a
//! GPU: the speculative update queued at hand-off (or, cancelled by the
//! decision or left to it by automatic speculation, queued by the final pass with its
//! resolution), the final passes that keep,
//! rescale, roll back or redo it, the step at `step()` where nothing speculated, what is
//! published, a checkpoint of device state resumed on either side, and a sub-group moved to
//! the host and back. A host-placed session with the same plan must end with the same bits.

mod common;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use superoffload::error::{Error, Result, Status};
use superoffload::kernels::{
    self, AdamBuffers, DType, Floats, FloatsMut, Isa, MomentsMut, Pool, PoolOptions, UpdateOptions, bf16,
    dtype::f32_to_bf16_bits,
};
use superoffload::session::{
    Borrowed, DeviceParam, DevicePass, GradientHome, GroupHparams, HandOff, HandedSumsq, HostCopy, HostState,
    NormSource, Placement, Session, SessionOptions, SliceDesc, Speculation, StepArgs, StepResult, SubGroupDesc, Ticket,
    Transport,
};

/// The bf16 parameter of master weights: rounded as the library rounds them.
fn rounded_to_bf16(master: &[f32]) -> Vec<u16> {
    master.iter().map(|&x| f32_to_bf16_bits(x)).collect()
}

/// A device-placed sub-group's state on the emulated device.
struct DeviceSubGroup {
    master: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    grad: Vec<bf16>,
}

impl DeviceSubGroup {
    fn from_host(state: &HostState<'_>) -> Result<DeviceSubGroup> {
        let f32s = |b: &FloatsMut<'_>| match b {
            FloatsMut::F32(s) => Ok(s.to_vec()),
            _ => Err(Error::unsupported("the emulated device keeps f32 state")),
        };
        let master = f32s(&state.master)?;
        let n = master.len();
        Ok(DeviceSubGroup {
            exp_avg: f32s(&state.exp_avg)?,
            exp_avg_sq: f32s(&state.exp_avg_sq)?,
            grad: vec![bf16::ZERO; n],
            master,
        })
    }

    fn to_host(&self, state: HostState<'_>) {
        for (dst, src) in
            [(state.master, &self.master), (state.exp_avg, &self.exp_avg), (state.exp_avg_sq, &self.exp_avg_sq)]
        {
            let FloatsMut::F32(dst) = dst else { panic!("f32 state expected") };
            dst.copy_from_slice(src);
        }
    }

    fn buffers(&mut self) -> AdamBuffers<'_> {
        AdamBuffers {
            param: FloatsMut::F32(&mut self.master),
            grad: Floats::Bf16(&self.grad),
            moments: MomentsMut::F32 { exp_avg: &mut self.exp_avg, exp_avg_sq: &mut self.exp_avg_sq },
            copy_out: None,
        }
    }
}

/// One `device_step` call, as the session made it.
#[derive(Clone, Debug, PartialEq)]
struct DeviceCall {
    sg: u32,
    passes: Vec<DevicePass>,
    publish: bool,
}

struct EmulatedDevice {
    pool: Pool,
    subgroups: Mutex<HashMap<u32, DeviceSubGroup>>,
    /// Every attached sub-group's parameter in the model: the bf16 weights last published.
    params: Mutex<HashMap<u32, Vec<u16>>>,
    /// The gradients of host-placed sub-groups that the session keeps on the device.
    kept: Mutex<HashMap<u32, Vec<bf16>>>,
    calls: Mutex<Vec<DeviceCall>>,
    /// While set, no gradient has landed: the CPU-Adam thread runs no job that reads one.
    held: AtomicBool,
}

impl EmulatedDevice {
    fn new() -> EmulatedDevice {
        EmulatedDevice {
            pool: Pool::new(&PoolOptions { num_threads: 1, isa: Some(Isa::best()), ..Default::default() }).unwrap(),
            subgroups: Mutex::new(HashMap::new()),
            params: Mutex::new(HashMap::new()),
            kept: Mutex::new(HashMap::new()),
            calls: Mutex::new(Vec::new()),
            held: AtomicBool::new(false),
        }
    }

    fn hold(&self, held: bool) {
        self.held.store(held, Ordering::Release);
    }

    /// Delivers a gradient as the CUDA transport does: into the device gradient of a
    /// device-placed sub-group or one kept on the device, else into the session's host
    /// buffer; its sum of squares is that of the source.
    fn deliver(&self, h: HandOff<'_>, g: &[bf16]) -> Result<Option<HandedSumsq>> {
        let sumsq = h.sumsq_scale.map(|scale| kernels::grad_sumsq_here(Floats::Bf16(g), scale)).transpose()?;
        let on_device =
            self.subgroups.lock().unwrap().contains_key(&h.sg) || self.kept.lock().unwrap().contains_key(&h.sg);
        if on_device && h.late {
            return Err(Error::unsupported("a gradient on the device takes no late gradients"));
        }
        if let Some(d) = self.subgroups.lock().unwrap().get_mut(&h.sg) {
            d.grad[h.range].copy_from_slice(g);
        } else if let Some(kept) = self.kept.lock().unwrap().get_mut(&h.sg) {
            kept[h.range].copy_from_slice(g);
        } else {
            let Some(FloatsMut::Bf16(dst)) = h.dst else { panic!("bf16 accumulation expected") };
            dst.copy_from_slice(g);
        }
        Ok(sumsq.map(HandedSumsq::Known))
    }

    fn calls(&self) -> Vec<DeviceCall> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }

    fn param(&self, sg: u32) -> Vec<u16> {
        self.params.lock().unwrap()[&sg].clone()
    }

    /// A piece of published weights lands in the parameter.
    fn receive(&self, sg: u32, offset: usize, piece: &[bf16]) {
        let mut params = self.params.lock().unwrap();
        for (d, b) in params.get_mut(&sg).expect("attached")[offset..].iter_mut().zip(piece) {
            *d = b.to_bits();
        }
    }
}

impl Transport for EmulatedDevice {
    transport_without_pinning!();
    fn attach(
        &self,
        sg: u32,
        _: Option<DeviceParam>,
        _: &[Range<usize>],
        placement: Placement,
        state: HostState<'_>,
    ) -> Result<()> {
        let FloatsMut::F32(master) = &state.master else { panic!("f32 master weights") };
        self.params.lock().unwrap().insert(sg, rounded_to_bf16(master));
        self.set_placement(sg, placement, state)
    }
    fn master_write(&self, _: u32) -> Result<()> {
        Ok(())
    }
    bf16_publication!(receive);
    fn publish(&self, _: u32) -> Result<()> {
        Ok(())
    }
    fn keep_gradient_on_device(&self, sg: u32) -> Result<()> {
        let n = self.params.lock().unwrap()[&sg].len();
        self.kept.lock().unwrap().insert(sg, vec![bf16::ZERO; n]);
        Ok(())
    }
    fn gradient_pieces(
        &self,
        sg: u32,
        range: Range<usize>,
        piece: usize,
        f: &mut dyn FnMut(usize, Floats<'_>) -> Result<()>,
    ) -> Result<()> {
        for start in range.clone().step_by(piece) {
            // A copy, as a piece copied to the host is: `f` may publish meanwhile.
            let copied: Vec<bf16> = self.kept.lock().unwrap()[&sg][start..(start + piece).min(range.end)].to_vec();
            f(start, Floats::Bf16(&copied))?;
        }
        Ok(())
    }
    fn gradient_ready(&self, _: u32) -> Result<()> {
        Ok(())
    }
    fn gradient_landed(&self, _: u32) -> bool {
        !self.held.load(Ordering::Acquire)
    }
    fn device_step(&self, sg: u32, passes: &[DevicePass], publish: bool) -> Result<()> {
        self.calls.lock().unwrap().push(DeviceCall { sg, passes: passes.to_vec(), publish });
        let mut subgroups = self.subgroups.lock().unwrap();
        let d = subgroups.get_mut(&sg).ok_or_else(|| Error::new(Status::InvalidState, "not on the device"))?;
        for pass in passes {
            match *pass {
                DevicePass::Update { hp, scale } => {
                    let opts = UpdateOptions { grad_scale: scale, ..Default::default() };
                    kernels::update(&self.pool, &hp, d.buffers(), &opts).map(drop)?
                }
                DevicePass::Rollback { hp, scale } => kernels::rollback(&self.pool, &hp, d.buffers(), scale)?,
                DevicePass::Rescale { hp, old_scale, new_scale } => {
                    kernels::rescale(&self.pool, &hp, d.buffers(), old_scale, new_scale)?
                }
            }
        }
        if publish {
            self.params.lock().unwrap().insert(sg, rounded_to_bf16(&d.master));
        }
        Ok(())
    }
    fn device_zero_gradient(&self, sg: u32, range: Range<usize>) -> Result<()> {
        match self.subgroups.lock().unwrap().get_mut(&sg) {
            Some(d) => d.grad[range].fill(bf16::ZERO),
            None => self.kept.lock().unwrap().get_mut(&sg).expect("a gradient on the device")[range].fill(bf16::ZERO),
        }
        Ok(())
    }
    fn set_placement(&self, sg: u32, placement: Placement, state: HostState<'_>) -> Result<()> {
        let mut subgroups = self.subgroups.lock().unwrap();
        match placement {
            Placement::Device => {
                subgroups.insert(sg, DeviceSubGroup::from_host(&state)?);
            }
            Placement::Host => {
                if let Some(d) = subgroups.remove(&sg) {
                    d.to_host(state);
                }
            }
        }
        Ok(())
    }
    fn download_state(&self, sg: u32, state: HostState<'_>) -> Result<()> {
        self.subgroups.lock().unwrap()[&sg].to_host(state);
        Ok(())
    }
    fn load_state(&self, sg: u32, state: HostState<'_>) -> Result<()> {
        let mut subgroups = self.subgroups.lock().unwrap();
        let d = subgroups.get_mut(&sg).expect("device-placed");
        let grad = std::mem::take(&mut d.grad);
        *d = DeviceSubGroup { grad, ..DeviceSubGroup::from_host(&state)? };
        self.params.lock().unwrap().insert(sg, rounded_to_bf16(&d.master));
        Ok(())
    }
}

const SIZES: [usize; 3] = [40_000, 7_001, 20_000];

struct Run {
    session: Session,
    /// The masters the session borrows (they must outlive it).
    _masters: Vec<Vec<f32>>,
}

fn run(transport: Option<Arc<EmulatedDevice>>, speculation: Speculation) -> Run {
    let placement = if transport.is_some() { Placement::Device } else { Placement::Host };
    run_with(transport, placement, SessionOptions { speculation, ..Default::default() })
}

/// A session of [`SIZES`] with `options` (bf16 gradients and a pool of two threads added),
/// every sub-group registered with `placement`.
fn run_with(transport: Option<Arc<EmulatedDevice>>, placement: Placement, options: SessionOptions) -> Run {
    let pool =
        Arc::new(Pool::new(&PoolOptions { num_threads: 2, isa: Some(Isa::best()), ..Default::default() }).unwrap());
    let opts = SessionOptions { pool: Some(pool), grad_dtype: DType::Bf16, accum_dtype: DType::Bf16, ..options };
    let with_device = transport.is_some();
    let session = Session::with_transport(opts, transport.map(|t| t as Arc<dyn Transport>)).unwrap();
    session.add_group(GroupHparams { lr: 1e-2, weight_decay: 0.05, ..GroupHparams::default() }).unwrap();
    let mut masters: Vec<Vec<f32>> =
        SIZES.iter().map(|&n| (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3).collect()).collect();
    for (k, m) in masters.iter_mut().enumerate() {
        // SAFETY: the heap buffer of `m` moves into the returned Run, which outlives the session's work.
        let master = unsafe { Borrowed::new("m", m.as_mut_ptr().cast(), m.len(), DType::F32) }.unwrap();
        // One slice short of the end: the padding must stay zero on the device too.
        let slices = vec![SliceDesc { name: format!("sg{k}"), offset: 0, numel: m.len() - 3 }];
        // The model's bf16 parameter (the emulated device keeps its own).
        let device = with_device.then_some(DeviceParam { ptr: 1 + k as u64, dtype: DType::Bf16 });
        session.add_subgroup(SubGroupDesc { placement, device, ..SubGroupDesc::new(0, master, slices) }).unwrap();
    }
    Run { session, _masters: masters }
}

/// What a step of the plan below does to the speculative update.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Plan {
    /// Not clipped: the update stands.
    Keep,
    /// Clipped: the update is rescaled.
    Rescale,
    /// Skipped (an overflow): the update is rolled back and nothing is published.
    Skip,
    /// The learning rate changes between backward and `step()`: the update is redone.
    Redo,
    /// One sub-group's squares exceed f32: it is not stepped ahead, only at `step()`.
    Declined,
}

const PLAN: [Plan; 8] =
    [Plan::Keep, Plan::Rescale, Plan::Keep, Plan::Skip, Plan::Redo, Plan::Declined, Plan::Keep, Plan::Rescale];

fn gradient(step: u64, k: usize, plan: Plan) -> Vec<bf16> {
    (0..SIZES[k] - 3)
        .map(|i| {
            if plan == Plan::Declined && k == 1 && i == 5 {
                // Finite, but its square is beyond f32.
                return bf16::from_f32(1e20);
            }
            bf16::from_f32(((i as u64 * 7 + step * 13 + k as u64) % 29) as f32 * 1e-3 - 0.014)
        })
        .collect()
}

/// Hands every gradient over (backward order); the speculative tickets returned.
fn backward(run: &Run, device: Option<&EmulatedDevice>, step: u64, plan: Plan) -> Vec<Ticket> {
    let s = &run.session;
    s.begin_step(Some(1.0), 1).unwrap();
    let mut tickets = Vec::new();
    for k in (0..SIZES.len()).rev() {
        let g = gradient(step, k, plan);
        let ticket = match device {
            Some(d) => s.hand_off(k as u32, g.len(), "test", |h| d.deliver(h, &g)).unwrap(),
            None => s.grad_copy(k as u32, Floats::Bf16(&g)).unwrap(),
        };
        tickets.extend(ticket);
    }
    tickets
}

/// Steps, then lets `device`'s gradients land (see [`EmulatedDevice::hold`]); the result.
fn finish(run: &Run, step: u64, plan: Plan, device: Option<&EmulatedDevice>) -> StepResult {
    let s = &run.session;
    if plan == Plan::Redo {
        s.set_group_hparams(0, GroupHparams { lr: 1e-2 / step as f64, weight_decay: 0.05, ..GroupHparams::default() })
            .unwrap();
    }
    let norm = if plan == Plan::Rescale { 5.0 } else { 0.5 };
    let args = StepArgs { max_norm: 1.0, norm: NormSource::Given(norm), overflow: plan == Plan::Skip };
    let t = s.step(args).unwrap();
    if let Some(device) = device {
        device.hold(false);
    }
    s.step_result(t, None).unwrap()
}

fn state(run: &Run, k: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let s = &run.session;
    let (m, v) = s.moments(k as u32).unwrap();
    let st = s.subgroup_state(k as u32).unwrap();
    // SAFETY: `master` points at the sub-group's f32 host master of `numel` elements, brought
    // up to date by the call, and the session is idle.
    let master = unsafe { std::slice::from_raw_parts(st.master.cast::<f32>(), st.numel) };
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    (bits(master), bits(&m), bits(&v))
}

/// Runs [`PLAN`] on a host-placed and a device-placed session with speculation on. With
/// `ahead`, each speculative job runs before `step()`; without, the gradients land only
/// after `step()` was called, so the decision cancels every queued job and the final passes
/// queue the update with its resolution.
fn speculation_against_host(ahead: bool) {
    let device = Arc::new(EmulatedDevice::new());
    let host = run(None, Speculation::On);
    let dev = run(Some(device.clone()), Speculation::On);
    for (step, &plan) in (1..).zip(PLAN.iter()) {
        let published: Vec<Vec<u16>> = (0..SIZES.len()).map(|k| device.param(k as u32)).collect();
        backward(&host, None, step, plan);
        device.hold(!ahead);
        let tickets = backward(&dev, Some(&device), step, plan);
        let declined = |k: u32| plan == Plan::Declined && k == 1;
        if ahead {
            // Each sub-group's update is queued on the device once its gradient is complete,
            // before step(), and nothing is published yet.
            for t in &tickets {
                dev.session.wait(*t, None).unwrap();
            }
            let calls = device.calls();
            for k in 0..SIZES.len() as u32 {
                let updates: Vec<_> = calls.iter().filter(|c| c.sg == k).collect();
                if declined(k) {
                    assert!(updates.is_empty(), "step {step}: sub-group {k} was stepped ahead: {updates:?}");
                    continue;
                }
                assert_eq!(updates.len(), 1, "step {step}: sub-group {k}: {calls:?}");
                assert!(matches!(updates[0].passes[..], [DevicePass::Update { .. }]) && !updates[0].publish);
                assert_eq!(device.param(k), published[k as usize], "step {step}: sub-group {k} published early");
            }
        }
        finish(&host, step, plan, None);
        let result = finish(&dev, step, plan, Some(&device));
        if !ahead {
            assert_eq!(result.cancelled, SIZES.len() as u32, "{result:?}");
        }
        // The final passes: what the verdict leaves to do (after the update, where it did not
        // run ahead), and one publication per stepped sub-group.
        let finals = device.calls();
        for k in 0..SIZES.len() as u32 {
            let resolution = if declined(k) { "" } else { resolution(plan) };
            let expected = if ahead && !declined(k) { resolution.to_string() } else { format!("update {resolution}") };
            assert_final_passes(&finals, k, expected.trim(), plan, step);
        }
        assert_host_bits_published(&host, &dev, &device, &published, plan, step);
    }
}

/// The passes a speculative step's resolution adds after its update, by plan.
fn resolution(plan: Plan) -> &'static str {
    match plan {
        Plan::Keep | Plan::Declined => "",
        Plan::Rescale => "rescale",
        Plan::Skip => "rollback",
        Plan::Redo => "rollback update",
    }
}

/// Sub-group `k`'s final passes among `finals` are `expected` (names, in order), and it is
/// published once unless the step was skipped.
fn assert_final_passes(finals: &[DeviceCall], k: u32, expected: &str, plan: Plan, step: u64) {
    let calls: Vec<_> = finals.iter().filter(|c| c.sg == k).collect();
    let names: Vec<&str> = calls
        .iter()
        .flat_map(|c| c.passes.iter())
        .map(|p| match p {
            DevicePass::Update { .. } => "update",
            DevicePass::Rollback { .. } => "rollback",
            DevicePass::Rescale { .. } => "rescale",
        })
        .collect();
    assert_eq!(names.join(" "), expected, "step {step} ({plan:?}): sub-group {k}");
    assert_eq!(calls.iter().filter(|c| c.publish).count(), usize::from(plan != Plan::Skip));
}

/// The device-placed session holds the host-placed one's state bit for bit, and its
/// parameters are that state's master weights rounded (those `published` before a skipped
/// step).
fn assert_host_bits_published(
    host: &Run,
    dev: &Run,
    device: &EmulatedDevice,
    published: &[Vec<u16>],
    plan: Plan,
    step: u64,
) {
    for k in 0..SIZES.len() {
        let (host_state, dev_state) = (state(host, k), state(dev, k));
        assert!(host_state == dev_state, "step {step} ({plan:?}): sub-group {k}: state differs");
        let rounded = rounded_to_bf16(&host_state.0.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>());
        let expected = if plan == Plan::Skip { &published[k] } else { &rounded };
        assert!(&device.param(k as u32) == expected, "step {step} ({plan:?}): sub-group {k}: published weights");
        // Padding stays zero.
        assert!(host_state.0[SIZES[k] - 3..].iter().all(|&b| b == 0));
    }
}

#[test]
fn a_device_placed_update_queued_at_hand_off_gives_the_host_bits() {
    speculation_against_host(true);
}

#[test]
fn a_device_placed_speculation_cancelled_at_step_gives_the_host_bits() {
    speculation_against_host(false);
}

/// With automatic speculation a device-placed sub-group decides as a host-placed one does,
/// but queues nothing at hand-off: its speculative step waits for the decision and runs with
/// its resolution, the last pass publishing. The bits are the host's, which stepped ahead.
#[test]
fn automatic_speculation_leaves_a_device_placed_step_to_the_decision_with_the_host_bits() {
    let device = Arc::new(EmulatedDevice::new());
    let host = run(None, Speculation::Auto);
    let dev = run(Some(device.clone()), Speculation::Auto);
    let mut speculated_steps = 0;
    for (step, &plan) in (1..).zip(PLAN.iter()) {
        let published: Vec<Vec<u16>> = (0..SIZES.len()).map(|k| device.param(k as u32)).collect();
        let speculated = !backward(&host, None, step, plan).is_empty();
        speculated_steps += usize::from(speculated);
        assert!(backward(&dev, Some(&device), step, plan).is_empty(), "step {step}: a device step queued ahead");
        assert!(device.calls().is_empty(), "step {step}: a device pass before step()");
        finish(&host, step, plan, None);
        let result = finish(&dev, step, plan, Some(&device));
        assert_eq!(result.speculative, 0, "{result:?}");
        let finals = device.calls();
        for k in 0..SIZES.len() as u32 {
            let declined = plan == Plan::Declined && k == 1;
            let resolution = if speculated && !declined { resolution(plan) } else { "" };
            let expected = match plan {
                // Nothing stepped ahead and the step is skipped: nothing to undo.
                Plan::Skip if !speculated => String::new(),
                _ => format!("update {resolution}"),
            };
            assert_final_passes(&finals, k, expected.trim(), plan, step);
        }
        assert_host_bits_published(&host, &dev, &device, &published, plan, step);
    }
    // The plan's factor stays unchanged often enough that every step speculates: each
    // resolution above ran after the update it resolves.
    assert_eq!(speculated_steps, PLAN.len());
}

#[test]
fn without_speculation_a_device_placed_sub_group_steps_at_step_only() {
    let device = Arc::new(EmulatedDevice::new());
    let host = run(None, Speculation::Off);
    let dev = run(Some(device.clone()), Speculation::Off);
    for (step, &plan) in (1..).zip(PLAN.iter()) {
        backward(&host, None, step, plan);
        assert!(backward(&dev, Some(&device), step, plan).is_empty(), "nothing speculates");
        assert!(device.calls().is_empty(), "step {step}: a device pass before step()");
        finish(&host, step, plan, None);
        finish(&dev, step, plan, Some(&device));
        for call in device.calls() {
            assert!(matches!(call.passes[..], [DevicePass::Update { .. }]) && call.publish, "{call:?}");
        }
        for k in 0..SIZES.len() {
            assert!(state(&host, k) == state(&dev, k), "step {step} ({plan:?}): sub-group {k}: state differs");
        }
    }
}

#[test]
fn a_checkpoint_of_device_placed_sub_groups_resumes_on_either_side_and_placement_moves_bit_for_bit() {
    let device = Arc::new(EmulatedDevice::new());
    let host = run(None, Speculation::On);
    let dev = run(Some(device.clone()), Speculation::On);
    let (first, rest) = PLAN.split_at(4);
    for (step, &plan) in (1..).zip(first) {
        backward(&host, None, step, plan);
        backward(&dev, Some(&device), step, plan);
        finish(&host, step, plan, None);
        finish(&dev, step, plan, Some(&device));
    }
    let path = std::env::temp_dir().join(format!("so-device-checkpoint-{}.safetensors", std::process::id()));
    dev.session.save(&path).unwrap();
    // The checkpoint holds the device state: it loads into a device-placed and a host-placed
    // session alike, and the device-placed one publishes what it loaded.
    let resumed_device = Arc::new(EmulatedDevice::new());
    let resumed_dev = run(Some(resumed_device.clone()), Speculation::On);
    let resumed_host = run(None, Speculation::On);
    resumed_dev.session.load(&path).unwrap();
    resumed_host.session.load(&path).unwrap();
    std::fs::remove_file(&path).ok();
    for k in 0..SIZES.len() {
        let master = state(&resumed_dev, k).0;
        let rounded = rounded_to_bf16(&master.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>());
        assert!(resumed_device.param(k as u32) == rounded, "sub-group {k}: the loaded weights are not published");
    }
    // One sub-group moves to the host and back while training goes on.
    resumed_dev.session.set_placement(1, Placement::Host).unwrap();
    for (step, &plan) in (5..).zip(rest) {
        if step == 7 {
            resumed_dev.session.set_placement(1, Placement::Device).unwrap();
        }
        backward(&host, None, step, plan);
        backward(&resumed_host, None, step, plan);
        backward(&resumed_dev, Some(&resumed_device), step, plan);
        finish(&host, step, plan, None);
        finish(&resumed_host, step, plan, None);
        finish(&resumed_dev, step, plan, Some(&resumed_device));
        for k in 0..SIZES.len() {
            let expected = state(&host, k);
            assert!(state(&resumed_host, k) == expected, "step {step} ({plan:?}): sub-group {k}: host resumed");
            assert!(state(&resumed_dev, k) == expected, "step {step} ({plan:?}): sub-group {k}: device resumed");
        }
    }
}

/// Host-placed sub-groups with nothing beside their state on the host: the gradient kept on
/// the device and read back in pieces by every pass, the copy written piece by piece into the
/// transport's buffer as it is published (and, where the gradient is on the host, with the
/// copy kept in full). Every speculation mode, over the whole plan: the host session's state
/// bit for bit, and its master weights rounded published (the previous ones where a step is
/// skipped).
#[test]
fn host_placed_sub_groups_keep_gradients_on_the_device_and_publish_without_a_copy_with_the_host_bits() {
    for speculation in [Speculation::On, Speculation::Auto, Speculation::Off] {
        for (gradient_home, host_copy) in [
            (GradientHome::Device, HostCopy::Bounded),
            (GradientHome::Device, HostCopy::Full),
            (GradientHome::Host, HostCopy::Bounded),
        ] {
            let what = format!("{speculation:?}, gradient {gradient_home:?}, copy {host_copy:?}");
            let device = Arc::new(EmulatedDevice::new());
            let host = run(None, speculation);
            let options = SessionOptions {
                speculation,
                gradient_home,
                host_copy,
                copy_dtype: Some(DType::Bf16),
                ..Default::default()
            };
            let dev = run_with(Some(device.clone()), Placement::Host, options);
            for (step, &plan) in (1..).zip(PLAN.iter()) {
                let published: Vec<Vec<u16>> = (0..SIZES.len()).map(|k| device.param(k as u32)).collect();
                backward(&host, None, step, plan);
                backward(&dev, Some(&device), step, plan);
                finish(&host, step, plan, None);
                let result = finish(&dev, step, plan, Some(&device));
                assert_eq!(result.device_stepped, 0, "{what}: {result:?}");
                assert!(device.calls().is_empty(), "{what}: nothing is stepped on the device");
                assert_host_bits_published(&host, &dev, &device, &published, plan, step);
            }
            let on_device = device.kept.lock().unwrap().len();
            assert_eq!(on_device, if gradient_home == GradientHome::Device { SIZES.len() } else { 0 }, "{what}");
            let bytes = dev.session.host_bytes();
            let copy = if host_copy == HostCopy::Full { 2 } else { 0 };
            let grad = if gradient_home == GradientHome::Host { 2 } else { 0 };
            let moments = 8;
            assert_eq!(bytes, SIZES.iter().sum::<usize>() * (moments + grad + copy), "{what}: host bytes");
        }
    }
}
