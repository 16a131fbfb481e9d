//! Conversion kernels shipped as PTX text: the driver compiles them for the GPU at load
//! time, so nothing needs nvcc or NVRTC. Both round exactly as `kernels::dtype` does on the
//! CPU: bf16 by integer round-to-nearest-even with every NaN made 0x7FC0; f16 by the IEEE
//! conversion with a NaN keeping its sign and top payload bits, quieted.

pub(crate) const CONVERT: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry so_f32_to_bf16(.param .u64 src, .param .u64 dst, .param .u64 n)
{
    .reg .pred %p<3>;
    .reg .b16 %h<2>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<12>;

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
    add.u64 %rd4, %rd4, %rd5;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd6, %r4, %r2;
bf16_loop:
    setp.ge.u64 %p1, %rd4, %rd3;
    @%p1 bra bf16_done;
    shl.b64 %rd7, %rd4, 2;
    add.u64 %rd8, %rd1, %rd7;
    ld.global.u32 %r5, [%rd8];
    shr.u32 %r6, %r5, 16;
    and.b32 %r6, %r6, 1;
    add.u32 %r7, %r5, 0x7fff;
    add.u32 %r7, %r7, %r6;
    shr.u32 %r7, %r7, 16;
    and.b32 %r8, %r5, 0x7fffffff;
    setp.gt.u32 %p2, %r8, 0x7f800000;
    selp.b32 %r9, 0x7fc0, %r7, %p2;
    cvt.u16.u32 %h1, %r9;
    shl.b64 %rd9, %rd4, 1;
    add.u64 %rd10, %rd2, %rd9;
    st.global.u16 [%rd10], %h1;
    add.u64 %rd4, %rd4, %rd6;
    bra bf16_loop;
bf16_done:
    ret;
}

.visible .entry so_f32_to_f16(.param .u64 src, .param .u64 dst, .param .u64 n)
{
    .reg .pred %p<3>;
    .reg .b16 %h<4>;
    .reg .f32 %f<2>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<12>;

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
    add.u64 %rd4, %rd4, %rd5;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd6, %r4, %r2;
f16_loop:
    setp.ge.u64 %p1, %rd4, %rd3;
    @%p1 bra f16_done;
    shl.b64 %rd7, %rd4, 2;
    add.u64 %rd8, %rd1, %rd7;
    ld.global.u32 %r5, [%rd8];
    mov.b32 %f1, %r5;
    cvt.rn.f16.f32 %h1, %f1;
    and.b32 %r8, %r5, 0x7fffffff;
    setp.gt.u32 %p2, %r8, 0x7f800000;
    shr.u32 %r6, %r5, 16;
    and.b32 %r6, %r6, 0x8000;
    shr.u32 %r7, %r8, 13;
    and.b32 %r7, %r7, 0x3ff;
    or.b32 %r7, %r7, 0x7e00;
    or.b32 %r7, %r7, %r6;
    cvt.u16.u32 %h2, %r7;
    selp.b16 %h3, %h2, %h1, %p2;
    shl.b64 %rd9, %rd4, 1;
    add.u64 %rd10, %rd2, %rd9;
    st.global.u16 [%rd10], %h3;
    add.u64 %rd4, %rd4, %rd6;
    bra f16_loop;
f16_done:
    ret;
}
"#;
