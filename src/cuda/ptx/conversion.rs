//! `so_f32_to_bf16` and `so_f32_to_f16`: an f32 staging buffer published into 16-bit
//! parameters, `dst[i]` = `src[i]` rounded as `kernels::dtype` rounds on the CPU. One emitter
//! writes both; they differ only in the conversion.

use super::pieces::{Bf16, GridStride, bf16_from_bits, f16_quiet_nan, nan_test};
use super::writer::{Ptx, ptx};

/// Elements a thread loads before it stores the first: the loads in flight per thread.
const SLOTS: usize = 4;
/// The predicate register after the slots' (%p2..): whether the element converted is a NaN.
const NAN_PREDICATE: usize = SLOTS + 2;

/// The 16-bit type a conversion kernel writes.
#[derive(Clone, Copy)]
enum Target {
    Bf16,
    F16,
}

pub(super) fn emit(out: &mut Ptx) {
    ptx!(
        out,
        "// Each thread converts its elements in batches of {SLOTS}, S apart (S: the grid's threads),
         // loading all {SLOTS} before it stores the first: {SLOTS} loads in flight, not one."
    );
    kernel(out, Target::Bf16);
    out.blank();
    kernel(out, Target::F16);
}

fn kernel(out: &mut Ptx, target: Target) {
    let name = match target {
        Target::Bf16 => "so_f32_to_bf16",
        Target::F16 => "so_f32_to_f16",
    };
    out.entry(name, &[".u64 src", ".u64 dst", ".u64 n"]);
    ptx!(
        out,
        ".reg .pred %p<8>;
         .reg .b16 %h<8>;
         .reg .f32 %f<4>;
         .reg .b32 %r<16>;
         .reg .b32 %x<{SLOTS}>;
         .reg .b64 %rd<16>;"
    );
    out.blank();
    out.lines(
        "ld.param.u64 %rd1, [src];
         ld.param.u64 %rd2, [dst];
         ld.param.u64 %rd3, [n];
         cvta.to.global.u64 %rd1, %rd1;
         cvta.to.global.u64 %rd2, %rd2;",
    );
    // The batch's first element in %rd4, S in %rd6, the next batch %rd11 on.
    let grid = GridStride::start(
        out,
        ["%rd4", "%rd6", "%rd11"],
        ["%r1", "%r2", "%r3", "%r4", "%rd5"],
        SLOTS,
        "S: the grid's threads",
    );
    let first = grid.first();
    ptx!(
        out,
        "{name}_batch:
         setp.ge.u64 %p1, {first}, %rd3;
         @%p1 bra {name}_done;"
    );
    // %p2.. : whether each slot's element is in range (%p1: the batch's first).
    let in_range = |slot: usize| format!("%p{}", slot + 2);
    for slot in 0..SLOTS {
        let element = grid.element(out, slot, "%rd7");
        let in_range = in_range(slot);
        ptx!(
            out,
            "setp.lt.u64 {in_range}, {element}, %rd3;
             shl.b64 %rd8, {element}, 2;
             add.u64 %rd8, %rd1, %rd8;
             @{in_range} ld.global.u32 %x{slot}, [%rd8];"
        );
    }
    for slot in 0..SLOTS {
        let element = grid.element(out, slot, "%rd7");
        ptx!(out, "mov.b32 %r5, %x{slot};");
        convert(out, target);
        ptx!(
            out,
            "shl.b64 %rd9, {element}, 1;
             add.u64 %rd10, %rd2, %rd9;
             @{} st.global.u16 [%rd10], %h1;",
            in_range(slot)
        );
    }
    grid.next_batch(out);
    ptx!(
        out,
        "bra {name}_batch;
         {name}_done:
         ret;
         }}"
    );
}

/// %h1 = the f32 bits in %r5, rounded to `target`.
fn convert(out: &mut Ptx, target: Target) {
    let nan = &format!("%p{NAN_PREDICATE}");
    let (bits, abs) = ("%r5", "%r8");
    match target {
        Target::Bf16 => {
            bf16_from_bits(out, &Bf16 { bits, lsb: "%r6", rounded: "%r7", abs, nan, wide: "%r9", half: "%h1" });
        }
        Target::F16 => {
            ptx!(
                out,
                "mov.b32 %f1, {bits};
                 cvt.rn.f16.f32 %h2, %f1;"
            );
            nan_test(out, bits, abs, nan);
            f16_quiet_nan(out, bits, abs, ["%r6", "%r7"], "%h3");
            ptx!(out, "selp.b16 %h1, %h3, %h2, {nan};");
        }
    }
}
