//! The automatic budget (`SessionOptions::GPU_BUDGET_AUTO`). After [`AUTO_BUDGET_AFTER`] steps
//! the caller's allocator holds its peak (PyTorch's caching allocator keeps what a step
//! reserved), so the device's free memory then is what the optimizer may take: the budget is
//! that less a headroom ([`AutoBudget::measured`]), within the limit the caller gave where its
//! allocator works under a cap the device does not show (PyTorch's per-process memory
//! fraction). The split places sub-groups within it as within an explicit budget: as many as
//! the exposed time asks for, not all that fit. A device-placed parameter is not free for the
//! GPU: its step moves 28 bytes and its gradient's copy 4 through the GPU's memory, where a
//! host-placed one whose step hides in the backward costs the GPU the sum of squares and the
//! publication of its weights (6 bytes with a bf16 copy); each launch of the step fills the
//! GPU, so it serializes with the forward beside it. Where speculative steps hide on the CPU (the factor
//! unchanged) the split stays small; where they cannot (clipping every step) the exposed
//! time grows it to the budget. Sub-groups the caller placed on the device count against it
//! as they do against an explicit budget.

/// Steps given to `step()` before the automatic budget measures the device's free memory.
pub(crate) const AUTO_BUDGET_AFTER: u64 = 3;
/// The automatic budget leaves at least this much device memory free...
const HEADROOM_MIN_BYTES: usize = 1 << 30;
/// ...and at least this fraction of the device's memory: room for what the caller allocates
/// later (fragmentation, a longer batch, an evaluation pass).
const HEADROOM_FRACTION: f64 = 0.05;

/// What the automatic budget measured and chose (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AutoBudget {
    /// Free device memory, within the caller's limit where it gave one.
    pub(crate) free: usize,
    pub(crate) total: usize,
    /// The caller's limit on free memory (`Session::limit_device_memory`).
    pub(crate) limit: Option<usize>,
    pub(crate) headroom: usize,
    /// `free - headroom`, 0 where the headroom takes it all.
    pub(crate) budget: usize,
}

impl AutoBudget {
    /// The budget left by a device with `free` of `total` bytes free, of which the caller
    /// lets the session take at most `limit`. The headroom is a fraction of the memory in
    /// question: the device's, or the limit where it is smaller.
    pub(crate) fn measured(free: usize, total: usize, limit: Option<usize>) -> AutoBudget {
        let free = limit.map_or(free, |l| free.min(l));
        let usable = limit.map_or(total, |l| total.min(l));
        let headroom = HEADROOM_MIN_BYTES.max((usable as f64 * HEADROOM_FRACTION) as usize);
        AutoBudget { free, total, limit, headroom, budget: free.saturating_sub(headroom) }
    }

    /// The device refused a placement: the budget ends at `bytes`, what the sub-groups placed
    /// before it hold.
    pub(crate) fn end_at(&mut self, bytes: usize) {
        self.budget = bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: usize = 1 << 30;

    #[test]
    fn the_budget_is_the_free_memory_less_the_headroom() {
        let b = AutoBudget::measured(30 * GIB, 80 * GIB, None);
        assert_eq!((b.headroom, b.budget), (4 * GIB, 26 * GIB), "5 % of an 80 GiB device");
        let b = AutoBudget::measured(3 * GIB, 16 * GIB, None);
        assert_eq!((b.headroom, b.budget), (GIB, 2 * GIB), "at least 1 GiB");
        assert_eq!(AutoBudget::measured(GIB / 2, 16 * GIB, None).budget, 0, "the headroom takes it all");
    }
}
