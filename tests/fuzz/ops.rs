//! The operations of a fuzz sequence: concrete values (no randomness left), so that a
//! sequence replays exactly and can be shrunk by deleting operations.

use superoffload::session::LossScalerOptions;

/// How a hyperparameter struct is passed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HpBad {
    None,
    Null,
    Size,
}

/// lr, beta1, beta2, eps, weight_decay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HpSpec {
    pub hp: [f64; 5],
    pub bad: HpBad,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerSpec {
    pub size_ok: bool,
    pub options: LossScalerOptions,
}

#[derive(Clone, Debug, PartialEq)]
pub enum PoolSpec {
    /// NULL pool, no cores: the process-wide default pool.
    Default,
    /// The sequence's own `so_pool_create` pool.
    Shared,
    /// A core list (a pinned pool of the session's own).
    Cores(Vec<u32>),
    /// A pool and cores: refused.
    Both,
    /// `cores` NULL with `num_cores` > 0.
    CoresNull,
    /// `cores` set with `num_cores` 0.
    CoresEmpty,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CreateSpec {
    pub null_options: bool,
    pub null_out: bool,
    pub size_delta: isize,
    pub mode: u32,
    pub bias_correction: bool,
    pub moment: u32,
    pub grad: u32,
    pub accum: u32,
    /// A `so_speculation` value (or not one).
    pub speculation: u32,
    pub limit: u64,
    pub amsgrad: bool,
    pub scaler: Option<ScalerSpec>,
    pub copy: u32,
    pub pool: PoolSpec,
    /// `gpu_budget_bytes`: must be 0 in a host session.
    pub gpu_budget: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum NameSpec {
    Named(String),
    Null,
    NonUtf8,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SliceSpec {
    pub name: NameSpec,
    pub offset: usize,
    pub numel: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SgBad {
    None,
    NullDesc,
    NullOut,
    Size,
    NullMaster,
    Misaligned,
    /// The master starts inside this sub-group's master buffer.
    OverlapOther(u32),
    GradOverlapsMaster,
    GradMisaligned,
    NullSlices,
    ZeroSlices,
    DeviceParam,
    /// A master buffer that claims far more elements than any allocation can hold.
    HugeNumel,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SgSpec {
    pub group: u32,
    pub numel: usize,
    pub master_dtype: u32,
    pub slices: Vec<SliceSpec>,
    pub caller_grad: bool,
    pub seed: u64,
    pub bad: SgBad,
    /// A `so_placement` value (or not one); a host session keeps everything on the host.
    pub placement: u32,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Special {
    None,
    Nan(usize),
    Inf(usize),
    NegInf(usize),
    Huge(usize),
}

/// Gradient values: `normalish(magnitude) * loss_scale` from `seed`, with one special value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fill {
    pub seed: u64,
    pub magnitude: f64,
    pub special: Special,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GradBad {
    None,
    NullGrad,
    Misaligned,
    NullOutTicket,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArgsSpec {
    pub null_args: bool,
    pub bad_size: bool,
    pub null_out: bool,
    pub max_norm: f64,
    pub norm_source: u32,
    pub given: f64,
    pub overflow: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WhichTicket {
    LatestStep,
    PreviousStep,
    Final(u32),
    /// The n-th ticket a gradient hand-off returned in this session (modulo their count).
    HandOff(usize),
    Zero,
    Never,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WaitHow {
    Wait,
    Query,
    WaitAll,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SaveTarget {
    Slot(u8),
    MissingDir,
    Null,
    Directory,
    NonUtf8,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LoadSource {
    Slot(u8),
    Truncated(u8, u64),
    Flipped(u8, u64),
    Garbage(u64),
    Empty,
    Missing,
    Directory,
    Null,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    Create(CreateSpec),
    Destroy,
    AddGroup {
        hp: HpSpec,
        null_out: bool,
    },
    SetGroup {
        group: u32,
        hp: HpSpec,
    },
    GetGroup {
        group: u32,
        bad: HpBad,
    },
    AddSubgroup(SgSpec),
    RemoveSubgroup {
        sg: u32,
    },
    SetPlacement {
        sg: u32,
        placement: u32,
    },
    SliceId {
        name: NameSpec,
    },
    BeginStep {
        loss_scale: f32,
        micro_steps: u32,
        settle: bool,
    },
    NextMicro,
    GradCopy {
        slice: u32,
        numel: usize,
        fill: Fill,
        bad: GradBad,
    },
    GradWritten {
        slice: u32,
        fill: Fill,
        add: bool,
    },
    LocalSumsq {
        timeout_ns: i64,
        null_out: bool,
    },
    Step(ArgsSpec),
    StepResult {
        which: WhichTicket,
        timeout_ns: i64,
        bad_size: bool,
    },
    Ticket {
        which: WhichTicket,
        timeout_ns: i64,
        how: WaitHow,
    },
    StepCount {
        sg: u32,
    },
    LossScale,
    HostBytes,
    Settle,
    Observe,
    Save(SaveTarget),
    Load(LoadSource),
    Trace(bool),
    TraceSave {
        bad_dir: bool,
    },
    NullHandle,
    /// Checkpoint the session, build a new one over the same slices partitioned
    /// differently (`seed`), load the checkpoint into it and go on with the new one.
    Repartition {
        seed: u64,
    },
}
