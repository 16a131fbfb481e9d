//! The generator: proposes the next operation from the model's state (mostly valid calls in
//! a plausible order, with a share of misuse and absurd values). It only reads the model,
//! so a sequence is a function of its seed.

use crate::common::Rng;
use superoffload::session::LossScalerOptions;

use crate::fuzz::api;
use crate::fuzz::model::{Phase, Sess, World};
use crate::fuzz::ops::*;
use crate::fuzz::reference;

pub struct Gen {
    pub rng: Rng,
    names: u64,
    magnitude: f64,
}

const ABSURD_F64: [f64; 9] = [1e-300, 1e300, 1e-30, 5e-324, -1.0, f64::NAN, f64::INFINITY, 1e-6, -0.0];

impl Gen {
    pub fn new(seed: u64) -> Gen {
        Gen { rng: Rng::new(seed), names: 0, magnitude: 0.01 }
    }

    fn chance(&mut self, p: f64) -> bool {
        self.rng.unit() < p
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.rng.below(xs.len())]
    }

    /// Index into `weights` with probability proportional to the weight.
    fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut x = self.rng.unit() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }

    pub fn next(&mut self, w: &World) -> Op {
        match &w.sess {
            None => {
                if self.chance(0.04) {
                    Op::NullHandle
                } else {
                    Op::Create(self.create_spec())
                }
            }
            Some(s) => match s.phase {
                Phase::Idle => self.idle(w, s),
                Phase::Backward { .. } => self.backward(s),
                Phase::Prepared => self.prepared(s),
            },
        }
    }

    fn create_spec(&mut self) -> CreateSpec {
        let mut c = CreateSpec {
            null_options: false,
            null_out: false,
            size_delta: 0,
            mode: if self.chance(0.7) { api::MODE_ADAMW } else { api::MODE_L2 },
            bias_correction: self.chance(0.8),
            moment: if self.chance(0.85) { api::DT_F32 } else { api::DT_BF16 },
            grad: self.pick(&[api::DT_F32, api::DT_F32, api::DT_F32, api::DT_BF16, api::DT_F16]),
            accum: self.pick(&[api::DT_F32, api::DT_F32, api::DT_F32, api::DT_F32, api::DT_BF16, api::DT_F16]),
            speculation: match self.rng.below(20) {
                0..=2 => api::SPEC_OFF,
                3..=16 => api::SPEC_ON,
                _ => api::SPEC_AUTO,
            },
            limit: if self.chance(0.85) { 0 } else { 2000 + self.rng.below(200_000) as u64 },
            amsgrad: false,
            scaler: None,
            copy: self.pick(&[api::DT_NONE, api::DT_NONE, api::DT_NONE, api::DT_NONE, api::DT_BF16, api::DT_F16]),
            pool: match self.rng.below(10) {
                0..=5 => PoolSpec::Default,
                6..=8 => PoolSpec::Shared,
                _ => PoolSpec::Cores(if self.chance(0.5) { vec![0] } else { vec![0, 1] }),
            },
            gpu_budget: 0,
        };
        if self.chance(0.3) {
            c.scaler = Some(ScalerSpec {
                size_ok: true,
                options: LossScalerOptions {
                    init_scale: self.pick(&[1.0, 256.0, 1024.5, 65536.0, 3.3, 0.125]),
                    growth_factor: self.pick(&[2.0, 1.5]),
                    backoff_factor: self.pick(&[0.5, 0.25]),
                    growth_interval: self.pick(&[1, 2, 3, 50]),
                    hysteresis: self.pick(&[1, 2]),
                    min_scale: self.pick(&[1.0, 0.5, 1e-3]),
                },
            });
        }
        if self.chance(0.15) {
            match self.rng.below(14) {
                12 => c.speculation = self.pick(&[3, 77]),
                13 => c.gpu_budget = 1 << 20,
                0 => c.size_delta = self.pick(&[-8, 8]),
                1 => c.mode = self.pick(&[0, 7]),
                2 => c.moment = self.pick(&[api::DT_F16, api::DT_NONE, 9]),
                3 => c.grad = self.pick(&[api::DT_NONE, 9]),
                4 => c.accum = self.pick(&[api::DT_NONE, 9]),
                5 => c.copy = self.pick(&[api::DT_F32, 9]),
                6 => c.amsgrad = true,
                7 => {
                    let mut s = c.scaler.unwrap_or(ScalerSpec {
                        size_ok: true,
                        options: LossScalerOptions {
                            init_scale: 1.0,
                            growth_factor: 2.0,
                            backoff_factor: 0.5,
                            growth_interval: 1,
                            hysteresis: 1,
                            min_scale: 1.0,
                        },
                    });
                    let o = &mut s.options;
                    match self.rng.below(7) {
                        0 => o.init_scale = self.pick(&[0.0, f32::NAN, -1.0, f32::INFINITY]),
                        1 => o.growth_factor = self.pick(&[1.0, 0.5, f32::INFINITY]),
                        2 => o.backoff_factor = self.pick(&[1.0, 0.0, -0.5]),
                        3 => o.growth_interval = 0,
                        4 => o.hysteresis = 0,
                        5 => o.min_scale = self.pick(&[0.0, f32::INFINITY]),
                        _ => s.size_ok = false,
                    }
                    c.scaler = Some(s);
                }
                8 => {
                    c.pool = match self.rng.below(4) {
                        0 => PoolSpec::Both,
                        1 => PoolSpec::CoresNull,
                        2 => PoolSpec::CoresEmpty,
                        _ => PoolSpec::Cores(vec![0, 0]),
                    }
                }
                9 => c.pool = PoolSpec::Cores(vec![9999]),
                10 => c.null_out = true,
                _ => c.null_options = true,
            }
        }
        c
    }

    fn hp_valid(&mut self) -> [f64; 5] {
        let lr = match self.rng.below(6) {
            0 => 1e-3,
            1 => 1e-2,
            2 => 3e-4,
            3 if self.chance(0.3) => 0.0,
            _ => self.rng.range(1e-4, 5e-2),
        };
        let beta1 = if self.chance(0.03) { 0.0 } else { self.pick(&[0.9, 0.9, 0.8, 0.5]) };
        let beta2 = if self.chance(0.03) { 0.0 } else { self.pick(&[0.999, 0.999, 0.99, 0.95]) };
        let eps = if self.chance(0.02) { 0.0 } else { self.pick(&[1e-8, 1e-6, 1e-3]) };
        let wd = self.pick(&[0.0, 0.01, 0.1, 0.01]);
        if self.chance(0.02) {
            // AdamW's decay factor 1 - lr * wd at or below 0: valid, but no speculation.
            return [2.0, beta1, beta2, eps, self.pick(&[0.5, 0.6])];
        }
        [lr, beta1, beta2, eps, wd]
    }

    fn hp_spec(&mut self) -> HpSpec {
        let mut hp = self.hp_valid();
        let bad = match self.rng.below(100) {
            0..=2 => HpBad::Null,
            3..=4 => HpBad::Size,
            _ => HpBad::None,
        };
        if bad == HpBad::None && self.chance(0.1) {
            match self.rng.below(5) {
                0 => hp[0] = self.pick(&[-1.0, f64::NAN, f64::INFINITY]),
                1 => hp[1] = self.pick(&[1.0, -0.1, f64::NAN]),
                2 => hp[2] = self.pick(&[1.0, 1.5]),
                3 => hp[3] = self.pick(&[-1.0, f64::NAN, f64::INFINITY]),
                _ => hp[4] = self.pick(&[-0.5, f64::INFINITY]),
            }
        }
        HpSpec { hp, bad }
    }

    fn name(&mut self) -> String {
        self.names += 1;
        format!("p{}", self.names)
    }

    fn subgroup_spec(&mut self, s: &Sess) -> SgSpec {
        let numel = match self.rng.below(10) {
            0..=4 => 1 + self.rng.below(64),
            5..=8 => 64 + self.rng.below(600),
            _ => 2000 + self.rng.below(18000),
        };
        let k = (1 + self.rng.below(4)).min(numel);
        let gaps = self.chance(0.1) && numel > 2 * k;
        let mut slices = Vec::new();
        let mut cuts: Vec<usize> = (0..k - 1).map(|_| 1 + self.rng.below(numel - 1)).collect();
        cuts.sort();
        cuts.dedup();
        let mut start = 0;
        for end in cuts.into_iter().chain([numel]) {
            let (mut a, mut b) = (start, end);
            if gaps && b - a > 2 {
                if self.chance(0.5) {
                    a += 1;
                } else {
                    b -= 1;
                }
            }
            slices.push(SliceSpec { name: NameSpec::Named(self.name()), offset: a, numel: b - a });
            start = end;
        }
        if self.chance(0.08) {
            let i = self.rng.below(slices.len());
            match self.rng.below(8) {
                0 if !s.names.is_empty() => {
                    let names: Vec<&String> = s.names.keys().collect();
                    slices[i].name = NameSpec::Named(names[self.rng.below(names.len())].clone());
                }
                1 if slices.len() > 1 => slices[i].name = slices[(i + 1) % slices.len()].name.clone(),
                2 => slices[i].name = NameSpec::Named(String::new()),
                3 => slices[i].name = NameSpec::Null,
                4 => slices[i].name = NameSpec::NonUtf8,
                5 => slices[i].numel = 0,
                6 => slices[i].offset = numel,
                _ => {
                    slices.push(SliceSpec { name: NameSpec::Named(self.name()), offset: slices[i].offset, numel: 1 });
                }
            }
        }
        let master_dtype = match self.rng.below(100) {
            0..=84 => api::DT_F32,
            85..=92 => api::DT_BF16,
            93..=97 => api::DT_F16,
            _ => self.pick(&[api::DT_NONE, 9]),
        };
        let live: Vec<u32> = s.live_sgs().map(|sg| sg.id).collect();
        let bad = if self.chance(0.1) {
            match self.rng.below(13) {
                0 => SgBad::NullDesc,
                1 => SgBad::NullOut,
                2 => SgBad::Size,
                3 => SgBad::NullMaster,
                4 => SgBad::Misaligned,
                5 if !live.is_empty() => SgBad::OverlapOther(live[self.rng.below(live.len())]),
                6 => SgBad::GradOverlapsMaster,
                7 => SgBad::GradMisaligned,
                8 => SgBad::NullSlices,
                9 => SgBad::ZeroSlices,
                10 => SgBad::DeviceParam,
                11 => SgBad::HugeNumel,
                _ => SgBad::None,
            }
        } else {
            SgBad::None
        };
        let caller_grad = self.chance(0.2) || matches!(bad, SgBad::GradOverlapsMaster | SgBad::GradMisaligned);
        let groups = s.groups.len() as u32;
        let group = if groups == 0 || self.chance(0.03) { groups } else { self.rng.below(groups as usize) as u32 };
        let placement = match self.rng.below(100) {
            0 => api::PLACE_DEVICE,
            1 => 5,
            _ => api::PLACE_HOST,
        };
        SgSpec { group, numel, master_dtype, slices, caller_grad, seed: self.rng.next_u64(), bad, placement }
    }

    fn fill(&mut self) -> Fill {
        let special = match self.rng.below(1000) {
            0..=14 => Special::Nan(self.rng.below(1 << 20)),
            15..=24 => Special::Inf(self.rng.below(1 << 20)),
            25..=29 => Special::NegInf(self.rng.below(1 << 20)),
            30..=39 => Special::Huge(self.rng.below(1 << 20)),
            _ => Special::None,
        };
        Fill { seed: self.rng.next_u64(), magnitude: self.magnitude, special }
    }

    fn loss_scale(&mut self) -> f32 {
        match self.rng.below(100) {
            0..=34 => 0.0,
            35..=69 => 1.0,
            70..=84 => 2f32.powi(self.rng.below(21) as i32 - 4),
            85..=89 => self.rng.range(0.01, 1e4) as f32,
            // 1e-45, 1e-40 and 2.5e-39 have no finite reciprocal in f32 (refused), 3e-39 has.
            _ => self.pick(&[
                f32::MAX,
                3e38,
                -1.0,
                f32::NAN,
                f32::INFINITY,
                -0.0,
                1e-12,
                1e-25,
                f32::MIN_POSITIVE,
                1e-45,
                1e-40,
                2.5e-39,
                3e-39,
            ]),
        }
    }

    fn which(&mut self, s: &Sess) -> WhichTicket {
        let live: Vec<u32> = s.live_sgs().map(|sg| sg.id).collect();
        match self.rng.below(100) {
            0..=39 if !live.is_empty() => WhichTicket::Final(live[self.rng.below(live.len())]),
            40..=54 => WhichTicket::LatestStep,
            55..=59 => WhichTicket::PreviousStep,
            60..=84 => WhichTicket::HandOff(self.rng.below(1000)),
            85..=91 => WhichTicket::Zero,
            _ => WhichTicket::Never,
        }
    }

    fn ticket_op(&mut self, s: &Sess) -> Op {
        let which = self.which(s);
        let timeout_ns = if self.chance(0.6) { -1 } else { 0 };
        let how = match self.rng.below(10) {
            0..=4 => WaitHow::Wait,
            5..=7 => WaitHow::Query,
            _ => WaitHow::WaitAll,
        };
        Op::Ticket { which, timeout_ns, how }
    }

    fn step_result_op(&mut self, s: &Sess) -> Op {
        let which = match self.rng.below(100) {
            0..=59 => WhichTicket::LatestStep,
            60..=74 => WhichTicket::PreviousStep,
            _ => self.which(s),
        };
        Op::StepResult { which, timeout_ns: if self.chance(0.85) { -1 } else { 0 }, bad_size: self.chance(0.05) }
    }

    fn own_norm(&self, s: &Sess) -> f64 {
        let unscale = (1.0 / s.s as f64) as f32;
        s.live_sgs().map(|sg| reference::sumsq(&sg.g, unscale)).sum::<f64>().sqrt()
    }

    fn step_args(&mut self, s: &Sess) -> ArgsSpec {
        let norm = self.own_norm(s);
        let max_norm = match self.rng.below(100) {
            0..=29 => 0.0,
            30..=59 => norm * self.rng.range(0.1, 0.95),
            60..=79 => norm * self.rng.range(1.05, 4.0),
            _ => self.pick(&ABSURD_F64),
        };
        let (norm_source, given) = match self.rng.below(100) {
            0..=64 => (api::NORM_LOCAL, 0.0),
            65..=89 => (api::NORM_GIVEN, norm),
            _ => (api::NORM_GIVEN, self.pick(&[-0.5, f64::NAN, f64::INFINITY, 0.0, 1e-300, 1e300, 3.7])),
        };
        let mut a = ArgsSpec {
            null_args: false,
            bad_size: false,
            null_out: false,
            max_norm,
            norm_source,
            given,
            overflow: self.chance(0.08),
        };
        match self.rng.below(100) {
            0..=2 => a.null_args = true,
            3..=4 => a.bad_size = true,
            5..=6 => a.norm_source = self.pick(&[0, 3]),
            7..=8 => a.null_out = true,
            _ => {}
        }
        a
    }

    fn save_op(&mut self) -> Op {
        Op::Save(match self.rng.below(100) {
            0..=84 => SaveTarget::Slot(self.rng.below(4) as u8),
            85..=89 => SaveTarget::MissingDir,
            90..=92 => SaveTarget::Null,
            93..=96 => SaveTarget::Directory,
            _ => SaveTarget::NonUtf8,
        })
    }

    fn load_op(&mut self) -> Op {
        let slot = self.rng.below(4) as u8;
        let seed = self.rng.next_u64();
        Op::Load(match self.rng.below(100) {
            0..=54 => LoadSource::Slot(slot),
            55..=66 => LoadSource::Truncated(slot, seed),
            67..=81 => LoadSource::Flipped(slot, seed),
            82..=86 => LoadSource::Garbage(seed),
            87..=89 => LoadSource::Empty,
            90..=93 => LoadSource::Missing,
            94..=96 => LoadSource::Directory,
            _ => LoadSource::Null,
        })
    }

    fn any_slice(&mut self, s: &Sess) -> Option<u32> {
        let live: Vec<u32> = (0..s.slices.len() as u32).filter(|&i| s.slices[i as usize].alive).collect();
        (!live.is_empty()).then(|| live[self.rng.below(live.len())])
    }

    fn grad_copy(&mut self, s: &Sess, slice: u32) -> Op {
        let n = s.slices.get(slice as usize).map_or(4, |x| x.range.len());
        let numel = if self.chance(0.02) {
            n + 1
        } else if self.chance(0.01) && n > 1 {
            n - 1
        } else {
            n
        };
        let bad = match self.rng.below(100) {
            0 => GradBad::NullGrad,
            1 => GradBad::Misaligned,
            2..=4 => GradBad::NullOutTicket,
            _ => GradBad::None,
        };
        Op::GradCopy { slice, numel, fill: self.fill(), bad }
    }

    fn misuse(&mut self, s: &Sess) -> Op {
        let slice = self.any_slice(s).unwrap_or(0);
        match self.rng.below(5) {
            0 => self.grad_copy(s, slice),
            1 => Op::Step(self.step_args(s)),
            2 => Op::NextMicro,
            3 => Op::LocalSumsq { timeout_ns: -1, null_out: false },
            _ => Op::GradWritten { slice, fill: self.fill(), add: false },
        }
    }

    fn idle(&mut self, w: &World, s: &Sess) -> Op {
        let has_sg = s.live_sgs().next().is_some();
        if s.groups.is_empty() && self.chance(0.9) {
            return Op::AddGroup { hp: HpSpec { hp: self.hp_valid(), bad: HpBad::None }, null_out: false };
        }
        if !has_sg && self.chance(0.7) {
            return Op::AddSubgroup(self.subgroup_spec(s));
        }
        let weights = [
            30.0, // begin
            2.0,  // add group
            6.0,  // add sub-group
            2.0,  // remove
            5.0,  // set group
            2.0,  // get group
            5.0,  // save
            6.0,  // load
            4.0,  // observe
            3.0,  // step result
            5.0,  // tickets
            2.0,  // step count
            2.0,  // loss scale
            1.0,  // host bytes
            2.0,  // slice id
            3.0,  // settle
            1.0,  // trace
            1.5,  // repartition
            1.5,  // destroy
            3.0,  // misuse
            0.3,  // null handle
            0.5,  // trace save
            1.0,  // placement
        ];
        match self.weighted(&weights) {
            0 => {
                self.magnitude = 10f64.powf(self.rng.range(-3.0, 0.5));
                let micro_steps = match self.rng.below(100) {
                    0..=69 => 1,
                    70..=89 => 2,
                    90..=97 => 3,
                    _ => 0,
                };
                Op::BeginStep { loss_scale: self.loss_scale(), micro_steps, settle: self.chance(0.6) }
            }
            1 => Op::AddGroup { hp: self.hp_spec(), null_out: self.chance(0.03) },
            2 => Op::AddSubgroup(self.subgroup_spec(s)),
            3 => {
                let live: Vec<u32> = s.live_sgs().map(|sg| sg.id).collect();
                let sg = if live.is_empty() || self.chance(0.1) {
                    self.rng.below(s.sgs.len() + 2) as u32
                } else {
                    live[self.rng.below(live.len())]
                };
                Op::RemoveSubgroup { sg }
            }
            4 => self.set_group(s),
            5 => Op::GetGroup {
                group: self.rng.below(s.groups.len() + 1) as u32,
                bad: self.pick(&[HpBad::None, HpBad::None, HpBad::None, HpBad::None, HpBad::Null, HpBad::Size]),
            },
            6 => self.save_op(),
            7 => {
                // Mostly a checkpoint this session can take, to go on from a loaded state.
                let good: Vec<u8> =
                    w.files.iter().filter(|(_, f)| s.load_verdict(&f.snap).is_ok()).map(|(k, _)| *k).collect();
                if !good.is_empty() && self.chance(0.6) {
                    Op::Load(LoadSource::Slot(good[self.rng.below(good.len())]))
                } else {
                    self.load_op()
                }
            }
            8 => Op::Observe,
            9 => self.step_result_op(s),
            10 => self.ticket_op(s),
            11 => Op::StepCount { sg: self.rng.below(s.sgs.len() + 1) as u32 },
            12 => Op::LossScale,
            13 => Op::HostBytes,
            14 => {
                let name = match self.rng.below(10) {
                    0 => NameSpec::Null,
                    1 => NameSpec::NonUtf8,
                    2 => NameSpec::Named("no such slice".into()),
                    _ => match self.any_slice(s) {
                        Some(i) => NameSpec::Named(s.slices[i as usize].name.clone()),
                        None => NameSpec::Named("p1".into()),
                    },
                };
                Op::SliceId { name }
            }
            15 => Op::Settle,
            16 => Op::Trace(self.chance(0.5)),
            17 => Op::Repartition { seed: self.rng.next_u64() },
            18 => Op::Destroy,
            19 => self.misuse(s),
            20 => Op::NullHandle,
            21 => Op::TraceSave { bad_dir: self.chance(0.3) },
            _ => Op::SetPlacement {
                sg: self.rng.below(s.sgs.len() + 1) as u32,
                placement: self.pick(&[api::PLACE_HOST, api::PLACE_HOST, api::PLACE_DEVICE, 9]),
            },
        }
    }

    fn set_group(&mut self, s: &Sess) -> Op {
        let groups = s.groups.len();
        let group = if groups == 0 || self.chance(0.05) { groups as u32 } else { self.rng.below(groups) as u32 };
        let mut hp = self.hp_spec();
        if hp.bad == HpBad::None && self.chance(0.5) && (group as usize) < groups {
            // A schedule: the learning rate moves, the rest stays.
            let g = s.groups[group as usize];
            hp.hp = [g.lr * self.rng.range(0.5, 1.5), g.beta1, g.beta2, g.eps, g.weight_decay];
        }
        Op::SetGroup { group, hp }
    }

    fn backward(&mut self, s: &Sess) -> Op {
        let Phase::Backward { micro, micro_steps } = s.phase else { unreachable!() };
        // Slices without a gradient in this micro-step, in backward (reverse) order.
        let todo: Vec<u32> = (0..s.slices.len() as u32)
            .rev()
            .filter(|&i| s.slices[i as usize].alive && s.slices[i as usize].seen != micro + 1)
            .collect();
        let submitted: Vec<u32> = (0..s.slices.len() as u32)
            .filter(|&i| {
                let sl = &s.slices[i as usize];
                sl.alive && s.sgs[sl.sg as usize].as_ref().is_some_and(|sg| sg.submitted.is_some())
            })
            .collect();
        let written: Vec<u32> = (0..s.slices.len() as u32)
            .filter(|&i| {
                let sl = &s.slices[i as usize];
                sl.alive && s.sgs[sl.sg as usize].as_ref().is_some_and(|sg| sg.grad_buf.is_some())
            })
            .collect();
        let last = micro + 1 == micro_steps;
        let w = [
            if todo.is_empty() { 0.0 } else { 55.0 },          // next gradient
            4.0,                                               // any slice (twice)
            if submitted.is_empty() { 0.0 } else { 5.0 },      // late
            1.0,                                               // unknown slice
            if written.is_empty() { 0.0 } else { 10.0 },       // grad_written
            if !last && todo.is_empty() { 40.0 } else { 1.0 }, // next micro-step
            if last && todo.is_empty() { 30.0 } else { 2.0 },  // step
            3.0,                                               // set group
            2.0,                                               // local sum of squares
            4.0,                                               // tickets
            2.0,                                               // step result
            1.0,                                               // step count
            0.5,                                               // host bytes
            3.0,                                               // misuse
        ];
        match self.weighted(&w) {
            0 => {
                let k = if self.chance(0.8) { 0 } else { self.rng.below(todo.len()) };
                self.grad_copy(s, todo[k])
            }
            1 => match self.any_slice(s) {
                Some(i) => self.grad_copy(s, i),
                None => Op::NextMicro,
            },
            2 => {
                let i = submitted[self.rng.below(submitted.len())];
                self.grad_copy(s, i)
            }
            3 => {
                let unknown = s.slices.len() as u32 + self.rng.below(3) as u32;
                self.grad_copy(s, unknown)
            }
            4 => {
                let i = written[self.rng.below(written.len())];
                Op::GradWritten { slice: i, fill: self.fill(), add: self.chance(0.5) }
            }
            5 => Op::NextMicro,
            6 => Op::Step(self.step_args(s)),
            7 => self.set_group(s),
            8 => Op::LocalSumsq { timeout_ns: if self.chance(0.7) { -1 } else { 0 }, null_out: self.chance(0.05) },
            9 => self.ticket_op(s),
            10 => self.step_result_op(s),
            11 => Op::StepCount { sg: self.rng.below(s.sgs.len() + 1) as u32 },
            12 => Op::HostBytes,
            _ => match self.rng.below(6) {
                0 => Op::BeginStep { loss_scale: 1.0, micro_steps: 1, settle: false },
                1 => self.save_op(),
                2 => self.load_op(),
                3 => Op::AddSubgroup(self.subgroup_spec(s)),
                4 => Op::RemoveSubgroup { sg: 0 },
                _ => Op::Observe,
            },
        }
    }

    fn prepared(&mut self, s: &Sess) -> Op {
        match self.weighted(&[40.0, 2.0, 2.0, 1.0, 1.0, 2.0]) {
            0 => Op::Step(self.step_args(s)),
            1 => match self.any_slice(s) {
                Some(i) => self.grad_copy(s, i),
                None => Op::NextMicro,
            },
            2 => Op::LocalSumsq { timeout_ns: -1, null_out: false },
            3 => Op::NextMicro,
            4 => Op::BeginStep { loss_scale: 1.0, micro_steps: 1, settle: false },
            _ => self.ticket_op(s),
        }
    }
}
