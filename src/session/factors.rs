//! The factors a step's gradients are multiplied by, and what a loss scale must be for them
//! to be usable: the vocabulary of the caller's side, the decision and the loss scaler alike.

use crate::error::{Error, Result};

/// torch's `clip_grad_norm_` coefficient: `min(1, max_norm / (norm + 1e-6))`, 1 when
/// `max_norm` is 0.
pub fn clip_coefficient(max_norm: f64, norm: f64) -> f64 {
    if max_norm > 0.0 { (max_norm / (norm + 1e-6)).min(1.0) } else { 1.0 }
}

/// The factor every gradient of a step is finally multiplied by: `clip / loss_scale`,
/// computed in f64 and rounded once. With `clip == 1` it is the unscale factor `1 / S` of the
/// speculative steps exactly, which is what lets a speculative step be kept.
pub fn grad_factor(clip: f64, loss_scale: f32) -> f32 {
    (clip / loss_scale as f64) as f32
}

/// The factor of a speculative step, and of every sum of squares taken at hand-over: the
/// unscaled gradient, `grad_factor(1, loss_scale)`.
pub fn unscale_factor(loss_scale: f32) -> f32 {
    grad_factor(1.0, loss_scale)
}

/// Whether a gradient factor can be stepped with: finite and > 0 in f32 (the kernels refuse
/// anything else).
pub fn usable_factor(factor: f32) -> bool {
    factor.is_finite() && factor > 0.0
}

/// A loss scale must be finite and > 0, and so must its reciprocal in f32, the unscale factor
/// of every sum of squares and speculative step (`1 / loss_scale` overflows for loss scales
/// below about 2.9e-39, subnormals of f32).
pub(crate) fn check_loss_scale(what: &str, scale: f32) -> Result<()> {
    if scale.is_finite() && scale > 0.0 && usable_factor(unscale_factor(scale)) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{what} = {scale:e} is out of range: it must be finite and > 0, and 1 / {what} must be finite in f32"
        )))
    }
}
