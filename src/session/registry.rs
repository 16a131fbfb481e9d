//! What a session holds between steps: param groups, named slices, sub-groups (their
//! buffers, pins and device attachment) and the host-memory account.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::buffers::HostBuf;
use super::provision::{check_host_allocation, padding};
use super::{
    GroupHparams, Phase, Placement, Session, SgData, SgWork, SliceDesc, SubGroup, SubGroupDesc, Ticket, state_error,
    to_f32, unknown, validate_group,
};
use crate::error::{Error, Result, Status};
use crate::kernels::{self, DType, FloatsMut};

pub(crate) struct SliceInfo {
    /// Empty once its sub-group was removed.
    pub name: String,
    pub sg: u32,
    /// Its index within the sub-group.
    pub index: usize,
    pub range: Range<usize>,
}

/// The registry's record of one sub-group.
pub(crate) struct SgTrack {
    pub sg: Arc<SubGroup>,
    /// Its slices' ids.
    pub slices: Range<usize>,
    /// The ticket after which the latest step of this sub-group is final (0 before any).
    pub final_ticket: Ticket,
    /// Borrowed address ranges (master, gradient, moments), for overlap checks.
    borrowed: Vec<Range<usize>>,
    host_bytes: usize,
    /// Host buffers the transport pinned for this sub-group (addresses).
    pinned: Vec<usize>,
}

#[derive(Default)]
pub(crate) struct Registry {
    pub groups: Vec<GroupHparams>,
    pub slices: Vec<SliceInfo>,
    names: HashMap<String, u32>,
    pub subgroups: Vec<Option<SgTrack>>,
    host_bytes: usize,
    /// Sub-groups registered but not yet provisioned (`provision.rs`), in registration order.
    pub unprovisioned: Vec<u32>,
}

impl Registry {
    pub(crate) fn live(&self) -> impl Iterator<Item = &SgTrack> {
        self.subgroups.iter().flatten()
    }

    pub(crate) fn track(&self, sg: u32) -> Result<&SgTrack> {
        self.subgroups.get(sg as usize).and_then(Option::as_ref).ok_or_else(|| unknown("sub-group", sg))
    }

    /// The sub-group and range of a slice, checking the gradient's length (`None`: unchecked).
    pub(crate) fn slice(&self, slice: u32, numel: Option<usize>) -> Result<&SliceInfo> {
        let info =
            self.slices.get(slice as usize).filter(|s| !s.name.is_empty()).ok_or_else(|| unknown("slice", slice))?;
        if let Some(n) = numel.filter(|&n| n != info.range.len()) {
            return Err(Error::invalid(format!(
                "slice {:?} has {} elements; the gradient has {n}",
                info.name,
                info.range.len()
            )));
        }
        Ok(info)
    }

    /// Host bytes the session allocated.
    pub(crate) fn host_bytes(&self) -> usize {
        self.host_bytes
    }

    /// A sub-group's gradient buffer and copy were allocated (`bytes`) and pinned (`pins`).
    pub(crate) fn provisioned(&mut self, sg: u32, bytes: usize, pins: Vec<usize>) {
        let track = self.subgroups[sg as usize].as_mut().expect("registered");
        track.host_bytes += bytes;
        track.pinned.extend(pins);
        self.host_bytes += bytes;
    }

    fn check_memory(&self, limit: Option<usize>, more: usize) -> Result<()> {
        match limit {
            Some(limit) if self.host_bytes + more > limit => Err(Error::new(
                Status::OutOfResources,
                format!(
                    "the host-memory limit of {limit} bytes would be exceeded: {more} more bytes needed, {} in use",
                    self.host_bytes
                ),
            )),
            _ => Ok(()),
        }
    }
}

impl Session {
    pub fn add_group(&self, hparams: GroupHparams) -> Result<u32> {
        validate_group(&hparams)?;
        let mut t = self.lock();
        t.reg.groups.push(hparams);
        Ok(t.reg.groups.len() as u32 - 1)
    }

    /// New hyperparameters for a group: speculative steps submitted from now on, and every
    /// sub-group's final step at the next `step()`, use them.
    pub fn set_group_hparams(&self, group: u32, hparams: GroupHparams) -> Result<()> {
        validate_group(&hparams)?;
        let mut t = self.lock();
        let slot = t.reg.groups.get_mut(group as usize).ok_or_else(|| unknown("group", group))?;
        *slot = hparams;
        Ok(())
    }

    pub fn group_hparams(&self, group: u32) -> Result<GroupHparams> {
        self.lock().reg.groups.get(group as usize).copied().ok_or_else(|| unknown("group", group))
    }

    /// Registers a sub-group (between steps). Sub-groups are finalized at `step()` in the
    /// order they were registered: register them in forward order.
    pub fn add_subgroup(&self, desc: SubGroupDesc) -> Result<u32> {
        let mut t = self.lock();
        if t.phase != Phase::Idle {
            return Err(state_error("sub-groups can only be added between steps (before begin_step or after step)"));
        }
        let o = &self.options;
        if desc.group as usize >= t.reg.groups.len() {
            return Err(unknown("group", desc.group));
        }
        let transport = self.shared.transport();
        if transport.is_none() && desc.device.is_some() {
            return Err(Error::invalid("a device parameter is set but this is a host session"));
        }
        if desc.placement == Placement::Device && transport.is_none() {
            return Err(Error::unsupported("device placement needs a CUDA session"));
        }
        let id = t.reg.subgroups.len() as u32;
        let master = HostBuf::borrowed(desc.master);
        let numel = master.len();
        if numel == 0 {
            return Err(Error::invalid("the master buffer has 0 elements"));
        }
        if desc.placement == Placement::Device && master.dtype() != DType::F32 {
            return Err(Error::unsupported("device placement needs f32 master weights"));
        }
        let caller_buffer = |b: Option<super::Borrowed>, what: &str, dtype: DType| -> Result<Option<HostBuf>> {
            let Some(b) = b else { return Ok(None) };
            let b = HostBuf::borrowed(b);
            if b.dtype() != dtype || b.len() != numel {
                return Err(Error::invalid(format!(
                    "the {what} buffer must hold {numel} elements of {}; it has {} of {}",
                    dtype.name(),
                    b.len(),
                    b.dtype().name()
                )));
            }
            Ok(Some(b))
        };
        let grad = caller_buffer(desc.grad, "gradient", o.accum_dtype)?;
        let exp_avg = caller_buffer(desc.exp_avg, "exp_avg", o.moment_dtype)?;
        let exp_avg_sq = caller_buffer(desc.exp_avg_sq, "exp_avg_sq", o.moment_dtype)?;
        check_slices(&desc.slices, numel, &t.reg.names)?;
        let labelled: Vec<(&str, Range<usize>)> = [
            ("master buffer", Some(&master)),
            ("gradient buffer", grad.as_ref()),
            ("exp_avg buffer", exp_avg.as_ref()),
            ("exp_avg_sq buffer", exp_avg_sq.as_ref()),
        ]
        .into_iter()
        .filter_map(|(name, b)| b.map(|b| (name, b.addr_range())))
        .collect();
        check_no_overlap(&labelled, &t.reg.subgroups)?;
        let borrowed: Vec<Range<usize>> = labelled.into_iter().map(|(_, r)| r).collect();

        // The moments now; the gradient buffer and the copy when the sub-group is provisioned.
        let owned = |b: &Option<HostBuf>| if b.is_none() { numel * o.moment_dtype.size() } else { 0 };
        let host_bytes = owned(&exp_avg) + owned(&exp_avg_sq);
        t.reg.check_memory(o.host_memory_limit, host_bytes)?;
        check_host_allocation(host_bytes, "the Adam moments")?;
        let allocate = |b: Option<HostBuf>, dtype: DType, what: &str| match b {
            Some(b) => Ok(b),
            None => HostBuf::zeros(dtype, numel, what),
        };
        let mut slices: Vec<&SliceDesc> = desc.slices.iter().collect();
        slices.sort_by_key(|s| s.offset);
        let ranges: Vec<Range<usize>> = slices.iter().map(|s| s.offset..s.offset + s.numel).collect();
        let mut data = SgData {
            exp_avg: allocate(exp_avg, o.moment_dtype, "sub-group state")?,
            exp_avg_sq: allocate(exp_avg_sq, o.moment_dtype, "sub-group state")?,
            grad,
            copy: None,
            master,
            work: SgWork::default(),
            sumsq: vec![None; ranges.len()],
            placement: desc.placement,
        };
        // Elements outside every slice are padding: zero in every buffer, they step to zero
        // (no gradient ever lands there), so no checkpoint needs them.
        let padding = padding(&ranges, numel);
        for gap in &padding {
            for buf in [&mut data.master, &mut data.exp_avg, &mut data.exp_avg_sq].into_iter().chain(data.grad.as_mut())
            {
                buf.zero_range(gap.clone());
            }
        }
        let pinned = self.pin_all(&mut data)?;
        if let Some(transport) = transport {
            let attached = transport
                .attach(id, desc.device, &ranges, desc.placement, data.host_state())
                .and_then(|()| zero_device_padding(transport, id, desc.placement, &padding));
            if let Err(e) = attached {
                transport.detach(id);
                self.unpin_all(pinned.into_iter());
                return Err(e);
            }
        }
        let speculative_dtypes = data.master.dtype() == DType::F32 && o.moment_dtype == DType::F32;
        let published_dtype = desc.device.map(|d| d.dtype).or(o.copy_dtype).unwrap_or(data.master.dtype());
        let mut pinned = pinned;
        let sg = Arc::new(SubGroup {
            id,
            group: desc.group,
            numel,
            slices: ranges,
            mode: o.mode,
            bias_correction: o.bias_correction,
            speculative_dtypes,
            published_dtype,
            data: Mutex::new(data),
            late: Mutex::new(None),
        });
        let mut host_bytes = host_bytes;
        if self.provisions_at_registration() {
            match self.provide(t.reg.host_bytes() + host_bytes, std::slice::from_ref(&sg)) {
                Ok(mut provided) => {
                    let (bytes, pins) = provided.pop().expect("one sub-group");
                    host_bytes += bytes;
                    pinned.extend(pins);
                }
                Err(e) => {
                    if let Some(transport) = transport {
                        transport.detach(id);
                    }
                    self.unpin_all(pinned.into_iter());
                    return Err(e);
                }
            }
        }
        let first = t.reg.slices.len();
        for (index, s) in slices.iter().enumerate() {
            let slice_id = t.reg.slices.len() as u32;
            t.reg.names.insert(s.name.clone(), slice_id);
            t.reg.slices.push(SliceInfo { name: s.name.clone(), sg: id, index, range: s.offset..s.offset + s.numel });
        }
        t.reg.host_bytes += host_bytes;
        let slice_ids = first..t.reg.slices.len();
        t.subgroup_added(slice_ids.len());
        self.shared.sched.add_subgroup(id);
        t.reg.subgroups.push(Some(SgTrack { sg, slices: slice_ids, final_ticket: 0, borrowed, host_bytes, pinned }));
        if !self.provisions_at_registration() {
            t.reg.unprovisioned.push(id);
        }
        Ok(id)
    }

    /// Unregisters a sub-group (between steps), after its outstanding work; its borrowed
    /// buffers are no longer used when this returns.
    pub fn remove_subgroup(&self, sg: u32) -> Result<()> {
        let mut t = self.lock();
        if t.phase != Phase::Idle {
            return Err(state_error("sub-groups can only be removed between steps"));
        }
        t.reg.track(sg)?;
        self.shared.tickets.drain();
        let track = t.reg.subgroups[sg as usize].take().expect("checked");
        t.reg.unprovisioned.retain(|&u| u != sg);
        self.forget(&mut t, track);
        Ok(())
    }

    /// Releases a sub-group taken out of the registry: its buffers, pins, slice names.
    fn forget(&self, t: &mut super::Tracking, track: SgTrack) {
        let bytes = self.release(&track);
        for i in track.slices {
            let name = std::mem::take(&mut t.reg.slices[i].name);
            t.reg.names.remove(&name);
        }
        t.reg.host_bytes -= bytes;
        self.shared.sched.remove_subgroup(track.sg.id);
    }

    /// Detaches a sub-group from the transport and unpins its buffers; the host bytes it held.
    fn release(&self, track: &SgTrack) -> usize {
        let mut bytes = track.host_bytes;
        let late = track.sg.late.lock().unwrap().take();
        if let Some(transport) = self.shared.transport() {
            transport.detach(track.sg.id);
            for &ptr in &track.pinned {
                transport.unpin(ptr as *mut u8);
            }
        }
        if let Some(mut late) = late {
            bytes += late.buffer.bytes();
            if let Some(transport) = self.shared.transport() {
                transport.unpin(late.buffer.as_mut_ptr());
            }
        }
        bytes
    }

    /// Releases every sub-group (the session is being destroyed; its thread has stopped).
    pub(crate) fn release_all(&self, t: &mut super::Tracking) {
        for track in t.reg.subgroups.iter().flatten() {
            self.release(track);
        }
    }

    /// Pins, through the transport, the buffers of a new sub-group that cross to the device:
    /// the master weights and a lent gradient buffer. Undone on failure.
    fn pin_all(&self, data: &mut SgData) -> Result<Vec<usize>> {
        let mut pinned = Vec::new();
        for buf in std::iter::once(&mut data.master).chain(data.grad.as_mut()) {
            match self.pin_buffer(buf) {
                Ok(p) => pinned.extend(p),
                Err(e) => {
                    self.unpin_all(pinned.into_iter());
                    return Err(e);
                }
            }
        }
        Ok(pinned)
    }

    /// Pins a buffer through the transport, if there is one; its address.
    pub(crate) fn pin_buffer(&self, buf: &mut HostBuf) -> Result<Option<usize>> {
        let Some(transport) = self.shared.transport() else { return Ok(None) };
        let ptr = buf.as_mut_ptr();
        transport.pin(ptr, buf.bytes())?;
        Ok(Some(ptr as usize))
    }

    pub(crate) fn unpin_all(&self, pins: impl Iterator<Item = usize>) {
        if let Some(transport) = self.shared.transport() {
            for p in pins {
                transport.unpin(p as *mut u8);
            }
        }
    }

    /// Pins a buffer the session allocates on the fly (late gradients).
    pub(crate) fn pinned(&self, mut buf: HostBuf) -> Result<HostBuf> {
        if let Some(transport) = self.shared.transport() {
            transport.pin(buf.as_mut_ptr(), buf.bytes())?;
        }
        Ok(buf)
    }

    /// Accounts `bytes` more host memory, within the limit.
    pub(crate) fn take_memory(&self, t: &mut super::Tracking, bytes: usize) -> Result<()> {
        t.reg.check_memory(self.options.host_memory_limit, bytes)?;
        t.reg.host_bytes += bytes;
        Ok(())
    }

    /// The slice id of a name.
    pub fn slice_id(&self, name: &str) -> Result<u32> {
        self.lock()
            .reg
            .names
            .get(name)
            .copied()
            .ok_or_else(|| Error::new(Status::NotFound, format!("no slice is named {name:?}")))
    }

    /// Copies a slice's master weights into `out` (one element per element of the slice,
    /// rounded to nearest even where `out` is narrower) once its sub-group's latest step is
    /// final: waits for that sub-group's final ticket alone, not for the sub-groups after it.
    /// The weights a forward reads next, for a caller whose parameters are apart from the
    /// master weights (the XLA handlers). Host sessions only: a session with a device
    /// transport publishes to the device.
    pub fn read_slice_weights(&self, slice: u32, out: FloatsMut<'_>) -> Result<()> {
        if self.shared.transport().is_some() {
            return Err(Error::unsupported(
                "a session with a device transport publishes its weights to the device: read them there",
            ));
        }
        let (sg, range, final_ticket) = {
            let t = self.lock();
            let info = t.reg.slice(slice, Some(out.len()))?;
            let track = t.reg.track(info.sg)?;
            (Arc::clone(&track.sg), info.range.clone(), track.final_ticket)
        };
        self.wait(final_ticket, None)?;
        let data = sg.data.lock().unwrap();
        kernels::copy_into(out, data.master.range(range), false, None).map(drop)
    }

    /// Host bytes the session allocated (moments, gradient buffers, copies, late gradients).
    pub fn host_bytes(&self) -> usize {
        self.lock().reg.host_bytes
    }

    /// Device bytes the transport allocated (0 in host mode).
    pub fn device_bytes(&self) -> usize {
        self.shared.transport().map_or(0, |t| t.device_bytes())
    }

    /// The ticket that completes when the sub-group's latest step is final (0 before its
    /// first `step()`).
    pub fn final_ticket(&self, sg: u32) -> Result<Ticket> {
        Ok(self.lock().reg.track(sg)?.final_ticket)
    }

    /// The sub-group whose latest final ticket `ticket` is, if any: a wait for it needs that
    /// sub-group's publication alone.
    pub fn final_ticket_of(&self, ticket: Ticket) -> Option<u32> {
        let t = self.lock();
        t.reg.live().find(|tr| tr.final_ticket == ticket).map(|tr| tr.sg.id)
    }

    /// Steps the sub-group has taken (skipped steps do not count). Read it after the
    /// sub-group's final ticket for the count after a step.
    pub fn step_count(&self, sg: u32) -> Result<u64> {
        let t = self.lock();
        Ok(t.reg.track(sg)?.sg.data.lock().unwrap().work.step_count)
    }

    /// Sets a sub-group's step count (between steps), e.g. after writing its state from a
    /// torch-style optimizer state dict.
    pub fn set_step_count(&self, sg: u32, count: u64) -> Result<()> {
        let t = self.lock();
        if t.phase != Phase::Idle {
            return Err(state_error("step counts are set between steps"));
        }
        let track = t.reg.track(sg)?;
        self.shared.tickets.drain();
        track.sg.data.lock().unwrap().work.step_count = count;
        Ok(())
    }

    /// Copies of a sub-group's moments, as f32 (waits for its outstanding work first).
    pub fn moments(&self, sg: u32) -> Result<(Vec<f32>, Vec<f32>)> {
        let t = self.lock();
        let track = t.reg.track(sg)?;
        self.shared.tickets.drain();
        let mut data = track.sg.data.lock().unwrap();
        self.sync_device_state(track.sg.id, &mut data)?;
        Ok((to_f32(data.exp_avg.floats()), to_f32(data.exp_avg_sq.floats())))
    }

    /// Brings a device-placed sub-group's state into its host buffers.
    pub(crate) fn sync_device_state(&self, sg: u32, data: &mut SgData) -> Result<()> {
        match (data.placement, self.shared.transport()) {
            (Placement::Device, Some(t)) => t.download_state(sg, data.host_state()),
            _ => Ok(()),
        }
    }

    /// A sub-group's state buffers (see [`SubGroupState`]), after its outstanding work.
    pub fn subgroup_state(&self, sg: u32) -> Result<SubGroupState> {
        let t = self.lock();
        let track = t.reg.track(sg)?;
        self.shared.tickets.drain();
        let mut data = track.sg.data.lock().unwrap();
        self.sync_device_state(track.sg.id, &mut data)?;
        Ok(SubGroupState {
            placement: data.placement,
            numel: track.sg.numel,
            master: data.master.as_mut_ptr(),
            exp_avg: data.exp_avg.as_mut_ptr(),
            exp_avg_sq: data.exp_avg_sq.as_mut_ptr(),
            master_dtype: data.master.dtype(),
            moment_dtype: data.exp_avg.dtype(),
            step_count: data.work.step_count,
        })
    }

    /// Moves a sub-group's master weights and moments to `placement` (between steps), bit
    /// for bit; its host buffers hold the state whenever it is on the host.
    pub fn set_placement(&self, sg: u32, placement: Placement) -> Result<()> {
        let t = self.lock();
        if t.phase != Phase::Idle {
            return Err(state_error("placement changes between steps"));
        }
        self.place(&t, sg, placement)
    }

    pub(crate) fn place(&self, t: &super::Tracking, sg: u32, placement: Placement) -> Result<()> {
        let track = t.reg.track(sg)?;
        let Some(transport) = self.shared.transport() else {
            return if placement == Placement::Host {
                Ok(())
            } else {
                Err(Error::unsupported("device placement needs a CUDA session"))
            };
        };
        self.shared.tickets.drain();
        let mut data = track.sg.data.lock().unwrap();
        if data.placement == placement {
            return Ok(());
        }
        if placement == Placement::Device && data.master.dtype() != DType::F32 {
            return Err(Error::unsupported("device placement needs f32 master weights"));
        }
        transport.set_placement(sg, placement, data.host_state())?;
        zero_device_padding(transport, sg, placement, &padding(&track.sg.slices, track.sg.numel))?;
        if placement == Placement::Host {
            // The host master is current again: stage and publish it as the model's weights
            // are (the device kernel published the same values already).
            data.copy_from_master(&self.shared.pool)?;
        }
        data.placement = placement;
        Ok(())
    }

    /// Sub-groups placed on the device.
    pub fn device_subgroups(&self) -> u32 {
        let t = self.lock();
        t.reg.live().filter(|tr| tr.sg.data.lock().unwrap().placement == Placement::Device).count() as u32
    }
}

/// Where a sub-group's state lives (from [`Session::subgroup_state`]). The pointers are the
/// session's (or the caller's borrowed) buffers: host memory, or device addresses when
/// `placement` is [`Placement::Device`] for the host copies, which are brought up to date
/// by the call. They stay valid until the sub-group is removed or the session destroyed.
#[derive(Clone, Copy, Debug)]
pub struct SubGroupState {
    pub placement: Placement,
    pub numel: usize,
    pub master: *mut u8,
    pub exp_avg: *mut u8,
    pub exp_avg_sq: *mut u8,
    pub master_dtype: DType,
    pub moment_dtype: DType,
    pub step_count: u64,
}

/// Slices must be named uniquely (across the session), non-empty, inside the sub-group
/// and pairwise disjoint.
fn check_slices(slices: &[SliceDesc], numel: usize, names: &HashMap<String, u32>) -> Result<()> {
    if slices.is_empty() {
        return Err(Error::invalid("a sub-group needs at least one slice"));
    }
    let mut order: Vec<&SliceDesc> = slices.iter().collect();
    order.sort_by_key(|s| s.offset);
    for (i, s) in order.iter().enumerate() {
        if s.name.is_empty() {
            return Err(Error::invalid("slice names must not be empty"));
        }
        if s.numel == 0 || s.offset.checked_add(s.numel).is_none_or(|end| end > numel) {
            return Err(Error::invalid(format!(
                "slice {:?} (offset {}, numel {}) is empty or outside the sub-group's {numel} elements",
                s.name, s.offset, s.numel
            )));
        }
        if names.contains_key(&s.name) || slices.iter().filter(|o| o.name == s.name).count() > 1 {
            return Err(Error::invalid(format!("slice name {:?} is used twice", s.name)));
        }
        if let Some(next) = order.get(i + 1)
            && s.offset + s.numel > next.offset
        {
            return Err(Error::new(Status::Aliasing, format!("slices {:?} and {:?} overlap", s.name, next.name)));
        }
    }
    Ok(())
}

/// A device-placed sub-group's gradient buffer is not initialised: its padding is zeroed
/// there too (hand-offs write the slices only).
fn zero_device_padding(
    transport: &dyn super::Transport,
    sg: u32,
    placement: Placement,
    padding: &[Range<usize>],
) -> Result<()> {
    if placement == Placement::Device {
        for gap in padding {
            transport.device_zero_gradient(sg, gap.clone())?;
        }
    }
    Ok(())
}

fn check_no_overlap(new: &[(&str, Range<usize>)], subgroups: &[Option<SgTrack>]) -> Result<()> {
    let overlaps = |a: &Range<usize>, b: &Range<usize>| a.start < b.end && b.start < a.end;
    for (i, (a_name, a)) in new.iter().enumerate() {
        if let Some((b_name, _)) = new[i + 1..].iter().find(|(_, b)| overlaps(a, b)) {
            return Err(Error::new(Status::Aliasing, format!("the {a_name} and the {b_name} overlap")));
        }
    }
    for (id, track) in subgroups.iter().enumerate() {
        let Some(track) = track else { continue };
        if track.borrowed.iter().any(|r| new.iter().any(|(_, n)| overlaps(n, r))) {
            return Err(Error::new(Status::Aliasing, format!("the buffers overlap those of sub-group {id}")));
        }
    }
    Ok(())
}
