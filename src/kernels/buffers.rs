//! The buffers a pass reads and writes: slices of any element type, erased to one enum each,
//! and the set of them an Adam step takes.

use super::dtype::DType;
use crate::error::{Error, Result};
use half::{bf16, f16};

/// A mutable slice of any element type.
pub enum FloatsMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// A slice of any element type.
#[derive(Clone, Copy)]
pub enum Floats<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

/// The parameter being stepped, in any dtype.
pub type ParamMut<'a> = FloatsMut<'a>;

/// The gradient, in any dtype, independent of the parameter's.
pub type GradRef<'a> = Floats<'a>;

/// Both moments (`exp_avg`, `exp_avg_sq`), in one dtype.
pub enum MomentsMut<'a> {
    F32 { exp_avg: &'a mut [f32], exp_avg_sq: &'a mut [f32] },
    Bf16 { exp_avg: &'a mut [bf16], exp_avg_sq: &'a mut [bf16] },
}

/// A low-precision copy of the updated parameter, written in the same pass.
pub enum CopyOutMut<'a> {
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

impl FloatsMut<'_> {
    pub fn len(&self) -> usize {
        match self {
            ParamMut::F32(s) => s.len(),
            ParamMut::Bf16(s) => s.len(),
            ParamMut::F16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            ParamMut::F32(_) => DType::F32,
            ParamMut::Bf16(_) => DType::Bf16,
            ParamMut::F16(_) => DType::F16,
        }
    }
}

impl Floats<'_> {
    pub fn len(&self) -> usize {
        match self {
            GradRef::F32(s) => s.len(),
            GradRef::Bf16(s) => s.len(),
            GradRef::F16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            GradRef::F32(_) => DType::F32,
            GradRef::Bf16(_) => DType::Bf16,
            GradRef::F16(_) => DType::F16,
        }
    }
}

impl MomentsMut<'_> {
    fn lens(&self) -> (usize, usize) {
        match self {
            MomentsMut::F32 { exp_avg, exp_avg_sq } => (exp_avg.len(), exp_avg_sq.len()),
            MomentsMut::Bf16 { exp_avg, exp_avg_sq } => (exp_avg.len(), exp_avg_sq.len()),
        }
    }
    pub fn dtype(&self) -> DType {
        match self {
            MomentsMut::F32 { .. } => DType::F32,
            MomentsMut::Bf16 { .. } => DType::Bf16,
        }
    }
}

impl CopyOutMut<'_> {
    fn len(&self) -> usize {
        match self {
            CopyOutMut::Bf16(s) => s.len(),
            CopyOutMut::F16(s) => s.len(),
        }
    }
}

/// Everything one step reads and writes.
pub struct AdamBuffers<'a> {
    pub param: ParamMut<'a>,
    pub grad: GradRef<'a>,
    pub moments: MomentsMut<'a>,
    pub copy_out: Option<CopyOutMut<'a>>,
}

impl AdamBuffers<'_> {
    /// The common length of every buffer.
    pub fn numel(&self) -> Result<usize> {
        let n = self.param.len();
        let (m, v) = self.moments.lens();
        let copy = self.copy_out.as_ref().map_or(n, CopyOutMut::len);
        let g = self.grad.len();
        if [g, m, v, copy].iter().any(|&len| len != n) {
            return Err(Error::invalid(format!(
                "buffer lengths differ: param {n}, grad {g}, exp_avg {m}, exp_avg_sq {v}{}",
                self.copy_out.as_ref().map_or(String::new(), |c| format!(", param copy {}", c.len()))
            )));
        }
        Ok(n)
    }
}
