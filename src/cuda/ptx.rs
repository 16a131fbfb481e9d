//! The device kernels, shipped as PTX text (`kernels.ptx`): the driver compiles them for the
//! GPU at load time, so nothing needs nvcc or NVRTC at build or run time
//! (`scripts/check_ptx.sh` assembles them with ptxas where it is installed).
//!
//! - `so_f32_to_bf16`, `so_f32_to_f16`: publication of f32 staging buffers into 16-bit
//!   parameters. Both round exactly as `kernels::dtype` does on the CPU: bf16 by integer
//!   round-to-nearest-even with every NaN made 0x7FC0; f16 by the IEEE conversion with a NaN
//!   keeping its sign and top payload bits, quieted.
//! - `so_sumsq_partials`: the per-block f64 partials of a gradient's sum of squares, the same
//!   bits as the CPU kernels' (summed in block order on the host).
//! - `so_adam_step`: the Adam step of device-placed sub-groups, and (`op` 1, 2) the rollback
//!   and rescale of one, each the CPU kernels' operation sequence exactly (bit-identical
//!   results).

pub(crate) const MODULE: &str = include_str!("kernels.ptx");
