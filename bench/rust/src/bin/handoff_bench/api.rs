//! The two APIs under test, each with its own session: the Rust API (`Session::grad_copy`)
//! and the C API (`so_session_grad_copy`), and what their steps measured.

use std::sync::Arc;
use std::time::{Duration, Instant};

use superoffload::error::Status;
use superoffload::ffi::session as c;
use superoffload::kernels::{DType, Floats, Pool};
use superoffload::session::{
    Borrowed, GroupHparams, NormSource, Session, SessionOptions, SliceDesc, Speculation, StepArgs, SubGroupDesc,
};

use crate::counters::{all_allocs, context_switches, my_allocs};
use crate::model::Model;

/// `Ok`, or the error of a C API call with the library's last error message.
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

/// One API's session and what its steps measured.
pub struct Api {
    pub name: &'static str,
    rust: Option<Session>,
    c_session: *mut c::so_session,
    _masters: Vec<Vec<f32>>,
    ids: Vec<u32>,
    /// Per measured call: (slice index, ns, completed a sub-group, preempted during it).
    pub calls: Vec<(usize, f64, bool, bool)>,
    pub step_ms: Vec<f64>,
    /// Per measured step: allocations by the training thread inside the hand-offs.
    pub my_allocs: Vec<u64>,
    /// ... and by every other thread in the same window.
    pub other_allocs: Vec<u64>,
    /// Allocations by the training thread, per call kind: (completing, other).
    pub alloc_calls: (u64, u64),
    pub alloc_count: (u64, u64),
    /// Context switches of the training thread inside the measured hand-offs.
    pub switches: (i64, i64),
}

impl Api {
    pub fn new_rust(m: &Model, pool: &Arc<Pool>, speculation: bool) -> Result<Api, String> {
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

    pub fn new_c(m: &Model, cores: &[usize], speculation: bool) -> Result<Api, String> {
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
    pub fn step(&mut self, grads: &[Vec<f32>], measure: bool, expected: usize) -> Result<(), String> {
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
        // Without clipping every speculative step is kept; `kept` counts the cancelled ones too
        // (not started at step(): their final pass takes the update).
        let (speculative, kept, cancelled, late) = self.finish()?;
        if late != 0 || (speculative as usize == expected && kept as usize != expected) {
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
    pub fn late_step(&mut self, grads: &[Vec<f32>], late: usize) -> Result<(u64, u32, Duration), String> {
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
