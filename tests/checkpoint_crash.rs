//! Crash during save: a child process (this test binary again, in a child role
//! selected by `SO_CRASH_ROLE`) trains a session of 25.6 M f32 parameters (a checkpoint of
//! 307 MB) and saves it to one path after every step; the parent SIGKILLs it at many points,
//! some at random times and some aimed inside a save (at a random fraction of its measured
//! duration). After each kill the file at the path must load, hold a step the child had
//! reached, and resume bit for bit: its weights and moments equal those of an uninterrupted
//! run at that step, and one more step from it equals the uninterrupted run's next step. No
//! temporary file may stand at the path; a leftover temporary file must not be loadable as a
//! good checkpoint unless it is complete, and the next child must save over the path
//! regardless. Disk full: a child whose `RLIMIT_FSIZE` is below the checkpoint size (SIGXFSZ
//! ignored) must get `SO_STATUS_IO` from the save and leave the previous checkpoint intact.
//!
//! CI runs a few kills; `SO_CRASH_KILLS=100` runs more. `SO_CRASH_DIR` chooses the directory
//! (default: the system's temporary directory, a real file system).

mod common;
mod fuzz;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::Rng;
use fuzz::api::{self, Session, Status};
use fuzz::mem::RawBuf;

/// 4 sub-groups of 6.4 M f32 parameters: 25.6 M parameters, a checkpoint of 307 MB.
const SUBGROUPS: usize = 4;
const PER_SUBGROUP: usize = 6_400_000;
/// The child stops after this many steps (the parent kills it long before, normally).
const MAX_STEPS: u64 = 4;
const CI_KILLS: u64 = 6;
const ROLE: &str = "SO_CRASH_ROLE";

/// The tests of this file share the machine's two cores and a few GB of memory: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A big session, deterministic in everything (masters, gradients, options).
struct Big {
    h: Session,
    masters: Vec<RawBuf>,
    grad: Vec<f32>,
}

impl Big {
    fn new() -> Big {
        let mut opts = api::session_options_default();
        api::set_speculation(&mut opts, api::SPEC_ON);
        let mut out = std::ptr::null_mut();
        // SAFETY: the options and the out-pointer are live locals.
        assert_eq!(unsafe { api::create(&opts, &mut out) }, Status::Ok, "{}", api::last_error());
        let h = Session(out);
        let hp = api::group_hparams_default();
        let mut g = 0;
        // SAFETY: `h` was created above; `hp` and `g` are live locals.
        assert_eq!(unsafe { h.add_group(&hp, &mut g) }, Status::Ok);
        let mut masters = Vec::new();
        for sg in 0..SUBGROUPS {
            let buf = RawBuf::new(PER_SUBGROUP * 4);
            let init: Vec<f32> = (0..PER_SUBGROUP).map(|i| value(sg as u64, i as u64, 0) * 50.0).collect();
            // SAFETY: `buf` holds PER_SUBGROUP f32 values, `init` as many.
            unsafe { std::ptr::copy_nonoverlapping(init.as_ptr().cast::<u8>(), buf.ptr(), PER_SUBGROUP * 4) };
            let name = api::cstring(&format!("layer{sg}"));
            let slices = [api::so_slice_desc { name: name.as_ptr(), offset: 0, numel: PER_SUBGROUP }];
            let mut d = api::subgroup_desc_default();
            d.master = buf.ptr().cast();
            d.master_dtype = api::DT_F32;
            d.numel = PER_SUBGROUP;
            d.slices = slices.as_ptr();
            d.num_slices = 1;
            let mut id = 0;
            // SAFETY: `d` points at `buf`, `slices` and `name`, all alive during the call.
            assert_eq!(unsafe { h.add_subgroup(&d, &mut id) }, Status::Ok, "{}", api::last_error());
            masters.push(buf);
        }
        Big { h, masters, grad: vec![0.0; PER_SUBGROUP] }
    }

    /// Step `k` (from 1): gradients of every sub-group in backward order, no clipping.
    fn step(&mut self, k: u64) {
        // SAFETY: `self.h` is live until drop.
        assert_eq!(unsafe { self.h.begin_step(1.0, 1) }, Status::Ok);
        for sg in (0..SUBGROUPS).rev() {
            for (i, g) in self.grad.iter_mut().enumerate() {
                *g = value(sg as u64, i as u64, k);
            }
            let st =
                // SAFETY: `self.grad` holds PER_SUBGROUP f32 values.
                unsafe { self.h.grad_copy(sg as u32, self.grad.as_ptr().cast(), PER_SUBGROUP, std::ptr::null_mut()) };
            assert_eq!(st, Status::Ok, "{}", api::last_error());
        }
        let args = api::step_args(0.0, None, false);
        let mut t = 0;
        // SAFETY: `args` and `t` are live locals.
        assert_eq!(unsafe { self.h.step(&args, &mut t) }, Status::Ok);
        let r = self.h.step_result(t, -1).expect("step result");
        assert!(!r.skipped, "{r:?}");
    }

    fn masters_hash(&self) -> u64 {
        let mut h = Hasher::new();
        for m in &self.masters {
            // SAFETY: each master buffer holds PER_SUBGROUP f32 values.
            h.bytes(unsafe { std::slice::from_raw_parts(m.ptr(), PER_SUBGROUP * 4) });
        }
        h.finish()
    }

    fn count(&self) -> u64 {
        self.h.count_of(0).expect("step count")
    }
}

impl Drop for Big {
    fn drop(&mut self) {
        // SAFETY: the handle is destroyed once, here, and never used after.
        unsafe { self.h.destroy() };
    }
}

/// Deterministic pseudo-random values in [-0.005, 0.005): element `i` of sub-group `sg` at
/// step `k` (k = 0: initial weights / 50).
fn value(sg: u64, i: u64, k: u64) -> f32 {
    let mut z = (sg << 56) ^ (k << 40) ^ i;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.01
}

/// 64-bit hash of byte strings (a multiply-rotate mix over 8-byte words).
struct Hasher(u64);

impl Hasher {
    fn new() -> Hasher {
        Hasher(0x243F_6A88_85A3_08D3)
    }
    fn bytes(&mut self, b: &[u8]) {
        let mut chunks = b.chunks_exact(8);
        for c in &mut chunks {
            self.0 = (self.0 ^ u64::from_le_bytes(c.try_into().unwrap()))
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left(31);
        }
        for &x in chunks.remainder() {
            self.0 = (self.0 ^ x as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(31);
        }
        self.0 ^= b.len() as u64;
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// The tensors of a checkpoint file (names and bytes, in name order) and its step count, or
/// why it is not a checkpoint.
fn tensors_hash(path: &Path) -> Result<(u64, u64), String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| e.to_string())?;
    let step = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get("slice.layer0.step"))
        .and_then(|s| s.parse().ok())
        .ok_or("no step count")?;
    let mut names: Vec<String> = file.names().into_iter().map(String::from).collect();
    names.sort();
    let mut h = Hasher::new();
    for n in names {
        h.bytes(n.as_bytes());
        h.bytes(file.tensor(&n).map_err(|e| e.to_string())?.data());
    }
    Ok((h.finish(), step))
}

/// The uninterrupted run: per step count, the hash of the weights and of the checkpoint's
/// tensors; the first checkpoint (step 0) is left at `path`. Also the mean seconds of a step
/// and of a save.
struct Truth {
    masters: Vec<u64>,
    tensors: Vec<u64>,
    step_s: f64,
    save_s: f64,
}

fn uninterrupted(dir: &Path, path: &Path) -> Truth {
    let mut big = Big::new();
    let file = dir.join("truth.safetensors");
    let (mut masters, mut tensors) = (Vec::new(), Vec::new());
    let (mut step_s, mut save_s) = (0.0, 0.0);
    for k in 0..=MAX_STEPS + 1 {
        if k > 0 {
            let t = Instant::now();
            big.step(k);
            step_s += t.elapsed().as_secs_f64();
        }
        masters.push(big.masters_hash());
        if k <= MAX_STEPS {
            let t = Instant::now();
            assert_eq!(big.h.save_path(&file), Status::Ok, "{}", api::last_error());
            save_s += t.elapsed().as_secs_f64();
            let (hash, step) = tensors_hash(&file).unwrap();
            assert_eq!(step, k);
            tensors.push(hash);
            if k == 0 {
                std::fs::copy(&file, path).unwrap();
            }
        }
    }
    let _ = std::fs::remove_file(&file);
    Truth { masters, tensors, step_s: step_s / (MAX_STEPS + 1) as f64, save_s: save_s / (MAX_STEPS + 1) as f64 }
}

/// The child: steps and saves to `SO_CRASH_PATH` in a loop, reporting on stdout.
fn saver_child() {
    let path = PathBuf::from(std::env::var("SO_CRASH_PATH").unwrap());
    let mut out = std::io::stdout().lock();
    let mut big = Big::new();
    writeln!(out, "@@ ready").unwrap();
    out.flush().unwrap();
    for k in 1..=MAX_STEPS {
        big.step(k);
        writeln!(out, "@@ saving {k}").unwrap();
        out.flush().unwrap();
        assert_eq!(big.h.save_path(&path), Status::Ok, "{}", api::last_error());
        writeln!(out, "@@ saved {k}").unwrap();
        out.flush().unwrap();
    }
    writeln!(out, "@@ done").unwrap();
    out.flush().unwrap();
}

fn scratch() -> PathBuf {
    let base = std::env::var("SO_CRASH_DIR").map(PathBuf::from).unwrap_or_else(|_| std::env::temp_dir());
    let dir = base.join(format!("superoffload-crash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn spawn_child(test: &str, role: &str, path: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env("SO_CRASH_PATH", path)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child")
}

/// Lines `@@ ...` of the child, with the time each arrived.
fn reader(child: &mut std::process::Child) -> mpsc::Receiver<(Instant, String)> {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // The test harness may print on the same line before it.
            if let Some(at) = line.find("@@ ")
                && tx.send((Instant::now(), line[at + 3..].to_string())).is_err()
            {
                break;
            }
        }
    });
    rx
}

/// Every file in `dir` but the checkpoint itself: the session's temporary file
/// (`.<name>.tmp-<pid>`) and the one safetensors writes before handing it over (`.tmpXXXXXX`).
fn temporaries(dir: &Path, path: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p != path).collect()
}

#[test]
fn save_survives_sigkill_at_any_point() {
    if std::env::var(ROLE).as_deref() == Ok("saver") {
        return saver_child();
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let kills = std::env::var("SO_CRASH_KILLS").map_or(CI_KILLS, |v| v.parse().expect("SO_CRASH_KILLS"));
    let dir = scratch();
    let path = dir.join("ckpt.safetensors");
    let start = Instant::now();
    let truth = uninterrupted(&dir, &path);
    eprintln!(
        "uninterrupted run: {:.2} s a step, {:.2} s a save of {} MB ({:.1} s)",
        truth.step_s,
        truth.save_s,
        std::fs::metadata(&path).unwrap().len() / 1_000_000,
        start.elapsed().as_secs_f64()
    );
    let mut rng = Rng::new(12);
    let (mut inside, mut leftovers, mut complete_leftovers, mut steps_seen) =
        (0, 0, 0, std::collections::BTreeSet::new());
    let mut checker = Big::new();
    // The step of the checkpoint at the path (the uninterrupted run left step 0 there).
    let mut previous = 0;
    for kill in 0..kills {
        let mut child = spawn_child("save_survives_sigkill_at_any_point", "saver", &path);
        let lines = reader(&mut child);
        let (t0, first) = lines.recv_timeout(Duration::from_secs(120)).expect("the child starts");
        assert_eq!(first, "ready");
        // Half the kills at a random time in the first three step+save cycles, half aimed
        // inside the save of a random step at a random fraction of its duration.
        let cycle = truth.step_s + truth.save_s;
        let mut events = vec![(t0, first)];
        if kill % 2 == 0 {
            let at = t0 + Duration::from_secs_f64(rng.range(0.0, 3.0 * cycle));
            while let Ok(e) = lines.recv_timeout(at.saturating_duration_since(Instant::now())) {
                events.push(e);
            }
        } else {
            let target = 1 + rng.below(3) as u64;
            loop {
                let e = lines.recv_timeout(Duration::from_secs(120)).expect("the child saves");
                let hit = e.1 == format!("saving {target}");
                events.push(e);
                if hit {
                    break;
                }
            }
            std::thread::sleep(Duration::from_secs_f64(rng.range(0.0, 1.1) * truth.save_s));
        }
        child.kill().unwrap();
        let status = child.wait().unwrap();
        while let Ok(e) = lines.recv_timeout(Duration::from_millis(200)) {
            events.push(e);
        }
        // Where did the kill land?
        let last = events.last().unwrap().1.clone();
        let in_save = last.starts_with("saving");
        inside += in_save as u64;
        let saved: Vec<u64> =
            events.iter().filter_map(|(_, l)| l.strip_prefix("saved ").map(|k| k.parse().unwrap())).collect();
        let saving: Vec<u64> =
            events.iter().filter_map(|(_, l)| l.strip_prefix("saving ").map(|k| k.parse().unwrap())).collect();

        // The file at the path is a complete checkpoint of a step the child reached (or the
        // previous child's, before this one's first save completed).
        let (hash, step) =
            tensors_hash(&path).unwrap_or_else(|e| panic!("kill {kill} ({last}): the checkpoint is broken: {e}"));
        let mut possible = vec![saved.last().copied().unwrap_or(previous)];
        if in_save {
            possible.push(*saving.last().unwrap());
        }
        assert!(
            possible.contains(&step),
            "kill {kill} ({last}): the checkpoint holds step {step}; expected one of {possible:?}"
        );
        previous = step;
        assert_eq!(
            hash, truth.tensors[step as usize],
            "kill {kill}: checkpoint of step {step} differs from the uninterrupted run's"
        );
        steps_seen.insert(step);
        // It loads and resumes bit for bit.
        assert_eq!(checker.h.load_path(&path), Status::Ok, "kill {kill}: {}", api::last_error());
        assert_eq!(checker.count(), step);
        assert_eq!(checker.masters_hash(), truth.masters[step as usize], "kill {kill}: loaded weights of step {step}");
        checker.step(step + 1);
        assert_eq!(checker.masters_hash(), truth.masters[step as usize + 1], "kill {kill}: resumed step {}", step + 1);

        // Leftovers: a temporary file never stands at the path; one that is incomplete does
        // not load; the next child saves over the path regardless (it is removed here only to
        // keep the disk use bounded).
        for tmp in temporaries(&dir, &path) {
            leftovers += 1;
            let st = checker.h.load_path(&tmp);
            assert!(matches!(st, Status::Ok | Status::BadCheckpoint), "kill {kill}: loading a leftover: {st:?}");
            if st == Status::Ok {
                // Only a complete checkpoint may load: one of the uninterrupted run's.
                let (hash, step) = tensors_hash(&tmp).expect("a leftover that loaded parses");
                assert_eq!(
                    hash, truth.tensors[step as usize],
                    "kill {kill}: a leftover loaded but is not a good checkpoint"
                );
                complete_leftovers += 1;
            }
            std::fs::remove_file(&tmp).unwrap();
        }
        eprintln!(
            "kill {kill:3}: {status} after {:?}, last event {last:?}, checkpoint at step {step}",
            events.last().unwrap().0 - t0
        );
    }
    drop(checker);
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "crash during save: {kills} kill points, {inside} inside a save, {leftovers} temporary files left over \
         ({complete_leftovers} of them complete), checkpoints of steps {steps_seen:?} resumed bit for bit ({:.1} s)",
        start.elapsed().as_secs_f64()
    );
    assert!(kills < 2 || inside > 0, "no kill landed inside a save");
}

/// The child for the disk-full case: a first save, then `RLIMIT_FSIZE` below the checkpoint
/// size and a second save, which must fail with `SO_STATUS_IO`.
fn disk_full_child() {
    let path = PathBuf::from(std::env::var("SO_CRASH_PATH").unwrap());
    let mut big = Big::new();
    big.step(1);
    assert_eq!(big.h.save_path(&path), Status::Ok, "{}", api::last_error());
    let size = std::fs::metadata(&path).unwrap().len();
    big.step(2);
    // SAFETY: plain libc calls with a valid rlimit; SIGXFSZ ignored so the save sees EFBIG.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let limit = libc::rlimit { rlim_cur: size / 3, rlim_max: libc::RLIM_INFINITY };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
    }
    let st = big.h.save_path(&path);
    println!("@@ second save: {st:?} ({})", api::last_error());
    assert_eq!(st, Status::Io, "a save beyond RLIMIT_FSIZE");
    // The session is still usable, and a save succeeds once there is room again.
    big.step(3);
    // SAFETY: plain libc call with a valid rlimit.
    unsafe {
        let limit = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
    }
    let other = path.with_file_name("after.safetensors");
    assert_eq!(big.h.save_path(&other), Status::Ok, "{}", api::last_error());
    assert_eq!(tensors_hash(&other).unwrap().1, 3);
    println!("@@ ok");
}

#[test]
fn save_beyond_the_file_size_limit_fails_cleanly() {
    if std::env::var(ROLE).as_deref() == Ok("disk-full") {
        return disk_full_child();
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch();
    let path = dir.join("ckpt.safetensors");
    let mut child = spawn_child("save_beyond_the_file_size_limit_fails_cleanly", "disk-full", &path);
    let lines = reader(&mut child);
    let status = child.wait().unwrap();
    let events: Vec<String> = lines.iter().map(|(_, l)| l).collect();
    assert!(status.success(), "the child failed: {status}, {events:?}");
    assert_eq!(events.last().map(String::as_str), Some("ok"), "{events:?}");
    // The previous checkpoint is intact: step 1, and it resumes bit for bit.
    let (_, step) = tensors_hash(&path).expect("the previous checkpoint is intact");
    assert_eq!(step, 1);
    let left: Vec<PathBuf> =
        temporaries(&dir, &path).into_iter().filter(|p| !p.ends_with("after.safetensors")).collect();
    assert!(left.is_empty(), "the failed save left {left:?}");
    let mut reference = Big::new();
    reference.step(1);
    let after_one = reference.masters_hash();
    reference.step(2);
    let after_two = reference.masters_hash();
    drop(reference);
    let mut loaded = Big::new();
    assert_eq!(loaded.h.load_path(&path), Status::Ok, "{}", api::last_error());
    assert_eq!(loaded.masters_hash(), after_one);
    loaded.step(2);
    assert_eq!(loaded.masters_hash(), after_two);
    drop(loaded);
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("disk full: {}", events.join("; "));
}
