//! Conversions between the C types and the core types, generated from one field list.
//!
//! Each `#[repr(C)]` struct is declared once, with its documentation (cbindgen copies it into
//! the header; cbindgen does not expand macros, so the declaration itself cannot be
//! generated). Next to it, one [`abi_struct!`] names the fields it shares with its core type;
//! the macro writes `to_core` (C to core: each field through [`FromC`], which validates enum
//! codes) and `from_core` (core to C, `struct_size` set: each field through [`ToC`]). Each
//! builds its result as a struct literal, so a field added to the struct it builds and not to
//! the list does not compile; with both directions (`<=>`), that is either side. Fields that
//! have no counterpart of the same name (pointer + length pairs, tagged values) are written
//! out in the invocation, in a `to_core` or `to_c` section.
//!
//! A shared field is documented once, on the C struct (the contract); the core struct's doc
//! links to it and says only what its Rust types add (`tests/architecture/abi_docs.rs` checks this).
//!
//! Enums cross as `uint32_t` and are mapped by [`abi_enum!`] (in `types.rs`).

use std::ffi::c_void;
use std::fmt;

use crate::error::{Error, Result};

/// How messages name a value: an argument (`grad_dtype`) or a field of one, `arg->field`
/// (`options->mode`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Field<'a> {
    arg: &'a str,
    member: Option<&'static str>,
}

impl<'a> Field<'a> {
    pub(crate) fn arg(arg: &'a str) -> Self {
        Field { arg, member: None }
    }

    pub(crate) fn member(arg: &'a str, member: &'static str) -> Self {
        Field { arg, member: Some(member) }
    }
}

impl fmt::Display for Field<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.member {
            Some(member) => write!(f, "{}->{member}", self.arg),
            None => f.write_str(self.arg),
        }
    }
}

/// The core value a C field's value stands for; fails for a value outside the field's range
/// (an enum code that is not one of its values).
pub(crate) trait FromC<C>: Sized {
    fn from_c(value: C, field: Field<'_>) -> Result<Self>;
}

/// The C value of a core value.
pub(crate) trait ToC<C> {
    fn to_c(self) -> C;
}

macro_rules! same_in_c {
    ($($t:ty),+) => {$(
        impl FromC<$t> for $t {
            fn from_c(value: $t, _: Field<'_>) -> Result<$t> {
                Ok(value)
            }
        }
        impl ToC<$t> for $t {
            fn to_c(self) -> $t {
                self
            }
        }
    )+};
}
same_in_c!(bool, f32, f64, i32, u32, u64, usize);

/// A byte count that is a `uint64_t` in C.
impl FromC<u64> for usize {
    fn from_c(value: u64, field: Field<'_>) -> Result<usize> {
        usize::try_from(value).map_err(|_| Error::invalid(format!("{field} = {value} does not fit in size_t")))
    }
}

impl ToC<u64> for usize {
    fn to_c(self) -> u64 {
        self as u64
    }
}

/// A limit that is a `uint64_t` in C, where 0 means none.
impl FromC<u64> for Option<usize> {
    fn from_c(value: u64, field: Field<'_>) -> Result<Option<usize>> {
        Ok(Some(usize::from_c(value, field)?).filter(|&v| v != 0))
    }
}

impl ToC<u64> for Option<usize> {
    fn to_c(self) -> u64 {
        self.unwrap_or(0) as u64
    }
}

/// A host buffer handed back to the caller.
impl ToC<*mut c_void> for *mut u8 {
    fn to_c(self) -> *mut c_void {
        self.cast()
    }
}

/// Declares the conversions of a `#[repr(C)]` struct from the list of fields it shares by
/// name with its core type (see the module docs).
///
/// - `so_x <=> Core { a, b }`: both directions.
/// - `so_x <=> Core { a, b } to_core |raw, arg| { c: expr } to_c |core| { d: expr }`: both,
///   with the fields that need an expression (`raw` is the C struct, `arg` its name in
///   messages, `core` the core value). `to_core (unsafe) |raw, arg|` makes `to_core` an
///   `unsafe fn`, for structs whose pointers it reads.
/// - `so_x => Core { a } to_core |raw, arg| { .. }`: C to core only.
/// - `so_x <= Core { a, b }`: core to C only (results).
macro_rules! abi_struct {
    ($c:ident <=> $core:ident { $($f:ident),* $(,)? }) => {
        $crate::ffi::convert::abi_struct!(@to_core $c $core [$($f)*] |raw, arg| {});
        $crate::ffi::convert::abi_struct!(@to_c $c $core [$($f)*] |core| {});
    };
    (
        $c:ident <=> $core:ident { $($f:ident),* $(,)? }
        to_core $(($unsafe:ident))? |$raw:ident, $arg:ident| { $($rf:ident: $re:expr),* $(,)? }
        to_c |$cv:ident| { $($wf:ident: $we:expr),* $(,)? }
    ) => {
        $crate::ffi::convert::abi_struct!(@to_core $c $core [$($f)*] $(($unsafe))? |$raw, $arg| { $($rf: $re),* });
        $crate::ffi::convert::abi_struct!(@to_c $c $core [$($f)*] |$cv| { $($wf: $we),* });
    };
    (
        $c:ident => $core:ident { $($f:ident),* $(,)? }
        to_core $(($unsafe:ident))? |$raw:ident, $arg:ident| { $($rf:ident: $re:expr),* $(,)? }
    ) => {
        $crate::ffi::convert::abi_struct!(@to_core $c $core [$($f)*] $(($unsafe))? |$raw, $arg| { $($rf: $re),* });
    };
    ($c:ident <= $core:ident { $($f:ident),* $(,)? }) => {
        $crate::ffi::convert::abi_struct!(@to_c $c $core [$($f)*] |core| {});
    };

    (@to_core $c:ident $core:ident [$($f:ident)*] $(($unsafe:ident))? |$raw:ident, $arg:ident|
        { $($rf:ident: $re:expr),* }) => {
        impl $c {
            /// The core value of the caller's struct, named `arg` in messages; every field
            /// is validated (enum codes).
            $(#[doc = concat!(
                "\n# Safety\nAn `", stringify!($unsafe), " fn` because it reads what the struct's ",
                "pointers point to: each must be NULL or valid as the header documents for this struct."
            )])?
            pub(crate) $($unsafe)? fn to_core(self, arg: &str) -> $crate::error::Result<$core> {
                let $raw = &self;
                let $arg = arg;
                Ok($core {
                    $($f: $crate::ffi::convert::FromC::from_c(
                        $raw.$f,
                        $crate::ffi::convert::Field::member($arg, stringify!($f)),
                    )?,)*
                    $($rf: $re,)*
                })
            }
        }
    };
    (@to_c $c:ident $core:ident [$($f:ident)*] |$cv:ident| { $($wf:ident: $we:expr),* }) => {
        impl $c {
            /// The C struct of a core value, `struct_size` set.
            pub(crate) fn from_core($cv: &$core) -> $c {
                $c {
                    struct_size: ::std::mem::size_of::<$c>(),
                    $($f: $crate::ffi::convert::ToC::to_c($cv.$f),)*
                    $($wf: $we,)*
                }
            }
        }
    };
}
pub(crate) use abi_struct;

/// Declares the conversions of a C enum (`#[repr(u32)]`, crossing the ABI as `uint32_t`):
/// `from_raw` and `parse` (an unknown code is `SO_STATUS_INVALID_ARGUMENT`, naming the field),
/// and, with a core enum, `From` both ways plus [`FromC`]/[`ToC`] for `u32` fields. Every
/// variant must be listed: the conversions are exhaustive matches.
///
/// - `so_x { A, B }`: C values only.
/// - `so_x <=> Core { A = CoreA, B = CoreB }`: one C value per core value.
/// - `so_x <=> Option<Core> { N = None, A = CoreA }`: a C value `N` standing for "none".
macro_rules! abi_enum {
    ($c:ident { $($cv:ident),+ $(,)? }) => {
        impl $c {
            /// The value of a raw code, if it is one.
            pub(crate) fn from_raw(raw: u32) -> Option<$c> {
                // Exhaustive: a variant left out of the list does not compile.
                let _ = |v: $c| match v { $($c::$cv => ()),+ };
                [$($c::$cv),+].into_iter().find(|v| *v as u32 == raw)
            }

            /// The value of a caller's code, or an error naming `field`.
            pub(crate) fn parse(raw: u32, field: impl ::std::fmt::Display) -> $crate::error::Result<$c> {
                $c::from_raw(raw).ok_or_else(|| {
                    $crate::error::Error::invalid(format!("{field} = {raw} is not a {} value", stringify!($c)))
                })
            }
        }
    };
    ($c:ident <=> Option<$core:ident> { $none:ident = None, $($cv:ident = $corev:ident),+ $(,)? }) => {
        $crate::ffi::convert::abi_enum!($c { $none, $($cv),+ });

        impl $c {
            /// The core value, `None` for the C value that stands for none.
            pub(crate) fn to_core(self) -> Option<$core> {
                match self {
                    $c::$none => None,
                    $($c::$cv => Some($core::$corev),)+
                }
            }
        }
        impl From<Option<$core>> for $c {
            fn from(value: Option<$core>) -> $c {
                match value {
                    None => $c::$none,
                    $(Some($core::$corev) => $c::$cv,)+
                }
            }
        }
        impl $crate::ffi::convert::FromC<u32> for Option<$core> {
            fn from_c(raw: u32, field: $crate::ffi::convert::Field<'_>) -> $crate::error::Result<Option<$core>> {
                Ok($c::parse(raw, field)?.to_core())
            }
        }
        impl $crate::ffi::convert::ToC<u32> for Option<$core> {
            fn to_c(self) -> u32 {
                $c::from(self) as u32
            }
        }
        impl $crate::ffi::convert::ToC<u32> for $core {
            fn to_c(self) -> u32 {
                $c::from(Some(self)) as u32
            }
        }
    };
    ($c:ident <=> $core:ident { $($cv:ident = $corev:ident),+ $(,)? }) => {
        $crate::ffi::convert::abi_enum!($c { $($cv),+ });

        impl From<$c> for $core {
            fn from(value: $c) -> $core {
                match value {
                    $($c::$cv => $core::$corev,)+
                }
            }
        }
        impl From<$core> for $c {
            fn from(value: $core) -> $c {
                match value {
                    $($core::$corev => $c::$cv,)+
                }
            }
        }
        impl $crate::ffi::convert::FromC<u32> for $core {
            fn from_c(raw: u32, field: $crate::ffi::convert::Field<'_>) -> $crate::error::Result<$core> {
                Ok($c::parse(raw, field)?.into())
            }
        }
        impl $crate::ffi::convert::ToC<u32> for $core {
            fn to_c(self) -> u32 {
                $c::from(self) as u32
            }
        }
    };
}
pub(crate) use abi_enum;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::session::{
        SO_GPU_BUDGET_AUTO, so_group_hparams, so_session_options, so_step_args, so_step_result, so_subgroup_state,
    };
    use crate::ffi::types::{so_dtype, so_placement, so_skip_reason};
    use crate::kernels::{DType, Isa};
    use crate::session::{
        GroupHparams, NormSource, Placement, SessionOptions, SkipReason, Speculation, StepArgs, StepResult,
        SubGroupState,
    };

    #[test]
    fn enum_codes_map_both_ways_and_unknown_ones_are_refused() {
        for raw in 0..64u32 {
            assert_eq!(so_dtype::from_raw(raw).map(|d| d as u32), (raw <= 3).then_some(raw));
        }
        assert_eq!(Option::<DType>::from_c(0, Field::arg("d")).unwrap(), None);
        assert_eq!(DType::from_c(2, Field::arg("d")).unwrap(), DType::Bf16);
        let e = DType::from_c(0, Field::member("desc", "master_dtype")).unwrap_err();
        assert_eq!(e.message, "desc->master_dtype is SO_DTYPE_NONE");
        let e = Speculation::from_c(7, Field::member("options", "speculation")).unwrap_err();
        assert_eq!(e.message, "options->speculation = 7 is not a so_speculation value");
        for s in [Speculation::Off, Speculation::On, Speculation::Auto] {
            assert_eq!(Speculation::from_c(s.to_c(), Field::arg("s")).unwrap(), s);
        }
        for isa in [None, Some(Isa::Portable), Some(Isa::Avx2), Some(Isa::Avx512)] {
            assert_eq!(Option::<Isa>::from_c(isa.to_c(), Field::arg("isa")).unwrap(), isa);
        }
    }

    #[test]
    fn structs_survive_a_trip_through_c() {
        let g = GroupHparams { lr: 0.5, beta1: 0.8, beta2: 0.9, eps: 1e-6, weight_decay: 0.1 };
        let c = so_group_hparams::from_core(&g);
        assert_eq!(c.struct_size, size_of::<so_group_hparams>());
        assert_eq!(c.to_core("hparams").unwrap(), g);

        for norm in [NormSource::Local, NormSource::Given(3.0)] {
            let args = StepArgs { max_norm: 1.0, norm, overflow: true };
            assert_eq!(so_step_args::from_core(&args).to_core("args").unwrap(), args);
        }

        let options = SessionOptions {
            speculation: Speculation::On,
            host_memory_limit: Some(4096),
            copy_dtype: Some(DType::Bf16),
            gpu_budget_bytes: 1 << 30,
            ..SessionOptions::default()
        };
        let c = so_session_options::from_core(&options);
        assert!(c.pool.is_null() && c.cores.is_null() && c.loss_scaler.is_null());
        // SAFETY: `from_core` left every pointer NULL.
        let back = unsafe { c.to_core("options") }.unwrap();
        assert_eq!(format!("{back:?}"), format!("{options:?}"));

        let auto = SessionOptions { gpu_budget_bytes: SessionOptions::GPU_BUDGET_AUTO, ..SessionOptions::default() };
        let c = so_session_options::from_core(&auto);
        assert_eq!(c.gpu_budget_bytes, SO_GPU_BUDGET_AUTO);
        // SAFETY: as above.
        assert_eq!(unsafe { c.to_core("options") }.unwrap().gpu_budget_bytes, SessionOptions::GPU_BUDGET_AUTO);

        let r = StepResult {
            serial: 3,
            skip_reason: SkipReason::NonFiniteNorm,
            forward_wait_s: 0.25,
            ..StepResult::default()
        };
        let c = so_step_result::from_core(&r);
        assert_eq!((c.serial, c.skip_reason, c.forward_wait_s), (3, so_skip_reason::NonFiniteNorm as u32, 0.25));

        let mut master = [0u8; 8];
        let s = SubGroupState {
            placement: Placement::Device,
            numel: 4,
            master: master.as_mut_ptr(),
            exp_avg: std::ptr::null_mut(),
            exp_avg_sq: std::ptr::null_mut(),
            master_dtype: DType::Bf16,
            moment_dtype: DType::F32,
            step_count: 9,
        };
        let c = so_subgroup_state::from_core(&s);
        assert_eq!(c.struct_size, size_of::<so_subgroup_state>());
        assert_eq!(
            (c.placement, c.numel, c.master.cast::<u8>(), c.master_dtype, c.moment_dtype, c.step_count),
            (so_placement::Device as u32, 4, master.as_mut_ptr(), so_dtype::Bf16 as u32, so_dtype::F32 as u32, 9)
        );
    }
}
