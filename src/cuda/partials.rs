//! Where a sub-group's sums of squares are summed: one f64 partial per block of its slices'
//! elements, on the device and, copied, in pinned host memory.

use std::ops::Range;

use super::driver::CUdeviceptr;
use super::events::Event;
use super::memory::{DeviceBuffer, PinnedBox};
use crate::error::Result;

/// Elements per partial of a sum of squares (the CPU kernels' block).
pub(super) const SUMSQ_BLOCK: usize = 8192;

/// The block partials of a sub-group's slices' sums of squares, on the device and in pinned
/// host memory.
pub(crate) struct SumsqPartials {
    /// Per slice: its partials' indices.
    spans: Vec<Range<usize>>,
    dev: DeviceBuffer,
    host: PinnedBox<f64>,
    /// Per slice: recorded after its partials' copy to the host, until consumed.
    ready: Vec<Option<Event>>,
}

impl SumsqPartials {
    /// Room for the partials of `slices` (element ranges).
    pub(crate) fn new(slices: &[Range<usize>]) -> Result<SumsqPartials> {
        let mut spans = Vec::with_capacity(slices.len());
        let mut total = 0;
        for r in slices {
            let count = r.len().div_ceil(SUMSQ_BLOCK);
            spans.push(total..total + count);
            total += count;
        }
        let dev = DeviceBuffer::alloc(total * 8)?;
        let host = PinnedBox::zeros(total)?;
        Ok(SumsqPartials { spans, dev, host, ready: slices.iter().map(|_| None).collect() })
    }

    /// Where slice `slice`'s partials go: how many, on the device and in host memory.
    pub(crate) fn slice_targets(&mut self, slice: usize) -> (usize, CUdeviceptr, *mut u8) {
        let span = self.spans[slice].clone();
        (span.len(), self.dev.at(span.start * 8), self.host.dst_at(span.start))
    }

    /// Records that slice `slice`'s partials are on their way to the host.
    pub(crate) fn set_ready(&mut self, slice: usize, copied: Event) {
        self.ready[slice] = Some(copied);
    }

    /// The event of slice `slice`'s copy, if it is unconsumed; consumes it.
    pub(crate) fn take_ready(&mut self, slice: usize) -> Option<Event> {
        self.ready[slice].take()
    }

    /// Slice `slice`'s sum of squares, its partials added in block order (as the CPU kernels
    /// add theirs), once its copy has landed.
    pub(crate) fn slice_sum(&self, slice: usize) -> f64 {
        self.host.as_slice()[self.spans[slice].clone()].iter().sum()
    }

    pub(crate) fn host_bytes(&self) -> usize {
        self.host.as_slice().len() * 8
    }

    /// The events of copies still unconsumed.
    pub(crate) fn pending(&self) -> impl Iterator<Item = &Event> {
        self.ready.iter().flatten()
    }

    /// Takes every event still unconsumed.
    pub(crate) fn take_pending(&mut self) -> impl Iterator<Item = Event> + '_ {
        self.ready.iter_mut().filter_map(Option::take)
    }
}
