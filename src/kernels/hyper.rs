//! The hyperparameters of a step, as the caller states them, and their checks.

use crate::error::{Error, Result};

/// How weight decay enters the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AdamMode {
    /// Decoupled decay (Loshchilov & Hutter): `p ← p·(1 - lr·wd)` before the update.
    AdamW,
    /// Classic Adam with L2 regularisation: `g ← g + wd·p` before the moments.
    L2,
}

/// Hyperparameters of one Adam step, as the caller states them (in double, like Python
/// floats). Each per-call constant of the f32 arithmetic is derived from these in f64 and
/// rounded once: so `beta2 = 0.999` gives `1 - beta2 = 1e-3` to f32 precision, not
/// `1 - 0.999f32`. Fields as [`so_adam_hparams`](crate::ffi::kernels::so_adam_hparams)
/// documents them, in Rust types.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamHyper {
    pub mode: AdamMode,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub bias_correction: bool,
    pub step: u64,
}

impl Default for AdamHyper {
    /// `torch.optim.AdamW`'s defaults, first step.
    fn default() -> Self {
        AdamHyper {
            mode: AdamMode::AdamW,
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            bias_correction: true,
            step: 1,
        }
    }
}

impl AdamHyper {
    /// Checks every field; the message names the field and its value.
    pub fn validate(&self) -> Result<()> {
        fn check(name: &str, x: f64, ok: bool, range: &str) -> Result<()> {
            if ok && x.is_finite() {
                Ok(())
            } else {
                Err(Error::invalid(format!("{name} = {x} is out of range: it must be {range}")))
            }
        }
        check("lr", self.lr, self.lr >= 0.0, "finite and >= 0")?;
        check("beta1", self.beta1, (0.0..1.0).contains(&self.beta1), "in [0, 1)")?;
        check("beta2", self.beta2, (0.0..1.0).contains(&self.beta2), "in [0, 1)")?;
        check("eps", self.eps, self.eps >= 0.0, "finite and >= 0")?;
        check("weight_decay", self.weight_decay, self.weight_decay >= 0.0, "finite and >= 0")?;
        if self.step == 0 {
            return Err(Error::invalid("step = 0 is out of range: steps count from 1"));
        }
        Ok(())
    }

    /// `(1 - beta1^t, 1 - beta2^t)` computed in f64 and rounded once to f32; `(1, 1)`
    /// without bias correction.
    pub fn bias_corrections(&self) -> (f32, f32) {
        if !self.bias_correction {
            return (1.0, 1.0);
        }
        let t = self.step as f64;
        ((1.0 - self.beta1.powf(t)) as f32, (1.0 - self.beta2.powf(t)) as f32)
    }

    /// AdamW's decay factor `1 - lr * wd`, rounded once to f32 (1 for Adam-L2).
    pub fn decay_factor(&self) -> f32 {
        match self.mode {
            AdamMode::AdamW => (1.0 - self.lr * self.weight_decay) as f32,
            AdamMode::L2 => 1.0,
        }
    }

    /// Rollback and rescale divide by the betas and by AdamW's decay factor.
    pub(super) fn validate_invertible(&self, what: &str) -> Result<()> {
        if self.beta1 == 0.0 || self.beta2 == 0.0 {
            return Err(Error::invalid(format!(
                "{what} needs beta1 > 0 and beta2 > 0 to recover the previous moments \
                 (got beta1 = {}, beta2 = {})",
                self.beta1, self.beta2
            )));
        }
        if self.decay_factor() <= 0.0 {
            return Err(Error::invalid(format!(
                "{what} needs 1 - lr * weight_decay > 0 to undo AdamW's decay (lr = {}, weight_decay = {})",
                self.lr, self.weight_decay
            )));
        }
        Ok(())
    }
}
