//! Gradient copies: device gradients to the session's pinned host buffers in pieces on two
//! copy streams (or, for a sub-group whose gradient stays on the device, into its device
//! gradient, by the pass that sums it, read back in bounded pieces for each CPU pass), and
//! each slice's sum of squares taken on the GPU as it arrives, its block partials copied to
//! pinned host memory for the session to add.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::attached::SgDevice;
use super::driver::{self, CUdeviceptr, CUstream, Kernel, Kernels, Raw, dtype_code};
use super::events::{Event, EventPool};
use super::faults::CopyFaults;
use super::memory::floats_mut_ptr;
use super::partials::SumsqPartials;
use super::slots::{SLOTS, Slots};
use crate::error::{Error, Result, Status};
use crate::kernels::{DType, Floats};
use crate::session::{HandOff, HandedSumsq};

/// Threads per thread block of `so_sumsq_partials` (eight per partial). Small, so that a
/// slice's partials spread over every SM: each lane's loads wait on memory latency.
const SUMSQ_THREADS: usize = 64;

/// What `so_sumsq_partials` reads: `numel` gradient elements at `src`, summed times `scale`;
/// and where it copies them (`copy`, 0: nowhere).
struct SumsqSource {
    src: CUdeviceptr,
    numel: usize,
    dtype: DType,
    scale: f32,
    copy: CUdeviceptr,
}

/// The transport's gradient copies: the streams they run on, the size of their pieces, the
/// slots a gradient kept on the device is read back through, and the copy faults of the GPU
/// fault tests. The transport owns one and hands it what the copies share with the rest of
/// it (the kernels, the event pool, the attached sub-group).
pub(super) struct GradientCopies {
    /// Gradient copies; the first also carries the end of every copy sequence.
    d2h: [Raw<CUstream>; 2],
    /// Sums of squares and gradients that land on the device.
    side: Raw<CUstream>,
    piece_bytes: usize,
    /// The session's accumulation dtype: of the gradients on the device.
    accum_dtype: DType,
    /// Pieces of gradients kept on the device, on their way to a pass.
    slots: Mutex<Slots>,
    faults: CopyFaults,
    events: Arc<EventPool>,
}

impl GradientCopies {
    pub(super) fn new(
        d2h: [Raw<CUstream>; 2],
        side: Raw<CUstream>,
        piece_bytes: usize,
        accum_dtype: DType,
        events: Arc<EventPool>,
    ) -> Self {
        let slots = Mutex::new(Slots::new(SLOTS));
        GradientCopies { d2h, side, piece_bytes, accum_dtype, slots, faults: CopyFaults::from_env(), events }
    }

    pub(super) fn accum_dtype(&self) -> DType {
        self.accum_dtype
    }

    /// The stream every gradient copy ends on.
    pub(super) fn copy_stream(&self) -> CUstream {
        self.d2h[0].0
    }

    /// The stream of the sums of squares and of the writes into device gradients.
    pub(super) fn side_stream(&self) -> CUstream {
        self.side.0
    }

    /// The three streams, the copy stream first.
    pub(super) fn streams(&self) -> [Raw<CUstream>; 3] {
        [self.d2h[0], self.d2h[1], self.side]
    }

    /// Host bytes the slots page-locked.
    pub(super) fn slot_bytes(&self) -> usize {
        self.slots.lock().unwrap().bytes()
    }

    /// Queues the copy of a device gradient, produced on `stream`, into the host place the
    /// session gave it (or into `dev`'s device gradient), and its sum of squares on the GPU
    /// when the session asks for one.
    pub(super) fn land(
        &self,
        kernels: &Kernels,
        dev: &mut SgDevice,
        h: HandOff<'_>,
        src: CUdeviceptr,
        dtype: DType,
        stream: CUstream,
    ) -> Result<Option<HandedSumsq>> {
        let size = dtype.size();
        // A gradient that stays on the device is copied there by the pass that sums it (once
        // the device step before, if any, has read the gradient there).
        let on_device = dev.device_gradient_at(h.range.start * size);
        let host = match (on_device, h.dst) {
            (Some(_), _) if h.late || h.sumsq_scale.is_none() => {
                return Err(Error::unsupported(
                    "a sub-group whose gradient stays on the device takes each slice's gradient once per step, at the \
                     last micro-step (no late gradients)",
                ));
            }
            (Some(_), _) => None,
            (None, Some(mut dst)) => {
                if dst.dtype() != dtype {
                    return Err(Error::unsupported(format!(
                        "a {} device gradient cannot land in a {} host buffer: in CUDA sessions the gradient dtype is \
                         the accumulation dtype (bf16 gradients of f32 master weights cross the link once, in bf16)",
                        dtype.name(),
                        dst.dtype().name()
                    )));
                }
                Some(floats_mut_ptr(&mut dst))
            }
            (None, None) => return Err(Error::new(Status::Panic, "a gradient with nowhere to land")),
        };
        if on_device.is_some() && dtype != self.accum_dtype {
            return Err(Error::unsupported(format!(
                "a {} device gradient cannot land in the session's {} device gradient",
                dtype.name(),
                self.accum_dtype.name()
            )));
        }
        let side_used = h.sumsq_scale.is_some() || on_device.is_some();
        {
            let ready = self.events.record(stream)?;
            ready.wait_in(self.d2h[0].0)?;
            if side_used {
                ready.wait_in(self.side.0)?;
            }
        }
        if on_device.is_some()
            && let Some(stepped) = dev.stepped()
        {
            stepped.wait_in(self.side.0)?;
        }
        let handed = match h.sumsq_scale {
            Some(scale) => {
                let sumsq = SumsqSource { src, numel: h.range.len(), dtype, scale, copy: on_device.unwrap_or(0) };
                self.queue_sumsq(kernels, dev.partials_mut(), h.slice, sumsq)?;
                Some(HandedSumsq::Deferred)
            }
            None => None,
        };
        if h.sumsq_scale.is_some() {
            dev.partials_mut().set_ready(h.slice, self.events.record(self.side.0)?);
        }
        if side_used {
            // The copy stream ends every sequence: `record_stream` on it covers the reads of
            // the sum of squares and of the device-gradient copy too.
            self.events.record(self.side.0)?.wait_in(self.d2h[0].0)?;
        }
        if let Some((dst, bytes)) = host {
            self.copy_pieces(dst, src, bytes)?;
        }
        dev.copy_queued(self.events.record(self.d2h[0].0)?);
        Ok(handed)
    }

    /// Copies elements `range` of the gradient kept on the device at `src` to the host in pieces of at most `piece` elements through the slots, calling `f` on
    /// each in order while the next ones are in flight (on the second copy stream). A slot's
    /// failure, a failure of queued work, goes to `note` too.
    pub(super) fn read_kept(
        &self,
        src: CUdeviceptr,
        range: Range<usize>,
        piece: usize,
        note: &dyn Fn(&Error),
        f: &mut dyn FnMut(usize, Floats<'_>) -> Result<()>,
    ) -> Result<()> {
        let size = self.accum_dtype.size();
        let pieces: Vec<Range<usize>> =
            range.clone().step_by(piece.max(1)).map(|s| s..(s + piece).min(range.end)).collect();
        let stream = self.d2h[1].0;
        let mut slots = self.slots.lock().unwrap();
        slots.reserve(piece * size).inspect_err(note)?;
        let ahead = slots.len();
        let queue = |slots: &mut Slots, i: usize| -> Result<()> {
            let p = &pieces[i];
            let slot = slots.ready(i % ahead).inspect_err(note)?;
            driver::memcpy_dtoh_async(slot.ptr(), src + (p.start * size) as u64, p.len() * size, stream)?;
            slot.used_by(self.events.record(stream)?);
            Ok(())
        };
        for i in 0..pieces.len().min(ahead) {
            queue(&mut slots, i)?;
        }
        for (i, p) in pieces.iter().enumerate() {
            let slot = slots.ready(i % ahead).inspect_err(note)?;
            f(p.start, slot.floats(self.accum_dtype, p.len()))?;
            if i + ahead < pieces.len() {
                queue(&mut slots, i + ahead)?;
            }
        }
        Ok(())
    }

    /// Queues a slice's sum of squares on the side stream: block partials on the device, then
    /// their copy to the host.
    fn queue_sumsq(
        &self,
        kernels: &Kernels,
        partials: &mut SumsqPartials,
        slice: usize,
        sumsq: SumsqSource,
    ) -> Result<()> {
        let (count, out, host) = partials.slice_targets(slice);
        let SumsqSource { src: mut g, numel, dtype, mut scale, mut copy } = sumsq;
        let (mut n, mut code) = (numel as u64, dtype_code(dtype));
        let (mut out, mut blocks) = (out, count as u64);
        let threads = count * 8;
        kernels.launch(
            Kernel::Sumsq,
            threads.div_ceil(SUMSQ_THREADS) as u32,
            SUMSQ_THREADS as u32,
            self.side.0,
            &mut [&mut g, &mut n, &mut code, &mut scale, &mut out, &mut blocks, &mut copy],
        )?;
        driver::memcpy_dtoh_async(host, out, count * 8, self.side.0)
    }

    /// The device-to-host copy of one gradient, in pieces alternating the two copy streams,
    /// each waiting for the one before, the first stream ending with a wait on the last.
    fn copy_pieces(&self, dst: *mut u8, src: CUdeviceptr, bytes: usize) -> Result<()> {
        let pieces = bytes.div_ceil(self.piece_bytes).max(1);
        let mut previous: Option<Event> = None;
        for i in 0..pieces {
            let stream = self.d2h[i % 2].0;
            if let Some(p) = previous.take() {
                p.wait_in(stream)?;
            }
            let offset = i * self.piece_bytes;
            let len = self.piece_bytes.min(bytes - offset);
            if !self.faults.drops_piece(i, pieces) {
                // The session keeps `dst` alive and untouched until `gradient_ready` has
                // waited for this copy.
                driver::memcpy_dtoh_async(dst.wrapping_add(offset), src + offset as u64, len, stream)?;
            }
            previous = Some(self.events.record(stream)?);
        }
        let last = previous.expect("at least one piece");
        if pieces > 1 && !self.faults.skips_final_wait() {
            last.wait_in(self.d2h[0].0)?;
        }
        Ok(())
    }
}
