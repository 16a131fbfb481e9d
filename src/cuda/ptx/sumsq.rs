//! `so_sumsq_partials`: the per-block f64 partials of a gradient's sum of squares, the same
//! bits as the CPU kernels' (which the host sums in block order).

use super::pieces::global_thread_index;
use super::writer::{Ptx, ptx};

/// Elements per partial: the CPU kernels' block.
const BLOCK: usize = 8192;
/// The CPU kernels' lanes in a block, reduced at its end by a tree of halvings.
const LANES: usize = 8;
/// A lane's elements loaded together while all of them are in the block.
const BATCH: usize = 16;

pub(super) fn emit(out: &mut Ptx) {
    ptx!(
        out,
        "// Sum of squares of scale * g, one f64 partial per block of {BLOCK} elements, exactly as the CPU
         // kernels take it: element i of a block goes to lane i % {LANES}, each lane adds its squares in
         // order with one rounding each, and the {LANES} lanes are reduced by the tree
         // (l0+l4, l1+l5, l2+l6, l3+l7), then pairs two apart, then the last two.
         // One thread per (block, lane); the grid covers every block (threads past the end add
         // nothing and still take part in the shuffles). With `copy` (not 0) each element read is
         // also stored there, at the same index: a device-placed sub-group's gradient lands in its
         // device buffer in the pass that sums it, not in a second read."
    );
    out.entry(
        "so_sumsq_partials",
        &[".u64 g", ".u64 n", ".u32 dtype", ".f32 scale", ".u64 partials", ".u64 blocks", ".u64 copy"],
    );
    ptx!(
        out,
        ".reg .pred %p<14>;
         .reg .b16 %h<2>;
         .reg .b32 %r<16>;
         .reg .f32 %f<4>;
         .reg .f64 %d<8>;
         .reg .b64 %rd<24>;
         .reg .b16 %hb<{BATCH}>;
         .reg .b32 %rb<{BATCH}>;
         .reg .f32 %fb<{BATCH}>;
         .reg .f64 %db<{BATCH}>;
         .reg .b64 %ab<{BATCH}>;"
    );
    out.blank();
    out.lines(
        "ld.param.u64 %rd1, [g];
         ld.param.u64 %rd2, [n];
         ld.param.u32 %r1, [dtype];
         ld.param.f32 %f1, [scale];
         ld.param.u64 %rd3, [partials];
         ld.param.u64 %rd4, [blocks];
         ld.param.u64 %rd20, [copy];
         setp.ne.u64 %p10, %rd20, 0;  // copying
         cvta.to.global.u64 %rd1, %rd1;
         cvta.to.global.u64 %rd3, %rd3;
         cvta.to.global.u64 %rd20, %rd20;
         sub.u64 %rd20, %rd20, %rd1;  // copy - g: added to a load's address, its store's",
    );
    global_thread_index(out, ["%r2", "%r3", "%r4"], "%rd6", "%rd5", "global thread index");
    let lane_bits = LANES.trailing_zeros();
    ptx!(
        out,
        "shr.u64 %rd7, %rd5, {lane_bits};  // block
         and.b64 %rd8, %rd5, {};  // lane
         mov.f64 %d1, 0d0000000000000000;  // accumulator
         setp.ge.u64 %p1, %rd7, %rd4;
         @%p1 bra sq_reduce;
         mul.lo.u64 %rd9, %rd7, {BLOCK};
         add.u64 %rd10, %rd9, %rd8;  // first element
         add.u64 %rd11, %rd9, {BLOCK};
         min.u64 %rd11, %rd11, %rd2;  // block end
         setp.eq.u32 %p2, %r1, 1;  // f32
         setp.eq.u32 %p3, %r1, 2;  // bf16 (else f16)
         or.pred %p8, %p2, %p3;
         not.pred %p8, %p8;  // f16
         and.pred %p11, %p10, %p2;  // copying f32
         not.pred %p12, %p2;
         and.pred %p12, %p10, %p12;  // copying 16-bit",
        LANES - 1
    );
    batches(out);
    remainder(out);
    reduce(out);
}

/// The lane's elements `BATCH` at a time while the batch's last is in the block.
fn batches(out: &mut Ptx) {
    ptx!(
        out,
        "// Batches of {BATCH} of the lane's elements while all {BATCH} are in the block: the loads are
         // independent and issued together, the squares then added in order (the same bits as
         // one element at a time, with {BATCH} loads in flight instead of one).
         selp.u64 %rd16, 4, 2, %p2;  // element bytes
         shl.b64 %rd17, %rd16, {};  // bytes between a lane's elements
         sq_batch:
         add.u64 %rd18, %rd10, {};  // the batch's last element
         setp.ge.u64 %p9, %rd18, %rd11;
         @%p9 bra sq_loop;
         mul.lo.u64 %rd19, %rd10, %rd16;
         add.u64 %ab0, %rd1, %rd19;",
        LANES.trailing_zeros(),
        (BATCH - 1) * LANES
    );
    // Every address and load first, so that all BATCH loads are in flight before the first
    // use; then the copies, the widening and the squares, each in element order.
    for slot in 1..BATCH {
        ptx!(out, "add.u64 %ab{slot}, %ab{}, %rd17;", slot - 1);
    }
    for slot in 0..BATCH {
        ptx!(
            out,
            "@%p2 ld.global.f32 %fb{slot}, [%ab{slot}];
             @!%p2 ld.global.u16 %hb{slot}, [%ab{slot}];"
        );
    }
    for slot in 0..BATCH {
        ptx!(
            out,
            "add.u64 %rd21, %ab{slot}, %rd20;
             @%p11 st.global.f32 [%rd21], %fb{slot};
             @%p12 st.global.u16 [%rd21], %hb{slot};"
        );
    }
    for slot in 0..BATCH {
        let (half, value) = (format!("%hb{slot}"), format!("%fb{slot}"));
        widen_bf16(out, "@%p3 ", &half, &format!("%rb{slot}"), &value);
        ptx!(out, "@%p8 cvt.f32.f16 {value}, {half};");
    }
    for slot in 0..BATCH {
        let value = format!("%fb{slot}");
        add_square(out, &value, &value, &format!("%db{slot}"));
    }
    ptx!(
        out,
        "add.u64 %rd10, %rd10, {};
         bra.uni sq_batch;",
        BATCH * LANES
    );
}

/// The lane's last elements, one at a time.
fn remainder(out: &mut Ptx) {
    out.lines(
        "sq_loop:
         setp.ge.u64 %p4, %rd10, %rd11;
         @%p4 bra sq_reduce;
         @%p2 bra sq_f32;
         shl.b64 %rd12, %rd10, 1;
         add.u64 %rd13, %rd1, %rd12;
         ld.global.u16 %h1, [%rd13];
         add.u64 %rd21, %rd13, %rd20;
         @%p10 st.global.u16 [%rd21], %h1;
         @%p3 bra sq_bf16;
         cvt.f32.f16 %f2, %h1;
         bra.uni sq_add;
         sq_bf16:",
    );
    widen_bf16(out, "", "%h1", "%r5", "%f2");
    out.lines(
        "bra.uni sq_add;
         sq_f32:
         shl.b64 %rd12, %rd10, 2;
         add.u64 %rd13, %rd1, %rd12;
         ld.global.f32 %f2, [%rd13];
         add.u64 %rd21, %rd13, %rd20;
         @%p10 st.global.f32 [%rd21], %f2;
         sq_add:",
    );
    add_square(out, "%f2", "%f3", "%d2");
    ptx!(
        out,
        "add.u64 %rd10, %rd10, {LANES};
         bra.uni sq_loop;"
    );
}

/// The lanes' tree, each level adding the lane half the width away (shuffled as two 32-bit
/// halves); lane 0 stores the block's partial.
fn reduce(out: &mut Ptx) {
    out.lines("sq_reduce:");
    // The shuffles stay within each block's lanes: segment mask and clamp of LANES-wide groups.
    let segment = ((32 - LANES) << 8) | 0x1f;
    let levels = [
        (LANES / 2, "%d1", "%d4", "lanes j < 4: l_j + l_{j+4}"),
        (LANES / 4, "%d4", "%d5", "lanes j < 2: s_j + s_{j+2}"),
        (LANES / 8, "%d5", "%d6", "lane 0: t_0 + t_1"),
    ];
    for (distance, sum, next, note) in levels {
        ptx!(
            out,
            "// {note}
             mov.b64 {{%r6, %r7}}, {sum};
             shfl.sync.down.b32 %r8, %r6, {distance}, {segment:#x}, 0xffffffff;
             shfl.sync.down.b32 %r9, %r7, {distance}, {segment:#x}, 0xffffffff;
             mov.b64 %d3, {{%r8, %r9}};
             add.rn.f64 {next}, {sum}, %d3;"
        );
    }
    out.lines(
        "setp.ne.u64 %p5, %rd8, 0;
         or.pred %p5, %p5, %p1;
         @%p5 bra sq_done;
         shl.b64 %rd14, %rd7, 3;
         add.u64 %rd15, %rd3, %rd14;
         st.global.f64 [%rd15], %d6;
         sq_done:
         ret;
         }",
    );
}

/// `value` = the bf16 `half` widened (exactly: its bits are the f32's top half), through the
/// 32-bit `wide`; each instruction under `guard` ("" or a predicate).
fn widen_bf16(out: &mut Ptx, guard: &str, half: &str, wide: &str, value: &str) {
    ptx!(
        out,
        "{guard}cvt.u32.u16 {wide}, {half};
         {guard}shl.b32 {wide}, {wide}, 16;
         {guard}mov.b32 {value}, {wide};"
    );
}

/// The accumulator %d1 += (`value` * scale)², the product rounded to f32 (`scaled`), then
/// widened to f64 (`wide`) and squared and added with one rounding.
fn add_square(out: &mut Ptx, value: &str, scaled: &str, wide: &str) {
    ptx!(
        out,
        "mul.rn.f32 {scaled}, {value}, %f1;
         cvt.f64.f32 {wide}, {scaled};
         fma.rn.f64 %d1, {wide}, {wide}, %d1;"
    );
}
