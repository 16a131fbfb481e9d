//! How much of a step that did not speculate writes the weights' copy first.
//!
//! A final pass can write the weights' copy alone, publish it, and leave the master weights
//! and moments to a state pass after publication (`policy.rs`, "State after the copy"): the
//! next forward waits for a copy pass instead of an update, and the CPU moves 42 bytes per
//! element instead of 28. Where the CPU-Adam thread has idle time that is the better trade
//! for every sub-group. Where it has none (clipping on every step, everything offloaded, a
//! host whose memory bandwidth is the limit) the extra bytes lengthen the step: the best is
//! then the copy first for a prefix of the sub-groups in forward order (those the forward
//! needs first) and one pass for the rest, at the crossing of the CPU's time, which falls as
//! the prefix shrinks, and the GPU's, which grows as the forward waits longer.
//!
//! [`StateAfter`] keeps that prefix as a number of elements, with no limit until the CPU is
//! measured to be the bottleneck. Every [`WINDOW`] consecutive steps that did not speculate
//! it takes the step of median period among them (the first not counted: it may carry the
//! previous limit's state passes; the median, because a pause of the caller's, such as an
//! evaluation or a checkpoint, makes one period an outlier), and compares the CPU-Adam
//! thread's idle time `I` in it (the period less its busy time) with [`IDLE_MARGIN`] of the
//! period:
//! - With a limit set and `I` above the margin: the GPU is the bottleneck. An element moved
//!   into the prefix costs the CPU (copy + state − one pass) and takes (one pass − copy) off
//!   the forward's wait: in all a state pass's time `s` off the idle time. The limit grows by
//!   (I − margin) / s.
//! - Otherwise, where the forward waits for the optimizer (`forward_wait_s`, `W`, above the
//!   margin) at least twice as long as the CPU-Adam thread idles, the CPU is the bottleneck
//!   or near it: the prefix shrinks by W / 2 / s. At most W of that wait can go, and the
//!   limit comes at the crossing from the side it is on. The thread idles a little even
//!   there (for the last gradient copy of each backward), so the first shrink is a trial
//!   that the periods measured after it keep or undo.
//!
//! Each window's median period is kept with its limit: a window slower than the best one by
//! more than [`WORSE`] ends the search at the best limit, so the choice is never slower than
//! the copy first for every sub-group as measured. A change of placement starts the search
//! afresh with no limit. A step that speculates is not measured (its passes are laid out by
//! the policy, not by the limit) and restarts the window, but the limit and the best stay:
//! speculation comes and goes with clipping, and the limit found for the steps that do not
//! speculate holds when they return. The limit changes which passes run, never the bits: a
//! copy pass and its state pass write exactly what one update writes.

/// Steps that measure one limit, the first of them not counted.
const WINDOW: usize = 4;
/// Idle time (of the CPU-Adam thread) or waiting time (of the GPU) below this fraction of the
/// step period counts as none.
const IDLE_MARGIN: f64 = 0.02;
/// A limit whose steps are this much slower than the best one's ends the search.
const WORSE: f64 = 0.02;

/// One step as [`StateAfter`] measures it (seconds, elements).
#[derive(Clone, Copy, Debug)]
struct Sample {
    /// Seconds from the previous `step()` to this one.
    period: f64,
    /// Seconds the CPU-Adam thread spent on jobs in that period.
    busy: f64,
    /// Seconds the forward waited for the optimizer (`forward_wait_s`).
    wait: f64,
    /// Elements whose state the previous step left for after publication.
    deferred: usize,
}

/// The step whose final passes run now.
#[derive(Clone, Copy, Debug)]
struct Current {
    speculated: bool,
    deferred: usize,
}

#[derive(Debug, Default)]
pub(crate) struct StateAfter {
    /// Elements of the prefix whose state may follow publication; `None`: every sub-group's.
    limit: Option<usize>,
    current: Option<Current>,
    window: Vec<Sample>,
    /// The limit with the shortest median period so far, and that period.
    best: Option<(Option<usize>, f64)>,
    /// The search ended at the best limit.
    settled: bool,
    /// The limit was fixed from outside (tests that compare layouts): no search.
    forced: bool,
    /// Seconds per element of a state pass (exponentially averaged).
    state_secs_per_element: Option<f64>,
}

impl StateAfter {
    /// A step was decided: how many elements, as a prefix in forward order, may leave their
    /// state for after publication (`None`: all of them) where it did not speculate.
    pub(crate) fn step_decided(&mut self, speculated: bool) -> Option<usize> {
        self.current = Some(Current { speculated, deferred: 0 });
        self.limit
    }

    /// A final pass of the current step left `elements` for a state pass.
    pub(crate) fn deferred(&mut self, elements: usize) {
        if let Some(c) = self.current.as_mut() {
            c.deferred += elements;
        }
    }

    pub(crate) fn state_pass_measured(&mut self, elements: usize, secs: f64) {
        if elements == 0 {
            return;
        }
        let rate = secs / elements as f64;
        self.state_secs_per_element = Some(self.state_secs_per_element.map_or(rate, |r| 0.8 * r + 0.2 * rate));
    }

    /// Starts the search afresh (the placement changed).
    pub(crate) fn reset(&mut self) {
        *self = StateAfter { state_secs_per_element: self.state_secs_per_element, ..StateAfter::default() };
    }

    /// Fixes the limit: no search from now on.
    #[cfg(any(test, feature = "fault-injection"))]
    pub(crate) fn force(&mut self, limit: Option<usize>) {
        self.reset();
        self.limit = limit;
        self.forced = true;
    }

    /// `step()` was called: the period since the previous one measured the current step.
    pub(crate) fn measured(&mut self, period: f64, busy: f64, wait: f64) {
        let Some(step) = self.current.take() else { return };
        if self.forced {
            return;
        }
        if step.speculated {
            self.window.clear();
            return;
        }
        if step.deferred == 0 && self.limit.is_none() {
            // Nothing could leave its state for later: nothing to choose.
            self.window.clear();
            return;
        }
        self.window.push(Sample { period, busy, wait, deferred: step.deferred });
        if self.window.len() < WINDOW {
            return;
        }
        let step = median(&mut self.window[1..]);
        self.window.clear();
        if self.settled {
            return;
        }
        match self.best {
            Some((limit, best)) if step.period > best * (1.0 + WORSE) => {
                self.limit = limit;
                self.settled = true;
                return;
            }
            Some((_, best)) if step.period >= best => {}
            _ => self.best = Some((self.limit, step.period)),
        }
        let Some(s) = self.state_secs_per_element else { return };
        let margin = IDLE_MARGIN * step.period;
        let idle = step.period - step.busy;
        if self.limit.is_some() && idle > margin {
            self.limit = Some(step.deferred + ((idle - margin) / s) as usize);
        } else if step.wait > margin && idle < step.wait / 2.0 {
            self.limit = Some(step.deferred.saturating_sub((step.wait / 2.0 / s) as usize));
        }
    }
}

/// The sample of median period.
fn median(samples: &mut [Sample]) -> Sample {
    samples.sort_by(|a, b| a.period.total_cmp(&b.period));
    samples[samples.len() / 2]
}

/// Whether a final pass over `numel` elements may leave its state for later with `left`
/// elements of the step's prefix left, which it then takes; one that does not fit ends the
/// prefix.
pub(crate) fn take_from_prefix(left: &mut Option<usize>, numel: usize) -> bool {
    match left {
        None => true,
        Some(l) if *l >= numel => {
            *l -= numel;
            true
        }
        Some(l) => {
            *l = 0;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's times by the model of the module's doc: sub-groups `sizes` in forward order,
    /// seconds per element of a copy pass, a state pass and one pass, and the GPU's forward
    /// and backward.
    struct Plant {
        sizes: Vec<usize>,
        copy: f64,
        state: f64,
        one_pass: f64,
        forward: f64,
        backward: f64,
        /// Other CPU-Adam thread work per step (the decision, waits for copies).
        other: f64,
        /// Time the CPU-Adam thread idles per step even where it is the bottleneck (the
        /// last gradient copy of a backward).
        gap: f64,
    }

    impl Plant {
        /// 2.8 B parameters in 28 sub-groups, at the H200 host's kernel rates
        /// (docs/performance.md): the CPU is the bottleneck with the copy first everywhere.
        fn host_bound() -> Plant {
            let per = |s: f64| s / 2.8e9;
            Plant {
                sizes: vec![100_000_000; 28],
                copy: per(0.47),
                state: per(0.56),
                one_pass: per(0.68),
                forward: 0.27,
                backward: 0.55,
                other: 0.1,
                gap: 0.03,
            }
        }

        /// Elements whose state follows publication under `limit`, as the final passes take them.
        fn deferred(&self, limit: Option<usize>) -> usize {
            let mut left = limit;
            self.sizes.iter().filter(|&&n| take_from_prefix(&mut left, n)).sum()
        }

        /// Period, CPU-Adam busy time and elements deferred of a step under `limit`.
        fn step(&self, limit: Option<usize>) -> (f64, f64, usize) {
            let total: usize = self.sizes.iter().sum();
            let deferred = self.deferred(limit) as f64;
            let rest = total as f64 - deferred;
            let chain = deferred * self.copy + rest * self.one_pass;
            let cpu = chain + deferred * self.state + self.other;
            let gpu = chain.max(self.forward) + self.backward;
            let period = (cpu + self.gap).max(gpu);
            (period, cpu, deferred as usize)
        }

        fn best_period(&self) -> f64 {
            (0..=self.sizes.len())
                .map(|k| self.step(Some(self.sizes[..k].iter().sum())).0)
                .fold(f64::INFINITY, f64::min)
        }

        /// Runs `steps` steps under a fresh search (every step clipped) and returns the
        /// period of the last without a pause, with `noise(step)` a relative error on each
        /// measured period.
        fn run(&self, steps: usize, noise: impl Fn(usize) -> f64) -> (f64, StateAfter) {
            let mut policy = StateAfter::default();
            let mut period = 0.0;
            for i in 0..steps {
                let limit = policy.step_decided(false);
                let (p, busy, deferred) = self.step(limit);
                policy.deferred(deferred);
                if deferred > 0 {
                    policy.state_pass_measured(deferred, deferred as f64 * self.state);
                }
                period = p;
                // Every 7th step the caller pauses (an evaluation): a long period, idle.
                let pause = if i % 7 == 6 { 2.0 * p } else { 0.0 };
                let measured = p * (1.0 + noise(i));
                policy.measured(measured + pause, busy, (measured - self.forward - self.backward).max(0.0));
            }
            (period, policy)
        }
    }

    #[test]
    fn where_the_cpu_is_the_bottleneck_the_prefix_shrinks_to_the_crossing() {
        let plant = Plant::host_bound();
        let all = plant.step(None).0;
        let (period, policy) = plant.run(40, |_| 0.0);
        assert!(policy.limit.is_some_and(|l| l < 28 * 100_000_000), "{policy:?}");
        assert!(period <= plant.best_period() * 1.02, "{period} against the best {}", plant.best_period());
        assert!(period < all * 0.96, "{period} against {all} with the copy first everywhere");
    }

    #[test]
    fn where_the_gpu_is_the_bottleneck_every_subgroup_writes_the_copy_first() {
        let plant = Plant { backward: 1.5, ..Plant::host_bound() };
        let (period, policy) = plant.run(40, |_| 0.0);
        assert_eq!(policy.limit, None);
        assert_eq!(period, plant.step(None).0);
    }

    #[test]
    fn a_slower_layout_ends_the_search_at_the_best_one() {
        // One pass far slower than the model's rates make it: shrinking only costs.
        let plant = Plant { one_pass: Plant::host_bound().copy * 3.0, ..Plant::host_bound() };
        let (period, policy) = plant.run(40, |_| 0.0);
        assert!(policy.settled, "{policy:?}");
        assert_eq!((policy.limit, period), (None, plant.step(None).0));
    }

    #[test]
    fn noise_in_the_periods_does_not_make_it_slower() {
        let gains = Plant::host_bound();
        let costs = Plant { one_pass: Plant::host_bound().copy * 3.0, ..Plant::host_bound() };
        for seed in 1..20u64 {
            // ±1.5 % on every measured period.
            let noise = |i: usize| {
                let x = (seed * 2_654_435_761 + i as u64 * 40_503).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                (x as f64 / (1u64 << 24) as f64 - 0.5) * 0.03
            };
            let all = gains.step(None).0;
            let (period, _) = gains.run(60, noise);
            assert!(period < all * 0.97, "seed {seed}: {period} against {all} with the copy first everywhere");
            let all = costs.step(None).0;
            let (period, _) = costs.run(60, noise);
            assert!(period <= all * 1.01, "seed {seed}: {period} against {all} where one pass costs more");
        }
    }

    #[test]
    fn speculation_and_a_forced_limit() {
        let plant = Plant::host_bound();
        let (_, mut policy) = plant.run(40, |_| 0.0);
        assert!(policy.limit.is_some());
        let (limit, best) = (policy.limit, policy.best);
        policy.window.clear();
        policy.step_decided(false);
        policy.measured(1.0, 1.0, 0.5);
        assert_eq!(policy.window.len(), 1);
        policy.step_decided(true);
        policy.measured(1.0, 1.0, 0.5);
        assert!(policy.window.is_empty(), "a step that speculated is not measured and restarts the window");
        assert_eq!((policy.limit, policy.best), (limit, best), "the limit and the best stay");
        policy.reset();
        assert_eq!((policy.limit, policy.best), (None, None), "a change of placement starts afresh");
        policy.force(Some(7));
        for _ in 0..2 * WINDOW {
            assert_eq!(policy.step_decided(false), Some(7));
            policy.deferred(7);
            policy.measured(1.0, 1.0, 0.5);
        }
        policy.step_decided(true);
        policy.measured(1.0, 1.0, 0.5);
        assert_eq!(policy.step_decided(false), Some(7), "a forced limit stays");
    }

    #[test]
    fn the_prefix_ends_at_the_first_subgroup_that_does_not_fit() {
        let mut left = Some(250);
        let taken: Vec<bool> = [100, 100, 100, 10].iter().map(|&n| take_from_prefix(&mut left, n)).collect();
        assert_eq!((taken, left), (vec![true, true, false, false], Some(0)));
        let mut none = None;
        assert!(take_from_prefix(&mut none, usize::MAX));
    }
}
