//! Reading checkpoints (the safetensors layout the README documents: `master/<slice>`,
//! `exp_avg/<slice>`, `exp_avg_sq/<slice>` and metadata), and predicting whether a session
//! accepts one. The session's C API has no accessor for the moments, so the tests read
//! them from a checkpoint the session writes.

use std::collections::BTreeMap;

use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use superoffload::kernels::DType;
use superoffload::session::LossScalerOptions;

use crate::common::Store;
use crate::fuzz::mem::store_from_bytes;

#[derive(Clone, Debug)]
pub struct SliceSnap {
    pub group: f64,
    pub step: u64,
    pub master: Store,
    pub exp_avg: Store,
    pub exp_avg_sq: Store,
}

/// The built-in loss scaler's saved state (options and state), as strings parse to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerSnap {
    pub scale: f32,
    pub growth_tracker: u32,
    pub hysteresis_left: u32,
    pub options: LossScalerOptions,
}

/// What a checkpoint holds.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub mode: String,
    pub bias_correction: String,
    pub moment_dtype: String,
    /// lr, beta1, beta2, eps, weight_decay per group.
    pub groups: Vec<[f64; 5]>,
    pub scaler: Option<ScalerSnap>,
    pub slices: BTreeMap<String, SliceSnap>,
    pub tensors: usize,
}

fn dtype_of(d: Dtype) -> Result<DType, String> {
    match d {
        Dtype::F32 => Ok(DType::F32),
        Dtype::BF16 => Ok(DType::Bf16),
        Dtype::F16 => Ok(DType::F16),
        other => Err(format!("unexpected tensor dtype {other:?}")),
    }
}

/// Parses a checkpoint the session wrote; an error means it is not one.
pub fn parse(bytes: &[u8]) -> Result<Snapshot, String> {
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| format!("metadata: {e}"))?;
    let file = SafeTensors::deserialize(bytes).map_err(|e| format!("deserialize: {e}"))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let get = |k: &str| meta.get(k).cloned().ok_or_else(|| format!("metadata lacks {k}"));
    let num = |k: &str| -> Result<f64, String> { get(k)?.parse::<f64>().map_err(|_| format!("{k} is not a number")) };
    let ngroups: usize = get("groups")?.parse().map_err(|_| "bad group count".to_string())?;
    let mut groups = Vec::new();
    for i in 0..ngroups {
        let f = |field: &str| num(&format!("group.{i}.{field}"));
        groups.push([f("lr")?, f("beta1")?, f("beta2")?, f("eps")?, f("weight_decay")?]);
    }
    let scaler = match get("loss_scaler")?.as_str() {
        "none" => None,
        "dynamic" => {
            let f = |field: &str| num(&format!("loss_scaler.{field}"));
            Some(ScalerSnap {
                scale: f("scale")? as f32,
                growth_tracker: f("growth_tracker")? as u32,
                hysteresis_left: f("hysteresis_left")? as u32,
                options: LossScalerOptions {
                    init_scale: f("init_scale")? as f32,
                    growth_factor: f("growth_factor")? as f32,
                    backoff_factor: f("backoff_factor")? as f32,
                    growth_interval: f("growth_interval")? as u32,
                    hysteresis: f("hysteresis")? as u32,
                    min_scale: f("min_scale")? as f32,
                },
            })
        }
        other => return Err(format!("loss_scaler = {other}")),
    };
    let mut slices = BTreeMap::new();
    for name in file.names() {
        let Some(slice) = name.strip_prefix("master/") else { continue };
        let tensor = |prefix: &str| -> Result<Store, String> {
            let v = file.tensor(&format!("{prefix}/{slice}")).map_err(|e| format!("{prefix}/{slice}: {e}"))?;
            Ok(store_from_bytes(dtype_of(v.dtype())?, v.data()))
        };
        slices.insert(
            slice.to_string(),
            SliceSnap {
                group: num(&format!("slice.{slice}.group"))?,
                step: get(&format!("slice.{slice}.step"))?.parse().map_err(|_| "bad step".to_string())?,
                master: tensor("master")?,
                exp_avg: tensor("exp_avg")?,
                exp_avg_sq: tensor("exp_avg_sq")?,
            },
        );
    }
    Ok(Snapshot {
        mode: get("mode")?,
        bias_correction: get("bias_correction")?,
        moment_dtype: get("moment_dtype")?,
        groups,
        scaler,
        slices,
        tensors: file.names().len(),
    })
}

pub fn read(path: &std::path::Path) -> Result<(Vec<u8>, Snapshot), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let snap = parse(&bytes)?;
    Ok((bytes, snap))
}
