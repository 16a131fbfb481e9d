//! The decoding of an XLA FFI call frame (`c_api.rs` declares its layout): XLA's metadata
//! request, the execution stage, buffers, scalar attributes, and the XLA error a failed handler
//! returns.

use std::ffi::{CString, c_void};
use std::mem::{offset_of, size_of};

use super::c_api::{
    API_VERSION, ATTR_SCALAR, Api, ApiVersion, Attrs, BUFFER, Buffer, EXTENSION_METADATA, ErrorCreate, ErrorCreateArgs,
    ErrorDestroyArgs, ExtensionBase, MAX_EXTENSIONS, Metadata, MetadataExtension, Operands, STAGE_EXECUTE, Scalar,
    StreamGetArgs, XLA_FFI_CallFrame, XLA_FFI_Error, XlaType, error_code, type_name,
};
use crate::error::{Error, Result, Status};
use crate::ffi::args::RawBuf;
use crate::kernels::{DType, Floats, FloatsMut};

/// A struct the runtime sent is at least as large as the fields read from it.
fn check_size(what: &str, struct_size: usize, needed: usize) -> Result<()> {
    if struct_size < needed {
        return Err(Error::new(
            Status::StructSize,
            format!(
                "XLA's {what} has {struct_size} bytes, fewer than the {needed} of XLA FFI API {}.{}",
                API_VERSION.0, API_VERSION.1
            ),
        ));
    }
    Ok(())
}

/// What a call frame asks for.
pub(crate) enum Request<'a> {
    /// XLA's metadata query at registration, answered (API version, no traits).
    Metadata,
    /// Execute the handler on these operands.
    Execute(Frame<'a>),
}

/// Opens a call frame: answers a metadata request, or checks an execution frame.
///
/// # Safety
/// `frame` is NULL or XLA's call frame for this call, valid (with everything it points to)
/// until the handler returns.
pub(crate) unsafe fn open<'a>(frame: *mut XLA_FFI_CallFrame) -> Result<Request<'a>> {
    if frame.is_null() {
        return Err(Error::new(Status::NullArgument, "the call frame is NULL"));
    }
    // SAFETY: XLA's frame, valid for the call (the caller's contract); `struct_size` is its
    // first field in every version.
    let frame = unsafe { &*frame };
    check_size("XLA_FFI_CallFrame", frame.struct_size, size_of::<XLA_FFI_CallFrame>())?;
    // SAFETY: the extension chain is XLA's, valid for the call.
    if let Some(metadata) = unsafe { metadata_extension(frame.extension_start)? } {
        // SAFETY: as above.
        unsafe { answer_metadata(metadata)? };
        return Ok(Request::Metadata);
    }
    if frame.stage != STAGE_EXECUTE {
        return Err(Error::invalid(format!(
            "called at execution stage {}; this handler is registered for the execute stage alone",
            frame.stage
        )));
    }
    // SAFETY: the API and the operand tables are XLA's, valid for the call.
    unsafe {
        error_create(frame.api)?;
        check_operands("XLA_FFI_Args", &frame.args)?;
        check_operands("XLA_FFI_Rets", &frame.rets)?;
    }
    check_size("XLA_FFI_Attrs", frame.attrs.struct_size, size_of::<Attrs>())?;
    Ok(Request::Execute(Frame { raw: frame }))
}

/// The metadata extension in the chain starting at `ext`, if there is one.
///
/// # Safety
/// `ext` is NULL or the start of XLA's extension chain, valid for the call.
unsafe fn metadata_extension(mut ext: *mut ExtensionBase) -> Result<Option<*mut MetadataExtension>> {
    for _ in 0..MAX_EXTENSIONS {
        if ext.is_null() {
            return Ok(None);
        }
        // SAFETY: a non-NULL link of XLA's chain.
        let base = unsafe { &*ext };
        if base.kind == EXTENSION_METADATA {
            check_size("XLA_FFI_Metadata_Extension", base.struct_size, size_of::<MetadataExtension>())?;
            return Ok(Some(ext.cast()));
        }
        ext = base.next;
    }
    Err(Error::invalid(format!("the call frame's extension chain is longer than {MAX_EXTENSIONS}")))
}

/// Writes the handler's API version and traits (none: not command-buffer compatible, as
/// the handlers' effects on the session would not be replayed) into XLA's metadata.
///
/// # Safety
/// `ext` is XLA's metadata extension, valid for the call.
unsafe fn answer_metadata(ext: *mut MetadataExtension) -> Result<()> {
    // SAFETY: XLA's extension (the caller's contract).
    let metadata = unsafe { (*ext).metadata };
    if metadata.is_null() {
        return Err(Error::new(Status::NullArgument, "XLA's metadata extension holds no metadata"));
    }
    // SAFETY: XLA's metadata, valid and writable for the call; `struct_size` first.
    let metadata = unsafe { &mut *metadata };
    check_size("XLA_FFI_Metadata", metadata.struct_size, offset_of!(Metadata, traits) + size_of::<u32>())?;
    metadata.api_version = ApiVersion {
        struct_size: size_of::<ApiVersion>(),
        extension_start: std::ptr::null_mut(),
        major_version: API_VERSION.0,
        minor_version: API_VERSION.1,
    };
    metadata.traits = 0;
    if metadata.struct_size >= size_of::<Metadata>() {
        metadata.state_type_id = 0; // XLA_FFI_UNKNOWN_TYPE_ID: the handlers keep no state in XLA
    }
    Ok(())
}

/// The API's `XLA_FFI_Error_Create`.
///
/// # Safety
/// `api` is NULL or XLA's API struct, valid for the call.
unsafe fn error_create(api: *const Api) -> Result<ErrorCreate> {
    if api.is_null() {
        return Err(Error::new(Status::NullArgument, "the call frame has no XLA FFI API"));
    }
    // SAFETY: XLA's API struct (the caller's contract); `struct_size` first.
    let api = unsafe { &*api };
    check_size("XLA_FFI_Api", api.struct_size, size_of::<Api>())?;
    api.error_create.ok_or_else(|| Error::new(Status::NullArgument, "the XLA FFI API has no XLA_FFI_Error_Create"))
}

/// # Safety
/// `ops` is XLA's operand table, its arrays valid for the call.
unsafe fn check_operands(what: &str, ops: &Operands) -> Result<()> {
    check_size(what, ops.struct_size, size_of::<Operands>())?;
    if ops.size < 0 || (ops.size > 0 && (ops.types.is_null() || ops.buffers.is_null())) {
        return Err(Error::invalid(format!("{what} has {} entries and no arrays", ops.size)));
    }
    Ok(())
}

/// The XLA error for a failed call, carrying `message`: NULL (which XLA takes for success)
/// only where the frame gives no way to make one (no usable API).
///
/// # Safety
/// `frame` is NULL or XLA's call frame for this call, valid until the handler returns.
pub(crate) unsafe fn make_error(frame: *mut XLA_FFI_CallFrame, status: Status, message: &str) -> *mut XLA_FFI_Error {
    if frame.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: XLA's frame (the caller's contract); its API is checked before use.
    let create = unsafe {
        let frame = &*frame;
        if frame.struct_size < offset_of!(XLA_FFI_CallFrame, ctx) {
            return std::ptr::null_mut();
        }
        match error_create(frame.api) {
            Ok(create) => create,
            Err(_) => return std::ptr::null_mut(),
        }
    };
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let mut args = ErrorCreateArgs {
        struct_size: size_of::<ErrorCreateArgs>(),
        extension_start: std::ptr::null_mut(),
        message: message.as_ptr(),
        errc: error_code(status) as i32,
    };
    // SAFETY: XLA's function with its argument struct, complete; XLA copies the message.
    unsafe { create(&mut args) }
}

/// An execution call frame whose tables were checked.
pub(crate) struct Frame<'a> {
    raw: &'a XLA_FFI_CallFrame,
}

/// One operand or result buffer.
pub(crate) struct BufferRef<'a> {
    /// "argument 1", "result 0": how messages name it.
    what: String,
    dtype: i32,
    data: *mut c_void,
    dims: &'a [i64],
}

impl<'a> Frame<'a> {
    pub(crate) fn args(&self) -> Result<Vec<BufferRef<'a>>> {
        // SAFETY: the table was checked in `open`; XLA's, valid for the call.
        unsafe { buffers(&self.raw.args, "argument") }
    }

    /// The call's GPU stream (a `CUstream` on XLA's CUDA platform), or None where XLA has none
    /// to give: on its CPU platform `XLA_FFI_Stream_Get` fails (that error is destroyed here).
    pub(crate) fn gpu_stream(&self) -> Option<*mut c_void> {
        // SAFETY: the API was checked in `open` (its size covers `stream_get`); XLA's, valid
        // for the call.
        let api = unsafe { &*self.raw.api };
        let get = api.stream_get?;
        if self.raw.ctx.is_null() {
            return None;
        }
        let mut args = StreamGetArgs {
            struct_size: size_of::<StreamGetArgs>(),
            extension_start: std::ptr::null_mut(),
            ctx: self.raw.ctx,
            stream: std::ptr::null_mut(),
        };
        // SAFETY: XLA's function with its complete argument struct and the call's context.
        let error = unsafe { get(&mut args) };
        if !error.is_null() {
            if let Some(destroy) = api.error_destroy {
                let mut args = ErrorDestroyArgs {
                    struct_size: size_of::<ErrorDestroyArgs>(),
                    extension_start: std::ptr::null_mut(),
                    error,
                };
                // SAFETY: the error XLA just made, destroyed once.
                unsafe { destroy(&mut args) };
            }
            return None;
        }
        (!args.stream.is_null()).then_some(args.stream)
    }

    pub(crate) fn rets(&self) -> Result<Vec<BufferRef<'a>>> {
        // SAFETY: as in `args`.
        unsafe { buffers(&self.raw.rets, "result") }
    }

    /// The results, `count` of them (`what` names the call's results in the message).
    pub(crate) fn rets_exactly(&self, count: usize, what: &str) -> Result<Vec<BufferRef<'a>>> {
        exactly(self.rets()?, count, "results", what)
    }

    /// A scalar attribute as an unsigned integer (any integer type, not negative).
    pub(crate) fn attr_u64(&self, name: &str) -> Result<u64> {
        let (dtype, value) = self.scalar_attr(name)?;
        let signed =
            |v: i64| u64::try_from(v).map_err(|_| Error::invalid(format!("attribute {name} = {v} is negative")));
        // SAFETY: XLA's scalar of that type, valid for the call; read unaligned.
        unsafe {
            match XlaType::from_raw(dtype) {
                Some(XlaType::U64) => Ok(value.cast::<u64>().read_unaligned()),
                Some(XlaType::U32) => Ok(u64::from(value.cast::<u32>().read_unaligned())),
                Some(XlaType::S64) => signed(value.cast::<i64>().read_unaligned()),
                Some(XlaType::S32) => signed(i64::from(value.cast::<i32>().read_unaligned())),
                _ => Err(Error::invalid(format!("attribute {name} is {}, not an integer", type_name(dtype)))),
            }
        }
    }

    pub(crate) fn attr_u32(&self, name: &str) -> Result<u32> {
        let v = self.attr_u64(name)?;
        u32::try_from(v).map_err(|_| Error::invalid(format!("attribute {name} = {v} does not fit in 32 bits")))
    }

    /// A scalar attribute as a float (f32 or f64).
    pub(crate) fn attr_f64(&self, name: &str) -> Result<f64> {
        let (dtype, value) = self.scalar_attr(name)?;
        // SAFETY: as in `attr_u64`.
        unsafe {
            match XlaType::from_raw(dtype) {
                Some(XlaType::F64) => Ok(value.cast::<f64>().read_unaligned()),
                Some(XlaType::F32) => Ok(f64::from(value.cast::<f32>().read_unaligned())),
                _ => Err(Error::invalid(format!("attribute {name} is {}, not a float", type_name(dtype)))),
            }
        }
    }

    fn scalar_attr(&self, name: &str) -> Result<(i32, *const c_void)> {
        let attrs = &self.raw.attrs;
        for i in 0..usize::try_from(attrs.size).unwrap_or(0) {
            // SAFETY: `size` entries in each of XLA's arrays, valid for the call.
            let (kind, span, attr) = unsafe { (*attrs.types.add(i), &**attrs.names.add(i), *attrs.attrs.add(i)) };
            // SAFETY: XLA's name bytes, `len` of them.
            let key = unsafe { std::slice::from_raw_parts(span.ptr.cast::<u8>(), span.len) };
            if key != name.as_bytes() {
                continue;
            }
            if kind != ATTR_SCALAR || attr.is_null() {
                return Err(Error::invalid(format!("attribute {name} is not a scalar")));
            }
            // SAFETY: a scalar attribute points to XLA's `XLA_FFI_Scalar`.
            let scalar = unsafe { &*attr.cast::<Scalar>() };
            if scalar.value.is_null() {
                return Err(Error::new(Status::NullArgument, format!("attribute {name} has no value")));
            }
            return Ok((scalar.dtype, scalar.value));
        }
        Err(Error::invalid(format!("the call has no attribute {name}")))
    }
}

fn exactly<T>(items: Vec<T>, count: usize, kind: &str, what: &str) -> Result<Vec<T>> {
    if items.len() != count {
        return Err(Error::invalid(format!("{what} takes {count} {kind}; the call has {}", items.len())));
    }
    Ok(items)
}

/// # Safety
/// `ops` was checked by `check_operands`; its buffers are XLA's, valid for `'a`.
unsafe fn buffers<'a>(ops: &Operands, kind: &str) -> Result<Vec<BufferRef<'a>>> {
    let count = usize::try_from(ops.size).unwrap_or(0);
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let what = format!("{kind} {i}");
        // SAFETY: `size` entries in each array (checked in `open`).
        let (kind, buffer) = unsafe { (*ops.types.add(i), *ops.buffers.add(i)) };
        if kind != BUFFER || buffer.is_null() {
            return Err(Error::invalid(format!("{what} is not a buffer")));
        }
        // SAFETY: XLA's buffer descriptor, valid for the call; `struct_size` first.
        let buffer = unsafe { &*buffer };
        check_size("XLA_FFI_Buffer", buffer.struct_size, size_of::<Buffer>())?;
        let rank =
            usize::try_from(buffer.rank).map_err(|_| Error::invalid(format!("{what} has rank {}", buffer.rank)))?;
        let dims = if rank == 0 {
            &[][..]
        } else if buffer.dims.is_null() {
            return Err(Error::new(Status::NullArgument, format!("{what} has rank {rank} and no dimensions")));
        } else {
            // SAFETY: `rank` dimensions, XLA's, valid for the call.
            unsafe { std::slice::from_raw_parts(buffer.dims, rank) }
        };
        out.push(BufferRef { what, dtype: buffer.dtype, data: buffer.data, dims });
    }
    Ok(out)
}

impl BufferRef<'_> {
    pub(crate) fn element_count(&self) -> Result<usize> {
        self.dims.iter().try_fold(1usize, |n, &d| {
            usize::try_from(d)
                .ok()
                .and_then(|d| n.checked_mul(d))
                .ok_or_else(|| Error::invalid(format!("{} has dimensions {:?}", self.what, self.dims)))
        })
    }

    pub(crate) fn data(&self) -> *mut c_void {
        self.data
    }

    /// The data pointer of `count` elements of `elem` bytes, checked to be usable as a slice.
    fn checked_data(&self, elem: usize) -> Result<(*mut c_void, usize)> {
        let count = self.element_count()?;
        if count == 0 {
            return Ok((std::ptr::NonNull::<u64>::dangling().as_ptr().cast(), 0));
        }
        if self.data.is_null() {
            return Err(Error::new(Status::NullArgument, format!("{} has no data", self.what)));
        }
        if !(self.data as usize).is_multiple_of(elem) {
            return Err(Error::invalid(format!("{} is not aligned to its {elem}-byte elements", self.what)));
        }
        if count.checked_mul(elem).is_none_or(|bytes| bytes > isize::MAX as usize) {
            return Err(Error::invalid(format!("{} is too large", self.what)));
        }
        Ok((self.data, count))
    }

    /// A floating-point buffer (f32, bf16 or f16) to read.
    ///
    /// # Safety
    /// XLA's buffer, not written by anything else while the view lives.
    pub(crate) unsafe fn floats(&self) -> Result<Floats<'_>> {
        let raw = self.float_buf()?;
        // SAFETY: XLA's buffer, unwritten while the view lives (the caller's contract).
        Ok(unsafe { raw.floats() })
    }

    /// A floating-point buffer (f32, bf16 or f16) to write.
    ///
    /// # Safety
    /// XLA's buffer, accessed by nothing else while the view lives.
    pub(crate) unsafe fn floats_mut(&self) -> Result<FloatsMut<'_>> {
        let raw = self.float_buf()?;
        // SAFETY: XLA's buffer, exclusively ours while the view lives (the caller's contract).
        Ok(unsafe { raw.floats_mut() })
    }

    /// A floating-point buffer on the device: its address, element count and dtype (a
    /// dangling address where it has no elements: nothing is copied then).
    pub(crate) fn device_floats(&self) -> Result<(u64, usize, DType)> {
        let dtype = self.float_dtype()?;
        let (ptr, n) = self.checked_data(dtype.size())?;
        Ok((ptr as u64, n, dtype))
    }

    /// The floating-point buffer as the library's checked buffer argument.
    fn float_buf(&self) -> Result<RawBuf<'_>> {
        let dtype = self.float_dtype()?;
        let (ptr, n) = self.checked_data(dtype.size())?;
        RawBuf::new(&self.what, "its element count", ptr.cast_const(), n, dtype)
    }

    fn float_dtype(&self) -> Result<DType> {
        XlaType::from_raw(self.dtype).and_then(XlaType::float_dtype).ok_or_else(|| {
            Error::invalid(format!("{} is {}; float32, bfloat16 or float16 expected", self.what, type_name(self.dtype)))
        })
    }

    /// The value of a one-element f32 or f64 buffer.
    ///
    /// # Safety
    /// XLA's buffer, valid for reads during the call.
    pub(crate) unsafe fn scalar_f64(&self) -> Result<f64> {
        let (kind, ptr) = self.float_scalar()?;
        // SAFETY: one aligned element of that type (the caller's contract).
        Ok(unsafe {
            match kind {
                XlaType::F64 => ptr.cast::<f64>().read(),
                _ => f64::from(ptr.cast::<f32>().read()),
            }
        })
    }

    /// The type (f32 or f64) and address of a one-element float buffer.
    pub(crate) fn float_scalar(&self) -> Result<(XlaType, *mut c_void)> {
        let kind = XlaType::from_raw(self.dtype).filter(|t| matches!(t, XlaType::F32 | XlaType::F64));
        let Some(kind) = kind else {
            return Err(Error::invalid(format!(
                "{} is {}; float32 or float64 expected",
                self.what,
                type_name(self.dtype)
            )));
        };
        let (ptr, n) = self.checked_data(kind.size())?;
        if n != 1 {
            return Err(Error::invalid(format!("{} has {n} elements; a scalar expected", self.what)));
        }
        Ok((kind, ptr))
    }

    /// Writes `values` into an unsigned 32-bit buffer of exactly that many elements.
    ///
    /// # Safety
    /// XLA's buffer, writable and accessed by nothing else during the call.
    pub(crate) unsafe fn write_u32(&self, values: &[u32]) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.write(XlaType::U32, values) }
    }

    /// Writes `value` into a one-element f32 buffer.
    ///
    /// # Safety
    /// As [`BufferRef::write_u32`].
    pub(crate) unsafe fn write_f32(&self, value: f32) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.write(XlaType::F32, &[value]) }
    }

    /// # Safety
    /// As [`BufferRef::write_u32`]; `T` is the element type of `kind`.
    unsafe fn write<T: Copy>(&self, kind: XlaType, values: &[T]) -> Result<()> {
        let ptr = self.destination(kind, values.len())?;
        // SAFETY: `values.len()` aligned elements of XLA's buffer, writable (the caller's
        // contract).
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), ptr.cast::<T>(), values.len()) };
        Ok(())
    }

    /// The address of a buffer of exactly `count` elements of `kind` (checked), to write.
    pub(crate) fn destination(&self, kind: XlaType, count: usize) -> Result<*mut c_void> {
        if XlaType::from_raw(self.dtype) != Some(kind) {
            return Err(Error::invalid(format!(
                "{} is {}; {} expected",
                self.what,
                type_name(self.dtype),
                type_name(kind as i32)
            )));
        }
        let (ptr, n) = self.checked_data(kind.size())?;
        if n != count {
            return Err(Error::invalid(format!("{} has {n} elements; {count} expected", self.what)));
        }
        Ok(ptr)
    }
}
