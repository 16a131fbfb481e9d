//! The adapter: the only place where the reliability tests call the session's C API (the
//! `extern "C"` functions the crate exports, called directly so that the C boundary is what
//! is exercised). When the ABI changes (speculation enum, placement, out-of-order tickets),
//! this file is what needs adapting.

use std::ffi::{CString, c_char, c_void};

pub use superoffload::error::Status;
use superoffload::ffi::pool as cp;
use superoffload::ffi::session as c;
pub use superoffload::ffi::session::{
    so_group_hparams, so_loss_scaler_options, so_session, so_session_options, so_slice_desc, so_step_args,
    so_step_result, so_subgroup_desc,
};
use superoffload::ffi::tickets as tk;

pub type Ticket = u64;

thread_local! {
    static CALLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts one C call made on this thread (for the figures the tests report).
pub fn count_call() {
    CALLS.with(|c| c.set(c.get() + 1));
}

/// C calls counted on this thread so far.
pub fn calls() -> u64 {
    CALLS.with(|c| c.get())
}

/// Raw values of `so_dtype`, `so_adam_mode`, `so_norm_source`, `so_skip_reason`.
pub const DT_NONE: u32 = 0;
pub const DT_F32: u32 = 1;
pub const DT_BF16: u32 = 2;
pub const DT_F16: u32 = 3;
pub const MODE_ADAMW: u32 = 1;
pub const MODE_L2: u32 = 2;
pub const NORM_LOCAL: u32 = 1;
pub const NORM_GIVEN: u32 = 2;
pub const SKIP_NONE: u32 = 0;
pub const SKIP_OVERFLOW: u32 = 1;
pub const SKIP_NON_FINITE_GRADIENT: u32 = 2;
pub const SKIP_NON_FINITE_NORM: u32 = 3;
pub const SKIP_UNUSABLE_FACTOR: u32 = 4;

pub fn session_options_default() -> so_session_options {
    c::so_session_options_default()
}
pub fn group_hparams_default() -> so_group_hparams {
    c::so_group_hparams_default()
}
pub fn subgroup_desc_default() -> so_subgroup_desc {
    c::so_subgroup_desc_default()
}
pub fn step_args_default() -> so_step_args {
    c::so_step_args_default()
}
pub fn loss_scaler_options_default() -> so_loss_scaler_options {
    c::so_loss_scaler_options_default()
}

/// `so_speculation` values.
pub const SPEC_OFF: u32 = 0;
pub const SPEC_ON: u32 = 1;
pub const SPEC_AUTO: u32 = 2;
/// `so_placement` values.
pub const PLACE_HOST: u32 = 0;
pub const PLACE_DEVICE: u32 = 1;

pub fn set_speculation(o: &mut so_session_options, mode: u32) {
    o.speculation = mode;
}
pub fn speculation(o: &so_session_options) -> u32 {
    o.speculation
}

/// The thread's last error message.
pub fn last_error() -> String {
    let mut buf = vec![0u8; 1024];
    let n = unsafe { superoffload::ffi::version::so_last_error_message(buf.as_mut_ptr().cast(), buf.len()) };
    buf.truncate(n.min(buf.len() - 1));
    String::from_utf8_lossy(&buf).into_owned()
}

pub fn cstring(s: &str) -> CString {
    CString::new(s).expect("no NUL in test strings")
}

/// A pool handle (`so_pool_create`), destroyed on drop.
pub struct Pool(pub *mut cp::so_pool);
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

impl Pool {
    pub fn new(threads: usize) -> Pool {
        let mut o = cp::so_pool_options_default();
        o.num_threads = threads;
        let mut p = std::ptr::null_mut();
        let s = unsafe { cp::so_pool_create(&o, &mut p) };
        assert_eq!(s, Status::Ok, "so_pool_create: {}", last_error());
        Pool(p)
    }
    pub fn raw(&self) -> *const cp::so_pool {
        self.0
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        unsafe { cp::so_pool_destroy(self.0) };
    }
}

/// Calls with raw arguments, so that NULLs and bad sizes can be passed. Out-parameters are
/// pointers the caller provides.
pub unsafe fn create(options: *const so_session_options, out: *mut *mut so_session) -> Status {
    unsafe { c::so_session_create(options, out) }
}

/// A session handle; every method is one C call. Not destroyed on drop: the tests destroy
/// sessions explicitly (`destroy`), as the C API does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Session(pub *mut so_session);
unsafe impl Send for Session {}
unsafe impl Sync for Session {}

impl Session {
    pub unsafe fn destroy(self) {
        unsafe { c::so_session_destroy(self.0) }
    }
    pub unsafe fn add_group(self, hp: *const so_group_hparams, out: *mut u32) -> Status {
        unsafe { c::so_session_add_group(self.0, hp, out) }
    }
    pub unsafe fn set_group(self, group: u32, hp: *const so_group_hparams) -> Status {
        unsafe { c::so_session_set_group(self.0, group, hp) }
    }
    pub unsafe fn get_group(self, group: u32, out: *mut so_group_hparams) -> Status {
        unsafe { c::so_session_get_group(self.0, group, out) }
    }
    pub unsafe fn add_subgroup(self, desc: *const so_subgroup_desc, out: *mut u32) -> Status {
        unsafe { c::so_session_add_subgroup(self.0, desc, out) }
    }
    pub fn set_placement(self, sg: u32, placement: u32) -> Status {
        unsafe { c::so_session_set_placement(self.0, sg, placement) }
    }
    pub unsafe fn remove_subgroup(self, sg: u32) -> Status {
        unsafe { c::so_session_remove_subgroup(self.0, sg) }
    }
    pub unsafe fn slice_id(self, name: *const c_char, out: *mut u32) -> Status {
        unsafe { c::so_session_slice_id(self.0, name, out) }
    }
    pub unsafe fn begin_step(self, loss_scale: f32, micro_steps: u32) -> Status {
        unsafe { c::so_session_begin_step(self.0, loss_scale, micro_steps) }
    }
    pub unsafe fn next_micro_step(self) -> Status {
        unsafe { c::so_session_next_micro_step(self.0) }
    }
    pub unsafe fn grad_copy(self, slice: u32, grad: *const c_void, numel: usize, out: *mut Ticket) -> Status {
        unsafe { c::so_session_grad_copy(self.0, slice, grad, numel, out) }
    }
    pub unsafe fn grad_written(self, slice: u32, out: *mut Ticket) -> Status {
        unsafe { c::so_session_grad_written(self.0, slice, out) }
    }
    pub unsafe fn local_grad_sumsq(self, timeout_ns: i64, out: *mut f64) -> Status {
        unsafe { c::so_session_local_grad_sumsq(self.0, timeout_ns, out) }
    }
    pub unsafe fn step(self, args: *const so_step_args, out: *mut Ticket) -> Status {
        unsafe { c::so_session_step(self.0, args, out) }
    }
    /// `so_session_step_result` into a raw struct whose `struct_size` the caller chose.
    pub unsafe fn step_result_raw(self, ticket: Ticket, timeout_ns: i64, out: *mut so_step_result) -> Status {
        unsafe { c::so_session_step_result(self.0, ticket, timeout_ns, out) }
    }
    pub fn step_result(self, ticket: Ticket, timeout_ns: i64) -> Result<so_step_result, Status> {
        let mut r: so_step_result = unsafe { std::mem::zeroed() };
        r.struct_size = std::mem::size_of::<so_step_result>();
        match unsafe { self.step_result_raw(ticket, timeout_ns, &mut r) } {
            Status::Ok => Ok(r),
            s => Err(s),
        }
    }
    pub unsafe fn final_ticket(self, sg: u32, out: *mut Ticket) -> Status {
        unsafe { c::so_session_final_ticket(self.0, sg, out) }
    }
    pub unsafe fn step_count(self, sg: u32, out: *mut u64) -> Status {
        unsafe { c::so_session_step_count(self.0, sg, out) }
    }
    pub unsafe fn loss_scale(self, out: *mut f32) -> Status {
        unsafe { c::so_session_loss_scale(self.0, out) }
    }
    pub unsafe fn host_bytes(self, out: *mut usize) -> Status {
        unsafe { c::so_session_host_bytes(self.0, out) }
    }
    pub fn ticket_query(self, t: Ticket) -> Status {
        unsafe { tk::so_ticket_query(self.0, t) }
    }
    pub fn ticket_wait(self, t: Ticket, timeout_ns: i64) -> Status {
        unsafe { tk::so_ticket_wait(self.0, t, timeout_ns) }
    }
    pub fn ticket_wait_all(self, t: Ticket, timeout_ns: i64) -> Status {
        unsafe { tk::so_ticket_wait_all(self.0, t, timeout_ns) }
    }
    pub unsafe fn save(self, path: *const c_char) -> Status {
        unsafe { c::so_session_save(self.0, path) }
    }
    pub unsafe fn load(self, path: *const c_char) -> Status {
        unsafe { c::so_session_load(self.0, path) }
    }
    pub fn trace(self, on: bool) -> Status {
        unsafe { c::so_session_trace(self.0, on) }
    }
    pub unsafe fn trace_save(self, path: *const c_char) -> Status {
        unsafe { c::so_session_trace_save(self.0, path) }
    }

    // ----- conveniences for tests that only make valid calls ---------------------------

    pub fn save_path(self, path: &std::path::Path) -> Status {
        let p = cstring(path.to_str().expect("UTF-8 path"));
        unsafe { self.save(p.as_ptr()) }
    }
    pub fn load_path(self, path: &std::path::Path) -> Status {
        let p = cstring(path.to_str().expect("UTF-8 path"));
        unsafe { self.load(p.as_ptr()) }
    }
    pub fn final_of(self, sg: u32) -> Result<Ticket, Status> {
        let mut t = 0;
        match unsafe { self.final_ticket(sg, &mut t) } {
            Status::Ok => Ok(t),
            s => Err(s),
        }
    }
    pub fn count_of(self, sg: u32) -> Result<u64, Status> {
        let mut n = 0;
        match unsafe { self.step_count(sg, &mut n) } {
            Status::Ok => Ok(n),
            s => Err(s),
        }
    }
}

/// Step arguments.
pub fn step_args(max_norm: f64, given: Option<f64>, overflow: bool) -> so_step_args {
    let mut a = step_args_default();
    a.max_norm = max_norm;
    if let Some(n) = given {
        a.norm_source = NORM_GIVEN;
        a.global_norm = n;
    } else {
        a.norm_source = NORM_LOCAL;
    }
    a.overflow = overflow;
    a
}
