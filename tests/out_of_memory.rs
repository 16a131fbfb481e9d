//! Out of memory is a status, not a kill: a session checks what it is about to allocate
//! against what the host can give (here, a child process's address-space limit) and refuses
//! with `OUT_OF_RESOURCES`, a message naming the need, what there is and what lowers it, and
//! nothing left allocated; the session goes on working within its means.
//!
//! The limited half runs in a child process (this test binary again, with `SO_OOM_CHILD` set),
//! so that the limit binds nothing else.

use std::process::Command;
use std::sync::Arc;

use superoffload::error::Status;
use superoffload::kernels::{DType, Floats, Pool, PoolOptions};
use superoffload::session::{
    Borrowed, GroupHparams, HostMemory, MemoryBound, NormSource, Session, SessionOptions, SliceDesc, StepArgs,
    SubGroupDesc,
};

const CHILD: &str = "SO_OOM_CHILD";
/// Elements of the sub-group refused: its moments (8 bytes an element) are 512 MiB.
const LARGE: usize = 64 << 20;
/// The large sub-group's moments (f32, two of them).
const MOMENTS_BYTES: u64 = LARGE as u64 * 8;
/// Address space the child leaves itself beyond what it maps when the limit is set.
const HEADROOM: u64 = 256 << 20;

#[test]
fn a_session_larger_than_the_address_space_limit_is_refused_and_keeps_working() {
    if std::env::var_os(CHILD).is_some() {
        return limited_child();
    }
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args(["--exact", "a_session_larger_than_the_address_space_limit_is_refused_and_keeps_working", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the limited child failed:\n{text}");
    assert!(text.contains("refused as expected"), "{text}");
}

fn limited_child() {
    // Everything that maps memory before the limit: the masters (untouched zero pages), the
    // pool and the session's thread.
    let mut large = vec![0.0f32; LARGE];
    let mut small = vec![0.5f32; 4096];
    let pool = Arc::new(Pool::new(&PoolOptions { num_threads: 1, ..Default::default() }).unwrap());
    let s = Session::new(SessionOptions { pool: Some(pool), ..SessionOptions::default() }).unwrap();
    s.add_group(GroupHparams::default()).unwrap();
    let vm_size = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .unwrap()
        * 1024;
    let limit = libc::rlimit { rlim_cur: vm_size + HEADROOM, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: setrlimit reads the struct it is given, which lives on this stack.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0);
    let measured = HostMemory::measure().unwrap();
    assert_eq!(measured.bound, MemoryBound::AddressSpace, "{measured:?}");
    // What the limit leaves is about the headroom, more where the process has unmapped memory
    // since (an idle malloc arena of 64 MiB): below the large sub-group's moments in any case.
    assert!((measured.available as u64) < MOMENTS_BYTES, "{measured:?}");

    let slices = |n| vec![SliceDesc { name: format!("w{n}"), offset: 0, numel: n }];
    // SAFETY: `large` and `small` outlive the session (dropped after it, below).
    let master = unsafe { Borrowed::new("large", large.as_mut_ptr().cast(), LARGE, DType::F32) }.unwrap();
    let e = s.add_subgroup(SubGroupDesc::new(0, master, slices(LARGE))).unwrap_err();
    assert_eq!(e.status, Status::OutOfResources, "{e:?}");
    for words in ["512.00 MiB of host memory for the Adam moments", "address-space limit", "bf16 moments"] {
        assert!(e.message.contains(words), "{words:?} in {}", e.message);
    }
    assert_eq!(s.host_bytes(), 0, "nothing stays allocated");

    // SAFETY: as above.
    let master = unsafe { Borrowed::new("small", small.as_mut_ptr().cast(), small.len(), DType::F32) }.unwrap();
    s.add_subgroup(SubGroupDesc::new(0, master, slices(small.len()))).unwrap();
    s.begin_step(None, 1).unwrap();
    s.grad_copy(0, Floats::F32(&vec![1e-3; small.len()])).unwrap();
    let t = s.step(StepArgs { max_norm: 1.0, norm: NormSource::Local, overflow: false }).unwrap();
    s.wait(t, None).unwrap();
    drop(s);
    assert!(small[0] < 0.5, "the small sub-group stepped");
    drop(large);
    println!("refused as expected");
}
