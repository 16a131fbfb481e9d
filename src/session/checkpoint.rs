//! Checkpoints: one safetensors file (readable by Python's `safetensors`) holding, per
//! named param slice, the master weights (`master/<name>`) and moments (`exp_avg/<name>`,
//! `exp_avg_sq/<name>`), plus metadata strings: options, group hyperparameters, each
//! slice's group and step count, the loss scaler, and a checksum of all of it.
//!
//! State is stored per slice, not per sub-group, so a checkpoint loads into a session whose
//! sub-group partition differs. Saving is atomic (temporary file, fsync, rename, fsync of
//! the directory); loading validates everything before it changes anything.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, View};

use super::factors::check_loss_scale;
use super::policy::parse_history;
use super::publish::write_and_publish;
use super::registry::Registry;
use super::scaler::{LossScaler, LossScalerOptions};
use super::shared::Shared;
use super::subgroup::{SgData, SgWork};
use super::types::{GroupHparams, Placement};
use crate::error::{Error, Result, Status};
use crate::kernels::{AdamMode, DType};

const FORMAT: &str = "superoffload-checkpoint";
const FORMAT_VERSION: &str = "1";

fn bad(message: impl Into<String>) -> Error {
    Error::new(Status::BadCheckpoint, message)
}

fn io(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::new(Status::Io, format!("{what} {}: {e}", path.display()))
}

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

fn mode_name(mode: AdamMode) -> &'static str {
    match mode {
        AdamMode::AdamW => "adamw",
        AdamMode::L2 => "l2",
    }
}

struct TensorBytes<'a> {
    dtype: Dtype,
    shape: [usize; 1],
    bytes: &'a [u8],
}

impl View for &TensorBytes<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// The checksum of a checkpoint: every tensor (name and bytes) and every metadata entry
/// but the checksum itself, in name order.
fn checkpoint_checksum<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a [u8])>,
    meta: &'a HashMap<String, String>,
) -> u64 {
    let mut entries: Vec<(&str, &str)> =
        meta.iter().filter(|(k, _)| k.as_str() != "checksum").map(|(k, v)| (k.as_str(), v.as_str())).collect();
    entries.sort();
    checksum(tensors.chain(entries.into_iter().map(|(k, v)| (k, v.as_bytes()))))
}

/// 64-bit checksum of named byte strings, in the order given. Any change of one 8-byte
/// word changes the result; it guards against corruption, not attack.
fn checksum<'a>(parts: impl Iterator<Item = (&'a str, &'a [u8])>) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h: u64 = 0x243F_6A88_85A3_08D3;
    let mut mix = |word: u64| h = (h ^ word).wrapping_mul(K).rotate_left(29);
    for (name, bytes) in parts {
        for chunk in name.as_bytes().chunks(8).chain(bytes.chunks(8)) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            mix(u64::from_le_bytes(word) ^ chunk.len() as u64);
        }
        mix(bytes.len() as u64);
    }
    h
}

fn put(meta: &mut HashMap<String, String>, key: impl Into<String>, value: impl ToString) {
    meta.insert(key.into(), value.to_string());
}

/// Writes a checkpoint of everything needed to resume bit for bit, after the work in flight
/// (the caller checked that no step is in progress).
pub(crate) fn save(path: &Path, reg: &Registry, shared: &Shared) -> Result<()> {
    shared.tickets.drain();
    let tracks: Vec<_> = reg.live().collect();
    let mut data: Vec<std::sync::MutexGuard<'_, SgData>> =
        tracks.iter().map(|tr| tr.sg().data.lock().unwrap()).collect();
    for (track, d) in tracks.iter().zip(data.iter_mut()) {
        d.download_device_state(track.sg().id, shared.transport())?;
    }

    let mut meta = HashMap::new();
    put(&mut meta, "format", FORMAT);
    put(&mut meta, "format_version", FORMAT_VERSION);
    put(&mut meta, "library_version", env!("CARGO_PKG_VERSION"));
    put(&mut meta, "mode", mode_name(shared.options.mode));
    put(&mut meta, "bias_correction", shared.options.bias_correction);
    put(&mut meta, "moment_dtype", shared.options.moment_dtype.name());
    put(&mut meta, "groups", reg.groups().len());
    for (i, g) in reg.groups().iter().enumerate() {
        for (field, value) in
            [("lr", g.lr), ("beta1", g.beta1), ("beta2", g.beta2), ("eps", g.eps), ("weight_decay", g.weight_decay)]
        {
            // Rust prints the shortest decimal that parses back to the same f64.
            put(&mut meta, format!("group.{i}.{field}"), value);
        }
    }
    if let Some(s) = *shared.scaler.lock().unwrap() {
        let o = s.options;
        put(&mut meta, "loss_scaler", "dynamic");
        for (field, value) in [
            ("scale", s.scale.to_string()),
            ("growth_tracker", s.growth_tracker.to_string()),
            ("hysteresis_left", s.hysteresis_left.to_string()),
            ("init_scale", o.init_scale.to_string()),
            ("growth_factor", o.growth_factor.to_string()),
            ("backoff_factor", o.backoff_factor.to_string()),
            ("growth_interval", o.growth_interval.to_string()),
            ("hysteresis", o.hysteresis.to_string()),
            ("min_scale", o.min_scale.to_string()),
        ] {
            put(&mut meta, format!("loss_scaler.{field}"), value);
        }
    } else {
        put(&mut meta, "loss_scaler", "none");
    }
    // What `Speculation::Auto` decides next depends on it, and the decision fixes bits.
    put(&mut meta, "speculation_history", shared.policy.lock().unwrap().history());

    let mut tensors: Vec<(String, TensorBytes<'_>)> = Vec::new();
    for (track, d) in tracks.iter().zip(&data) {
        for (_, slice) in reg.slices_of(track) {
            put(&mut meta, format!("slice.{}.group", slice.name), track.sg().group);
            put(&mut meta, format!("slice.{}.step", slice.name), d.work.step_count);
            for (prefix, buf) in [("master", &d.master), ("exp_avg", &d.exp_avg), ("exp_avg_sq", &d.exp_avg_sq)] {
                let size = buf.dtype().size();
                tensors.push((
                    format!("{prefix}/{}", slice.name),
                    TensorBytes {
                        dtype: st_dtype(buf.dtype()),
                        shape: [slice.range.len()],
                        bytes: &buf.as_bytes()[slice.range.start * size..slice.range.end * size],
                    },
                ));
            }
        }
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let sum = checkpoint_checksum(tensors.iter().map(|(n, t)| (n.as_str(), t.bytes)), &meta);
    put(&mut meta, "checksum", format!("{sum:016x}"));

    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        path.file_name().map_or("checkpoint".into(), |n| n.to_string_lossy()),
        std::process::id()
    ));
    let written =
        safetensors::tensor::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(meta), &tmp)
            .map_err(|e| Error::new(Status::Io, format!("cannot write {}: {e}", tmp.display())))
            .and_then(|()| {
                let file = std::fs::File::open(&tmp).map_err(|e| io(&tmp, "cannot reopen", e))?;
                file.sync_all().map_err(|e| io(&tmp, "cannot fsync", e))?;
                std::fs::rename(&tmp, path).map_err(|e| io(path, "cannot rename the checkpoint to", e))
            });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if let Ok(dir) = std::fs::File::open(dir) {
        let _ = dir.sync_all();
    }
    Ok(())
}

/// Loads a checkpoint into the session's registry and shared parts, after the work in flight
/// (the caller checked that no step is in progress); on any mismatch or corruption nothing
/// changes.
pub(crate) fn load(path: &Path, reg: &mut Registry, shared: &Shared) -> Result<()> {
    shared.tickets.drain();
    let mapped = Mapped::open(path)?;
    let bytes = mapped.bytes();
    let (_, header) = SafeTensors::read_metadata(bytes)
        .map_err(|e| bad(format!("{}: not a readable safetensors file: {e}", path.display())))?;
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| bad(format!("{}: truncated or corrupt safetensors data: {e}", path.display())))?;
    let meta = header.metadata().clone().unwrap_or_default();
    // Absent in checkpoints of 0.2.0: the history starts anew.
    let history = meta
        .get("speculation_history")
        .map_or(Ok(String::new()), |h| parse_history(h).map(|_| h.clone()).map_err(|e| bad(e.message)))?;
    let get =
        |key: &str| meta.get(key).map(String::as_str).ok_or_else(|| bad(format!("checkpoint metadata lacks {key:?}")));
    let parse = |key: &str| -> Result<f64> {
        get(key)?.parse::<f64>().map_err(|_| bad(format!("checkpoint metadata {key:?} is not a number")))
    };
    if get("format")? != FORMAT || get("format_version")? != FORMAT_VERSION {
        return Err(bad(format!(
            "{} is not a superoffload checkpoint of format version {FORMAT_VERSION}",
            path.display()
        )));
    }
    for (key, ours) in [
        ("mode", mode_name(shared.options.mode).to_string()),
        ("bias_correction", shared.options.bias_correction.to_string()),
        ("moment_dtype", shared.options.moment_dtype.name().to_string()),
    ] {
        let theirs = get(key)?;
        if theirs != ours {
            return Err(bad(format!("the checkpoint was saved with {key} = {theirs}; this session has {ours}")));
        }
    }

    let mut names: Vec<String> = file.names().into_iter().map(String::from).collect();
    names.sort();
    let views: Vec<_> = names.iter().map(|n| file.tensor(n).expect("listed")).collect();
    let sum = checkpoint_checksum(names.iter().zip(&views).map(|(n, v)| (n.as_str(), v.data())), &meta);
    if get("checksum")? != format!("{sum:016x}") {
        return Err(bad(format!("{}: checksum mismatch, the data is corrupt", path.display())));
    }

    let groups: usize = get("groups")?.parse().map_err(|_| bad("bad group count"))?;
    if groups != reg.groups().len() {
        return Err(bad(format!("the checkpoint has {groups} param groups; this session has {}", reg.groups().len())));
    }
    let mut new_groups = Vec::with_capacity(groups);
    for i in 0..groups {
        let f = |field: &str| parse(&format!("group.{i}.{field}"));
        let g = GroupHparams {
            lr: f("lr")?,
            beta1: f("beta1")?,
            beta2: f("beta2")?,
            eps: f("eps")?,
            weight_decay: f("weight_decay")?,
        };
        g.validate().map_err(|e| bad(format!("group {i}: {}", e.message)))?;
        new_groups.push(g);
    }
    let scaler = match (get("loss_scaler")?, shared.options.loss_scaler.is_some()) {
        ("none", false) => None,
        ("dynamic", true) => {
            let f = |field: &str| parse(&format!("loss_scaler.{field}"));
            let options = LossScalerOptions {
                init_scale: f("init_scale")? as f32,
                growth_factor: f("growth_factor")? as f32,
                backoff_factor: f("backoff_factor")? as f32,
                growth_interval: f("growth_interval")? as u32,
                hysteresis: f("hysteresis")? as u32,
                min_scale: f("min_scale")? as f32,
            };
            options.validate().map_err(|e| bad(e.message))?;
            let scale = f("scale")? as f32;
            check_loss_scale("loss scaler scale", scale).map_err(|e| bad(e.message))?;
            Some(LossScaler {
                options,
                scale,
                growth_tracker: f("growth_tracker")? as u32,
                hysteresis_left: f("hysteresis_left")? as u32,
            })
        }
        (theirs, ours) => {
            return Err(bad(format!(
                "the checkpoint's loss scaler is {theirs:?}; this session {} a built-in loss scaler",
                if ours { "has" } else { "has no" }
            )));
        }
    };

    // Match every slice and every sub-group's step count before touching anything.
    let tracks: Vec<_> = reg.live().collect();
    let mut plan = Vec::new();
    let mut expected_tensors = 0;
    for track in &tracks {
        let data = track.sg().data.lock().unwrap();
        let mut step = None;
        for (_, slice) in reg.slices_of(track) {
            if !meta.contains_key(&format!("slice.{}.group", slice.name)) {
                return Err(bad(format!("the checkpoint lacks slice {:?}, which this session registers", slice.name)));
            }
            let group = parse(&format!("slice.{}.group", slice.name))?;
            if group != track.sg().group as f64 {
                return Err(bad(format!(
                    "slice {:?} is in group {group} in the checkpoint and in group {} here",
                    slice.name,
                    track.sg().group
                )));
            }
            let count =
                get(&format!("slice.{}.step", slice.name))?.parse::<u64>().map_err(|_| bad("bad step count"))?;
            if *step.get_or_insert(count) != count {
                return Err(bad(format!(
                    "sub-group {}'s slices have different step counts in the checkpoint; slices stepped \
                     separately cannot share a sub-group",
                    track.sg().id
                )));
            }
            for (prefix, buf) in
                [("master", &data.master), ("exp_avg", &data.exp_avg), ("exp_avg_sq", &data.exp_avg_sq)]
            {
                let name = format!("{prefix}/{}", slice.name);
                let view = file.tensor(&name).map_err(|_| bad(format!("the checkpoint lacks tensor {name:?}")))?;
                if view.dtype() != st_dtype(buf.dtype()) || view.shape() != [slice.range.len()] {
                    return Err(bad(format!(
                        "tensor {name:?} is {:?}{:?} in the checkpoint; this session needs {:?}[{}]",
                        view.dtype(),
                        view.shape(),
                        st_dtype(buf.dtype()),
                        slice.range.len()
                    )));
                }
                expected_tensors += 1;
            }
        }
        plan.push((track.sg().clone(), step.unwrap_or(0)));
    }
    if expected_tensors != names.len() {
        return Err(bad(format!(
            "the checkpoint holds {} tensors but this session's slices account for {expected_tensors}: \
             it has slices this session does not register",
            names.len()
        )));
    }

    // Apply. What the caller's stream queued may still read the old weights: publication
    // of the loaded ones follows it.
    let transport = shared.transport();
    if let Some(transport) = transport {
        transport.before_step()?;
    }
    for (track, (sg, step)) in tracks.iter().zip(&plan) {
        let mut data = sg.data.lock().unwrap();
        if let (Some(transport), Placement::Host) = (transport, data.placement) {
            // The latest publication may still be reading the host weights.
            transport.master_write(sg.id)?;
        }
        for (_, slice) in reg.slices_of(track) {
            let range = slice.range.clone();
            for (prefix, which) in [("master", 0), ("exp_avg", 1), ("exp_avg_sq", 2)] {
                let view = file.tensor(&format!("{prefix}/{}", slice.name)).expect("checked");
                let buf = match which {
                    0 => &mut data.master,
                    1 => &mut data.exp_avg,
                    _ => &mut data.exp_avg_sq,
                };
                buf.write_bytes(range.clone(), view.data());
            }
        }
        data.work = SgWork { step_count: *step, ..Default::default() };
        data.copy_from_master(&shared.pool)?;
        let d = &mut *data;
        // The model's device copy of the weights follows the loaded master weights.
        match (transport, d.placement) {
            (Some(transport), Placement::Device) => transport.load_state(sg.id, d.host_state())?,
            (Some(transport), Placement::Host) => {
                write_and_publish(shared, sg, d, 0..sg.numel, None)?;
                transport.publish(sg.id)?;
            }
            (None, _) => {}
        }
    }
    if let Some(transport) = transport {
        transport.after_load()?;
    }
    reg.replace_groups(new_groups);
    *shared.scaler.lock().unwrap() = scaler;
    shared.policy.lock().unwrap().restore_history(&history)?;
    Ok(())
}

/// A checkpoint file mapped read-only: loading needs no more memory than the state it
/// restores (pages are read as they are copied, and can be dropped again by the kernel).
struct Mapped {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Mapped {
    fn open(path: &Path) -> Result<Mapped> {
        let file = std::fs::File::open(path).map_err(|e| io(path, "cannot open", e))?;
        let len = file.metadata().map_err(|e| io(path, "cannot stat", e))?.len() as usize;
        if len == 0 {
            return Err(bad(format!("{}: the file is empty", path.display())));
        }
        use std::os::fd::AsRawFd;
        // SAFETY: a read-only private mapping of a file we opened; checked for failure.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_PRIVATE, file.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io(path, "cannot map", std::io::Error::last_os_error()));
        }
        Ok(Mapped { ptr, len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes for as long as `self` lives. A file
        // truncated by someone else while loaded would fault; checkpoints are replaced by
        // rename, never truncated in place.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping `open` made.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}
