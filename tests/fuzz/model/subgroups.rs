//! Sub-groups: registration with good and bad descriptions, removal, and slice ids.

use std::ffi::{CString, c_char, c_void};
use std::path::Path;

use superoffload::kernels::DType;

use super::{Check, Phase, Sess, SgM, SliceM, Stats, dtype_from_raw, judge};
use crate::common::{Rng, Store};
use crate::fuzz::api::{self, Status};
use crate::fuzz::mem::{RawBuf, set_bits, zeros};
use crate::fuzz::ops::*;

impl Sess {
    // ----- sub-groups -------------------------------------------------------------------

    pub fn add_subgroup(&mut self, spec: &SgSpec, stats: &mut Stats) -> Check {
        let o = self.opts.clone();
        let mdt = dtype_from_raw(spec.master_dtype);
        let esize = mdt.flatten().map_or(4, DType::size);
        let master = RawBuf::new(spec.numel * esize + 64);
        let mut rng = Rng::new(spec.seed);
        let init = mdt.flatten().map(|d| {
            let s = Store::from_f64(d, (0..spec.numel).map(|_| rng.normalish(0.5)).collect::<Vec<_>>().into_iter());
            master.write(&s);
            s
        });
        let grad_buf = spec.caller_grad.then(|| {
            let b = RawBuf::new(spec.numel * o.accum.size() + 64);
            // Junk the session must zero for slices without a gradient (and keeps elsewhere).
            let junk =
                Store::from_f64(o.accum, (0..spec.numel).map(|_| rng.normalish(0.01)).collect::<Vec<_>>().into_iter());
            b.write(&junk);
            (b, junk)
        });
        let other = match spec.bad {
            SgBad::OverlapOther(k) => self.sg(k).map(|sg| sg.master.ptr()),
            _ => None,
        };
        let master_ptr: *mut c_void = match spec.bad {
            SgBad::NullMaster => std::ptr::null_mut(),
            SgBad::Misaligned => master.ptr().wrapping_add(1).cast(),
            SgBad::OverlapOther(_) => other.unwrap_or(master.ptr()).cast(),
            _ => master.ptr().cast(),
        };
        let grad_ptr: *mut c_void = match (&grad_buf, spec.bad) {
            (_, SgBad::GradOverlapsMaster) => master_ptr,
            (Some((b, _)), SgBad::GradMisaligned) => b.ptr().wrapping_add(1).cast(),
            (Some((b, _)), _) => b.ptr().cast(),
            (None, _) => std::ptr::null_mut(),
        };
        let names: Vec<Option<CString>> = spec
            .slices
            .iter()
            .map(|s| match &s.name {
                NameSpec::Named(n) => Some(CString::new(n.as_str()).unwrap()),
                NameSpec::NonUtf8 => Some(CString::new(vec![b'x', 0xff, 0xfe]).unwrap()),
                NameSpec::Null => None,
            })
            .collect();
        let raw_slices: Vec<api::so_slice_desc> = spec
            .slices
            .iter()
            .zip(&names)
            .map(|(s, n)| api::so_slice_desc {
                name: n.as_ref().map_or(std::ptr::null(), |c| c.as_ptr() as *const c_char),
                offset: s.offset,
                numel: s.numel,
            })
            .collect();
        let mut d = api::subgroup_desc_default();
        if spec.bad == SgBad::Size {
            d.struct_size += 16;
        }
        d.group = spec.group;
        d.master = master_ptr;
        d.master_dtype = spec.master_dtype;
        d.numel = if spec.bad == SgBad::HugeNumel { usize::MAX / 2 } else { spec.numel };
        d.grad = grad_ptr;
        d.slices = if spec.bad == SgBad::NullSlices { std::ptr::null() } else { raw_slices.as_ptr() };
        d.num_slices = if spec.bad == SgBad::ZeroSlices { 0 } else { raw_slices.len() };
        if spec.bad == SgBad::DeviceParam {
            d.device_param = 0x1000;
        }
        d.placement = spec.placement;
        let mut out = 0xDEAD_BEEFu32;
        let st = unsafe {
            self.h.add_subgroup(
                if spec.bad == SgBad::NullDesc { std::ptr::null() } else { &d },
                if spec.bad == SgBad::NullOut { std::ptr::null_mut() } else { &mut out },
            )
        };
        api::count_call();

        // Every refusal that applies.
        let mut e = Vec::new();
        match spec.bad {
            SgBad::NullDesc | SgBad::NullOut | SgBad::NullMaster | SgBad::NullSlices | SgBad::ZeroSlices => {
                e.push(Status::NullArgument)
            }
            SgBad::Size => e.push(Status::StructSize),
            SgBad::Misaligned | SgBad::GradMisaligned | SgBad::DeviceParam | SgBad::HugeNumel => {
                e.push(Status::InvalidArgument)
            }
            SgBad::GradOverlapsMaster => e.push(Status::Aliasing),
            SgBad::OverlapOther(_) if other.is_some() => e.push(Status::Aliasing),
            _ => {}
        }
        if mdt.flatten().is_none() {
            e.push(Status::InvalidArgument);
        }
        match spec.placement {
            api::PLACE_HOST => {}
            api::PLACE_DEVICE => e.push(Status::Unsupported),
            _ => e.push(Status::InvalidArgument),
        }
        if spec.slices.iter().any(|s| s.name == NameSpec::Null) {
            e.push(Status::NullArgument);
        }
        if spec.slices.iter().any(|s| s.name == NameSpec::NonUtf8) {
            e.push(Status::InvalidArgument);
        }
        if self.phase != Phase::Idle {
            e.push(Status::InvalidState);
        }
        if spec.group as usize >= self.groups.len() {
            e.push(Status::NotFound);
        }
        if spec.numel == 0 {
            e.push(Status::InvalidArgument);
        }
        if spec.slices.is_empty() {
            e.push(Status::NullArgument);
        }
        let mut seen_names: Vec<&str> = Vec::new();
        for (i, s) in spec.slices.iter().enumerate() {
            if let NameSpec::Named(n) = &s.name {
                if n.is_empty() || self.names.contains_key(n) || seen_names.contains(&n.as_str()) {
                    e.push(Status::InvalidArgument);
                }
                seen_names.push(n);
            }
            if s.numel == 0 || s.offset.checked_add(s.numel).is_none_or(|end| end > spec.numel) {
                e.push(Status::InvalidArgument);
            }
            for t in &spec.slices[i + 1..] {
                if s.numel > 0 && t.numel > 0 && s.offset < t.offset + t.numel && t.offset < s.offset + s.numel {
                    e.push(Status::Aliasing);
                }
            }
        }
        let bytes = 2 * spec.numel * o.moment.size()
            + if spec.caller_grad { 0 } else { spec.numel * o.accum.size() }
            + o.copy.map_or(0, |c| spec.numel * c.size());
        if o.limit.is_some_and(|l| self.host_bytes + bytes > l) {
            e.push(Status::OutOfResources);
        }
        if spec.bad == SgBad::HugeNumel {
            e.extend([Status::OutOfResources, Status::Aliasing]);
        }
        if !judge("so_session_add_subgroup", st, &e)? {
            stats.refusals += 1;
            ensure!(out == 0xDEAD_BEEF, "add_subgroup wrote its out-parameter on failure");
            return self.refused(stats);
        }
        let id = self.sgs.len() as u32;
        ensure!(out == id, "add_subgroup returned {out}, model {id}");
        let dtype = mdt.flatten().unwrap();
        let mut covered = vec![false; spec.numel];
        let mut slice_ids = Vec::new();
        for s in &spec.slices {
            let NameSpec::Named(name) = &s.name else { unreachable!() };
            let sid = self.slices.len() as u32;
            self.names.insert(name.clone(), sid);
            self.slices.push(SliceM {
                name: name.clone(),
                sg: id,
                range: s.offset..s.offset + s.numel,
                alive: true,
                seen: 0,
            });
            slice_ids.push(sid);
            covered[s.offset..s.offset + s.numel].fill(true);
        }
        let (grad_buf, mut g) = match grad_buf {
            Some((b, junk)) => (Some(b), junk),
            None => (None, zeros(o.accum, spec.numel)),
        };
        // Elements outside every slice are padding, zeroed at registration.
        let mut p = init.unwrap();
        for i in (0..spec.numel).filter(|&i| !covered[i]) {
            set_bits(&mut p, i, 0);
            set_bits(&mut g, i, 0);
        }
        self.host_bytes += bytes;
        self.sgs.push(Some(SgM {
            id,
            group: spec.group,
            numel: spec.numel,
            master_dtype: dtype,
            master,
            grad_buf,
            slices: slice_ids,
            covered,
            g,
            late: None,
            late_merged: false,
            p,
            m: zeros(o.moment, spec.numel),
            v: zeros(o.moment, spec.numel),
            known: vec![true; spec.numel],
            count: 0,
            count_prev: 0,
            approx: None,
            slices_done: 0,
            submitted: None,
            final_ticket: 0,
            final_waited: true,
            host_bytes: bytes,
            late_bytes: 0,
        }));
        Ok(())
    }

    pub(super) fn remove_subgroup(&mut self, id: u32, stats: &mut Stats, scratch: &Path) -> Check {
        if self.phase == Phase::Idle {
            self.settle(stats, scratch, None, false)?;
        }
        let st = unsafe { self.h.remove_subgroup(id) };
        api::count_call();
        let mut e = Vec::new();
        if self.phase != Phase::Idle {
            e.push(Status::InvalidState);
        }
        if self.sg(id).is_none() {
            e.push(Status::NotFound);
        }
        if !judge("so_session_remove_subgroup", st, &e)? {
            stats.refusals += 1;
            return self.refused(stats);
        }
        self.drained();
        let sg = self.sgs[id as usize].take().unwrap();
        // It is the caller's again: the session left its weights as they were.
        sg.check_master(" by remove_subgroup")?;
        self.host_bytes -= sg.host_bytes + sg.late_bytes;
        for &sl in &sg.slices {
            let s = &mut self.slices[sl as usize];
            s.alive = false;
            self.names.remove(&s.name);
        }
        Ok(())
    }

    pub(super) fn slice_id(&mut self, name: &NameSpec, stats: &mut Stats) -> Check {
        let c = match name {
            NameSpec::Named(n) => Some(CString::new(n.as_str()).unwrap()),
            NameSpec::NonUtf8 => Some(CString::new(vec![0xffu8]).unwrap()),
            NameSpec::Null => None,
        };
        let mut out = 0xDEAD_BEEFu32;
        let st = unsafe { self.h.slice_id(c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()), &mut out) };
        api::count_call();
        let errs = match name {
            NameSpec::Null => vec![Status::NullArgument],
            NameSpec::NonUtf8 => vec![Status::InvalidArgument, Status::NotFound],
            NameSpec::Named(n) if !self.names.contains_key(n) => vec![Status::NotFound],
            NameSpec::Named(_) => vec![],
        };
        if !judge("so_session_slice_id", st, &errs)? {
            stats.refusals += 1;
            ensure!(out == 0xDEAD_BEEF, "slice_id wrote its out-parameter on failure");
            return Ok(());
        }
        let NameSpec::Named(n) = name else { unreachable!() };
        ensure!(out == self.names[n], "slice {n}: id {out}, model {}", self.names[n]);
        Ok(())
    }
}
