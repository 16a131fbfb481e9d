//! Bounded host buffers that pieces pass through between the session and the device: a few
//! page-locked slots used in turn, each remembering the copy that last used it, so that a
//! slot is written again only once that copy is done.

use super::events::{self, Event};
use super::memory::PinnedBox;
use crate::error::Result;
use crate::kernels::{DType, Floats, FloatsMut, bf16, f16};

/// Slots of each bounded buffer: one piece filled while others are in flight.
pub(super) const SLOTS: usize = 4;

/// One page-locked slot and the copy that last used it.
pub(crate) struct Slot {
    buf: PinnedBox<u64>,
    used: Option<Event>,
}

impl Slot {
    pub(crate) fn ptr(&mut self) -> *mut u8 {
        self.buf.dst_at(0)
    }

    /// The first `len` elements of `dtype` (within the slot's bytes, checked by `Slots`).
    pub(crate) fn floats_mut(&mut self, dtype: DType, len: usize) -> FloatsMut<'_> {
        assert!(len * dtype.size() <= self.buf.bytes(), "a slot holds {} bytes", self.buf.bytes());
        let ptr = self.buf.dst_at(0);
        // SAFETY: the slot's 8-byte-aligned allocation holds at least `len` elements of
        // `dtype` (asserted), every bit pattern is a valid float, and the borrow of `self`
        // keeps the memory alive and unaliased.
        unsafe {
            match dtype {
                DType::F32 => FloatsMut::F32(std::slice::from_raw_parts_mut(ptr.cast::<f32>(), len)),
                DType::Bf16 => FloatsMut::Bf16(std::slice::from_raw_parts_mut(ptr.cast::<bf16>(), len)),
                DType::F16 => FloatsMut::F16(std::slice::from_raw_parts_mut(ptr.cast::<f16>(), len)),
            }
        }
    }

    pub(crate) fn floats(&mut self, dtype: DType, len: usize) -> Floats<'_> {
        match self.floats_mut(dtype, len) {
            FloatsMut::F32(s) => Floats::F32(s),
            FloatsMut::Bf16(s) => Floats::Bf16(s),
            FloatsMut::F16(s) => Floats::F16(s),
        }
    }

    /// Records the copy that now uses the slot.
    pub(crate) fn used_by(&mut self, copy: Event) {
        self.used = Some(copy);
    }

    /// Waits for the copy that last used the slot.
    fn ready(&mut self) -> Result<()> {
        events::synchronize_all(self.used.take().into_iter().collect())
    }
}

/// `count` slots, allocated on first use, at least as large as the largest piece asked for.
pub(crate) struct Slots {
    count: usize,
    slots: Vec<Slot>,
    next: usize,
}

impl Slots {
    pub(crate) const fn new(count: usize) -> Slots {
        Slots { count, slots: Vec::new(), next: 0 }
    }

    pub(crate) fn len(&self) -> usize {
        self.count
    }

    /// Host bytes the slots hold.
    pub(crate) fn bytes(&self) -> usize {
        self.slots.iter().map(|s| s.buf.bytes()).sum()
    }

    /// Makes every slot hold at least `bytes` (a smaller one is replaced once its copy is done).
    pub(crate) fn reserve(&mut self, bytes: usize) -> Result<()> {
        if self.slots.len() == self.count && self.slots.iter().all(|s| s.buf.bytes() >= bytes) {
            return Ok(());
        }
        for slot in &mut self.slots {
            slot.ready()?;
        }
        self.slots.clear();
        let words = bytes.div_ceil(8).max(1);
        for _ in 0..self.count {
            self.slots.push(Slot { buf: PinnedBox::zeros(words)?, used: None });
        }
        Ok(())
    }

    /// Slot `i` (of `len()`), once its last copy is done. Call `reserve` first.
    pub(crate) fn ready(&mut self, i: usize) -> Result<&mut Slot> {
        let slot = &mut self.slots[i];
        slot.ready()?;
        Ok(slot)
    }

    /// The slot after the one this returned last, holding at least `bytes`, once ready.
    pub(crate) fn next_ready(&mut self, bytes: usize) -> Result<&mut Slot> {
        self.reserve(bytes)?;
        let i = self.next;
        self.next = (i + 1) % self.count;
        self.ready(i)
    }
}
