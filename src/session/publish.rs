//! How a pass reaches a sub-group's buffers and its weights reach the device: the gradient from
//! its host buffer, or in pieces copied from the device where it is kept there; the weights
//! published piece by piece as the pass writes them, from the session's copy, the master
//! weights, or (no copy kept) a bounded buffer of the transport's that the pass writes into.

use std::ops::Range;

use super::shared::Shared;
use super::subgroup::{SgData, SubGroup};
use crate::error::{Error, Result, Status};
use crate::kernels::{self, AdamBuffers, CopyOutMut, DType, Floats, FloatsMut, MomentsMut};

/// Elements of a final pass published at a time (16 MiB of bf16 weights): the copy of one
/// piece overlaps the pass over the next.
pub(crate) const PUBLISH_PIECE: usize = 1 << 23;
/// Elements of a gradient kept on the device copied to the host at a time (4 MiB of bf16).
pub(crate) const GRADIENT_PIECE: usize = 1 << 21;

/// A pass over some elements of a sub-group: their range, and their buffers.
pub(crate) type Pass<'p> = dyn FnMut(Range<usize>, AdamBuffers<'_>) -> Result<()> + 'p;

/// Where a pass writes the weights' low-precision copy.
pub(crate) enum CopyTo<'b> {
    /// The session's full copy, if it keeps one.
    Session,
    /// A buffer holding elements `first..` (a piece on its way to the device).
    Buffer {
        first: usize,
        out: FloatsMut<'b>,
    },
    Nowhere,
}

/// Where a sub-group's published weights come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// The session's full copy (in the published dtype).
    Copy,
    /// The master weights (in the published dtype).
    Master,
    /// Written into the transport's buffer, in the published dtype.
    Filled(DType),
}

fn source(sg: &SubGroup, data: &SgData) -> Source {
    match &data.copy {
        Some(c) if c.dtype() == sg.published_dtype => Source::Copy,
        _ if data.master.dtype() == sg.published_dtype => Source::Master,
        _ => Source::Filled(sg.published_dtype),
    }
}

/// A copy output of a buffer of any dtype: a 16-bit one, or none (an f32 buffer is not a copy).
fn copy_out(out: FloatsMut<'_>) -> Option<CopyOutMut<'_>> {
    match out {
        FloatsMut::Bf16(s) => Some(CopyOutMut::Bf16(s)),
        FloatsMut::F16(s) => Some(CopyOutMut::F16(s)),
        FloatsMut::F32(_) => None,
    }
}

fn sub_range<'s>(out: &'s mut FloatsMut<'_>, range: Range<usize>) -> FloatsMut<'s> {
    match out {
        FloatsMut::F32(s) => FloatsMut::F32(&mut s[range]),
        FloatsMut::Bf16(s) => FloatsMut::Bf16(&mut s[range]),
        FloatsMut::F16(s) => FloatsMut::F16(&mut s[range]),
    }
}

/// The buffers of elements `range` of a sub-group, its gradient `grad` (those elements).
fn views<'a>(
    data: &'a mut SgData,
    grad: Option<Floats<'a>>,
    range: Range<usize>,
    copy_to: &'a mut CopyTo<'_>,
) -> AdamBuffers<'a> {
    let SgData { master, exp_avg, exp_avg_sq, grad: host_grad, copy, .. } = data;
    let moments = match (exp_avg.range_mut(range.clone()), exp_avg_sq.range_mut(range.clone())) {
        (FloatsMut::F32(m), FloatsMut::F32(v)) => MomentsMut::F32 { exp_avg: m, exp_avg_sq: v },
        (FloatsMut::Bf16(m), FloatsMut::Bf16(v)) => MomentsMut::Bf16 { exp_avg: m, exp_avg_sq: v },
        _ => unreachable!("moments are allocated f32 or bf16, both alike"),
    };
    let copy_out = match copy_to {
        CopyTo::Session => copy.as_mut().and_then(|c| copy_out(c.range_mut(range.clone()))),
        CopyTo::Buffer { first, out } => copy_out(sub_range(out, range.start - *first..range.end - *first)),
        CopyTo::Nowhere => None,
    };
    let grad = grad.unwrap_or_else(|| host_grad.as_ref().expect("a host gradient").range(range.clone()));
    AdamBuffers { param: master.range_mut(range), grad, moments, copy_out }
}

/// Runs `pass` over elements `range` of a sub-group in order: once, where its gradient is
/// on the host; piece by piece as the pieces land, where it is kept on the device. The
/// caller waited for the gradient's copies (`gradient_ready`).
pub(crate) fn each_piece(
    shared: &Shared,
    sg: &SubGroup,
    data: &mut SgData,
    range: Range<usize>,
    mut copy_to: CopyTo<'_>,
    pass: &mut Pass<'_>,
) -> Result<()> {
    if range.is_empty() {
        return Ok(());
    }
    if data.grad.is_some() {
        return pass(range.clone(), views(data, None, range, &mut copy_to));
    }
    let transport = shared.transport().ok_or_else(|| Error::new(Status::Panic, "no gradient buffer"))?;
    transport.gradient_pieces(sg.id, range, GRADIENT_PIECE, &mut |first, grad| {
        let piece = first..first + grad.len();
        pass(piece.clone(), views(data, Some(grad), piece, &mut copy_to))
    })
}

/// Runs `pass` over elements `range` (`None`: they are final as they are) and publishes
/// them in pieces, each as soon as it is written (the sub-group's `publish` follows its
/// last range). Without a transport, the pass alone.
pub(crate) fn write_and_publish(
    shared: &Shared,
    sg: &SubGroup,
    data: &mut SgData,
    range: Range<usize>,
    mut pass: Option<&mut Pass<'_>>,
) -> Result<()> {
    let Some(transport) = shared.transport() else {
        return match pass {
            Some(pass) => each_piece(shared, sg, data, range, CopyTo::Session, pass),
            None => Ok(()),
        };
    };
    let from = source(sg, data);
    for start in range.clone().step_by(PUBLISH_PIECE) {
        let piece = start..(start + PUBLISH_PIECE).min(range.end);
        match from {
            Source::Copy | Source::Master => {
                if let Some(pass) = pass.as_deref_mut() {
                    each_piece(shared, sg, data, piece.clone(), CopyTo::Session, pass)?;
                }
                let src = match (&data.copy, from) {
                    (Some(c), Source::Copy) => c.range(piece.clone()),
                    _ => data.master.range(piece.clone()),
                };
                transport.publish_piece(sg.id, piece.start, src)?;
            }
            Source::Filled(dtype) => {
                // A pass over f32 master weights writes the copy where it goes; any other
                // pass (or none) leaves the piece to be converted from the master weights.
                let writes_copy = data.master.dtype() == DType::F32 && dtype != DType::F32;
                let mut pass = pass.as_deref_mut();
                transport.publish_filled(sg.id, piece.start, piece.len(), dtype, &mut |mut out| {
                    match pass.as_deref_mut() {
                        Some(pass) if writes_copy => {
                            let out = sub_range(&mut out, 0..piece.len());
                            return each_piece(
                                shared,
                                sg,
                                data,
                                piece.clone(),
                                CopyTo::Buffer { first: piece.start, out },
                                pass,
                            );
                        }
                        Some(pass) => each_piece(shared, sg, data, piece.clone(), CopyTo::Nowhere, pass)?,
                        None => {}
                    }
                    kernels::convert(&shared.pool, out, data.master.range(piece.clone()))
                })?;
            }
        }
    }
    Ok(())
}

/// Whether a pass over the sub-group writes a low-precision copy of its f32 master weights
/// (the session's, or a piece on its way to the device): then a step can publish that copy
/// first and write the master weights and moments after (`kernels::update_copy`).
pub(crate) fn writes_copy(sg: &SubGroup, data: &SgData, transport: bool) -> bool {
    data.master.dtype() == DType::F32
        && (data.copy.is_some() || (transport && matches!(source(sg, data), Source::Filled(d) if d != DType::F32)))
}
