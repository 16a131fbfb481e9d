//! The device kernels, shipped as PTX text: the driver compiles them for the GPU at load
//! time, so nothing needs nvcc or NVRTC at build or run time (`scripts/check_ptx.sh`
//! assembles them with ptxas where it is installed).
//!
//! - `so_f32_to_bf16`, `so_f32_to_f16`: publication of f32 staging buffers into 16-bit
//!   parameters. Both round exactly as `kernels::dtype` does on the CPU: bf16 by integer
//!   round-to-nearest-even with every NaN made 0x7FC0; f16 by the IEEE conversion with a NaN
//!   keeping its sign and top payload bits, quieted.
//! - `so_sumsq_partials`: the per-block f64 partials of a gradient's sum of squares, the same
//!   bits as the CPU kernels' (summed in block order on the host).
//! - `so_adam_step`: the Adam step of device-placed sub-groups, and (`op` 1, 2) the rollback
//!   and rescale of one, each the CPU kernels' operation sequence exactly (bit-identical
//!   results).

pub(crate) const MODULE: &str = r#"
.version 7.0
.target sm_52
.address_size 64

// Each thread converts its elements in batches of four, S apart (S: the grid's threads),
// loading all four before it stores the first: four loads in flight, not one.
.visible .entry so_f32_to_bf16(.param .u64 src, .param .u64 dst, .param .u64 n)
{
    .reg .pred %p<8>;
    .reg .b16 %h<8>;
    .reg .f32 %f<4>;
    .reg .b32 %r<16>;
    .reg .b32 %x<4>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [src];
    ld.param.u64 %rd2, [dst];
    ld.param.u64 %rd3, [n];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;            // the batch's first element
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd6, %r4, %r2;         // S: the grid's threads
    shl.b64 %rd11, %rd6, 2;              // 4 S: the grid's batch
so_f32_to_bf16_batch:
    setp.ge.u64 %p1, %rd4, %rd3;
    @%p1 bra so_f32_to_bf16_done;
    setp.lt.u64 %p2, %rd4, %rd3;
    shl.b64 %rd8, %rd4, 2;
    add.u64 %rd8, %rd1, %rd8;
    @%p2 ld.global.u32 %x0, [%rd8];
    add.u64 %rd7, %rd4, %rd6;
    setp.lt.u64 %p3, %rd7, %rd3;
    shl.b64 %rd8, %rd7, 2;
    add.u64 %rd8, %rd1, %rd8;
    @%p3 ld.global.u32 %x1, [%rd8];
    add.u64 %rd7, %rd7, %rd6;
    setp.lt.u64 %p4, %rd7, %rd3;
    shl.b64 %rd8, %rd7, 2;
    add.u64 %rd8, %rd1, %rd8;
    @%p4 ld.global.u32 %x2, [%rd8];
    add.u64 %rd7, %rd7, %rd6;
    setp.lt.u64 %p5, %rd7, %rd3;
    shl.b64 %rd8, %rd7, 2;
    add.u64 %rd8, %rd1, %rd8;
    @%p5 ld.global.u32 %x3, [%rd8];
    mov.b32 %r5, %x0;
    shr.u32 %r6, %r5, 16;
    and.b32 %r6, %r6, 1;
    add.u32 %r7, %r5, 0x7fff;
    add.u32 %r7, %r7, %r6;
    shr.u32 %r7, %r7, 16;
    and.b32 %r8, %r5, 0x7fffffff;
    setp.gt.u32 %p6, %r8, 0x7f800000;
    selp.b32 %r9, 0x7fc0, %r7, %p6;
    cvt.u16.u32 %h1, %r9;
    shl.b64 %rd9, %rd4, 1;
    add.u64 %rd10, %rd2, %rd9;
    @%p2 st.global.u16 [%rd10], %h1;
    add.u64 %rd7, %rd4, %rd6;
    mov.b32 %r5, %x1;
    shr.u32 %r6, %r5, 16;
    and.b32 %r6, %r6, 1;
    add.u32 %r7, %r5, 0x7fff;
    add.u32 %r7, %r7, %r6;
    shr.u32 %r7, %r7, 16;
    and.b32 %r8, %r5, 0x7fffffff;
    setp.gt.u32 %p6, %r8, 0x7f800000;
    selp.b32 %r9, 0x7fc0, %r7, %p6;
    cvt.u16.u32 %h1, %r9;
    shl.b64 %rd9, %rd7, 1;
    add.u64 %rd10, %rd2, %rd9;
    @%p3 st.global.u16 [%rd10], %h1;
    add.u64 %rd7, %rd7, %rd6;
    mov.b32 %r5, %x2;
    shr.u32 %r6, %r5, 16;
    and.b32 %r6, %r6, 1;
    add.u32 %r7, %r5, 0x7fff;
    add.u32 %r7, %r7, %r6;
    shr.u32 %r7, %r7, 16;
    and.b32 %r8, %r5, 0x7fffffff;
    setp.gt.u32 %p6, %r8, 0x7f800000;
    selp.b32 %r9, 0x7fc0, %r7, %p6;
    cvt.u16.u32 %h1, %r9;
    shl.b64 %rd9, %rd7, 1;
    add.u64 %rd10, %rd2, %rd9;
    @%p4 st.global.u16 [%rd10], %h1;
    add.u64 %rd7, %rd7, %rd6;
    mov.b32 %r5, %x3;
    shr.u32 %r6, %r5, 16;
    and.b32 %r6, %r6, 1;
    add.u32 %r7, %r5, 0x7fff;
    add.u32 %r7, %r7, %r6;
    shr.u32 %r7, %r7, 16;
    and.b32 %r8, %r5, 0x7fffffff;
    setp.gt.u32 %p6, %r8, 0x7f800000;
    selp.b32 %r9, 0x7fc0, %r7, %p6;
    cvt.u16.u32 %h1, %r9;
    shl.b64 %rd9, %rd7, 1;
    add.u64 %rd10, %rd2, %rd9;
    @%p5 st.global.u16 [%rd10], %h1;
    add.u64 %rd4, %rd4, %rd11;
    bra so_f32_to_bf16_batch;
so_f32_to_bf16_done:
    ret;
}

.visible .entry so_f32_to_f16(.param .u64 src, .param .u64 dst, .param .u64 n)
{
    .reg .pred %p<8>;
    .reg .b16 %h<8>;
    .reg .f32 %f<4>;
    .reg .b32 %r<16>;
    .reg .b32 %x<4>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [src];
    ld.param.u64 %rd2, [dst];
    ld.param.u64 %rd3, [n];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;            // the batch's first element
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd6, %r4, %r2;         // S: the grid's threads
    shl.b64 %rd11, %rd6, 2;              // 4 S: the grid's batch
so_f32_to_f16_batch:
    setp.ge.u64 %p1, %rd4, %rd3;
    @%p1 bra so_f32_to_f16_done;
    setp.lt.u64 %p2, %rd4, %rd3;
    shl.b64 %rd8, %rd4, 2;
    add.u64 %rd8, %rd1, %rd8;
    @%p2 ld.global.u32 %x0, [%rd8];
    add.u64 %rd7, %rd4, %rd6;
    setp.lt.u64 %p3, %rd7, %rd3;
    shl.b64 %rd8, %rd7, 2;
    add.u64 %rd8, %rd1, %rd8;
    @%p3 ld.global.u32 %x1, [%rd8];
    add.u64 %rd7, %rd7, %rd6;
    setp.lt.u64 %p4, %rd7, %rd3;
    shl.b64 %rd8, %rd7, 2;
    add.u64 %rd8, %rd1, %rd8;
    @%p4 ld.global.u32 %x2, [%rd8];
    add.u64 %rd7, %rd7, %rd6;
    setp.lt.u64 %p5, %rd7, %rd3;
    shl.b64 %rd8, %rd7, 2;
    add.u64 %rd8, %rd1, %rd8;
    @%p5 ld.global.u32 %x3, [%rd8];
    mov.b32 %r5, %x0;
    mov.b32 %f1, %r5;
    cvt.rn.f16.f32 %h2, %f1;
    and.b32 %r8, %r5, 0x7fffffff;
    setp.gt.u32 %p6, %r8, 0x7f800000;
    shr.u32 %r6, %r5, 16;
    and.b32 %r6, %r6, 0x8000;
    shr.u32 %r7, %r8, 13;
    and.b32 %r7, %r7, 0x3ff;
    or.b32 %r7, %r7, 0x7e00;
    or.b32 %r7, %r7, %r6;
    cvt.u16.u32 %h3, %r7;
    selp.b16 %h1, %h3, %h2, %p6;
    shl.b64 %rd9, %rd4, 1;
    add.u64 %rd10, %rd2, %rd9;
    @%p2 st.global.u16 [%rd10], %h1;
    add.u64 %rd7, %rd4, %rd6;
    mov.b32 %r5, %x1;
    mov.b32 %f1, %r5;
    cvt.rn.f16.f32 %h2, %f1;
    and.b32 %r8, %r5, 0x7fffffff;
    setp.gt.u32 %p6, %r8, 0x7f800000;
    shr.u32 %r6, %r5, 16;
    and.b32 %r6, %r6, 0x8000;
    shr.u32 %r7, %r8, 13;
    and.b32 %r7, %r7, 0x3ff;
    or.b32 %r7, %r7, 0x7e00;
    or.b32 %r7, %r7, %r6;
    cvt.u16.u32 %h3, %r7;
    selp.b16 %h1, %h3, %h2, %p6;
    shl.b64 %rd9, %rd7, 1;
    add.u64 %rd10, %rd2, %rd9;
    @%p3 st.global.u16 [%rd10], %h1;
    add.u64 %rd7, %rd7, %rd6;
    mov.b32 %r5, %x2;
    mov.b32 %f1, %r5;
    cvt.rn.f16.f32 %h2, %f1;
    and.b32 %r8, %r5, 0x7fffffff;
    setp.gt.u32 %p6, %r8, 0x7f800000;
    shr.u32 %r6, %r5, 16;
    and.b32 %r6, %r6, 0x8000;
    shr.u32 %r7, %r8, 13;
    and.b32 %r7, %r7, 0x3ff;
    or.b32 %r7, %r7, 0x7e00;
    or.b32 %r7, %r7, %r6;
    cvt.u16.u32 %h3, %r7;
    selp.b16 %h1, %h3, %h2, %p6;
    shl.b64 %rd9, %rd7, 1;
    add.u64 %rd10, %rd2, %rd9;
    @%p4 st.global.u16 [%rd10], %h1;
    add.u64 %rd7, %rd7, %rd6;
    mov.b32 %r5, %x3;
    mov.b32 %f1, %r5;
    cvt.rn.f16.f32 %h2, %f1;
    and.b32 %r8, %r5, 0x7fffffff;
    setp.gt.u32 %p6, %r8, 0x7f800000;
    shr.u32 %r6, %r5, 16;
    and.b32 %r6, %r6, 0x8000;
    shr.u32 %r7, %r8, 13;
    and.b32 %r7, %r7, 0x3ff;
    or.b32 %r7, %r7, 0x7e00;
    or.b32 %r7, %r7, %r6;
    cvt.u16.u32 %h3, %r7;
    selp.b16 %h1, %h3, %h2, %p6;
    shl.b64 %rd9, %rd7, 1;
    add.u64 %rd10, %rd2, %rd9;
    @%p5 st.global.u16 [%rd10], %h1;
    add.u64 %rd4, %rd4, %rd11;
    bra so_f32_to_f16_batch;
so_f32_to_f16_done:
    ret;
}

// Sum of squares of scale * g, one f64 partial per block of 8192 elements, exactly as the CPU
// kernels take it: element i of a block goes to lane i % 8, each lane adds its squares in
// order with one rounding each, and the eight lanes are reduced by the tree
// (l0+l4, l1+l5, l2+l6, l3+l7), then pairs two apart, then the last two.
// One thread per (block, lane); the grid covers every block (threads past the end add
// nothing and still take part in the shuffles). With `copy` (not 0) each element read is
// also stored there, at the same index: a device-placed sub-group's gradient lands in its
// device buffer in the pass that sums it, not in a second read.
.visible .entry so_sumsq_partials(.param .u64 g, .param .u64 n, .param .u32 dtype, .param .f32 scale,
                                  .param .u64 partials, .param .u64 blocks, .param .u64 copy)
{
    .reg .pred %p<14>;
    .reg .b16 %h<2>;
    .reg .b32 %r<16>;
    .reg .f32 %f<4>;
    .reg .f64 %d<8>;
    .reg .b64 %rd<24>;
    .reg .b16 %hb<16>;
    .reg .b32 %rb<16>;
    .reg .f32 %fb<16>;
    .reg .f64 %db<16>;
    .reg .b64 %ab<16>;

    ld.param.u64 %rd1, [g];
    ld.param.u64 %rd2, [n];
    ld.param.u32 %r1, [dtype];
    ld.param.f32 %f1, [scale];
    ld.param.u64 %rd3, [partials];
    ld.param.u64 %rd4, [blocks];
    ld.param.u64 %rd20, [copy];
    setp.ne.u64 %p10, %rd20, 0;          // copying
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    cvta.to.global.u64 %rd20, %rd20;
    sub.u64 %rd20, %rd20, %rd1;          // copy - g: added to a load's address, its store's
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd5, %r2, %r3;
    cvt.u64.u32 %rd6, %r4;
    add.u64 %rd5, %rd5, %rd6;            // global thread index
    shr.u64 %rd7, %rd5, 3;               // block
    and.b64 %rd8, %rd5, 7;               // lane
    mov.f64 %d1, 0d0000000000000000;     // accumulator
    setp.ge.u64 %p1, %rd7, %rd4;
    @%p1 bra sq_reduce;
    mul.lo.u64 %rd9, %rd7, 8192;
    add.u64 %rd10, %rd9, %rd8;           // first element
    add.u64 %rd11, %rd9, 8192;
    min.u64 %rd11, %rd11, %rd2;          // block end
    setp.eq.u32 %p2, %r1, 1;             // f32
    setp.eq.u32 %p3, %r1, 2;             // bf16 (else f16)
    or.pred %p8, %p2, %p3;
    not.pred %p8, %p8;                   // f16
    and.pred %p11, %p10, %p2;            // copying f32
    not.pred %p12, %p2;
    and.pred %p12, %p10, %p12;           // copying 16-bit
    // Batches of 16 of the lane's elements while all 16 are in the block: the loads are
    // independent and issued together, the squares then added in order (the same bits as
    // one element at a time, with 16 loads in flight instead of one).
    selp.u64 %rd16, 4, 2, %p2;           // element bytes
    shl.b64 %rd17, %rd16, 3;             // bytes between a lane's elements
sq_batch:
    add.u64 %rd18, %rd10, 120;           // the batch's last element
    setp.ge.u64 %p9, %rd18, %rd11;
    @%p9 bra sq_loop;
    mul.lo.u64 %rd19, %rd10, %rd16;
    add.u64 %ab0, %rd1, %rd19;
    add.u64 %ab1, %ab0, %rd17;
    add.u64 %ab2, %ab1, %rd17;
    add.u64 %ab3, %ab2, %rd17;
    add.u64 %ab4, %ab3, %rd17;
    add.u64 %ab5, %ab4, %rd17;
    add.u64 %ab6, %ab5, %rd17;
    add.u64 %ab7, %ab6, %rd17;
    add.u64 %ab8, %ab7, %rd17;
    add.u64 %ab9, %ab8, %rd17;
    add.u64 %ab10, %ab9, %rd17;
    add.u64 %ab11, %ab10, %rd17;
    add.u64 %ab12, %ab11, %rd17;
    add.u64 %ab13, %ab12, %rd17;
    add.u64 %ab14, %ab13, %rd17;
    add.u64 %ab15, %ab14, %rd17;
    @%p2 ld.global.f32 %fb0, [%ab0];
    @!%p2 ld.global.u16 %hb0, [%ab0];
    @%p2 ld.global.f32 %fb1, [%ab1];
    @!%p2 ld.global.u16 %hb1, [%ab1];
    @%p2 ld.global.f32 %fb2, [%ab2];
    @!%p2 ld.global.u16 %hb2, [%ab2];
    @%p2 ld.global.f32 %fb3, [%ab3];
    @!%p2 ld.global.u16 %hb3, [%ab3];
    @%p2 ld.global.f32 %fb4, [%ab4];
    @!%p2 ld.global.u16 %hb4, [%ab4];
    @%p2 ld.global.f32 %fb5, [%ab5];
    @!%p2 ld.global.u16 %hb5, [%ab5];
    @%p2 ld.global.f32 %fb6, [%ab6];
    @!%p2 ld.global.u16 %hb6, [%ab6];
    @%p2 ld.global.f32 %fb7, [%ab7];
    @!%p2 ld.global.u16 %hb7, [%ab7];
    @%p2 ld.global.f32 %fb8, [%ab8];
    @!%p2 ld.global.u16 %hb8, [%ab8];
    @%p2 ld.global.f32 %fb9, [%ab9];
    @!%p2 ld.global.u16 %hb9, [%ab9];
    @%p2 ld.global.f32 %fb10, [%ab10];
    @!%p2 ld.global.u16 %hb10, [%ab10];
    @%p2 ld.global.f32 %fb11, [%ab11];
    @!%p2 ld.global.u16 %hb11, [%ab11];
    @%p2 ld.global.f32 %fb12, [%ab12];
    @!%p2 ld.global.u16 %hb12, [%ab12];
    @%p2 ld.global.f32 %fb13, [%ab13];
    @!%p2 ld.global.u16 %hb13, [%ab13];
    @%p2 ld.global.f32 %fb14, [%ab14];
    @!%p2 ld.global.u16 %hb14, [%ab14];
    @%p2 ld.global.f32 %fb15, [%ab15];
    @!%p2 ld.global.u16 %hb15, [%ab15];
    add.u64 %rd21, %ab0, %rd20;
    @%p11 st.global.f32 [%rd21], %fb0;
    @%p12 st.global.u16 [%rd21], %hb0;
    add.u64 %rd21, %ab1, %rd20;
    @%p11 st.global.f32 [%rd21], %fb1;
    @%p12 st.global.u16 [%rd21], %hb1;
    add.u64 %rd21, %ab2, %rd20;
    @%p11 st.global.f32 [%rd21], %fb2;
    @%p12 st.global.u16 [%rd21], %hb2;
    add.u64 %rd21, %ab3, %rd20;
    @%p11 st.global.f32 [%rd21], %fb3;
    @%p12 st.global.u16 [%rd21], %hb3;
    add.u64 %rd21, %ab4, %rd20;
    @%p11 st.global.f32 [%rd21], %fb4;
    @%p12 st.global.u16 [%rd21], %hb4;
    add.u64 %rd21, %ab5, %rd20;
    @%p11 st.global.f32 [%rd21], %fb5;
    @%p12 st.global.u16 [%rd21], %hb5;
    add.u64 %rd21, %ab6, %rd20;
    @%p11 st.global.f32 [%rd21], %fb6;
    @%p12 st.global.u16 [%rd21], %hb6;
    add.u64 %rd21, %ab7, %rd20;
    @%p11 st.global.f32 [%rd21], %fb7;
    @%p12 st.global.u16 [%rd21], %hb7;
    add.u64 %rd21, %ab8, %rd20;
    @%p11 st.global.f32 [%rd21], %fb8;
    @%p12 st.global.u16 [%rd21], %hb8;
    add.u64 %rd21, %ab9, %rd20;
    @%p11 st.global.f32 [%rd21], %fb9;
    @%p12 st.global.u16 [%rd21], %hb9;
    add.u64 %rd21, %ab10, %rd20;
    @%p11 st.global.f32 [%rd21], %fb10;
    @%p12 st.global.u16 [%rd21], %hb10;
    add.u64 %rd21, %ab11, %rd20;
    @%p11 st.global.f32 [%rd21], %fb11;
    @%p12 st.global.u16 [%rd21], %hb11;
    add.u64 %rd21, %ab12, %rd20;
    @%p11 st.global.f32 [%rd21], %fb12;
    @%p12 st.global.u16 [%rd21], %hb12;
    add.u64 %rd21, %ab13, %rd20;
    @%p11 st.global.f32 [%rd21], %fb13;
    @%p12 st.global.u16 [%rd21], %hb13;
    add.u64 %rd21, %ab14, %rd20;
    @%p11 st.global.f32 [%rd21], %fb14;
    @%p12 st.global.u16 [%rd21], %hb14;
    add.u64 %rd21, %ab15, %rd20;
    @%p11 st.global.f32 [%rd21], %fb15;
    @%p12 st.global.u16 [%rd21], %hb15;
    @%p3 cvt.u32.u16 %rb0, %hb0;
    @%p3 shl.b32 %rb0, %rb0, 16;
    @%p3 mov.b32 %fb0, %rb0;
    @%p8 cvt.f32.f16 %fb0, %hb0;
    @%p3 cvt.u32.u16 %rb1, %hb1;
    @%p3 shl.b32 %rb1, %rb1, 16;
    @%p3 mov.b32 %fb1, %rb1;
    @%p8 cvt.f32.f16 %fb1, %hb1;
    @%p3 cvt.u32.u16 %rb2, %hb2;
    @%p3 shl.b32 %rb2, %rb2, 16;
    @%p3 mov.b32 %fb2, %rb2;
    @%p8 cvt.f32.f16 %fb2, %hb2;
    @%p3 cvt.u32.u16 %rb3, %hb3;
    @%p3 shl.b32 %rb3, %rb3, 16;
    @%p3 mov.b32 %fb3, %rb3;
    @%p8 cvt.f32.f16 %fb3, %hb3;
    @%p3 cvt.u32.u16 %rb4, %hb4;
    @%p3 shl.b32 %rb4, %rb4, 16;
    @%p3 mov.b32 %fb4, %rb4;
    @%p8 cvt.f32.f16 %fb4, %hb4;
    @%p3 cvt.u32.u16 %rb5, %hb5;
    @%p3 shl.b32 %rb5, %rb5, 16;
    @%p3 mov.b32 %fb5, %rb5;
    @%p8 cvt.f32.f16 %fb5, %hb5;
    @%p3 cvt.u32.u16 %rb6, %hb6;
    @%p3 shl.b32 %rb6, %rb6, 16;
    @%p3 mov.b32 %fb6, %rb6;
    @%p8 cvt.f32.f16 %fb6, %hb6;
    @%p3 cvt.u32.u16 %rb7, %hb7;
    @%p3 shl.b32 %rb7, %rb7, 16;
    @%p3 mov.b32 %fb7, %rb7;
    @%p8 cvt.f32.f16 %fb7, %hb7;
    @%p3 cvt.u32.u16 %rb8, %hb8;
    @%p3 shl.b32 %rb8, %rb8, 16;
    @%p3 mov.b32 %fb8, %rb8;
    @%p8 cvt.f32.f16 %fb8, %hb8;
    @%p3 cvt.u32.u16 %rb9, %hb9;
    @%p3 shl.b32 %rb9, %rb9, 16;
    @%p3 mov.b32 %fb9, %rb9;
    @%p8 cvt.f32.f16 %fb9, %hb9;
    @%p3 cvt.u32.u16 %rb10, %hb10;
    @%p3 shl.b32 %rb10, %rb10, 16;
    @%p3 mov.b32 %fb10, %rb10;
    @%p8 cvt.f32.f16 %fb10, %hb10;
    @%p3 cvt.u32.u16 %rb11, %hb11;
    @%p3 shl.b32 %rb11, %rb11, 16;
    @%p3 mov.b32 %fb11, %rb11;
    @%p8 cvt.f32.f16 %fb11, %hb11;
    @%p3 cvt.u32.u16 %rb12, %hb12;
    @%p3 shl.b32 %rb12, %rb12, 16;
    @%p3 mov.b32 %fb12, %rb12;
    @%p8 cvt.f32.f16 %fb12, %hb12;
    @%p3 cvt.u32.u16 %rb13, %hb13;
    @%p3 shl.b32 %rb13, %rb13, 16;
    @%p3 mov.b32 %fb13, %rb13;
    @%p8 cvt.f32.f16 %fb13, %hb13;
    @%p3 cvt.u32.u16 %rb14, %hb14;
    @%p3 shl.b32 %rb14, %rb14, 16;
    @%p3 mov.b32 %fb14, %rb14;
    @%p8 cvt.f32.f16 %fb14, %hb14;
    @%p3 cvt.u32.u16 %rb15, %hb15;
    @%p3 shl.b32 %rb15, %rb15, 16;
    @%p3 mov.b32 %fb15, %rb15;
    @%p8 cvt.f32.f16 %fb15, %hb15;
    mul.rn.f32 %fb0, %fb0, %f1;
    cvt.f64.f32 %db0, %fb0;
    fma.rn.f64 %d1, %db0, %db0, %d1;
    mul.rn.f32 %fb1, %fb1, %f1;
    cvt.f64.f32 %db1, %fb1;
    fma.rn.f64 %d1, %db1, %db1, %d1;
    mul.rn.f32 %fb2, %fb2, %f1;
    cvt.f64.f32 %db2, %fb2;
    fma.rn.f64 %d1, %db2, %db2, %d1;
    mul.rn.f32 %fb3, %fb3, %f1;
    cvt.f64.f32 %db3, %fb3;
    fma.rn.f64 %d1, %db3, %db3, %d1;
    mul.rn.f32 %fb4, %fb4, %f1;
    cvt.f64.f32 %db4, %fb4;
    fma.rn.f64 %d1, %db4, %db4, %d1;
    mul.rn.f32 %fb5, %fb5, %f1;
    cvt.f64.f32 %db5, %fb5;
    fma.rn.f64 %d1, %db5, %db5, %d1;
    mul.rn.f32 %fb6, %fb6, %f1;
    cvt.f64.f32 %db6, %fb6;
    fma.rn.f64 %d1, %db6, %db6, %d1;
    mul.rn.f32 %fb7, %fb7, %f1;
    cvt.f64.f32 %db7, %fb7;
    fma.rn.f64 %d1, %db7, %db7, %d1;
    mul.rn.f32 %fb8, %fb8, %f1;
    cvt.f64.f32 %db8, %fb8;
    fma.rn.f64 %d1, %db8, %db8, %d1;
    mul.rn.f32 %fb9, %fb9, %f1;
    cvt.f64.f32 %db9, %fb9;
    fma.rn.f64 %d1, %db9, %db9, %d1;
    mul.rn.f32 %fb10, %fb10, %f1;
    cvt.f64.f32 %db10, %fb10;
    fma.rn.f64 %d1, %db10, %db10, %d1;
    mul.rn.f32 %fb11, %fb11, %f1;
    cvt.f64.f32 %db11, %fb11;
    fma.rn.f64 %d1, %db11, %db11, %d1;
    mul.rn.f32 %fb12, %fb12, %f1;
    cvt.f64.f32 %db12, %fb12;
    fma.rn.f64 %d1, %db12, %db12, %d1;
    mul.rn.f32 %fb13, %fb13, %f1;
    cvt.f64.f32 %db13, %fb13;
    fma.rn.f64 %d1, %db13, %db13, %d1;
    mul.rn.f32 %fb14, %fb14, %f1;
    cvt.f64.f32 %db14, %fb14;
    fma.rn.f64 %d1, %db14, %db14, %d1;
    mul.rn.f32 %fb15, %fb15, %f1;
    cvt.f64.f32 %db15, %fb15;
    fma.rn.f64 %d1, %db15, %db15, %d1;
    add.u64 %rd10, %rd10, 128;
    bra.uni sq_batch;
sq_loop:
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
sq_bf16:
    cvt.u32.u16 %r5, %h1;
    shl.b32 %r5, %r5, 16;
    mov.b32 %f2, %r5;
    bra.uni sq_add;
sq_f32:
    shl.b64 %rd12, %rd10, 2;
    add.u64 %rd13, %rd1, %rd12;
    ld.global.f32 %f2, [%rd13];
    add.u64 %rd21, %rd13, %rd20;
    @%p10 st.global.f32 [%rd21], %f2;
sq_add:
    mul.rn.f32 %f3, %f2, %f1;
    cvt.f64.f32 %d2, %f3;
    fma.rn.f64 %d1, %d2, %d2, %d1;
    add.u64 %rd10, %rd10, 8;
    bra.uni sq_loop;
sq_reduce:
    // lanes j < 4: l_j + l_{j+4}
    mov.b64 {%r6, %r7}, %d1;
    shfl.sync.down.b32 %r8, %r6, 4, 0x181f, 0xffffffff;
    shfl.sync.down.b32 %r9, %r7, 4, 0x181f, 0xffffffff;
    mov.b64 %d3, {%r8, %r9};
    add.rn.f64 %d4, %d1, %d3;
    // lanes j < 2: s_j + s_{j+2}
    mov.b64 {%r6, %r7}, %d4;
    shfl.sync.down.b32 %r8, %r6, 2, 0x181f, 0xffffffff;
    shfl.sync.down.b32 %r9, %r7, 2, 0x181f, 0xffffffff;
    mov.b64 %d3, {%r8, %r9};
    add.rn.f64 %d5, %d4, %d3;
    // lane 0: t_0 + t_1
    mov.b64 {%r6, %r7}, %d5;
    shfl.sync.down.b32 %r8, %r6, 1, 0x181f, 0xffffffff;
    shfl.sync.down.b32 %r9, %r7, 1, 0x181f, 0xffffffff;
    mov.b64 %d3, {%r8, %r9};
    add.rn.f64 %d6, %d5, %d3;
    setp.ne.u64 %p5, %rd8, 0;
    or.pred %p5, %p5, %p1;
    @%p5 bra sq_done;
    shl.b64 %rd14, %rd7, 3;
    add.u64 %rd15, %rd3, %rd14;
    st.global.f64 [%rd15], %d6;
sq_done:
    ret;
}

// One AdamW / Adam-L2 step of f32 master weights, in exactly the CPU kernels' operation
// sequence (kernels/math.rs, Update), every operation rounded once (.rn; nothing fused that
// the CPU does not fuse):
//   g  = g * grad_scale;  Adam-L2: g = fma(wd, p, g)
//   m  = fma(1-b1, g, b1*m);  v = fma(1-b2, g*g, b2*v)
//   u  = m / (sqrt(v) / sqrt(bc2) + eps);  p = fma(-lr/bc1, u, p*decay)
// dtypes (so_dtype codes): gradient f32/bf16/f16, moments f32/bf16, the copy written to
// `out` none(0)/f32/bf16/f16; 16-bit stores round to nearest even (a bf16 NaN is 0x7FC0,
// an f16 NaN keeps its sign and top payload bits, quieted), as on the CPU.
.visible .entry so_adam_step(.param .u64 p, .param .u64 g, .param .u64 m, .param .u64 v, .param .u64 out,
                             .param .u64 n, .param .u32 g_dtype, .param .u32 m_dtype, .param .u32 out_dtype,
                             .param .f32 grad_scale, .param .f32 beta1, .param .f32 omb1, .param .f32 beta2,
                             .param .f32 omb2, .param .f32 eps, .param .f32 sqrt_bc2, .param .f32 step_size,
                             .param .f32 decay, .param .f32 wd, .param .u32 has_l2, .param .u32 op,
                             .param .f32 new_scale)
{
    .reg .pred %p<24>;
    .reg .b16 %h<8>;
    .reg .b32 %r<40>;
    .reg .f32 %f<64>;
    .reg .b64 %rd<40>;
    .reg .f32 %sp<4>;                    // a batch's four slots: p, and the raw bits of g, m, v
    .reg .b32 %sg<4>, %sm<4>, %sv<4>;

    ld.param.u64 %rd1, [p];
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
    neg.f32 %f29, %f3;                   // -(1-b1)
    neg.f32 %f30, %f5;                   // -(1-b2)
    setp.eq.u32 %p12, %r26, 1;           // rollback
    setp.eq.u32 %p13, %r26, 2;           // rescale
    setp.eq.u32 %p1, %r1, 1;     // gradient f32
    setp.eq.u32 %p2, %r1, 2;     // gradient bf16 (else f16)
    setp.eq.u32 %p3, %r2, 1;     // moments f32 (else bf16)
    setp.ne.u32 %p4, %r4, 0;     // L2 term
    setp.eq.u32 %p5, %r3, 0;     // no copy
    setp.eq.u32 %p6, %r3, 1;     // f32 copy
    setp.eq.u32 %p7, %r3, 2;     // bf16 copy (else f16)
    setp.ne.u32 %p15, %r1, 1;
    not.pred %p16, %p2;
    and.pred %p16, %p16, %p15;   // gradient f16
    // Each thread takes its elements in batches of four, S apart (S: the grid's threads), and
    // loads all four before it steps the first: one element's loads per thread left HBM idle
    // while its divisions ran. Each element is stepped alone, in the same sequence as before.
    mov.u32 %r5, %ctaid.x;
    mov.u32 %r6, %ntid.x;
    mov.u32 %r7, %tid.x;
    mul.wide.u32 %rd7, %r5, %r6;
    cvt.u64.u32 %rd8, %r7;
    add.u64 %rd7, %rd7, %rd8;            // the batch's first element
    mov.u32 %r8, %nctaid.x;
    mul.wide.u32 %rd9, %r8, %r6;         // S
    shl.b64 %rd30, %rd9, 2;              // 4 S: the grid's batch
ad_batch:
    setp.ge.u64 %p8, %rd7, %rd6;
    @%p8 bra ad_done;
    setp.lt.u64 %p18, %rd7, %rd6;          // slot 0 in range
    and.pred %p19, %p18, %p1;
    and.pred %p20, %p18, %p15;
    and.pred %p21, %p18, %p3;
    xor.pred %p22, %p18, %p21;
    shl.b64 %rd10, %rd7, 2;
    shl.b64 %rd11, %rd7, 1;
    add.u64 %rd12, %rd1, %rd10;
    @%p18 ld.global.f32 %sp0, [%rd12];
    selp.b64 %rd13, %rd10, %rd11, %p1;
    add.u64 %rd13, %rd2, %rd13;
    @%p19 ld.global.u32 %sg0, [%rd13];
    @%p20 ld.global.u16 %sg0, [%rd13];
    selp.b64 %rd17, %rd10, %rd11, %p3;
    add.u64 %rd14, %rd3, %rd17;
    add.u64 %rd15, %rd4, %rd17;
    @%p21 ld.global.u32 %sm0, [%rd14];
    @%p22 ld.global.u16 %sm0, [%rd14];
    @%p21 ld.global.u32 %sv0, [%rd15];
    @%p22 ld.global.u16 %sv0, [%rd15];
    add.u64 %rd21, %rd7, %rd9;
    setp.lt.u64 %p18, %rd21, %rd6;          // slot 1 in range
    and.pred %p19, %p18, %p1;
    and.pred %p20, %p18, %p15;
    and.pred %p21, %p18, %p3;
    xor.pred %p22, %p18, %p21;
    shl.b64 %rd10, %rd21, 2;
    shl.b64 %rd11, %rd21, 1;
    add.u64 %rd12, %rd1, %rd10;
    @%p18 ld.global.f32 %sp1, [%rd12];
    selp.b64 %rd13, %rd10, %rd11, %p1;
    add.u64 %rd13, %rd2, %rd13;
    @%p19 ld.global.u32 %sg1, [%rd13];
    @%p20 ld.global.u16 %sg1, [%rd13];
    selp.b64 %rd17, %rd10, %rd11, %p3;
    add.u64 %rd14, %rd3, %rd17;
    add.u64 %rd15, %rd4, %rd17;
    @%p21 ld.global.u32 %sm1, [%rd14];
    @%p22 ld.global.u16 %sm1, [%rd14];
    @%p21 ld.global.u32 %sv1, [%rd15];
    @%p22 ld.global.u16 %sv1, [%rd15];
    add.u64 %rd21, %rd21, %rd9;
    setp.lt.u64 %p18, %rd21, %rd6;          // slot 2 in range
    and.pred %p19, %p18, %p1;
    and.pred %p20, %p18, %p15;
    and.pred %p21, %p18, %p3;
    xor.pred %p22, %p18, %p21;
    shl.b64 %rd10, %rd21, 2;
    shl.b64 %rd11, %rd21, 1;
    add.u64 %rd12, %rd1, %rd10;
    @%p18 ld.global.f32 %sp2, [%rd12];
    selp.b64 %rd13, %rd10, %rd11, %p1;
    add.u64 %rd13, %rd2, %rd13;
    @%p19 ld.global.u32 %sg2, [%rd13];
    @%p20 ld.global.u16 %sg2, [%rd13];
    selp.b64 %rd17, %rd10, %rd11, %p3;
    add.u64 %rd14, %rd3, %rd17;
    add.u64 %rd15, %rd4, %rd17;
    @%p21 ld.global.u32 %sm2, [%rd14];
    @%p22 ld.global.u16 %sm2, [%rd14];
    @%p21 ld.global.u32 %sv2, [%rd15];
    @%p22 ld.global.u16 %sv2, [%rd15];
    add.u64 %rd21, %rd21, %rd9;
    setp.lt.u64 %p18, %rd21, %rd6;          // slot 3 in range
    and.pred %p19, %p18, %p1;
    and.pred %p20, %p18, %p15;
    and.pred %p21, %p18, %p3;
    xor.pred %p22, %p18, %p21;
    shl.b64 %rd10, %rd21, 2;
    shl.b64 %rd11, %rd21, 1;
    add.u64 %rd12, %rd1, %rd10;
    @%p18 ld.global.f32 %sp3, [%rd12];
    selp.b64 %rd13, %rd10, %rd11, %p1;
    add.u64 %rd13, %rd2, %rd13;
    @%p19 ld.global.u32 %sg3, [%rd13];
    @%p20 ld.global.u16 %sg3, [%rd13];
    selp.b64 %rd17, %rd10, %rd11, %p3;
    add.u64 %rd14, %rd3, %rd17;
    add.u64 %rd15, %rd4, %rd17;
    @%p21 ld.global.u32 %sm3, [%rd14];
    @%p22 ld.global.u16 %sm3, [%rd14];
    @%p21 ld.global.u32 %sv3, [%rd15];
    @%p22 ld.global.u16 %sv3, [%rd15];
    mov.u64 %rd20, %rd7;                 // the element in slot 0
    mov.u32 %r27, 0;
ad_elem:
    shl.b64 %rd10, %rd20, 2;             // 4-byte offset
    shl.b64 %rd11, %rd20, 1;             // 2-byte offset
    add.u64 %rd12, %rd1, %rd10;
    selp.b64 %rd17, %rd10, %rd11, %p3;
    add.u64 %rd14, %rd3, %rd17;
    add.u64 %rd15, %rd4, %rd17;
    mov.f32 %f12, %sp0;                  // p
    // the gradient and moments from their raw bits (16-bit values widen exactly)
    shl.b32 %r9, %sg0, 16;
    mov.b32 %f31, %r9;
    mov.b32 %f13, %sg0;
    selp.f32 %f13, %f13, %f31, %p1;
    cvt.u16.u32 %h1, %sg0;
    cvt.f32.f16 %f32, %h1;
    selp.f32 %f13, %f32, %f13, %p16;
    shl.b32 %r10, %sm0, 16;
    mov.b32 %f33, %r10;
    mov.b32 %f14, %sm0;
    selp.f32 %f14, %f14, %f33, %p3;
    shl.b32 %r11, %sv0, 16;
    mov.b32 %f34, %r11;
    mov.b32 %f15, %sv0;
    selp.f32 %f15, %f15, %f34, %p3;
    @%p12 bra ad_rollback;
    @%p13 bra ad_rescale;
    // the step
    mul.rn.f32 %f16, %f13, %f1;          // g = g * grad_scale
    @%p4 fma.rn.f32 %f16, %f10, %f12, %f16;   // Adam-L2: g = wd * p + g
    mul.rn.f32 %f17, %f2, %f14;          // b1 * m
    fma.rn.f32 %f18, %f3, %f16, %f17;    // m' = (1-b1) * g + b1 * m
    mul.rn.f32 %f19, %f16, %f16;         // g * g
    mul.rn.f32 %f20, %f4, %f15;          // b2 * v
    fma.rn.f32 %f21, %f5, %f19, %f20;    // v' = (1-b2) * g*g + b2 * v
    sqrt.rn.f32 %f22, %f21;
    div.rn.f32 %f23, %f22, %f7;          // / sqrt(bc2)
    add.rn.f32 %f24, %f23, %f6;          // + eps
    div.rn.f32 %f25, %f18, %f24;         // u = m' / denom
    mul.rn.f32 %f26, %f12, %f9;          // p * decay
    fma.rn.f32 %f27, %f11, %f25, %f26;   // p' = -step_size * u + p * decay
ad_store:
    st.global.f32 [%rd12], %f27;
    // moments back
    @%p3 bra ad_s32;
    mov.b32 %r12, %f18;
    shr.u32 %r13, %r12, 16;
    and.b32 %r13, %r13, 1;
    add.u32 %r14, %r12, 0x7fff;
    add.u32 %r14, %r14, %r13;
    shr.u32 %r14, %r14, 16;
    and.b32 %r15, %r12, 0x7fffffff;
    setp.gt.u32 %p9, %r15, 0x7f800000;
    selp.b32 %r14, 0x7fc0, %r14, %p9;
    cvt.u16.u32 %h4, %r14;
    st.global.u16 [%rd14], %h4;
    mov.b32 %r16, %f21;
    shr.u32 %r17, %r16, 16;
    and.b32 %r17, %r17, 1;
    add.u32 %r18, %r16, 0x7fff;
    add.u32 %r18, %r18, %r17;
    shr.u32 %r18, %r18, 16;
    and.b32 %r19, %r16, 0x7fffffff;
    setp.gt.u32 %p10, %r19, 0x7f800000;
    selp.b32 %r18, 0x7fc0, %r18, %p10;
    cvt.u16.u32 %h5, %r18;
    st.global.u16 [%rd15], %h5;
    bra.uni ad_sdone;
ad_s32:
    st.global.f32 [%rd14], %f18;
    st.global.f32 [%rd15], %f21;
ad_sdone:
    // the copy of the new weights
    @%p5 bra ad_next;
    @%p6 bra ad_o32;
    add.u64 %rd16, %rd5, %rd11;
    mov.b32 %r20, %f27;
    and.b32 %r21, %r20, 0x7fffffff;
    setp.gt.u32 %p11, %r21, 0x7f800000;  // NaN
    @%p7 bra ad_obf;
    cvt.rn.f16.f32 %h6, %f27;
    shr.u32 %r22, %r20, 16;
    and.b32 %r22, %r22, 0x8000;
    shr.u32 %r23, %r21, 13;
    and.b32 %r23, %r23, 0x3ff;
    or.b32 %r23, %r23, 0x7e00;
    or.b32 %r23, %r23, %r22;
    cvt.u16.u32 %h7, %r23;
    selp.b16 %h6, %h7, %h6, %p11;
    st.global.u16 [%rd16], %h6;
    bra.uni ad_next;
ad_obf:
    shr.u32 %r24, %r20, 16;
    and.b32 %r24, %r24, 1;
    add.u32 %r25, %r20, 0x7fff;
    add.u32 %r25, %r25, %r24;
    shr.u32 %r25, %r25, 16;
    selp.b32 %r25, 0x7fc0, %r25, %p11;
    cvt.u16.u32 %h6, %r25;
    st.global.u16 [%rd16], %h6;
    bra.uni ad_next;
ad_o32:
    add.u64 %rd16, %rd5, %rd10;
    st.global.f32 [%rd16], %f27;
ad_next:
    mov.f32 %sp0, %sp1;                  // the next slot moves to slot 0
    mov.f32 %sp1, %sp2;
    mov.f32 %sp2, %sp3;
    mov.b32 %sg0, %sg1;
    mov.b32 %sg1, %sg2;
    mov.b32 %sg2, %sg3;
    mov.b32 %sm0, %sm1;
    mov.b32 %sm1, %sm2;
    mov.b32 %sm2, %sm3;
    mov.b32 %sv0, %sv1;
    mov.b32 %sv1, %sv2;
    mov.b32 %sv2, %sv3;
    add.u64 %rd20, %rd20, %rd9;
    add.u32 %r27, %r27, 1;
    setp.lt.u32 %p18, %r27, 4;
    setp.lt.and.u64 %p18, %rd20, %rd6, %p18;
    @%p18 bra ad_elem;
    add.u64 %rd7, %rd7, %rd30;
    bra.uni ad_batch;
ad_done:
    ret;
    // Rollback (f32 moments): the inverse of the step for the same gradient and scale.
    //   u = m / denom(v);  p = fma(lr/bc1, u, p) / decay;  g = g * scale (Adam-L2: fma(wd, p, g))
    //   m = fma(-(1-b1), g, m) / b1;  v = max0(fma(-(1-b2), g*g, v) / b2)
ad_rollback:
    sqrt.rn.f32 %f40, %f15;
    div.rn.f32 %f41, %f40, %f7;
    add.rn.f32 %f42, %f41, %f6;
    div.rn.f32 %f43, %f14, %f42;         // u
    fma.rn.f32 %f44, %f8, %f43, %f12;    // step_size * u + p
    div.rn.f32 %f27, %f44, %f9;          // / decay
    mul.rn.f32 %f45, %f13, %f1;          // g * grad_scale
    @%p4 fma.rn.f32 %f45, %f10, %f27, %f45;
    fma.rn.f32 %f46, %f29, %f45, %f14;
    div.rn.f32 %f18, %f46, %f2;          // m
    mul.rn.f32 %f47, %f45, %f45;
    fma.rn.f32 %f48, %f30, %f47, %f15;
    div.rn.f32 %f49, %f48, %f4;
    setp.lt.f32 %p14, %f49, 0f00000000;  // max0: a NaN stays NaN
    selp.f32 %f21, 0f00000000, %f49, %p14;
    bra.uni ad_store;
    // Rescale (f32 moments): the step on grad_scale * g becomes the step on new_scale * g.
    //   u_old = m / denom(v);  Adam-L2: p_prev = fma(lr/bc1, u_old, p), g_x = fma(wd, p_prev, g * x)
    //   m = fma(1-b1, g_new, fma(-(1-b1), g_old, m));  v = max0(fma(1-b2, g_new^2, fma(-(1-b2), g_old^2, v)))
    //   p = fma(-lr/bc1, m / denom(v) - u_old, p)
ad_rescale:
    sqrt.rn.f32 %f40, %f15;
    div.rn.f32 %f41, %f40, %f7;
    add.rn.f32 %f42, %f41, %f6;
    div.rn.f32 %f43, %f14, %f42;         // u_old
    mul.rn.f32 %f50, %f13, %f1;          // g * old scale
    mul.rn.f32 %f51, %f13, %f28;         // g * new scale
    @!%p4 bra rs_moments;
    fma.rn.f32 %f52, %f8, %f43, %f12;    // p_prev
    fma.rn.f32 %f50, %f10, %f52, %f50;
    fma.rn.f32 %f51, %f10, %f52, %f51;
rs_moments:
    fma.rn.f32 %f53, %f29, %f50, %f14;
    fma.rn.f32 %f18, %f3, %f51, %f53;    // m
    mul.rn.f32 %f54, %f50, %f50;
    fma.rn.f32 %f55, %f30, %f54, %f15;
    mul.rn.f32 %f56, %f51, %f51;
    fma.rn.f32 %f57, %f5, %f56, %f55;
    setp.lt.f32 %p14, %f57, 0f00000000;
    selp.f32 %f21, 0f00000000, %f57, %p14; // v
    sqrt.rn.f32 %f58, %f21;
    div.rn.f32 %f59, %f58, %f7;
    add.rn.f32 %f60, %f59, %f6;
    div.rn.f32 %f61, %f18, %f60;         // u_new
    sub.rn.f32 %f62, %f61, %f43;
    fma.rn.f32 %f27, %f11, %f62, %f12;   // p
    bra.uni ad_store;
}
"#;
