//! XLA's FFI C API (`xla/ffi/api/c_api.h`, as JAX's `jax.ffi.include_dir()` ships it): the part
//! the handlers use, declared from its documented layout. Its structs carry their `struct_size`
//! and only ever grow at the end: the handlers declare API version 0.1 ([`API_VERSION`], the
//! oldest a current XLA accepts) and read nothing a 0.1 call frame lacks, so no XLA header or
//! compiler is needed and one library serves every jaxlib whose FFI accepts 0.1 handlers.
//! The structs mirror a foreign layout, so their fields are plain data (`pub`), read where the
//! call frame is decoded.

use std::ffi::{c_char, c_void};

use crate::error::Status;
use crate::kernels::DType;

/// The FFI API version the handlers are written against: (major, minor).
pub(super) const API_VERSION: (i32, i32) = (0, 1);

/// `XLA_FFI_Extension_Metadata`: the extension of the call frame XLA sends at registration.
pub(super) const EXTENSION_METADATA: i32 = 1;
/// `XLA_FFI_ExecutionStage_EXECUTE`.
pub(super) const STAGE_EXECUTE: i32 = 3;
/// `XLA_FFI_ArgType_BUFFER` and `XLA_FFI_RetType_BUFFER`.
pub(super) const BUFFER: i32 = 1;
/// `XLA_FFI_AttrType_SCALAR`.
pub(super) const ATTR_SCALAR: i32 = 3;
/// Extensions followed at most, against a chain that loops.
pub(super) const MAX_EXTENSIONS: usize = 64;

/// XLA's element types (`XLA_FFI_DataType`), those the handlers read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum XlaType {
    S32 = 4,
    S64 = 5,
    U32 = 8,
    U64 = 9,
    F16 = 10,
    F32 = 11,
    F64 = 12,
    Bf16 = 16,
}

impl XlaType {
    pub(super) fn from_raw(raw: i32) -> Option<XlaType> {
        use XlaType::*;
        [S32, S64, U32, U64, F16, F32, F64, Bf16].into_iter().find(|t| *t as i32 == raw)
    }

    /// The session's dtype of a floating-point buffer.
    pub(super) fn float_dtype(self) -> Option<DType> {
        match self {
            XlaType::F32 => Some(DType::F32),
            XlaType::Bf16 => Some(DType::Bf16),
            XlaType::F16 => Some(DType::F16),
            _ => None,
        }
    }

    pub(super) fn size(self) -> usize {
        match self {
            XlaType::F16 | XlaType::Bf16 => 2,
            XlaType::S32 | XlaType::U32 | XlaType::F32 => 4,
            XlaType::S64 | XlaType::U64 | XlaType::F64 => 8,
        }
    }
}

/// A name for an element type code in messages.
pub(super) fn type_name(raw: i32) -> String {
    XlaType::from_raw(raw).map_or_else(|| format!("XLA element type {raw}"), |t| format!("{t:?}").to_lowercase())
}

/// XLA's error codes (`XLA_FFI_Error_Code`), those a handler's failure maps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ErrorCode {
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    NotFound = 5,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    DataLoss = 15,
}

pub(super) fn error_code(status: Status) -> ErrorCode {
    match status {
        Status::NullArgument | Status::InvalidArgument | Status::StructSize | Status::Aliasing => {
            ErrorCode::InvalidArgument
        }
        Status::NonFinite => ErrorCode::InvalidArgument,
        Status::InvalidState => ErrorCode::FailedPrecondition,
        Status::NotFound => ErrorCode::NotFound,
        Status::Unsupported => ErrorCode::Unimplemented,
        Status::OutOfResources => ErrorCode::ResourceExhausted,
        Status::Timeout => ErrorCode::DeadlineExceeded,
        Status::Pending | Status::CudaUnavailable => ErrorCode::Unavailable,
        Status::Io => ErrorCode::Unknown,
        Status::BadCheckpoint => ErrorCode::DataLoss,
        Status::CudaError | Status::StreamCapturing | Status::Panic | Status::Ok => ErrorCode::Internal,
    }
}

/// `XLA_FFI_Extension_Base`.
#[repr(C)]
pub struct ExtensionBase {
    pub struct_size: usize,
    pub kind: i32,
    pub next: *mut ExtensionBase,
}

/// `XLA_FFI_Api_Version`.
#[repr(C)]
pub struct ApiVersion {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub major_version: i32,
    pub minor_version: i32,
}

/// `XLA_FFI_Metadata` (`state_type_id` is written only where the runtime's struct has it).
#[repr(C)]
pub struct Metadata {
    pub struct_size: usize,
    pub api_version: ApiVersion,
    pub traits: u32,
    pub state_type_id: i64,
}

/// `XLA_FFI_Metadata_Extension`.
#[repr(C)]
pub struct MetadataExtension {
    pub extension_base: ExtensionBase,
    pub metadata: *mut Metadata,
}

/// `XLA_FFI_Error_Create_Args`.
#[repr(C)]
pub struct ErrorCreateArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub message: *const c_char,
    pub errc: i32,
}

/// XLA's opaque error (`XLA_FFI_Error`), made by the API's `XLA_FFI_Error_Create`.
pub struct XLA_FFI_Error {
    _private: [u8; 0],
}

pub(super) type ErrorCreate = unsafe extern "C" fn(args: *mut ErrorCreateArgs) -> *mut XLA_FFI_Error;

/// `XLA_FFI_Error_Destroy_Args`.
#[repr(C)]
pub struct ErrorDestroyArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub error: *mut XLA_FFI_Error,
}

pub(super) type ErrorDestroy = unsafe extern "C" fn(args: *mut ErrorDestroyArgs);

/// XLA's opaque execution context (`XLA_FFI_ExecutionContext`), the call frame's `ctx`.
pub struct ExecutionContext {
    _private: [u8; 0],
}

/// `XLA_FFI_Stream_Get_Args`: the platform's stream of the call (a `CUstream` on CUDA).
#[repr(C)]
pub struct StreamGetArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub ctx: *mut ExecutionContext,
    pub stream: *mut c_void,
}

pub(super) type StreamGet = unsafe extern "C" fn(args: *mut StreamGetArgs) -> *mut XLA_FFI_Error;

/// `XLA_FFI_Api`, up to `XLA_FFI_Stream_Get`, the last function the handlers call (the order
/// of its functions is fixed within a major version).
#[repr(C)]
pub struct Api {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub api_version: ApiVersion,
    pub internal_api: *const c_void,
    pub error_create: Option<ErrorCreate>,
    /// `XLA_FFI_Error_GetMessage`, not called.
    pub error_get_message: *const c_void,
    pub error_destroy: Option<ErrorDestroy>,
    /// `XLA_FFI_Handler_Register`, not called.
    pub handler_register: *const c_void,
    pub stream_get: Option<StreamGet>,
}

/// `XLA_FFI_Buffer`.
#[repr(C)]
pub struct Buffer {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub dtype: i32,
    pub data: *mut c_void,
    pub rank: i64,
    pub dims: *const i64,
}

/// `XLA_FFI_Args` and `XLA_FFI_Rets` (the same layout).
#[repr(C)]
pub struct Operands {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *const i32,
    pub buffers: *const *mut Buffer,
}

/// `XLA_FFI_ByteSpan`.
#[repr(C)]
pub struct ByteSpan {
    pub ptr: *const c_char,
    pub len: usize,
}

/// `XLA_FFI_Scalar`.
#[repr(C)]
pub struct Scalar {
    pub dtype: i32,
    pub value: *const c_void,
}

/// `XLA_FFI_Attrs` (sorted by name).
#[repr(C)]
pub struct Attrs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *const i32,
    pub names: *const *const ByteSpan,
    pub attrs: *const *const c_void,
}

/// XLA's call frame (`XLA_FFI_CallFrame`), up to the attributes (the `future` after them
/// is never set: every handler completes before it returns).
#[repr(C)]
pub struct XLA_FFI_CallFrame {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub api: *const Api,
    pub ctx: *mut ExecutionContext,
    pub stage: i32,
    pub args: Operands,
    pub rets: Operands,
    pub attrs: Attrs,
}
