//! `so_adam_step`: the Adam step of device-placed sub-groups, and (`op` 1, 2) the rollback and
//! rescale of one, each the CPU kernels' operation sequence exactly (bit-identical results).

use super::pieces::{
    Bf16, GridStride, bf16_from_bits, bf16_quiet_nan, bf16_round_nearest_even, f16_quiet_nan, nan_test,
};
use super::writer::{Ptx, ptx};

/// Elements a thread loads before it steps the first: the loads in flight per thread.
const SLOTS: usize = 4;

/// The registers holding a batch's slots (prefix, type): p, and the raw bits of g, m, v.
const SLOT_REGISTERS: [(&str, &str); 4] = [("%sp", "f32"), ("%sg", "b32"), ("%sm", "b32"), ("%sv", "b32")];

pub(super) fn emit(out: &mut Ptx) {
    out.lines(
        "// One AdamW / Adam-L2 step of f32 master weights, in exactly the CPU kernels' operation
         // sequence (kernels/math.rs, Update), every operation rounded once (.rn; nothing fused that
         // the CPU does not fuse):
         //   g  = g * grad_scale;  Adam-L2: g = fma(wd, p, g)
         //   m  = fma(1-b1, g, b1*m);  v = fma(1-b2, g*g, b2*v)
         //   u  = m / (sqrt(v) / sqrt(bc2) + eps);  p = fma(-lr/bc1, u, p*decay)
         // dtypes (so_dtype codes): gradient f32/bf16/f16, moments f32/bf16, the copy written to
         // `out` none(0)/f32/bf16/f16; 16-bit stores round to nearest even (a bf16 NaN is 0x7FC0,
         // an f16 NaN keeps its sign and top payload bits, quieted), as on the CPU.",
    );
    out.entry(
        "so_adam_step",
        &[
            ".u64 p",
            ".u64 g",
            ".u64 m",
            ".u64 v",
            ".u64 out",
            ".u64 n",
            ".u32 g_dtype",
            ".u32 m_dtype",
            ".u32 out_dtype",
            ".f32 grad_scale",
            ".f32 beta1",
            ".f32 omb1",
            ".f32 beta2",
            ".f32 omb2",
            ".f32 eps",
            ".f32 sqrt_bc2",
            ".f32 step_size",
            ".f32 decay",
            ".f32 wd",
            ".u32 has_l2",
            ".u32 op",
            ".f32 new_scale",
        ],
    );
    ptx!(
        out,
        ".reg .pred %p<24>;
         .reg .b16 %h<8>;
         .reg .b32 %r<40>;
         .reg .f32 %f<64>;
         .reg .b64 %rd<40>;
         .reg .f32 %sp<{SLOTS}>;  // a batch's {SLOTS} slots: p, and the raw bits of g, m, v
         .reg .b32 %sg<{SLOTS}>, %sm<{SLOTS}>, %sv<{SLOTS}>;"
    );
    out.blank();
    parameters(out);
    batch_loads(out);
    step(out);
    stores(out);
    next_element(out);
    rollback(out);
    rescale(out);
    out.lines("}");
}

fn parameters(out: &mut Ptx) {
    out.lines(
        "ld.param.u64 %rd1, [p];
         ld.param.u64 %rd2, [g];
         ld.param.u64 %rd3, [m];
         ld.param.u64 %rd4, [v];
         ld.param.u64 %rd5, [out];
         ld.param.u64 %rd6, [n];
         ld.param.u32 %r1, [g_dtype];
         ld.param.u32 %r2, [m_dtype];
         ld.param.u32 %r3, [out_dtype];
         ld.param.f32 %f1, [grad_scale];
         ld.param.f32 %f2, [beta1];
         ld.param.f32 %f3, [omb1];
         ld.param.f32 %f4, [beta2];
         ld.param.f32 %f5, [omb2];
         ld.param.f32 %f6, [eps];
         ld.param.f32 %f7, [sqrt_bc2];
         ld.param.f32 %f8, [step_size];
         ld.param.f32 %f9, [decay];
         ld.param.f32 %f10, [wd];
         ld.param.u32 %r4, [has_l2];
         ld.param.u32 %r26, [op];
         ld.param.f32 %f28, [new_scale];
         cvta.to.global.u64 %rd1, %rd1;
         cvta.to.global.u64 %rd2, %rd2;
         cvta.to.global.u64 %rd3, %rd3;
         cvta.to.global.u64 %rd4, %rd4;
         cvta.to.global.u64 %rd5, %rd5;
         neg.f32 %f11, %f8;
         neg.f32 %f29, %f3;  // -(1-b1)
         neg.f32 %f30, %f5;  // -(1-b2)
         setp.eq.u32 %p12, %r26, 1;  // rollback
         setp.eq.u32 %p13, %r26, 2;  // rescale
         setp.eq.u32 %p1, %r1, 1;  // gradient f32
         setp.eq.u32 %p2, %r1, 2;  // gradient bf16 (else f16)
         setp.eq.u32 %p3, %r2, 1;  // moments f32 (else bf16)
         setp.ne.u32 %p4, %r4, 0;  // L2 term
         setp.eq.u32 %p5, %r3, 0;  // no copy
         setp.eq.u32 %p6, %r3, 1;  // f32 copy
         setp.eq.u32 %p7, %r3, 2;  // bf16 copy (else f16)
         setp.ne.u32 %p15, %r1, 1;
         not.pred %p16, %p2;
         and.pred %p16, %p16, %p15;  // gradient f16",
    );
}

/// The batch's `SLOTS` elements loaded into the slot registers, S apart (%rd9).
fn batch_loads(out: &mut Ptx) {
    ptx!(
        out,
        "// Each thread takes its elements in batches of {SLOTS}, S apart (S: the grid's threads), and
         // loads all {SLOTS} before it steps the first: one element's loads per thread left HBM idle
         // while its divisions ran. Each element is stepped alone, in the same sequence as before."
    );
    // The batch's first element in %rd7, S in %rd9, the next batch %rd30 on.
    let grid = GridStride::start(out, ["%rd7", "%rd9", "%rd30"], ["%r5", "%r6", "%r7", "%r8", "%rd8"], SLOTS, "S");
    out.lines(
        "ad_batch:
         setp.ge.u64 %p8, %rd7, %rd6;
         @%p8 bra ad_done;",
    );
    for slot in 0..SLOTS {
        let element = grid.element(out, slot, "%rd21");
        // %p18: in range; %p19, %p20: with an f32, a 16-bit gradient; %p21, %p22: with f32,
        // bf16 moments.
        ptx!(
            out,
            "setp.lt.u64 %p18, {element}, %rd6;  // slot {slot} in range
             and.pred %p19, %p18, %p1;
             and.pred %p20, %p18, %p15;
             and.pred %p21, %p18, %p3;
             xor.pred %p22, %p18, %p21;
             shl.b64 %rd10, {element}, 2;
             shl.b64 %rd11, {element}, 1;
             add.u64 %rd12, %rd1, %rd10;
             @%p18 ld.global.f32 %sp{slot}, [%rd12];
             selp.b64 %rd13, %rd10, %rd11, %p1;
             add.u64 %rd13, %rd2, %rd13;
             @%p19 ld.global.u32 %sg{slot}, [%rd13];
             @%p20 ld.global.u16 %sg{slot}, [%rd13];
             selp.b64 %rd17, %rd10, %rd11, %p3;
             add.u64 %rd14, %rd3, %rd17;
             add.u64 %rd15, %rd4, %rd17;
             @%p21 ld.global.u32 %sm{slot}, [%rd14];
             @%p22 ld.global.u16 %sm{slot}, [%rd14];
             @%p21 ld.global.u32 %sv{slot}, [%rd15];
             @%p22 ld.global.u16 %sv{slot}, [%rd15];"
        );
    }
}

/// The element in slot 0 (%rd20) decoded and stepped: p' in %f27, m' in %f18, v' in %f21.
fn step(out: &mut Ptx) {
    out.lines(
        "mov.u64 %rd20, %rd7;  // the element in slot 0
         mov.u32 %r27, 0;
         ad_elem:
         shl.b64 %rd10, %rd20, 2;  // 4-byte offset
         shl.b64 %rd11, %rd20, 1;  // 2-byte offset
         add.u64 %rd12, %rd1, %rd10;
         selp.b64 %rd17, %rd10, %rd11, %p3;
         add.u64 %rd14, %rd3, %rd17;
         add.u64 %rd15, %rd4, %rd17;
         mov.f32 %f12, %sp0;  // p
         // the gradient and moments from their raw bits (16-bit values widen exactly)",
    );
    widen_raw(out, ["%sg0", "%r9", "%f31"], "%p1", "%f13");
    out.lines(
        "cvt.u16.u32 %h1, %sg0;
         cvt.f32.f16 %f32, %h1;
         selp.f32 %f13, %f32, %f13, %p16;",
    );
    widen_raw(out, ["%sm0", "%r10", "%f33"], "%p3", "%f14");
    widen_raw(out, ["%sv0", "%r11", "%f34"], "%p3", "%f15");
    out.lines(
        "@%p12 bra ad_rollback;
         @%p13 bra ad_rescale;
         // the step
         mul.rn.f32 %f16, %f13, %f1;  // g = g * grad_scale
         @%p4 fma.rn.f32 %f16, %f10, %f12, %f16;  // Adam-L2: g = wd * p + g
         mul.rn.f32 %f17, %f2, %f14;  // b1 * m
         fma.rn.f32 %f18, %f3, %f16, %f17;  // m' = (1-b1) * g + b1 * m
         mul.rn.f32 %f19, %f16, %f16;  // g * g
         mul.rn.f32 %f20, %f4, %f15;  // b2 * v
         fma.rn.f32 %f21, %f5, %f19, %f20;  // v' = (1-b2) * g*g + b2 * v",
    );
    update(out, ["%f18", "%f21"], ["%f22", "%f23", "%f24"], ["%f25", "u = m' / denom"]);
    out.lines(
        "mul.rn.f32 %f26, %f12, %f9;  // p * decay
         fma.rn.f32 %f27, %f11, %f25, %f26;  // p' = -step_size * u + p * decay",
    );
}

/// p', m', v' stored (16-bit moments rounded to bf16), and the copy of p' written to `out`.
fn stores(out: &mut Ptx) {
    out.lines(
        "ad_store:
         st.global.f32 [%rd12], %f27;
         // moments back
         @%p3 bra ad_s32;",
    );
    // Per moment: its value, the registers of its bf16 conversion (`Bf16`), its address.
    let moments = [
        ("%f18", ["%r12", "%r13", "%r14", "%r15", "%p9", "%h4"], "%rd14"),
        ("%f21", ["%r16", "%r17", "%r18", "%r19", "%p10", "%h5"], "%rd15"),
    ];
    for (value, [bits, lsb, rounded, abs, nan, half], address) in moments {
        ptx!(out, "mov.b32 {bits}, {value};");
        bf16_from_bits(out, &Bf16 { bits, lsb, rounded, abs, nan, wide: rounded, half });
        ptx!(out, "st.global.u16 [{address}], {half};");
    }
    out.lines(
        "bra.uni ad_sdone;
         ad_s32:
         st.global.f32 [%rd14], %f18;
         st.global.f32 [%rd15], %f21;
         ad_sdone:
         // the copy of the new weights
         @%p5 bra ad_next;
         @%p6 bra ad_o32;
         add.u64 %rd16, %rd5, %rd11;
         mov.b32 %r20, %f27;",
    );
    let (bits, abs, nan) = ("%r20", "%r21", "%p11");
    nan_test(out, bits, abs, nan);
    out.lines(
        "@%p7 bra ad_obf;
         cvt.rn.f16.f32 %h6, %f27;",
    );
    f16_quiet_nan(out, bits, abs, ["%r22", "%r23"], "%h7");
    ptx!(
        out,
        "selp.b16 %h6, %h7, %h6, {nan};
         st.global.u16 [%rd16], %h6;
         bra.uni ad_next;
         ad_obf:"
    );
    bf16_round_nearest_even(out, bits, "%r24", "%r25");
    bf16_quiet_nan(out, "%r25", nan, "%r25", "%h6");
    out.lines(
        "st.global.u16 [%rd16], %h6;
         bra.uni ad_next;
         ad_o32:
         add.u64 %rd16, %rd5, %rd10;
         st.global.f32 [%rd16], %f27;",
    );
}

/// The next slot's element moved to slot 0 while the batch has one in range, else the next
/// batch.
fn next_element(out: &mut Ptx) {
    out.lines(
        "ad_next:
         // the next slot moves to slot 0",
    );
    for (register, kind) in SLOT_REGISTERS {
        for slot in 0..SLOTS - 1 {
            ptx!(out, "mov.{kind} {register}{slot}, {register}{};", slot + 1);
        }
    }
    ptx!(
        out,
        "add.u64 %rd20, %rd20, %rd9;
         add.u32 %r27, %r27, 1;
         setp.lt.u32 %p18, %r27, {SLOTS};
         setp.lt.and.u64 %p18, %rd20, %rd6, %p18;
         @%p18 bra ad_elem;
         add.u64 %rd7, %rd7, %rd30;
         bra.uni ad_batch;
         ad_done:
         ret;"
    );
}

fn rollback(out: &mut Ptx) {
    out.lines(
        "// Rollback (f32 moments): the inverse of the step for the same gradient and scale.
         //   u = m / denom(v);  p = fma(lr/bc1, u, p) / decay;  g = g * scale (Adam-L2: fma(wd, p, g))
         //   m = fma(-(1-b1), g, m) / b1;  v = max0(fma(-(1-b2), g*g, v) / b2)
         ad_rollback:",
    );
    update(out, ["%f14", "%f15"], ["%f40", "%f41", "%f42"], ["%f43", "u"]);
    out.lines(
        "fma.rn.f32 %f44, %f8, %f43, %f12;  // step_size * u + p
         div.rn.f32 %f27, %f44, %f9;  // / decay
         mul.rn.f32 %f45, %f13, %f1;  // g * grad_scale
         @%p4 fma.rn.f32 %f45, %f10, %f27, %f45;
         fma.rn.f32 %f46, %f29, %f45, %f14;
         div.rn.f32 %f18, %f46, %f2;  // m
         mul.rn.f32 %f47, %f45, %f45;
         fma.rn.f32 %f48, %f30, %f47, %f15;
         div.rn.f32 %f49, %f48, %f4;",
    );
    max0(out, "%f49", "%f21");
    out.lines("bra.uni ad_store;");
}

fn rescale(out: &mut Ptx) {
    out.lines(
        "// Rescale (f32 moments): the step on grad_scale * g becomes the step on new_scale * g.
         //   u_old = m / denom(v);  Adam-L2: p_prev = fma(lr/bc1, u_old, p), g_x = fma(wd, p_prev, g * x)
         //   m = fma(1-b1, g_new, fma(-(1-b1), g_old, m));  v = max0(fma(1-b2, g_new^2, fma(-(1-b2), g_old^2, v)))
         //   p = fma(-lr/bc1, m / denom(v) - u_old, p)
         ad_rescale:",
    );
    update(out, ["%f14", "%f15"], ["%f40", "%f41", "%f42"], ["%f43", "u_old"]);
    out.lines(
        "mul.rn.f32 %f50, %f13, %f1;  // g * old scale
         mul.rn.f32 %f51, %f13, %f28;  // g * new scale
         @!%p4 bra rs_moments;
         fma.rn.f32 %f52, %f8, %f43, %f12;  // p_prev
         fma.rn.f32 %f50, %f10, %f52, %f50;
         fma.rn.f32 %f51, %f10, %f52, %f51;
         rs_moments:
         fma.rn.f32 %f53, %f29, %f50, %f14;
         fma.rn.f32 %f18, %f3, %f51, %f53;  // m
         mul.rn.f32 %f54, %f50, %f50;
         fma.rn.f32 %f55, %f30, %f54, %f15;
         mul.rn.f32 %f56, %f51, %f51;
         fma.rn.f32 %f57, %f5, %f56, %f55;",
    );
    max0(out, "%f57", "%f21");
    update(out, ["%f18", "%f21"], ["%f58", "%f59", "%f60"], ["%f61", "u_new"]);
    out.lines(
        "sub.rn.f32 %f62, %f61, %f43;
         fma.rn.f32 %f27, %f11, %f62, %f12;  // p
         bra.uni ad_store;",
    );
}

/// `value` = the gradient or moment whose raw bits are in `raw`: f32 under `is_f32`, else
/// bf16 widened through `wide` and `widened`.
fn widen_raw(out: &mut Ptx, [raw, wide, widened]: [&str; 3], is_f32: &str, value: &str) {
    ptx!(
        out,
        "shl.b32 {wide}, {raw}, 16;
         mov.b32 {widened}, {wide};
         mov.b32 {value}, {raw};
         selp.f32 {value}, {value}, {widened}, {is_f32};"
    );
}

/// `u` = m / (sqrt(v) / sqrt(bc2) + eps), through the scratch `root`, `scaled`, `denom`
/// (`note`: the comment on `u`).
fn update(out: &mut Ptx, [m, v]: [&str; 2], [root, scaled, denom]: [&str; 3], [u, note]: [&str; 2]) {
    ptx!(
        out,
        "sqrt.rn.f32 {root}, {v};
         div.rn.f32 {scaled}, {root}, %f7;  // / sqrt(bc2)
         add.rn.f32 {denom}, {scaled}, %f6;  // + eps
         div.rn.f32 {u}, {m}, {denom};  // {note}"
    );
}

/// `max` = max(`value`, 0), a NaN kept (%p14: scratch).
fn max0(out: &mut Ptx, value: &str, max: &str) {
    ptx!(
        out,
        "setp.lt.f32 %p14, {value}, 0f00000000;  // max0: a NaN stays NaN
         selp.f32 {max}, 0f00000000, {value}, %p14;"
    );
}
