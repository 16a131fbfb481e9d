//! A session's model: its construction, the dispatch of its operations, and its groups.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use superoffload::session::GroupHparams;

use super::{Check, Opts, Phase, Scaler, Sess, SgM, SliceM, Stats, hp_bits_equal, hp_of, hp_valid, judge};
use crate::fuzz::api::{self, Session, Status};
use crate::fuzz::ops::*;

impl Sess {
    pub(super) fn new(h: Session, opts: Opts, scaler: Option<Scaler>, scratch: PathBuf) -> Sess {
        Sess {
            h,
            opts,
            groups: Vec::new(),
            sgs: Vec::new(),
            slices: Vec::new(),
            names: HashMap::new(),
            phase: Phase::Idle,
            serial: 0,
            s: 1.0,
            scaler,
            host_bytes: 0,
            spec_min: 0,
            spec_max: 0,
            late_count: 0,
            pending: None,
            step_tickets: Vec::new(),
            outcomes: HashMap::new(),
            handoffs: Vec::new(),
            hidden: Vec::new(),
            last_seen: 0,
            refusals: 0,
            scratch,
        }
    }

    pub fn live_sgs(&self) -> impl Iterator<Item = &SgM> {
        self.sgs.iter().flatten()
    }

    pub(super) fn sg(&self, id: u32) -> Option<&SgM> {
        self.sgs.get(id as usize).and_then(Option::as_ref)
    }

    pub(super) fn live_slice(&self, id: u32) -> Option<&SliceM> {
        self.slices.get(id as usize).filter(|s| s.alive)
    }

    /// Everything the session had queued is done (after a save or load, which drain).
    pub(super) fn drained(&mut self) {
        for sg in self.sgs.iter_mut().flatten() {
            sg.final_waited = true;
        }
    }

    pub fn apply(&mut self, op: &Op, stats: &mut Stats, scratch: &Path, observe: bool) -> Check {
        match op {
            Op::AddGroup { hp, null_out } => self.add_group(hp, *null_out, stats),
            Op::SetGroup { group, hp } => self.set_group(*group, hp, stats),
            Op::GetGroup { group, bad } => self.get_group(*group, *bad, stats),
            Op::RemoveSubgroup { sg } => self.remove_subgroup(*sg, stats, scratch),
            Op::SetPlacement { sg, placement } => {
                let st = self.h.set_placement(*sg, *placement);
                api::count_call();
                let mut e = Vec::new();
                match *placement {
                    api::PLACE_HOST => {}
                    api::PLACE_DEVICE => e.push(Status::Unsupported),
                    _ => e.push(Status::InvalidArgument),
                }
                if self.phase != Phase::Idle {
                    e.push(Status::InvalidState);
                }
                if self.sg(*sg).is_none() {
                    e.push(Status::NotFound);
                }
                if !judge("so_session_set_placement", st, &e)? {
                    stats.refusals += 1;
                    return self.refused(stats);
                }
                self.check_quiet()
            }
            Op::SliceId { name } => self.slice_id(name, stats),
            Op::BeginStep { loss_scale, micro_steps, settle } => {
                self.begin_step(*loss_scale, *micro_steps, *settle, stats, scratch, observe)
            }
            Op::NextMicro => self.next_micro(stats),
            Op::GradCopy { slice, numel, fill, bad } => self.grad_copy(*slice, *numel, fill, *bad, stats),
            Op::GradWritten { slice, fill, add } => self.grad_written(*slice, fill, *add, stats),
            Op::LocalSumsq { timeout_ns, null_out } => self.local_sumsq(*timeout_ns, *null_out, stats),
            Op::Step(args) => self.step(args, stats),
            Op::StepResult { which, timeout_ns, bad_size } => {
                self.step_result_op(*which, *timeout_ns, *bad_size, stats, scratch, observe)
            }
            Op::Ticket { which, timeout_ns, how } => self.ticket_op(*which, *timeout_ns, *how),
            Op::StepCount { sg } => self.step_count(*sg),
            Op::LossScale => self.loss_scale_op(stats, scratch),
            Op::HostBytes => {
                let mut n = usize::MAX;
                let st = unsafe { self.h.host_bytes(&mut n) };
                api::count_call();
                judge("so_session_host_bytes", st, &[])?;
                ensure!(n == self.host_bytes, "host bytes {n}, model {}", self.host_bytes);
                Ok(())
            }
            Op::Settle => {
                if self.phase == Phase::Idle {
                    self.settle(stats, scratch, None, observe)?;
                    self.wait_finals()?;
                    self.check_quiet()?;
                }
                Ok(())
            }
            Op::Trace(on) => {
                let st = self.h.trace(*on);
                api::count_call();
                judge("so_session_trace", st, &[]).map(drop)
            }
            Op::TraceSave { bad_dir } => {
                let path = if *bad_dir {
                    scratch.with_file_name("no such dir").join("trace.json")
                } else {
                    scratch.with_file_name("trace.json")
                };
                let p = api::cstring(path.to_str().unwrap());
                let st = unsafe { self.h.trace_save(p.as_ptr()) };
                api::count_call();
                judge("so_session_trace_save", st, if *bad_dir { &[Status::Io] } else { &[] }).map(drop)
            }
            _ => unreachable!("handled by World"),
        }
    }

    // ----- groups -----------------------------------------------------------------------

    fn hp_struct(hp: &HpSpec) -> api::so_group_hparams {
        let mut h = api::group_hparams_default();
        h.lr = hp.hp[0];
        h.beta1 = hp.hp[1];
        h.beta2 = hp.hp[2];
        h.eps = hp.hp[3];
        h.weight_decay = hp.hp[4];
        if hp.bad == HpBad::Size {
            h.struct_size -= 8;
        }
        h
    }

    fn hp_errors(hp: &HpSpec) -> Vec<Status> {
        match hp.bad {
            HpBad::Null => vec![Status::NullArgument],
            HpBad::Size => vec![Status::StructSize],
            HpBad::None if !hp_valid(&hp_of(hp.hp)) => vec![Status::InvalidArgument],
            HpBad::None => vec![],
        }
    }

    fn add_group(&mut self, hp: &HpSpec, null_out: bool, stats: &mut Stats) -> Check {
        let h = Self::hp_struct(hp);
        let mut out = 0xDEAD_BEEFu32;
        let st = unsafe {
            self.h.add_group(
                if hp.bad == HpBad::Null { std::ptr::null() } else { &h },
                if null_out { std::ptr::null_mut() } else { &mut out },
            )
        };
        api::count_call();
        let mut errs = Self::hp_errors(hp);
        if null_out {
            errs.push(Status::NullArgument);
        }
        if !judge("so_session_add_group", st, &errs)? {
            stats.refusals += 1;
            ensure!(out == 0xDEAD_BEEF, "add_group wrote its out-parameter on failure");
            return self.refused(stats);
        }
        ensure!(out as usize == self.groups.len(), "add_group returned id {out}, model {}", self.groups.len());
        self.groups.push(hp_of(hp.hp));
        Ok(())
    }

    fn set_group(&mut self, group: u32, hp: &HpSpec, stats: &mut Stats) -> Check {
        let h = Self::hp_struct(hp);
        let st = unsafe { self.h.set_group(group, if hp.bad == HpBad::Null { std::ptr::null() } else { &h }) };
        api::count_call();
        let mut errs = Self::hp_errors(hp);
        if group as usize >= self.groups.len() {
            errs.push(Status::NotFound);
        }
        if !judge("so_session_set_group", st, &errs)? {
            stats.refusals += 1;
            return self.refused(stats);
        }
        self.groups[group as usize] = hp_of(hp.hp);
        Ok(())
    }

    fn get_group(&mut self, group: u32, bad: HpBad, stats: &mut Stats) -> Check {
        let mut out = api::group_hparams_default();
        out.lr = -77.0;
        if bad == HpBad::Size {
            out.struct_size += 8;
        }
        let st = unsafe { self.h.get_group(group, if bad == HpBad::Null { std::ptr::null_mut() } else { &mut out }) };
        api::count_call();
        let mut errs = Vec::new();
        match bad {
            HpBad::Null => errs.push(Status::NullArgument),
            HpBad::Size => errs.push(Status::StructSize),
            HpBad::None => {}
        }
        if group as usize >= self.groups.len() {
            errs.push(Status::NotFound);
        }
        if !judge("so_session_get_group", st, &errs)? {
            stats.refusals += 1;
            ensure!(out.lr == -77.0, "get_group wrote its out-parameter on failure");
            return Ok(());
        }
        let got = GroupHparams {
            lr: out.lr,
            beta1: out.beta1,
            beta2: out.beta2,
            eps: out.eps,
            weight_decay: out.weight_decay,
        };
        ensure!(
            hp_bits_equal(&got, &self.groups[group as usize]),
            "group {group}: {got:?} vs model {:?}",
            self.groups[group as usize]
        );
        Ok(())
    }
}
