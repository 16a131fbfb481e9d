//! Provisioning: the buffers a sub-group needs beside its Adam state, decided from the memory
//! the session measures on both sides. A sub-group's gradient waits for the optimizer on the
//! host (a pinned buffer, 2 or 4 bytes per element) or on the device (`GradientHome`), and
//! a full copy of its weights in the published dtype is kept on the host or not (`HostCopy`).
//!
//! Where the options leave it to the session (`Auto`, CUDA sessions), it decides at the first
//! `begin_step` after the sub-groups were registered, when the caller has allocated what it
//! lends the session (master weights, moments) and, during the first backward, what its
//! forward needs on the device: host gradients for as many sub-groups in forward order as the
//! host's available memory holds (less a reserve), then full copies for as many as still fit;
//! the gradients of the rest stay on the device, within its free memory (less the automatic
//! budget's headroom). Nothing is allocated unless everything fits: a plan that does not fit
//! is refused with what it needs, what there is and which option lowers it.

use std::ops::Range;
use std::sync::Arc;

use super::auto_budget::AutoBudget;
use super::buffers::HostBuf;
use super::shared::Shared;
use super::subgroup::SubGroup;
use super::types::{GradientHome, HostCopy, SessionOptions};
use crate::error::{Error, Result, Status};
use crate::kernels::DType;

/// Host memory left free by the automatic choices: at least this...
const HOST_RESERVE_MIN_BYTES: usize = 2 << 30;
/// ...and at least this fraction of the host's memory: what the process allocates later
/// (pinned staging of its own, data loaders, a checkpoint being written: a bf16 state dict
/// alone is 2 bytes a parameter, an eighth of the 16 that f32 Adam state, a host gradient and
/// a host copy take).
/// Host buffers only save PCIe time where the gradient would otherwise be read back from the
/// GPU, so the session leaves them out before it fills the host.
const HOST_RESERVE_FRACTION: f64 = 0.125;

/// A size in the unit that reads best: "512 B", "3.50 MiB", "14.25 GiB".
pub(crate) fn size(bytes: usize) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// What the host can give this process now: the least of the memory available system-wide
/// (`/proc/meminfo`), what the limit of the memory cgroup (v2 or v1) the process runs in leaves,
/// and what its address-space limit (`RLIMIT_AS`) leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMemory {
    pub available: usize,
    pub total: usize,
    /// Which limit `available` is.
    pub bound: MemoryBound,
}

/// The limit a process's available host memory comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryBound {
    /// The host's (`MemAvailable`).
    Host,
    /// The process's memory cgroup.
    Cgroup,
    /// The process's address-space limit.
    AddressSpace,
}

impl MemoryBound {
    /// How a message names the limit, after the amount ("12 GiB is available ...").
    fn words(self) -> &'static str {
        match self {
            MemoryBound::Host => "",
            MemoryBound::Cgroup => " within this process's cgroup limit",
            MemoryBound::AddressSpace => " within this process's address-space limit (RLIMIT_AS)",
        }
    }
}

impl HostMemory {
    /// Measures this process's host memory; `None` where the system does not say (not Linux).
    pub fn measure() -> Option<HostMemory> {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let (total, available) = (kib_field(&meminfo, "MemTotal:")?, kib_field(&meminfo, "MemAvailable:")?);
        let mut m = HostMemory { available, total, bound: MemoryBound::Host };
        if let Some((limit, used)) = cgroup_limit() {
            m.total = m.total.min(limit);
            m.tighten(limit.saturating_sub(used), MemoryBound::Cgroup);
        }
        if let Some(left) = address_space_left() {
            m.tighten(left, MemoryBound::AddressSpace);
        }
        Some(m)
    }

    fn tighten(&mut self, left: usize, bound: MemoryBound) {
        if left < self.available {
            (self.available, self.bound) = (left, bound);
        }
    }
}

/// The reserve the automatic choices leave on a host of `total` bytes.
pub(crate) fn host_reserve(total: usize) -> usize {
    HOST_RESERVE_MIN_BYTES.max((total as f64 * HOST_RESERVE_FRACTION) as usize)
}

/// A `/proc` field given in kB, in bytes.
fn kib_field(text: &str, name: &str) -> Option<usize> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse::<usize>().ok())
        .map(|kb| kb * 1024)
}

/// What this process's address-space limit leaves of it, where one is set.
fn address_space_left() -> Option<usize> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given, which lives on this stack.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    let used = kib_field(&std::fs::read_to_string("/proc/self/status").ok()?, "VmSize:")?;
    Some((limit.rlim_cur as usize).saturating_sub(used))
}

/// The (limit, usage) of this process's memory cgroup, where it sets a limit.
fn cgroup_limit() -> Option<(usize, usize)> {
    let read = |path: &str| std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<usize>().ok());
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in cgroups.lines() {
        // v2: "0::/path"; v1: "N:memory:/path" (or a list of controllers).
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let dir = if controllers.is_empty() {
            format!("/sys/fs/cgroup{path}")
        } else if controllers.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory{path}")
        } else {
            continue;
        };
        let (limit, usage) = if controllers.is_empty() {
            (read(&format!("{dir}/memory.max")), read(&format!("{dir}/memory.current")))
        } else {
            (read(&format!("{dir}/memory.limit_in_bytes")), read(&format!("{dir}/memory.usage_in_bytes")))
        };
        // "max" (v2) does not parse; v1's unlimited is a huge number.
        if let (Some(limit), Some(usage)) = (limit, usage)
            && limit < (1usize << 60)
        {
            return Some((limit, usage));
        }
    }
    None
}

/// What one sub-group asks of provisioning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SgNeed {
    pub numel: usize,
    /// The caller lent its gradient buffer: nothing to decide for the gradient.
    pub caller_gradient: bool,
    /// The caller lent the buffer of its weights' copy: no host bytes for it.
    pub caller_copy: bool,
}

/// What the session can measure and spend when it provisions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Room {
    /// Host bytes the session may allocate (`None`: unmeasured, no limit), and what bounds
    /// them, for a refusal's message.
    pub host: Option<usize>,
    pub host_bound: String,
    /// Of `host`, what the automatic choices leave free.
    pub reserve: usize,
    /// Device bytes the session may take for gradients kept there (`None`: the transport
    /// does not say).
    pub device: Option<usize>,
}

/// The buffers each sub-group gets, in the order given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Provision {
    /// Per sub-group: its gradient waits on the device.
    pub device_gradient: Vec<bool>,
    /// Per sub-group: a full host copy of its weights is kept.
    pub full_copy: Vec<bool>,
    pub host_bytes: usize,
    pub device_bytes: usize,
}

/// Host bytes per element of a host gradient and a full copy.
fn per_element(options: &SessionOptions) -> (usize, usize) {
    (options.accum_dtype.size(), options.copy_dtype.map_or(0, DType::size))
}

/// Decides the buffers of `needs` (forward order). Explicit options are followed; `Auto`
/// gives host gradients to a prefix in forward order while `room.host` lasts (all of them in
/// a host session), then full copies to a prefix likewise, and keeps the other gradients on
/// the device within `room.device`.
pub(crate) fn plan(options: &SessionOptions, transport: bool, needs: &[SgNeed], room: Room) -> Result<Provision> {
    let (grad_size, copy_size) = per_element(options);
    let auto_gradient = transport && options.gradient_home == GradientHome::Auto;
    let auto_copy = transport && options.host_copy == HostCopy::Auto && copy_size > 0;
    let mut out = Provision {
        device_gradient: needs
            .iter()
            .map(|n| !n.caller_gradient && options.gradient_home == GradientHome::Device)
            .collect(),
        full_copy: vec![copy_size > 0 && options.host_copy != HostCopy::Bounded; needs.len()],
        ..Provision::default()
    };
    if !transport && out.device_gradient.iter().any(|&d| d) {
        return Err(Error::unsupported("gradient_home device needs a CUDA session (host sessions have no device)"));
    }
    // What explicit choices take first.
    let mut host = 0usize;
    for (i, n) in needs.iter().enumerate() {
        if !n.caller_gradient && !out.device_gradient[i] && !auto_gradient {
            host += n.numel * grad_size;
        }
        if out.full_copy[i] && !auto_copy && !n.caller_copy {
            host += n.numel * copy_size;
        }
    }
    let mut left = room.host.map(|h| h.saturating_sub(room.reserve).saturating_sub(host));
    let mut take = |bytes: usize| match &mut left {
        Some(l) if *l < bytes => false,
        Some(l) => {
            *l -= bytes;
            true
        }
        None => true,
    };
    if auto_gradient {
        let mut fits = true;
        for (i, n) in needs.iter().enumerate().filter(|(_, n)| !n.caller_gradient) {
            fits = fits && take(n.numel * grad_size);
            out.device_gradient[i] = !fits;
            if fits {
                host += n.numel * grad_size;
            }
        }
    }
    if auto_copy {
        let mut fits = !out.device_gradient.iter().any(|&d| d);
        for (i, n) in needs.iter().enumerate() {
            fits = fits && take(n.numel * copy_size);
            out.full_copy[i] = fits;
            if fits {
                host += n.numel * copy_size;
            }
        }
    }
    out.host_bytes = host;
    out.device_bytes =
        needs.iter().zip(&out.device_gradient).filter(|(_, d)| **d).map(|(n, _)| n.numel * grad_size).sum();
    if room.host.is_some_and(|h| host > h) {
        // A host session has no device to move gradients or copies to.
        let lower = if transport {
            "gradient_home = device or host_copy = bounded, bf16 moments, or more host memory"
        } else {
            "bf16 moments, a larger host_memory_limit, or more host memory"
        };
        return Err(refusal(
            format!("{} of host memory for gradients and copies", size(host)),
            room.host_bound.clone(),
            lower,
        ));
    }
    if room.device.is_some_and(|d| out.device_bytes > d) {
        return Err(refusal(
            format!(
                "{} of host memory for gradients and copies, and {} of device memory for the gradients the host \
                 cannot hold",
                size(host),
                size(out.device_bytes)
            ),
            format!(
                "{}; the device can give {}",
                room.host_bound,
                room.device.map_or(String::new(), |d| format!("{} (free memory less a headroom)", size(d)))
            ),
            "bf16 moments (4 bytes per parameter less host memory), a smaller batch or model on the device, or more \
             host memory",
        ));
    }
    Ok(out)
}

/// An out-of-memory refusal: what is needed, what there is, what lowers the need.
pub(crate) fn refusal(needs: String, has: String, lower: &str) -> Error {
    Error::new(Status::OutOfResources, format!("the session needs {needs}; {has}; lower it with {lower}"))
}

/// Checks `bytes` more host memory against what the system can give now before the session
/// allocates it, leaving a sixteenth of it (what is available is an estimate).
pub(crate) fn check_host_allocation(bytes: usize, what: &str) -> Result<()> {
    match HostMemory::measure() {
        Some(m) if bytes > m.available - m.available / 16 => Err(refusal(
            format!("{} of host memory for {what}", size(bytes)),
            format!("{} is available{}", size(m.available), m.bound.words()),
            "bf16 moments, lending the session buffers allocated elsewhere, or more host memory",
        )),
        _ => Ok(()),
    }
}

/// Whether sub-groups are provisioned as they are registered (nothing left to measure: a
/// host session, or both choices explicit).
pub(crate) fn at_registration(shared: &Shared) -> bool {
    let o = &shared.options;
    shared.transport().is_none() || (o.host_copy != HostCopy::Auto && o.gradient_home != GradientHome::Auto)
}

/// Decides the buffers of `sgs` ([`plan`], the session holding `in_use` host bytes) and
/// allocates, pins and attaches them; per sub-group, the host bytes and pins it took. All
/// or nothing.
pub(crate) fn provide(shared: &Shared, in_use: usize, sgs: &[Arc<SubGroup>]) -> Result<Vec<(usize, Vec<usize>)>> {
    let options = &shared.options;
    let needs: Vec<SgNeed> = sgs
        .iter()
        .map(|sg| {
            let data = sg.data.lock().unwrap();
            SgNeed { numel: sg.numel, caller_gradient: data.grad.is_some(), caller_copy: data.copy.is_some() }
        })
        .collect();
    let (host, reserve, host_bound) = host_room(options, in_use);
    let room = Room { host, host_bound, reserve, device: device_room(shared) };
    let decided = plan(options, shared.transport().is_some(), &needs, room)?;
    let mut done = Vec::with_capacity(sgs.len());
    for (i, sg) in sgs.iter().enumerate() {
        match provide_one(shared, sg, decided.device_gradient[i], decided.full_copy[i]) {
            Ok(taken) => done.push(taken),
            Err(e) => {
                for (sg, (_, pins)) in sgs.iter().zip(done) {
                    take_back(shared, sg, pins);
                }
                return Err(e);
            }
        }
    }
    Ok(done)
}

/// Host bytes provisioning may spend: what the system gives (less a sixteenth, as it is an
/// estimate), within the session's `host_memory_limit` (of which `in_use` is taken); the
/// reserve the automatic choices leave of it; and which limit bounds it, in words.
fn host_room(options: &SessionOptions, in_use: usize) -> (Option<usize>, usize, String) {
    let measured = HostMemory::measure();
    let limited = options.host_memory_limit.map(|l| l.saturating_sub(in_use));
    match (measured, limited) {
        (Some(m), limited) if limited.is_none_or(|l| m.available - m.available / 16 < l) => (
            Some(m.available - m.available / 16),
            host_reserve(m.total).min(m.available / 2),
            format!("{} is available{}", size(m.available), m.bound.words()),
        ),
        (_, Some(l)) => {
            let limit = options.host_memory_limit.unwrap_or_default();
            (Some(l), 0, format!("the session's host-memory limit of {limit} bytes leaves {}", size(l)))
        }
        (_, None) => (None, 0, String::new()),
    }
}

/// Device bytes gradients kept there may take: the device's free memory within the
/// caller's limit, less the automatic budget's headroom.
fn device_room(shared: &Shared) -> Option<usize> {
    let (free, total) = shared.transport()?.device_memory().ok()?;
    let limit = shared.policy.lock().unwrap().device_memory_limit();
    Some(AutoBudget::measured(free, total, limit).budget)
}

/// Allocates and pins one sub-group's gradient buffer (or has the transport keep it on
/// the device) and full copy, as decided; the host bytes and pins it took. Undone on
/// failure.
fn provide_one(shared: &Shared, sg: &SubGroup, device_gradient: bool, full_copy: bool) -> Result<(usize, Vec<usize>)> {
    let o = &shared.options;
    let mut data = sg.data.lock().unwrap();
    let mut pins = Vec::new();
    let mut bytes = 0;
    let outcome = (|| -> Result<()> {
        if data.grad.is_none() {
            if device_gradient {
                let transport = shared.transport().expect("a device gradient has a transport");
                transport.keep_gradient_on_device(sg.id)?;
                for gap in padding(&sg.slices, sg.numel) {
                    transport.device_zero_gradient(sg.id, gap)?;
                }
            } else {
                let mut grad = HostBuf::zeros(o.accum_dtype, sg.numel, "a gradient buffer")?;
                pins.extend(shared.pin(&mut grad)?);
                bytes += grad.bytes();
                data.grad = Some(grad);
            }
        }
        if data.copy.as_ref().is_some_and(|c| !c.is_owned()) {
            // The caller's copy buffer: the weights as registered.
            data.copy_from_master(&shared.pool)?;
        } else if let Some(dtype) = o.copy_dtype.filter(|_| full_copy) {
            let mut copy = HostBuf::zeros(dtype, sg.numel, "a master-weight copy")?;
            crate::kernels::convert(&shared.pool, copy.floats_mut(), data.master.floats())?;
            pins.extend(shared.pin(&mut copy)?);
            bytes += copy.bytes();
            data.copy = Some(copy);
        }
        Ok(())
    })();
    drop(data);
    match outcome {
        Ok(()) => Ok((bytes, pins)),
        Err(e) => {
            take_back(shared, sg, pins);
            Err(e)
        }
    }
}

/// Frees what `provide_one` allocated for a sub-group and undoes its pins.
fn take_back(shared: &Shared, sg: &SubGroup, pins: Vec<usize>) {
    shared.unpin_all(pins.into_iter());
    let mut data = sg.data.lock().unwrap();
    if data.copy.as_ref().is_some_and(HostBuf::is_owned) {
        data.copy = None;
    }
    if data.grad.as_ref().is_some_and(HostBuf::is_owned) {
        data.grad = None;
    }
}

/// The ranges of a sub-group of `numel` elements outside its slices (`slices` sorted).
pub(crate) fn padding(slices: &[Range<usize>], numel: usize) -> Vec<Range<usize>> {
    let mut gaps = Vec::new();
    let mut next = 0;
    for r in slices.iter().chain(std::iter::once(&(numel..numel))) {
        if r.start > next {
            gaps.push(next..r.start);
        }
        next = r.end;
    }
    gaps
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: usize = 1 << 30;

    fn cuda_options(moment: DType) -> SessionOptions {
        SessionOptions {
            grad_dtype: DType::Bf16,
            accum_dtype: DType::Bf16,
            copy_dtype: Some(DType::Bf16),
            moment_dtype: moment,
            ..SessionOptions::default()
        }
    }

    fn needs(count: usize, numel: usize) -> Vec<SgNeed> {
        vec![SgNeed { numel, caller_gradient: false, caller_copy: false }; count]
    }

    /// Bytes per parameter on each side, for every choice: the gradient (2 with bf16) and the
    /// copy (2) on the host where they fit, on the device (the gradient) or bounded (the
    /// copy) where they do not.
    #[test]
    fn automatic_choices_fill_the_host_in_forward_order() {
        let o = cuda_options(DType::F32);
        let n = 10 * GIB / 2; // 10 GiB of bf16 gradient per sub-group
        let plenty = Room { host: Some(100 * GIB), host_bound: String::new(), reserve: 0, device: Some(100 * GIB) };
        let all = plan(&o, true, &needs(4, n), plenty.clone()).unwrap();
        assert_eq!(all.device_gradient, vec![false; 4]);
        assert_eq!(all.full_copy, vec![true; 4]);
        assert_eq!((all.host_bytes, all.device_bytes), (80 * GIB, 0), "4 bytes a parameter on the host");

        let no_copies = plan(&o, true, &needs(4, n), Room { host: Some(45 * GIB), ..plenty.clone() }).unwrap();
        assert_eq!(no_copies.device_gradient, vec![false; 4]);
        assert_eq!(no_copies.full_copy, vec![false; 4], "every gradient before any copy");
        assert_eq!(no_copies.host_bytes, 40 * GIB);

        let short = plan(&o, true, &needs(4, n), Room { host: Some(25 * GIB), ..plenty.clone() }).unwrap();
        assert_eq!(short.device_gradient, vec![false, false, true, true], "host gradients for a forward prefix");
        assert_eq!(short.full_copy, vec![false; 4]);
        assert_eq!((short.host_bytes, short.device_bytes), (20 * GIB, 20 * GIB));

        let none = plan(&o, true, &needs(4, n), Room { host: Some(0), ..plenty }).unwrap();
        assert_eq!(none.device_gradient, vec![true; 4]);
        assert_eq!((none.host_bytes, none.device_bytes), (0, 40 * GIB), "nothing beyond the state on the host");
    }

    /// Host bytes per parameter beside the state, for each gradient dtype and copy, where all
    /// fits; the automatic choices leave the reserve, which explicit ones may use.
    #[test]
    fn bytes_per_parameter_follow_the_dtypes_and_the_reserve() {
        let n = 1000;
        let room = |host, reserve| Room { host, host_bound: String::new(), reserve, device: Some(usize::MAX) };
        for (accum, copy, per_param) in [
            (DType::Bf16, Some(DType::Bf16), 4),
            (DType::Bf16, None, 2),
            (DType::F32, Some(DType::Bf16), 6),
            (DType::F32, Some(DType::F16), 6),
            (DType::F32, None, 4),
        ] {
            let o = SessionOptions { accum_dtype: accum, copy_dtype: copy, ..SessionOptions::default() };
            let p = plan(&o, true, &needs(3, n), room(None, 0)).unwrap();
            assert_eq!((p.host_bytes, p.device_bytes), (3 * n * per_param, 0), "{accum:?} {copy:?}");
            let lean = SessionOptions { gradient_home: GradientHome::Device, host_copy: HostCopy::Bounded, ..o };
            let p = plan(&lean, true, &needs(3, n), room(None, 0)).unwrap();
            assert_eq!((p.host_bytes, p.device_bytes), (0, 3 * n * accum.size()), "{accum:?} {copy:?}, lean");
        }
        let o = cuda_options(DType::F32);
        let p = plan(&o, true, &needs(4, 10 * GIB / 2), room(Some(30 * GIB), 10 * GIB)).unwrap();
        assert_eq!(p.device_gradient, vec![false, false, true, true], "two gradients fit beside the reserve");
        let explicit = SessionOptions { gradient_home: GradientHome::Host, host_copy: HostCopy::Bounded, ..o };
        let p = plan(&explicit, true, &needs(3, 10 * GIB / 2), room(Some(30 * GIB), 10 * GIB)).unwrap();
        assert_eq!(p.host_bytes, 30 * GIB, "explicit choices may use the reserve");
    }

    #[test]
    fn a_plan_that_does_not_fit_is_refused_with_its_figures() {
        let o = cuda_options(DType::Bf16);
        let n = 10 * GIB / 2;
        let room = |host, device| Room { host, host_bound: "1.00 GiB is available".into(), reserve: 0, device };
        let e = plan(&o, true, &needs(4, n), room(Some(GIB), Some(30 * GIB))).unwrap_err();
        assert_eq!(e.status, Status::OutOfResources);
        for words in
            ["40.00 GiB of device memory", "1.00 GiB is available", "the device can give 30.00 GiB", "bf16 moments"]
        {
            assert!(e.message.contains(words), "{words:?} in {}", e.message);
        }
        let explicit = SessionOptions { gradient_home: GradientHome::Host, host_copy: HostCopy::Full, ..o };
        let e = plan(&explicit, true, &needs(4, n), room(Some(50 * GIB), None)).unwrap_err();
        assert!(e.message.contains("80.00 GiB of host memory"), "{}", e.message);
        assert!(e.message.contains("gradient_home = device"), "{}", e.message);
    }

    #[test]
    fn explicit_choices_and_host_sessions_decide_nothing() {
        let n = 1000;
        let host = SessionOptions { copy_dtype: Some(DType::Bf16), ..SessionOptions::default() };
        let room = |host, device| Room { host, host_bound: String::new(), reserve: 0, device };
        let e = plan(&host, false, &needs(2, n), room(Some(0), None)).unwrap_err();
        assert!(e.message.contains("bf16 moments"), "{}", e.message);
        for cuda_only in ["gradient_home", "host_copy"] {
            assert!(!e.message.contains(cuda_only), "a host session is advised no {cuda_only}: {}", e.message);
        }
        let p = plan(&host, false, &needs(2, n), room(None, None)).unwrap();
        assert_eq!((p.device_gradient, p.full_copy, p.host_bytes), (vec![false; 2], vec![true; 2], 2 * n * 6));
        let device = SessionOptions { gradient_home: GradientHome::Device, host_copy: HostCopy::Bounded, ..host };
        let p = plan(&device, true, &needs(2, n), room(Some(0), Some(GIB))).unwrap();
        assert_eq!(
            (p.device_gradient, p.full_copy, p.host_bytes, p.device_bytes),
            (vec![true; 2], vec![false; 2], 0, 2 * n * 4)
        );
        assert!(plan(&device, false, &needs(2, n), room(None, None)).is_err(), "a host session has no device");
        assert!(plan(&device, true, &needs(2, n), room(None, None)).is_ok(), "a device that does not say");
        let lent = [SgNeed { numel: n, caller_gradient: true, caller_copy: false }];
        let p = plan(&device, true, &lent, room(Some(0), Some(0))).unwrap();
        assert_eq!(p.device_gradient, vec![false], "a lent gradient buffer stays where it is");
    }

    #[test]
    fn sizes_read_in_their_unit() {
        assert_eq!(size(1000), "1000 B");
        assert_eq!(size(3 << 19), "1.50 MiB");
        assert_eq!(size(14 * GIB + GIB / 4), "14.25 GiB");
    }

    #[test]
    fn the_reserve_is_a_fraction_of_large_hosts() {
        assert_eq!(host_reserve(8 * GIB), 2 * GIB);
        assert_eq!(host_reserve(128 * GIB), 16 * GIB);
        let m = HostMemory::measure();
        if let Some(m) = m {
            assert!(m.available <= m.total && m.total > 0, "{m:?}");
        }
    }
}
