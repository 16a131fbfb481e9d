//! Saves, loads (of good, corrupted and foreign checkpoints) and repartitioning, and what the
//! model expects of a checkpoint.

use std::ffi::CString;
use std::path::PathBuf;

use superoffload::kernels::{AdamMode, DType};

use super::{Check, FileEntry, Phase, Scaler, Sess, World, hp_of, judge};
use crate::common::Rng;
use crate::fuzz::api::{self, Status};
use crate::fuzz::ckpt::{self, Snapshot};
use crate::fuzz::mem::{put, sub};
use crate::fuzz::ops::*;

impl World {
    pub(super) fn observe_op(&mut self) -> Check {
        let scratch = self.scratch_path();
        let s = self.sess.as_mut().unwrap();
        if s.phase != Phase::Idle {
            let st = s.h.save_path(&scratch);
            api::count_call();
            judge("so_session_save during a step", st, &[Status::InvalidState])?;
            self.stats.refusals += 1;
            return Ok(());
        }
        s.settle(&mut self.stats, &scratch, None, true)
    }

    pub(super) fn save(&mut self, target: SaveTarget) -> Check {
        let path = match target {
            SaveTarget::Slot(k) => self.slot_path(k),
            SaveTarget::MissingDir => self.dir.join("no such dir").join("x.safetensors"),
            SaveTarget::Directory => self.dir.clone(),
            _ => PathBuf::new(),
        };
        let s = self.sess.as_mut().unwrap();
        let st = match target {
            SaveTarget::Null => unsafe { s.h.save(std::ptr::null()) },
            SaveTarget::NonUtf8 => {
                let p = CString::new(vec![b'/', b't', 0xff, 0xfe]).unwrap();
                unsafe { s.h.save(p.as_ptr()) }
            }
            _ => s.h.save_path(&path),
        };
        api::count_call();
        let mut errs = Vec::new();
        match target {
            SaveTarget::Null => errs.push(Status::NullArgument),
            SaveTarget::NonUtf8 => errs.push(Status::InvalidArgument),
            SaveTarget::MissingDir | SaveTarget::Directory => errs.push(Status::Io),
            SaveTarget::Slot(_) => {}
        }
        if s.phase != Phase::Idle {
            errs.push(Status::InvalidState);
        }
        if !judge("so_session_save", st, &errs)? {
            self.stats.refusals += 1;
            if s.phase == Phase::Idle && s.pending.is_none() {
                s.check_quiet()?;
            }
            return Ok(());
        }
        self.stats.saves += 1;
        let (bytes, snap) = ckpt::read(&path).map_err(|e| format!("the saved checkpoint does not parse: {e}"))?;
        // A save is an observation: the file holds the moments the reference is checked against.
        s.settle(&mut self.stats, &path, Some(&snap), true)?;
        if let SaveTarget::Slot(k) = target {
            self.files.insert(k, FileEntry { bytes, snap });
        }
        Ok(())
    }

    pub(super) fn load(&mut self, source: LoadSource) -> Check {
        let scratch = self.scratch_path();
        {
            let s = self.sess.as_mut().unwrap();
            if s.phase == Phase::Idle {
                s.settle(&mut self.stats, &scratch, None, false)?;
            }
        }
        let corrupt = self.dir.join("corrupt.safetensors");
        // (path, the snapshot it holds if it is a good file, the snapshot it came from if corrupted)
        let (path, good, origin): (Option<PathBuf>, Option<&Snapshot>, Option<&Snapshot>) = match source {
            LoadSource::Slot(k) => (Some(self.slot_path(k)), self.files.get(&k).map(|f| &f.snap), None),
            LoadSource::Truncated(k, seed) | LoadSource::Flipped(k, seed) => match self.files.get(&k) {
                Some(f) => {
                    let mut bytes = f.bytes.clone();
                    if matches!(source, LoadSource::Truncated(..)) {
                        bytes.truncate((seed % bytes.len() as u64) as usize);
                    } else {
                        let bit = seed % (bytes.len() as u64 * 8);
                        bytes[(bit / 8) as usize] ^= 1 << (bit % 8);
                    }
                    std::fs::write(&corrupt, &bytes).unwrap();
                    (Some(corrupt.clone()), None, Some(&f.snap))
                }
                None => {
                    std::fs::write(&corrupt, b"not a checkpoint").unwrap();
                    (Some(corrupt.clone()), None, None)
                }
            },
            LoadSource::Garbage(seed) => {
                let mut rng = Rng::new(seed);
                let n = rng.below(3000);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                std::fs::write(&corrupt, &bytes).unwrap();
                (Some(corrupt.clone()), None, None)
            }
            LoadSource::Empty => {
                std::fs::write(&corrupt, b"").unwrap();
                (Some(corrupt.clone()), None, None)
            }
            LoadSource::Missing => (Some(self.dir.join("missing.safetensors")), None, None),
            LoadSource::Directory => (Some(self.dir.clone()), None, None),
            LoadSource::Null => (None, None, None),
        };
        let s = self.sess.as_mut().unwrap();
        let st = match &path {
            Some(p) => s.h.load_path(p),
            None => unsafe { s.h.load(std::ptr::null()) },
        };
        api::count_call();
        let mut errs = Vec::new();
        let mut ok_state: Option<&Snapshot> = None;
        match source {
            LoadSource::Null => errs.push(Status::NullArgument),
            LoadSource::Missing | LoadSource::Directory => errs.push(Status::Io),
            LoadSource::Slot(_) => match good {
                None => errs.push(Status::Io),
                Some(snap) => match s.load_verdict(snap) {
                    Ok(()) => ok_state = Some(snap),
                    Err(e) => errs.push(e),
                },
            },
            _ => errs.push(Status::BadCheckpoint),
        }
        if s.phase != Phase::Idle {
            errs.push(Status::InvalidState);
            ok_state = None;
            if errs.len() == 1 {
                // A load that would succeed is refused during a step.
            }
        }
        if st == Status::Ok && ok_state.is_none() && s.phase == Phase::Idle {
            // A corrupted file loaded: acceptable only if the corruption changed nothing
            // the checkpoint means (the state must then be the original's).
            if let Some(orig) = origin
                && s.load_verdict(orig).is_ok()
            {
                s.apply_snapshot(orig);
                self.stats.loads_ok += 1;
                return s.check_loaded(orig);
            }
        }
        if !judge(&format!("so_session_load({source:?})"), st, &errs)? {
            self.stats.loads_refused += 1;
            self.stats.refusals += 1;
            if s.phase == Phase::Idle {
                s.drained();
                s.check_quiet()?;
            }
            return Ok(());
        }
        let snap = ok_state.unwrap();
        self.stats.loads_ok += 1;
        s.apply_snapshot(snap);
        s.check_loaded(snap)
    }

    pub(super) fn repartition(&mut self, seed: u64) -> Check {
        let scratch = self.scratch_path();
        let (snap, opts_spec, groups) = {
            let s = self.sess.as_mut().unwrap();
            if s.phase != Phase::Idle {
                return Ok(());
            }
            s.settle(&mut self.stats, &scratch, None, true)?;
            let (_, snap) = ckpt::read(&scratch)?;
            (snap, s.opts.spec.clone(), s.groups.clone())
        };
        // The live slices in registration order, with their master dtype and step.
        let old = self.sess.as_ref().unwrap();
        let mut order: Vec<(String, usize, DType, u64, u32)> = Vec::new();
        for sg in old.sgs.iter().flatten() {
            for &sl in &sg.slices {
                let info = &old.slices[sl as usize];
                order.push((info.name.clone(), info.range.len(), sg.master_dtype, sg.count, sg.group));
            }
        }
        self.apply(&Op::Destroy)?;
        let mut spec = opts_spec;
        spec.null_out = false;
        self.create(&spec)?;
        let s = self.sess.as_mut().unwrap();
        for g in &groups {
            let hp = HpSpec { hp: [g.lr, g.beta1, g.beta2, g.eps, g.weight_decay], bad: HpBad::None };
            s.apply(&Op::AddGroup { hp, null_out: false }, &mut self.stats, &scratch, false)?;
        }
        let mut rng = Rng::new(seed);
        let mut i = 0;
        while i < order.len() {
            let mut j = i + 1;
            // Only slices of one dtype, group and step count can share a sub-group.
            while j < order.len()
                && order[j].2 == order[i].2
                && order[j].3 == order[i].3
                && order[j].4 == order[i].4
                && rng.below(3) != 0
            {
                j += 1;
            }
            let mut offset = 0;
            let slices = order[i..j]
                .iter()
                .map(|(name, n, ..)| {
                    let sl = SliceSpec { name: NameSpec::Named(name.clone()), offset, numel: *n };
                    offset += n;
                    sl
                })
                .collect();
            let raw = match order[i].2 {
                DType::F32 => api::DT_F32,
                DType::Bf16 => api::DT_BF16,
                DType::F16 => api::DT_F16,
            };
            let sg = SgSpec {
                group: order[i].4,
                numel: offset,
                master_dtype: raw,
                slices,
                caller_grad: false,
                seed: rng.next_u64(),
                bad: SgBad::None,
                placement: api::PLACE_HOST,
            };
            s.add_subgroup(&sg, &mut self.stats)?;
            i = j;
        }
        let st = s.h.load_path(&scratch);
        api::count_call();
        let expected = s.load_verdict(&snap);
        match expected {
            Ok(()) => {
                judge("so_session_load into another partition", st, &[])?;
                s.apply_snapshot(&snap);
                self.stats.repartitions += 1;
                s.check_loaded(&snap)
            }
            Err(e) => {
                // A memory limit can refuse some sub-groups, so the layout differs.
                judge("so_session_load into another partition", st, &[e])?;
                Ok(())
            }
        }
    }
}

impl Sess {
    // ----- checkpoints ------------------------------------------------------------------

    /// Whether `load` must accept `snap` (Ok) or with which status it must refuse it.
    pub fn load_verdict(&self, snap: &Snapshot) -> Result<(), Status> {
        let bad = Err(Status::BadCheckpoint);
        let mode = match self.opts.mode {
            AdamMode::AdamW => "adamw",
            AdamMode::L2 => "l2",
        };
        if snap.mode != mode
            || snap.bias_correction != self.opts.bias.to_string()
            || snap.moment_dtype != self.opts.moment.name()
        {
            return bad;
        }
        if snap.groups.len() != self.groups.len() || snap.scaler.is_some() != self.scaler.is_some() {
            return bad;
        }
        let mut slices = 0;
        for sg in self.live_sgs() {
            let mut step = None;
            for &sl in &sg.slices {
                let info = &self.slices[sl as usize];
                let Some(s) = snap.slices.get(&info.name) else { return bad };
                if s.group != sg.group as f64 || *step.get_or_insert(s.step) != s.step {
                    return bad;
                }
                let n = info.range.len();
                if s.master.dtype() != sg.master_dtype
                    || s.master.len() != n
                    || s.exp_avg.dtype() != self.opts.moment
                    || s.exp_avg.len() != n
                    || s.exp_avg_sq.dtype() != self.opts.moment
                    || s.exp_avg_sq.len() != n
                {
                    return bad;
                }
                slices += 1;
            }
        }
        if snap.tensors != 3 * slices {
            return bad;
        }
        Ok(())
    }

    pub fn apply_snapshot(&mut self, snap: &Snapshot) {
        self.groups = snap.groups.iter().map(|g| hp_of(*g)).collect();
        if let (Some(f), Some(m)) = (&snap.scaler, self.scaler.as_mut()) {
            *m = Scaler { options: f.options, scale: f.scale, tracker: f.growth_tracker, left: f.hysteresis_left };
        }
        self.drained();
        for sg in self.sgs.iter_mut().flatten() {
            for &sl in &sg.slices {
                let info = &self.slices[sl as usize];
                let s = &snap.slices[&info.name];
                put(&mut sg.p, info.range.start, &s.master);
                put(&mut sg.m, info.range.start, &s.exp_avg);
                put(&mut sg.v, info.range.start, &s.exp_avg_sq);
                sg.known[info.range.clone()].fill(true);
                sg.count = s.step;
                sg.count_prev = s.step;
            }
            sg.approx = None;
        }
    }

    /// After a load: the masters are the checkpoint's, and so are the step counts.
    pub fn check_loaded(&mut self, snap: &Snapshot) -> Check {
        self.check_quiet()?;
        for sg in self.live_sgs() {
            for &sl in &sg.slices {
                let info = &self.slices[sl as usize];
                let live = sub(&sg.master.read(sg.master_dtype, sg.numel), info.range.clone());
                ensure!(live == snap.slices[&info.name].master, "slice {}: loaded master weights differ", info.name);
            }
            let n = self.h.count_of(sg.id);
            api::count_call();
            ensure!(n == Ok(sg.count), "sub-group {}: step count after load {n:?}, model {}", sg.id, sg.count);
        }
        Ok(())
    }
}
