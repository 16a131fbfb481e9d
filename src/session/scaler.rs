//! Dynamic loss scaling for fp16 (torch `GradScaler` semantics, plus DeepSpeed's
//! hysteresis): back off on an overflow, grow after `growth_interval` clean steps.

use super::factors::check_loss_scale;
use crate::error::{Error, Result};

/// Settings of the built-in loss scaler. Fields as
/// [`so_loss_scaler_options`](crate::ffi::session::so_loss_scaler_options) documents them, in
/// Rust types.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScalerOptions {
    pub init_scale: f32,
    pub growth_factor: f32,
    pub backoff_factor: f32,
    pub growth_interval: u32,
    pub hysteresis: u32,
    pub min_scale: f32,
}

impl Default for LossScalerOptions {
    /// torch.amp.GradScaler's defaults.
    fn default() -> Self {
        LossScalerOptions {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            min_scale: 1.0,
        }
    }
}

impl LossScalerOptions {
    pub fn validate(&self) -> Result<()> {
        // The scale stays within [min_scale, f32::MAX]: both ends must be usable loss scales.
        check_loss_scale("loss scaler init_scale", self.init_scale)?;
        check_loss_scale("loss scaler min_scale", self.min_scale)?;
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return Err(Error::invalid(format!("loss scaler growth_factor = {} must be > 1", self.growth_factor)));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return Err(Error::invalid(format!(
                "loss scaler backoff_factor = {} must be in (0, 1)",
                self.backoff_factor
            )));
        }
        if self.growth_interval == 0 || self.hysteresis == 0 {
            return Err(Error::invalid("loss scaler growth_interval and hysteresis must be >= 1"));
        }
        Ok(())
    }
}

/// The scaler's state; everything here is saved in checkpoints.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    pub options: LossScalerOptions,
    pub scale: f32,
    /// Consecutive steps without overflow since the last change of scale.
    pub growth_tracker: u32,
    /// Overflows still tolerated before the next backoff.
    pub hysteresis_left: u32,
}

impl LossScaler {
    pub fn new(options: LossScalerOptions) -> Self {
        LossScaler { options, scale: options.init_scale, growth_tracker: 0, hysteresis_left: options.hysteresis }
    }

    /// Records the verdict of one step.
    pub fn update(&mut self, overflow: bool) {
        let o = self.options;
        if overflow {
            self.growth_tracker = 0;
            if self.hysteresis_left > 1 {
                self.hysteresis_left -= 1;
            } else {
                self.scale = (self.scale * o.backoff_factor).max(o.min_scale);
                self.hysteresis_left = o.hysteresis;
            }
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker >= o.growth_interval {
                let grown = self.scale * o.growth_factor;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
                self.hysteresis_left = o.hysteresis;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_grows_and_honours_hysteresis() {
        let opts = LossScalerOptions { init_scale: 1024.0, growth_interval: 3, hysteresis: 2, ..Default::default() };
        let mut s = LossScaler::new(opts);
        s.update(true);
        assert_eq!(s.scale, 1024.0, "first overflow absorbed by hysteresis");
        s.update(true);
        assert_eq!(s.scale, 512.0);
        for _ in 0..3 {
            s.update(false);
        }
        assert_eq!(s.scale, 1024.0);
        let mut floor = LossScaler::new(LossScalerOptions { init_scale: 1.0, ..Default::default() });
        floor.update(true);
        assert_eq!(floor.scale, 1.0, "never below min_scale");
    }
}
