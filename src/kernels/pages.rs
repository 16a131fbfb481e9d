//! How the host memory the passes stream through is backed.

/// Bytes of a transparent huge page (x86-64; arm64 with 4 KiB pages).
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Asks Linux to back the whole 2 MiB pages of `[ptr, ptr + bytes)` with transparent huge
/// pages, where the system leaves them to `madvise`. Call it on a fresh allocation before its
/// first touch, which is when its pages are chosen: a pass streaming through gigabytes of
/// state then misses the TLB once per 2 MiB of each buffer rather than once per 4 KiB
/// (docs/performance.md, "Huge pages for the host state"). Advice only: refused or
/// elsewhere, nothing changes.
pub fn advise_huge_pages(ptr: *mut u8, bytes: usize) {
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE_BYTES);
    let end = (ptr as usize).saturating_add(bytes) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
    if end <= start {
        return;
    }
    #[cfg(target_os = "linux")]
    // SAFETY: MADV_HUGEPAGE changes how the mapped pages of a range are backed, never what
    // they hold; on memory that is not mapped it fails with no effect.
    unsafe {
        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
    }
}
