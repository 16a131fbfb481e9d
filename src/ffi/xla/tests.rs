//! The handlers driven by call frames laid out as XLA lays them out, with an API whose
//! `XLA_FFI_Error_Create` records the error and whose `XLA_FFI_Stream_Get` answers as XLA's CPU
//! platform does (an error) or as a GPU platform would (a stream): XLA's metadata request, one
//! whole step on a host session (begin, hand-overs, step, reads), and the refusals.

use std::ffi::{CStr, c_void};
use std::mem::size_of;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::c_api::{
    API_VERSION, ATTR_SCALAR, Api, ApiVersion, Attrs, BUFFER, Buffer, ByteSpan, EXTENSION_METADATA, ErrorCreateArgs,
    ErrorDestroyArgs, ExecutionContext, ExtensionBase, Metadata, MetadataExtension, Operands, STAGE_EXECUTE, Scalar,
    StreamGetArgs, XlaType,
};
use super::*;
use crate::ffi::session::{so_session, so_session_create, so_session_destroy, so_session_id};
use crate::session::{Borrowed, GroupHparams, SliceDesc, SubGroupDesc};

type Handler = unsafe extern "C" fn(so_xla_call_frame_t) -> so_xla_error_t;

/// An error as the fake API made it: (XLA error code, message).
type Made = (i32, String);

unsafe extern "C" fn record_error(args: *mut ErrorCreateArgs) -> *mut XLA_FFI_Error {
    // SAFETY: the handler passes a complete argument struct with a NUL-terminated message.
    let (code, message) = unsafe { ((*args).errc, CStr::from_ptr((*args).message).to_string_lossy().into_owned()) };
    Box::into_raw(Box::new((code, message))).cast()
}

/// Errors the fake API destroyed (XLA's CPU platform answers every `XLA_FFI_Stream_Get` with
/// one, which the handler must destroy).
static DESTROYED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn destroy_error(args: *mut ErrorDestroyArgs) {
    // SAFETY: an error `record_error` or `no_stream` made from a Box, destroyed once.
    drop(unsafe { Box::from_raw((*args).error.cast::<Made>()) });
    DESTROYED.fetch_add(1, Ordering::Relaxed);
}

/// `XLA_FFI_Stream_Get` on XLA's CPU platform: an error.
unsafe extern "C" fn no_stream(_args: *mut StreamGetArgs) -> *mut XLA_FFI_Error {
    Box::into_raw(Box::new((12, "XLA FFI GPU context is not available".to_string()))).cast()
}

/// `XLA_FFI_Stream_Get` on a GPU platform: a stream (never used: the sessions here are host
/// sessions, which refuse it).
unsafe extern "C" fn some_stream(args: *mut StreamGetArgs) -> *mut XLA_FFI_Error {
    // SAFETY: the handler passes a complete, writable argument struct.
    unsafe { (*args).stream = std::ptr::dangling_mut::<u64>().cast() };
    std::ptr::null_mut()
}

/// Where the fake XLA runs the call.
#[derive(Clone, Copy)]
enum Platform {
    Cpu,
    Gpu,
}

fn api(platform: Platform) -> Api {
    Api {
        struct_size: size_of::<Api>(),
        extension_start: std::ptr::null_mut(),
        api_version: ApiVersion {
            struct_size: size_of::<ApiVersion>(),
            extension_start: std::ptr::null_mut(),
            major_version: 0,
            minor_version: 3,
        },
        internal_api: std::ptr::null(),
        error_create: Some(record_error),
        error_get_message: std::ptr::null(),
        error_destroy: Some(destroy_error),
        handler_register: std::ptr::null(),
        stream_get: Some(match platform {
            Platform::Cpu => no_stream,
            Platform::Gpu => some_stream,
        }),
    }
}

/// A buffer operand or result: XLA element type, data, dimensions.
struct Buf {
    dtype: XlaType,
    data: *mut c_void,
    dims: Vec<i64>,
}

impl Buf {
    fn of<T>(dtype: XlaType, data: &mut [T], dims: &[i64]) -> Buf {
        Buf { dtype, data: data.as_mut_ptr().cast(), dims: dims.to_vec() }
    }
}

/// A scalar attribute.
enum Attr {
    U64(u64),
    U32(u32),
    F64(f64),
}

/// Calls `handler` at `stage` with a frame built from the operands, results and attributes
/// (attributes given sorted by name, as XLA sorts them).
fn call_at(
    handler: Handler,
    stage: i32,
    args: &[Buf],
    rets: &[Buf],
    attrs: &[(&str, Attr)],
) -> std::result::Result<(), Made> {
    call_on(Platform::Cpu, handler, stage, args, rets, attrs)
}

/// As `call_at`, on `platform`.
fn call_on(
    platform: Platform,
    handler: Handler,
    stage: i32,
    args: &[Buf],
    rets: &[Buf],
    attrs: &[(&str, Attr)],
) -> std::result::Result<(), Made> {
    let api = api(platform);
    // XLA's execution context is opaque; the fake API's `XLA_FFI_Stream_Get` never reads it.
    let ctx: *mut ExecutionContext = std::ptr::dangling_mut::<u64>().cast();
    let descriptors = |bufs: &[Buf]| -> Vec<Buffer> {
        bufs.iter()
            .map(|b| Buffer {
                struct_size: size_of::<Buffer>(),
                extension_start: std::ptr::null_mut(),
                dtype: b.dtype as i32,
                data: b.data,
                rank: b.dims.len() as i64,
                dims: b.dims.as_ptr(),
            })
            .collect()
    };
    let (mut arg_bufs, mut ret_bufs) = (descriptors(args), descriptors(rets));
    let arg_ptrs: Vec<*mut Buffer> = arg_bufs.iter_mut().map(|b| b as *mut Buffer).collect();
    let ret_ptrs: Vec<*mut Buffer> = ret_bufs.iter_mut().map(|b| b as *mut Buffer).collect();
    let (arg_types, ret_types) = (vec![BUFFER; args.len()], vec![BUFFER; rets.len()]);
    let values: Vec<[u8; 8]> = attrs
        .iter()
        .map(|(_, a)| match a {
            Attr::U64(v) => v.to_ne_bytes(),
            Attr::U32(v) => u64::from(*v).to_ne_bytes(), // the low bytes first on x86-64
            Attr::F64(v) => v.to_ne_bytes(),
        })
        .collect();
    let scalars: Vec<Scalar> = attrs
        .iter()
        .zip(&values)
        .map(|((_, a), v)| Scalar {
            dtype: match a {
                Attr::U64(_) => XlaType::U64,
                Attr::U32(_) => XlaType::U32,
                Attr::F64(_) => XlaType::F64,
            } as i32,
            value: v.as_ptr().cast(),
        })
        .collect();
    let names: Vec<ByteSpan> = attrs.iter().map(|(n, _)| ByteSpan { ptr: n.as_ptr().cast(), len: n.len() }).collect();
    let name_ptrs: Vec<*const ByteSpan> = names.iter().map(|n| n as *const ByteSpan).collect();
    let attr_ptrs: Vec<*const c_void> = scalars.iter().map(|s| (s as *const Scalar).cast()).collect();
    let attr_types = vec![ATTR_SCALAR; attrs.len()];
    let operands = |n: usize, types: &[i32], ptrs: &[*mut Buffer]| Operands {
        struct_size: size_of::<Operands>(),
        extension_start: std::ptr::null_mut(),
        size: n as i64,
        types: types.as_ptr(),
        buffers: ptrs.as_ptr(),
    };
    let mut frame = XLA_FFI_CallFrame {
        struct_size: size_of::<XLA_FFI_CallFrame>(),
        extension_start: std::ptr::null_mut(),
        api: &api,
        ctx,
        stage,
        args: operands(args.len(), &arg_types, &arg_ptrs),
        rets: operands(rets.len(), &ret_types, &ret_ptrs),
        attrs: Attrs {
            struct_size: size_of::<Attrs>(),
            extension_start: std::ptr::null_mut(),
            size: attrs.len() as i64,
            types: attr_types.as_ptr(),
            names: name_ptrs.as_ptr(),
            attrs: attr_ptrs.as_ptr(),
        },
    };
    // SAFETY: a complete frame whose tables outlive the call.
    let error = unsafe { handler(&mut frame) };
    if error.is_null() {
        Ok(())
    } else {
        // SAFETY: made by `record_error` from a Box.
        Err(*unsafe { Box::from_raw(error.cast::<Made>()) })
    }
}

fn call(handler: Handler, args: &[Buf], rets: &[Buf], attrs: &[(&str, Attr)]) -> std::result::Result<(), Made> {
    call_at(handler, STAGE_EXECUTE, args, rets, attrs)
}

/// XLA's error codes the tests expect.
const INVALID_ARGUMENT: i32 = 3;
const NOT_FOUND: i32 = 5;
const UNIMPLEMENTED: i32 = 12;

#[test]
fn every_handler_answers_the_metadata_request() {
    for handler in [so_xla_begin_step, so_xla_hand_over, so_xla_step, so_xla_read_weights] as [Handler; 4] {
        let mut metadata = Metadata {
            struct_size: size_of::<Metadata>(),
            api_version: ApiVersion {
                struct_size: size_of::<ApiVersion>(),
                extension_start: std::ptr::null_mut(),
                major_version: -1,
                minor_version: -1,
            },
            traits: 7,
            state_type_id: 9,
        };
        let mut ext = MetadataExtension {
            extension_base: ExtensionBase {
                struct_size: size_of::<MetadataExtension>(),
                kind: EXTENSION_METADATA,
                next: std::ptr::null_mut(),
            },
            metadata: &mut metadata,
        };
        let empty = || Operands {
            struct_size: size_of::<Operands>(),
            extension_start: std::ptr::null_mut(),
            size: 0,
            types: std::ptr::null(),
            buffers: std::ptr::null(),
        };
        // As XLA's registration builds it: no API, no operands.
        let mut frame = XLA_FFI_CallFrame {
            struct_size: size_of::<XLA_FFI_CallFrame>(),
            extension_start: &mut ext.extension_base,
            api: std::ptr::null(),
            ctx: std::ptr::null_mut(),
            stage: STAGE_EXECUTE,
            args: empty(),
            rets: empty(),
            attrs: Attrs {
                struct_size: size_of::<Attrs>(),
                extension_start: std::ptr::null_mut(),
                size: 0,
                types: std::ptr::null(),
                names: std::ptr::null(),
                attrs: std::ptr::null(),
            },
        };
        // SAFETY: a complete metadata frame.
        assert!(unsafe { handler(&mut frame) }.is_null());
        let v = &metadata.api_version;
        assert_eq!((v.major_version, v.minor_version), API_VERSION);
        assert_eq!((metadata.traits, metadata.state_type_id), (0, 0));
    }
}

/// The `session` attribute of a session: its id.
fn id_of(handle: *mut so_session) -> u64 {
    let mut id = 0;
    // SAFETY: a live session; `id` is writable.
    assert_eq!(unsafe { so_session_id(handle, &mut id) }, Status::Ok);
    assert_ne!(id, 0);
    id
}

/// A host session with one group and one sub-group of two slices ("w": 6 elements, "b": 2),
/// its master weights `master` (borrowed).
fn session_with_two_slices(master: &mut [f32; 8]) -> *mut so_session {
    let mut handle = std::ptr::null_mut();
    // SAFETY: default options; `handle` is writable.
    assert_eq!(unsafe { so_session_create(std::ptr::null(), &mut handle) }, Status::Ok);
    // SAFETY: just created, destroyed by the caller after use.
    let s = unsafe { crate::ffi::session::session_ref(handle) }.unwrap();
    let group = s.add_group(GroupHparams { lr: 0.0, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }).unwrap();
    // SAFETY: `master` outlives the session (the caller destroys it first).
    let borrowed = unsafe { Borrowed::new("master", master.as_mut_ptr().cast(), 8, crate::kernels::DType::F32) };
    let slices =
        vec![SliceDesc { name: "w".into(), offset: 0, numel: 6 }, SliceDesc { name: "b".into(), offset: 6, numel: 2 }];
    s.add_subgroup(SubGroupDesc::new(group, borrowed.unwrap(), slices)).unwrap();
    handle
}

fn begin(session: u64, lr: f32, scale: &mut f32, previous: &mut [u32; 2]) -> std::result::Result<(), Made> {
    let (mut lr, mut loss_scale) = (lr, 1.0f32);
    call(
        so_xla_begin_step,
        &[
            Buf::of(XlaType::F32, std::slice::from_mut(&mut lr), &[]),
            Buf::of(XlaType::F32, std::slice::from_mut(&mut loss_scale), &[]),
            Buf::of(XlaType::U32, previous, &[2]),
        ],
        &[Buf::of(XlaType::F32, std::slice::from_mut(scale), &[])],
        &[("group", Attr::U32(0)), ("session", Attr::U64(session))],
    )
}

#[test]
fn a_step_through_the_handlers_matches_the_session_api() {
    let mut master = [0.5f32, -1.0, 2.0, 0.25, -0.75, 1.5, 0.0, 0.0];
    let handle = session_with_two_slices(&mut master);
    let session = id_of(handle);
    let mut ticket = [0u32; 2];
    let mut scale = 0.0f32;
    begin(session, 1e-2, &mut scale, &mut ticket).unwrap();
    assert_eq!(scale, 1.0);
    let mut grad_w = [0.1f32, -0.2, 0.3, -0.4, 0.5, -0.6];
    let mut grad_b = [1.0f32, -1.0];
    for (slice, grad) in [(0u32, &mut grad_w[..]), (1, &mut grad_b[..])] {
        let n = grad.len() as i64;
        // The result aliased to the operand, as `input_output_aliases={0: 0}` asks.
        let (g, aliased) = (Buf::of(XlaType::F32, grad, &[n]), Buf::of(XlaType::F32, grad, &[n]));
        let token = Buf::of(XlaType::F32, std::slice::from_mut(&mut scale), &[]);
        let attrs = [("session", Attr::U64(session)), ("slice", Attr::U32(slice))];
        call(so_xla_hand_over, &[g, token], &[aliased], &attrs).unwrap();
    }
    call(
        so_xla_step,
        &[Buf::of(XlaType::F32, &mut grad_w, &[6]), Buf::of(XlaType::F32, &mut grad_b, &[2])],
        &[Buf::of(XlaType::U32, &mut ticket, &[2])],
        &[("max_norm", Attr::F64(0.5)), ("session", Attr::U64(session))],
    )
    .unwrap();
    let step_ticket = u64::from(ticket[0]) | (u64::from(ticket[1]) << 32);
    assert_ne!(step_ticket, 0);
    let (mut w, mut b) = ([0f32; 6], [0f32; 2]);
    for (slice, out) in [(0u32, &mut w[..]), (1, &mut b[..])] {
        let n = out.len() as i64;
        call(
            so_xla_read_weights,
            &[Buf::of(XlaType::U32, &mut ticket, &[2])],
            &[Buf::of(XlaType::F32, out, &[n])],
            &[("session", Attr::U64(session)), ("slice", Attr::U32(slice))],
        )
        .unwrap();
    }
    // SAFETY: live until destroyed below.
    let s = unsafe { crate::ffi::session::session_ref(handle) }.unwrap();
    let result = s.step_result(step_ticket, None).unwrap();
    assert!(!result.skipped && result.clip_coef < 1.0, "{result:?}");
    assert_eq!(s.group_hparams(0).unwrap().lr, f64::from(1e-2f32));
    assert_eq!([&w[..], &b[..]].concat(), master.to_vec(), "the weights read are the master weights");
    assert_ne!(master[0], 0.5);
    // SAFETY: no call on it is running.
    unsafe { so_session_destroy(handle) };
}

#[test]
fn the_cpu_platform_stream_error_is_destroyed_and_a_gpu_call_of_a_host_session_refused() {
    let mut master = [1.0f32; 8];
    let handle = session_with_two_slices(&mut master);
    let session = id_of(handle);
    let (mut ticket, mut scale) = ([0u32; 2], 0.0f32);
    let destroyed = DESTROYED.load(Ordering::Relaxed);
    begin(session, 1e-2, &mut scale, &mut ticket).unwrap();
    assert!(DESTROYED.load(Ordering::Relaxed) > destroyed, "XLA's error from XLA_FFI_Stream_Get is destroyed");
    let mut out = [0f32; 6];
    let (code, message) = call_on(
        Platform::Gpu,
        so_xla_read_weights,
        STAGE_EXECUTE,
        &[],
        &[Buf::of(XlaType::F32, &mut out, &[6])],
        &[("session", Attr::U64(session)), ("slice", Attr::U32(0))],
    )
    .unwrap_err();
    assert_eq!(code, UNIMPLEMENTED, "{message}");
    assert!(message.contains("runs on a GPU and its session is a host session"), "{message}");
    assert_eq!(out, [0f32; 6], "nothing was written");
    // SAFETY: no call on it is running.
    unsafe { so_session_destroy(handle) };
}

#[test]
fn a_step_left_unfinished_is_skipped_at_the_next_begin() {
    let mut master = [1.0f32; 8];
    let handle = session_with_two_slices(&mut master);
    let (mut ticket, mut scale) = ([0u32; 2], 0.0f32);
    begin(id_of(handle), 1e-2, &mut scale, &mut ticket).unwrap();
    // The execution failed before its step: the next one begins anyway.
    begin(id_of(handle), 1e-2, &mut scale, &mut ticket).unwrap();
    // SAFETY: live until destroyed below.
    let s = unsafe { crate::ffi::session::session_ref(handle) }.unwrap();
    assert!(s.step_in_progress());
    assert_eq!(master, [1.0f32; 8], "the unfinished step changed nothing");
    // SAFETY: no call on it is running.
    unsafe { so_session_destroy(handle) };
}

#[test]
fn refusals_are_xla_errors_with_the_library_message() {
    let mut master = [0.0f32; 8];
    let handle = session_with_two_slices(&mut master);
    let session = id_of(handle);
    let (mut ticket, mut scale) = ([0u32; 2], 0.0f32);

    let (code, message) = begin(handle as u64, 1e-2, &mut scale, &mut ticket).unwrap_err();
    assert_eq!(code, NOT_FOUND, "an address is not an id");
    let expected = format!("so_xla_begin_step: attribute session = {} is not the id of a live session", handle as u64);
    assert!(message.starts_with(&expected), "{message}");

    let (code, message) = begin(session, -1.0, &mut scale, &mut ticket).unwrap_err();
    assert_eq!(code, INVALID_ARGUMENT, "{message}");

    begin(session, 1e-2, &mut scale, &mut ticket).unwrap();
    let mut ints = [0i32; 6];
    let attrs = [("session", Attr::U64(session)), ("slice", Attr::U32(0))];
    let wrong_type = [Buf::of(XlaType::S32, &mut ints, &[6])];
    let (code, message) =
        call(so_xla_hand_over, &wrong_type, &[Buf::of(XlaType::S32, &mut ints, &[6])], &attrs).unwrap_err();
    assert_eq!(code, INVALID_ARGUMENT);
    assert!(message.contains("argument 0 is s32; float32, bfloat16 or float16 expected"), "{message}");

    let (mut short, mut out) = ([0f32; 5], [0f32; 5]);
    let wrong_size = [Buf::of(XlaType::F32, &mut short, &[5])];
    let (_, message) =
        call(so_xla_hand_over, &wrong_size, &[Buf::of(XlaType::F32, &mut out, &[5])], &attrs).unwrap_err();
    assert!(message.contains("slice \"w\" has 6 elements; the gradient has 5"), "{message}");

    let (_, message) =
        call(so_xla_step, &[], &[Buf::of(XlaType::U32, &mut ticket, &[2])], &[("session", Attr::U64(session))])
            .unwrap_err();
    assert!(message.contains("no attribute max_norm"), "{message}");

    let mut lr = 1e-2f32;
    let only_lr = [Buf::of(XlaType::F32, std::slice::from_mut(&mut lr), &[])];
    let (_, message) = call(
        so_xla_begin_step,
        &only_lr,
        &[Buf::of(XlaType::F32, std::slice::from_mut(&mut scale), &[])],
        &[("group", Attr::U32(0)), ("session", Attr::U64(session))],
    )
    .unwrap_err();
    assert!(message.contains("the learning rate and the loss scale"), "{message}");

    let (_, message) = call_at(so_xla_step, 1, &[], &[], &[]).unwrap_err();
    assert!(message.contains("execution stage 1"), "{message}");
    // SAFETY: no call on it is running.
    unsafe { so_session_destroy(handle) };
    let (code, _) = begin(session, 1e-2, &mut scale, &mut ticket).unwrap_err();
    assert_eq!(code, NOT_FOUND, "a destroyed session is refused");
    // A later session, wherever it lives, has another id.
    let mut other_master = [0.0f32; 8];
    let other = session_with_two_slices(&mut other_master);
    assert_ne!(id_of(other), session);
    assert_eq!(begin(session, 1e-2, &mut scale, &mut ticket).unwrap_err().0, NOT_FOUND);
    // SAFETY: no call on it is running.
    unsafe { so_session_destroy(other) };
}
