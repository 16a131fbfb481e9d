//! What a session holds between steps: param groups, named slices, sub-groups (their
//! buffers, pins and device attachment) and the host-memory account.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::buffers::{Borrowed, HostBuf};
use super::provision::{self, check_host_allocation, padding};
use super::shared::Shared;
use super::subgroup::{SgData, SgWork, SubGroup};
use super::tickets::Ticket;
use super::transport::Transport;
use super::types::{GroupHparams, Placement, SessionOptions, SliceDesc, SubGroupDesc};
use crate::error::{Error, Result, Status};
use crate::kernels::{DType, Floats};

/// A registered slice: a record the registry keeps and lends out.
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
    sg: Arc<SubGroup>,
    /// Its slices' ids.
    slices: Range<usize>,
    /// The ticket after which the latest step of this sub-group is final (0 before any).
    final_ticket: Ticket,
    /// Borrowed address ranges (master, gradient, moments), for overlap checks.
    borrowed: Vec<Range<usize>>,
    host_bytes: usize,
    /// Host buffers the transport pinned for this sub-group (addresses).
    pinned: Vec<usize>,
}

impl SgTrack {
    pub(crate) fn sg(&self) -> &Arc<SubGroup> {
        &self.sg
    }

    /// The ids of its slices.
    pub(crate) fn slice_ids(&self) -> Range<usize> {
        self.slices.clone()
    }

    /// The ticket after which its latest step is final (0 before any).
    pub(crate) fn final_ticket(&self) -> Ticket {
        self.final_ticket
    }

    /// Detaches the sub-group from the transport and unpins its buffers; the host bytes it held.
    fn release(&self, shared: &Shared) -> usize {
        let mut bytes = self.host_bytes;
        let late = self.sg.late.lock().unwrap().take();
        if let Some(transport) = shared.transport() {
            transport.detach(self.sg.id);
            for &ptr in &self.pinned {
                transport.unpin(ptr as *mut u8);
            }
        }
        if let Some(mut late) = late {
            bytes += late.buffer.bytes();
            if let Some(transport) = shared.transport() {
                transport.unpin(late.buffer.as_mut_ptr());
            }
        }
        bytes
    }
}

#[derive(Default)]
pub(crate) struct Registry {
    groups: Vec<GroupHparams>,
    slices: Vec<SliceInfo>,
    names: HashMap<String, u32>,
    subgroups: Vec<Option<SgTrack>>,
    host_bytes: usize,
    /// Sub-groups registered but not yet provisioned (`provision.rs`), in registration order.
    unprovisioned: Vec<u32>,
    /// Device bytes of the sub-groups registered with their moments page-locked, as the
    /// split may place them ([`Registry::may_be_placed`]).
    placeable_bytes: usize,
}

impl Registry {
    /// Adds a group of hyperparameters the caller validated ([`GroupHparams::validate`]).
    pub(crate) fn add_group(&mut self, hparams: GroupHparams) -> u32 {
        self.groups.push(hparams);
        self.groups.len() as u32 - 1
    }

    /// Sets a group's hyperparameters, which the caller validated.
    pub(crate) fn set_group(&mut self, group: u32, hparams: GroupHparams) -> Result<()> {
        let slot = self.groups.get_mut(group as usize).ok_or_else(|| unknown("group", group))?;
        *slot = hparams;
        Ok(())
    }

    pub(crate) fn group(&self, group: u32) -> Result<GroupHparams> {
        self.groups.get(group as usize).copied().ok_or_else(|| unknown("group", group))
    }

    /// Every group's hyperparameters, by id.
    pub(crate) fn groups(&self) -> &[GroupHparams] {
        &self.groups
    }

    /// Replaces every group's hyperparameters (a checkpoint's, one per group).
    pub(crate) fn replace_groups(&mut self, groups: Vec<GroupHparams>) {
        self.groups = groups;
    }

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

    /// A slice's name, for messages: empty once its sub-group was removed, `?` for an id never
    /// issued.
    pub(crate) fn slice_name(&self, slice: u32) -> &str {
        self.slices.get(slice as usize).map_or("?", |s| s.name.as_str())
    }

    /// A registered sub-group's slices, in order, with their ids.
    pub(crate) fn slices_of<'a>(&'a self, track: &SgTrack) -> impl Iterator<Item = (usize, &'a SliceInfo)> + use<'a> {
        track.slice_ids().map(|i| (i, &self.slices[i]))
    }

    /// The slice id of a name.
    pub(crate) fn slice_id(&self, name: &str) -> Result<u32> {
        self.names.get(name).copied().ok_or_else(|| Error::new(Status::NotFound, format!("no slice is named {name:?}")))
    }

    /// Host bytes the session allocated.
    pub(crate) fn host_bytes(&self) -> usize {
        self.host_bytes
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

    /// Accounts `bytes` more host memory, within `limit`.
    pub(crate) fn take_memory(&mut self, limit: Option<usize>, bytes: usize) -> Result<()> {
        self.check_memory(limit, bytes)?;
        self.host_bytes += bytes;
        Ok(())
    }

    /// Registers a sub-group (the caller checked that no step is in progress); its id.
    pub(crate) fn add_subgroup(&mut self, desc: SubGroupDesc, shared: &Shared) -> Result<u32> {
        let o = &shared.options;
        if desc.group as usize >= self.groups.len() {
            return Err(unknown("group", desc.group));
        }
        let transport = shared.transport();
        if transport.is_none() && desc.device.is_some() {
            return Err(Error::invalid("a device parameter is set but this is a host session"));
        }
        if desc.placement == Placement::Device && transport.is_none() {
            return Err(Error::unsupported("device placement needs a CUDA session"));
        }
        let id = self.subgroups.len() as u32;
        let master = HostBuf::borrowed(desc.master);
        let numel = master.len();
        if numel == 0 {
            return Err(Error::invalid("the master buffer has 0 elements"));
        }
        if desc.placement == Placement::Device && master.dtype() != DType::F32 {
            return Err(Error::unsupported("device placement needs f32 master weights"));
        }
        let caller_buffer = |b: Option<Borrowed>, what: &str, dtype: DType| -> Result<Option<HostBuf>> {
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
        let copy = match (desc.copy, o.copy_dtype) {
            (None, _) => None,
            (Some(_), _) if transport.is_some() => {
                return Err(Error::unsupported("a caller copy buffer needs a host session (a CUDA session publishes)"));
            }
            (Some(_), None) => {
                return Err(Error::invalid("a copy buffer is set but the session keeps no copy (copy_dtype)"));
            }
            (Some(b), Some(dtype)) => caller_buffer(Some(b), "copy", dtype)?,
        };
        check_slices(&desc.slices, numel, &self.names)?;
        let labelled: Vec<(&str, Range<usize>)> = [
            ("master buffer", Some(&master)),
            ("gradient buffer", grad.as_ref()),
            ("exp_avg buffer", exp_avg.as_ref()),
            ("exp_avg_sq buffer", exp_avg_sq.as_ref()),
            ("copy buffer", copy.as_ref()),
        ]
        .into_iter()
        .filter_map(|(name, b)| b.map(|b| (name, b.addr_range())))
        .collect();
        check_no_overlap(&labelled, &self.subgroups)?;
        let borrowed: Vec<Range<usize>> = labelled.into_iter().map(|(_, r)| r).collect();

        // The moments now; the gradient buffer and the copy when the sub-group is provisioned.
        let owned = |b: &Option<HostBuf>| if b.is_none() { numel * o.moment_dtype.size() } else { 0 };
        let host_bytes = owned(&exp_avg) + owned(&exp_avg_sq);
        self.check_memory(o.host_memory_limit, host_bytes)?;
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
            copy,
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
        let placeable = self.may_be_placed(numel, data.master.dtype(), shared);
        let pinned = pin_all(shared, &mut data, placeable)?;
        if let Some(transport) = transport {
            let attached = transport
                .attach(id, desc.device, &ranges, desc.placement, data.host_state())
                .and_then(|()| zero_device_padding(transport, id, desc.placement, &padding));
            if let Err(e) = attached {
                transport.detach(id);
                shared.unpin_all(pinned.into_iter());
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
        let at_registration = provision::at_registration(shared);
        if at_registration {
            match provision::provide(shared, self.host_bytes + host_bytes, std::slice::from_ref(&sg)) {
                Ok(mut provided) => {
                    let (bytes, pins) = provided.pop().expect("one sub-group");
                    host_bytes += bytes;
                    pinned.extend(pins);
                }
                Err(e) => {
                    if let Some(transport) = transport {
                        transport.detach(id);
                    }
                    shared.unpin_all(pinned.into_iter());
                    return Err(e);
                }
            }
        }
        let first = self.slices.len();
        for (index, s) in slices.iter().enumerate() {
            let slice_id = self.slices.len() as u32;
            self.names.insert(s.name.clone(), slice_id);
            self.slices.push(SliceInfo { name: s.name.clone(), sg: id, index, range: s.offset..s.offset + s.numel });
        }
        self.host_bytes += host_bytes;
        if placeable {
            self.placeable_bytes += numel * o.device_bytes_per_element();
        }
        let slice_ids = first..self.slices.len();
        shared.sched.add_subgroup(id);
        self.subgroups.push(Some(SgTrack { sg, slices: slice_ids, final_ticket: 0, borrowed, host_bytes, pinned }));
        if !at_registration {
            self.unprovisioned.push(id);
        }
        Ok(id)
    }

    /// Whether the split may place a new sub-group of `numel` elements with `master` weights
    /// on the device: the sub-groups registered before it (the split places the first ones in
    /// forward order) and it fit the budget, or with the automatic budget the device's total
    /// memory. Its moments are then page-locked at registration, so that a placement copies
    /// them at the link's rate beside the step (from pageable memory the driver copies at
    /// about a ninth of it, and the step begins only once it is done).
    fn may_be_placed(&self, numel: usize, master: DType, shared: &Shared) -> bool {
        let options = &shared.options;
        let cap = match options.gpu_budget_bytes {
            _ if master != DType::F32 => return false,
            0 => return false,
            SessionOptions::GPU_BUDGET_AUTO => match shared.transport().map(Transport::device_memory) {
                Some(Ok((_, total))) => total,
                _ => return false,
            },
            budget => budget,
        };
        self.placeable_bytes.saturating_add(numel.saturating_mul(options.device_bytes_per_element())) <= cap
    }

    /// Unregisters a sub-group (the caller checked that no step is in progress), after its
    /// outstanding work: its buffers, pins and slice names are released.
    pub(crate) fn remove_subgroup(&mut self, sg: u32, shared: &Shared) -> Result<()> {
        self.track(sg)?;
        shared.tickets.drain();
        let track = self.subgroups[sg as usize].take().expect("checked");
        self.unprovisioned.retain(|&u| u != sg);
        let bytes = track.release(shared);
        for i in track.slices {
            let name = std::mem::take(&mut self.slices[i].name);
            self.names.remove(&name);
        }
        self.host_bytes -= bytes;
        shared.sched.remove_subgroup(track.sg.id);
        Ok(())
    }

    /// Releases every sub-group (the session is being destroyed; its thread has stopped).
    pub(crate) fn release_all(&self, shared: &Shared) {
        for track in self.live() {
            track.release(shared);
        }
    }

    /// Provisions the sub-groups registered since the last time ([`provision::provide`]). On
    /// failure they stay unprovisioned and nothing of it stays allocated.
    pub(crate) fn provision_pending(&mut self, shared: &Shared) -> Result<()> {
        if self.unprovisioned.is_empty() {
            return Ok(());
        }
        let sgs: Vec<Arc<SubGroup>> =
            self.unprovisioned.iter().map(|&id| self.track(id).expect("registered").sg.clone()).collect();
        let provided = provision::provide(shared, self.host_bytes, &sgs)?;
        for (sg, (bytes, pins)) in sgs.iter().zip(provided) {
            let track = self.subgroups[sg.id as usize].as_mut().expect("registered");
            track.host_bytes += bytes;
            track.pinned.extend(pins);
            self.host_bytes += bytes;
        }
        self.unprovisioned.clear();
        Ok(())
    }

    /// Gives every live sub-group its final ticket of the step, `issue(id)`, in registration
    /// (forward) order; the sub-groups with their tickets.
    pub(crate) fn issue_final_tickets(&mut self, mut issue: impl FnMut(u32) -> Ticket) -> Vec<(Arc<SubGroup>, Ticket)> {
        let mut subgroups = Vec::new();
        for track in self.subgroups.iter_mut().flatten() {
            track.final_ticket = issue(track.sg.id);
            subgroups.push((track.sg.clone(), track.final_ticket));
        }
        subgroups
    }

    /// The ticket that completes when the sub-group's latest step is final.
    pub(crate) fn final_ticket(&self, sg: u32) -> Result<Ticket> {
        Ok(self.track(sg)?.final_ticket)
    }

    /// The sub-group whose latest final ticket `ticket` is, if any.
    pub(crate) fn final_ticket_of(&self, ticket: Ticket) -> Option<u32> {
        self.live().find(|tr| tr.final_ticket == ticket).map(|tr| tr.sg.id)
    }

    pub(crate) fn step_count(&self, sg: u32) -> Result<u64> {
        Ok(self.track(sg)?.sg.data.lock().unwrap().work.step_count)
    }

    /// Sets a sub-group's step count (the caller checked that no step is in progress), after
    /// its outstanding work.
    pub(crate) fn set_step_count(&self, sg: u32, count: u64, shared: &Shared) -> Result<()> {
        let track = self.track(sg)?;
        shared.tickets.drain();
        track.sg.data.lock().unwrap().work.step_count = count;
        Ok(())
    }

    /// Copies of a sub-group's moments, as f32, after its outstanding work.
    pub(crate) fn moments(&self, sg: u32, shared: &Shared) -> Result<(Vec<f32>, Vec<f32>)> {
        let track = self.track(sg)?;
        shared.tickets.drain();
        let mut data = track.sg.data.lock().unwrap();
        data.download_device_state(track.sg.id, shared.transport())?;
        Ok((to_f32(data.exp_avg.floats()), to_f32(data.exp_avg_sq.floats())))
    }

    /// A sub-group's state buffers, after its outstanding work.
    pub(crate) fn subgroup_state(&self, sg: u32, shared: &Shared) -> Result<SubGroupState> {
        let track = self.track(sg)?;
        shared.tickets.drain();
        let mut data = track.sg.data.lock().unwrap();
        data.download_device_state(track.sg.id, shared.transport())?;
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

    /// Moves a sub-group's master weights and moments to `placement` (the caller checked that
    /// no step is in progress), bit for bit; its host buffers hold the state whenever it is on
    /// the host. It waits for this sub-group's outstanding work only (its final and state
    /// passes), so that the first sub-groups are placed while the last ones' passes still run.
    pub(crate) fn place(&self, sg: u32, placement: Placement, shared: &Shared) -> Result<()> {
        let track = self.track(sg)?;
        let Some(transport) = shared.transport() else {
            return if placement == Placement::Host {
                Ok(())
            } else {
                Err(Error::unsupported("device placement needs a CUDA session"))
            };
        };
        shared.caller_wait_idle(sg, track.final_ticket);
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
            data.copy_from_master(&shared.pool)?;
        }
        data.placement = placement;
        Ok(())
    }

    /// Sub-groups placed on the device.
    pub(crate) fn device_subgroups(&self) -> u32 {
        self.live().filter(|tr| tr.sg.data.lock().unwrap().placement == Placement::Device).count() as u32
    }
}

fn unknown(what: &str, id: u32) -> Error {
    Error::new(Status::NotFound, format!("no {what} has id {id}"))
}

fn to_f32(values: Floats<'_>) -> Vec<f32> {
    match values {
        Floats::F32(v) => v.to_vec(),
        Floats::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        Floats::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
    }
}

/// Pins, through the transport, the buffers of a new sub-group that cross to the device:
/// the master weights and a lent gradient buffer (undone on failure), and, where it can, the
/// moments of one the split may place (they only make its placement faster: unpinned, the
/// driver copies them from pageable memory).
fn pin_all(shared: &Shared, data: &mut SgData, placeable: bool) -> Result<Vec<usize>> {
    let mut pinned = Vec::new();
    for buf in std::iter::once(&mut data.master).chain(data.grad.as_mut()) {
        match shared.pin(buf) {
            Ok(p) => pinned.extend(p),
            Err(e) => {
                shared.unpin_all(pinned.into_iter());
                return Err(e);
            }
        }
    }
    if placeable {
        for buf in [&mut data.exp_avg, &mut data.exp_avg_sq] {
            if let Ok(p) = shared.pin(buf) {
                pinned.extend(p);
            }
        }
    }
    Ok(pinned)
}

/// Where a sub-group's state lives (from
/// [`Session::subgroup_state`](super::Session::subgroup_state)). The pointers are the
/// session's (or the caller's borrowed) buffers: host memory, or device addresses when
/// `placement` is [`Placement::Device`] for the host copies, which are brought up to date
/// by the call. They stay valid until the sub-group is removed or the session destroyed.
/// Fields as [`so_subgroup_state`](crate::ffi::session::so_subgroup_state) documents them, in
/// Rust types.
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
    transport: &dyn Transport,
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
