//! What a hand-off may cost besides time: allocations, counted per thread and in all by a
//! counting global allocator, and the calling thread's context switches.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

struct Counting;

static ALL_ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD_ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn note_alloc() {
    ALL_ALLOCS.fetch_add(1, Ordering::Relaxed);
    let _ = THREAD_ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards to the system allocator, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc();
        // SAFETY: our caller meets `GlobalAlloc::alloc`'s contract, which is `System`'s too.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc();
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note_alloc();
        // SAFETY: `ptr` came from `System` through this allocator, with `layout` (the caller's
        // contract of `realloc`).
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as in `realloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// (voluntary, involuntary) context switches of the calling thread so far: voluntary ones
/// mean it blocked (a contended lock, a wait), involuntary ones that it was preempted.
pub fn context_switches() -> (i64, i64) {
    // SAFETY: a zeroed rusage is valid; RUSAGE_THREAD fills it for this thread.
    unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut u);
        (u.ru_nvcsw as i64, u.ru_nivcsw as i64)
    }
}

/// Allocations the calling thread has made so far.
pub fn my_allocs() -> u64 {
    THREAD_ALLOCS.with(Cell::get)
}

/// Allocations every thread has made so far.
pub fn all_allocs() -> u64 {
    ALL_ALLOCS.load(Ordering::Relaxed)
}
