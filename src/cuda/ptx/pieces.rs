//! The instruction sequences more than one kernel uses, each written once: a thread's place
//! in the grid, the elements of a batch, and the rounding of f32 bits to bf16 and f16 exactly
//! as `kernels::dtype` rounds on the CPU.

use super::writer::{Ptx, ptx};

/// A grid-stride walk in batches: each thread takes its elements a batch at a time, S apart
/// (S: the grid's threads). The registers that hold the calling thread's place in it.
pub(super) struct GridStride<'a> {
    /// The batch's first element (at the start, the global thread index).
    first: &'a str,
    /// S, between a batch's elements.
    stride: &'a str,
    /// What `first` advances by from one batch to the next.
    batch_stride: &'a str,
}

impl<'a> GridStride<'a> {
    /// The walk in the registers `[first, stride, batch_stride]` (as the fields), set for the
    /// calling thread's first batch of `batch` elements (a power of two). `scratch` holds
    /// %ctaid.x, %ntid.x, %tid.x, %nctaid.x (u32) and %tid.x widened; `stride_note` is the
    /// comment on `stride`.
    pub(super) fn start(
        out: &mut Ptx,
        [first, stride, batch_stride]: [&'a str; 3],
        [block, block_threads, thread, blocks, thread_wide]: [&str; 5],
        batch: usize,
        stride_note: &str,
    ) -> GridStride<'a> {
        global_thread_index(out, [block, block_threads, thread], thread_wide, first, "the batch's first element");
        assert!(batch.is_power_of_two(), "the batch stride is a shift");
        let shift = batch.trailing_zeros();
        ptx!(
            out,
            "mov.u32 {blocks}, %nctaid.x;
             mul.wide.u32 {stride}, {blocks}, {block_threads};  // {stride_note}
             shl.b64 {batch_stride}, {stride}, {shift};  // {batch} S: the grid's batch"
        );
        GridStride { first, stride, batch_stride }
    }

    /// The register holding the batch's first element.
    pub(super) fn first(&self) -> &'a str {
        self.first
    }

    /// The element of the batch's slot `slot`: `first` for slot 0, else `cursor` set to the
    /// element S past the slot before's. Returns the register that holds it.
    pub(super) fn element(&self, out: &mut Ptx, slot: usize, cursor: &'a str) -> &'a str {
        let (first, stride) = (self.first, self.stride);
        match slot {
            0 => return first,
            1 => ptx!(out, "add.u64 {cursor}, {first}, {stride};"),
            _ => ptx!(out, "add.u64 {cursor}, {cursor}, {stride};"),
        }
        cursor
    }

    /// Advances `first` to the next batch.
    pub(super) fn next_batch(&self, out: &mut Ptx) {
        let (first, batch_stride) = (self.first, self.batch_stride);
        ptx!(out, "add.u64 {first}, {first}, {batch_stride};");
    }
}

/// `index` = ctaid * ntid + tid, the calling thread's index in the grid (`note`: its comment).
pub(super) fn global_thread_index(
    out: &mut Ptx,
    [block, block_threads, thread]: [&str; 3],
    wide: &str,
    index: &str,
    note: &str,
) {
    ptx!(
        out,
        "mov.u32 {block}, %ctaid.x;
         mov.u32 {block_threads}, %ntid.x;
         mov.u32 {thread}, %tid.x;
         mul.wide.u32 {index}, {block}, {block_threads};
         cvt.u64.u32 {wide}, {thread};
         add.u64 {index}, {index}, {wide};  // {note}"
    );
}

/// `nan` = whether the f32 `bits` are a NaN; `abs` keeps them without the sign.
pub(super) fn nan_test(out: &mut Ptx, bits: &str, abs: &str, nan: &str) {
    ptx!(
        out,
        "and.b32 {abs}, {bits}, 0x7fffffff;
         setp.gt.u32 {nan}, {abs}, 0x7f800000;"
    );
}

/// `rounded` = the top half of the f32 `bits` rounded to nearest even (`lsb`: scratch).
pub(super) fn bf16_round_nearest_even(out: &mut Ptx, bits: &str, lsb: &str, rounded: &str) {
    ptx!(
        out,
        "shr.u32 {lsb}, {bits}, 16;
         and.b32 {lsb}, {lsb}, 1;
         add.u32 {rounded}, {bits}, 0x7fff;
         add.u32 {rounded}, {rounded}, {lsb};
         shr.u32 {rounded}, {rounded}, 16;"
    );
}

/// `half` = the rounded bf16, every NaN made 0x7FC0 (through the 32-bit `wide`).
pub(super) fn bf16_quiet_nan(out: &mut Ptx, rounded: &str, nan: &str, wide: &str, half: &str) {
    ptx!(
        out,
        "selp.b32 {wide}, 0x7fc0, {rounded}, {nan};
         cvt.u16.u32 {half}, {wide};"
    );
}

/// The registers of an f32 to bf16 conversion: `bits` in, `half` out, the others scratch
/// (`wide` may be `rounded`).
pub(super) struct Bf16<'a> {
    pub(super) bits: &'a str,
    pub(super) lsb: &'a str,
    pub(super) rounded: &'a str,
    pub(super) abs: &'a str,
    pub(super) nan: &'a str,
    pub(super) wide: &'a str,
    pub(super) half: &'a str,
}

/// `half` = the bf16 of the f32 `bits`.
pub(super) fn bf16_from_bits(out: &mut Ptx, registers: &Bf16) {
    let Bf16 { bits, lsb, rounded, abs, nan, wide, half } = *registers;
    bf16_round_nearest_even(out, bits, lsb, rounded);
    nan_test(out, bits, abs, nan);
    bf16_quiet_nan(out, rounded, nan, wide, half);
}

/// `half` = the f16 NaN of the f32 NaN `bits` (`abs`: them without the sign): its sign and
/// top payload bits, quieted.
pub(super) fn f16_quiet_nan(out: &mut Ptx, bits: &str, abs: &str, [sign, payload]: [&str; 2], half: &str) {
    ptx!(
        out,
        "shr.u32 {sign}, {bits}, 16;
         and.b32 {sign}, {sign}, 0x8000;
         shr.u32 {payload}, {abs}, 13;
         and.b32 {payload}, {payload}, 0x3ff;
         or.b32 {payload}, {payload}, 0x7e00;
         or.b32 {payload}, {payload}, {sign};
         cvt.u16.u32 {half}, {payload};"
    );
}
