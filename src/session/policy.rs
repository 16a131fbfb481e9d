//! Decisions made from measurements of earlier steps: whether a sub-group speculates
//! (`Speculation::Auto`) and how many first sub-groups to keep on the device (the automatic
//! split).
//!
//! Speculation. A speculative step pays when the step's final factor equals the factor it
//! was taken with (it is kept: no pass after backward) and costs a little when it does not
//! (a rescale after backward instead of an update, about as long; the chunk in flight when
//! `step()` arrives). So in `Auto` a sub-group speculates when
//! - the factor stayed unchanged (not clipped, not skipped) in at least half of the recent
//!   steps (the last [`HISTORY`], counted with one pseudo-step each way, so a new session
//!   speculates), and
//! - on the previous step its gradient completed at least one chunk's worth of CPU time
//!   before `step()` was called (a sub-group completing later would not get far before the
//!   decision cancels or preempts it; the first sub-groups in forward order, whose gradients
//!   come last, are the typical case).
//!
//! Split. After [`SPLIT_AFTER`] measured steps with every sub-group offloaded, the exposed
//! optimizer time `W` (mean `forward_wait_s` of those steps, the first excluded) is what the
//! next forward waited for. Sub-groups are finalized in forward order, so moving the first
//! `r` to the device takes their CPU passes (`numel × seconds per element`) off the front of
//! that queue: the split is the smallest `r` whose passes add up to `W`, within the device
//! budget. No exposed time: no split.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::Speculation;
use super::passes::SPECULATION_CHUNK;

/// Recent steps whose factor changes are remembered.
pub(crate) const HISTORY: usize = 8;
/// Steps measured before the automatic split is chosen.
pub(crate) const SPLIT_AFTER: usize = 3;

pub(crate) struct Policy {
    mode: Speculation,
    /// Whether each recent step's final factor equalled its speculative one (newest last).
    unchanged: VecDeque<bool>,
    /// Per sub-group: when its gradient completed this step.
    completed_at: Vec<Option<Instant>>,
    /// Per sub-group: from completion to `step()` on the previous step.
    slack: Vec<Option<Duration>>,
    /// Seconds per element of a CPU update pass (exponentially averaged).
    secs_per_element: Option<f64>,
    /// `forward_wait_s` of every step so far.
    waits: Vec<f64>,
}

impl Policy {
    pub(crate) fn new(mode: Speculation) -> Policy {
        Policy {
            mode,
            unchanged: VecDeque::new(),
            completed_at: Vec::new(),
            slack: Vec::new(),
            secs_per_element: None,
            waits: Vec::new(),
        }
    }

    fn slot<T: Default + Clone>(v: &mut Vec<T>, sg: u32) -> &mut T {
        if v.len() <= sg as usize {
            v.resize(sg as usize + 1, T::default());
        }
        &mut v[sg as usize]
    }

    pub(crate) fn completed(&mut self, sg: u32, at: Instant) {
        *Self::slot(&mut self.completed_at, sg) = Some(at);
    }

    pub(crate) fn step_called(&mut self, at: Instant, forward_wait_s: f64) {
        for (sg, done) in self.completed_at.iter_mut().enumerate() {
            if let Some(done) = done.take() {
                *Self::slot(&mut self.slack, sg as u32) = Some(at.saturating_duration_since(done));
            }
        }
        self.waits.push(forward_wait_s);
    }

    pub(crate) fn decided(&mut self, unchanged: bool) {
        if self.unchanged.len() == HISTORY {
            self.unchanged.pop_front();
        }
        self.unchanged.push_back(unchanged);
    }

    pub(crate) fn pass_measured(&mut self, elements: usize, took: Duration) {
        if elements == 0 {
            return;
        }
        let rate = took.as_secs_f64() / elements as f64;
        self.secs_per_element = Some(match self.secs_per_element {
            Some(r) => 0.8 * r + 0.2 * rate,
            None => rate,
        });
    }

    pub(crate) fn should_speculate(&self, sg: u32, numel: usize) -> bool {
        match self.mode {
            Speculation::Off => false,
            Speculation::On => true,
            Speculation::Auto => {
                let same = self.unchanged.iter().filter(|&&u| u).count();
                let likely_kept = 2 * (same + 1) >= self.unchanged.len() + 2;
                let early = match (self.slack.get(sg as usize).copied().flatten(), self.secs_per_element) {
                    (Some(slack), Some(rate)) => slack.as_secs_f64() >= rate * numel.min(SPECULATION_CHUNK) as f64,
                    _ => true,
                };
                likely_kept && early
            }
        }
    }

    /// The automatic split: how many first sub-groups (of `numels`, in forward order) to
    /// place on the device, once enough steps were measured (`None` before).
    pub(crate) fn split(&self, numels: &[usize], device_bytes_per_element: usize, budget: usize) -> Option<usize> {
        if self.waits.len() < SPLIT_AFTER {
            return None;
        }
        let measured = &self.waits[1..];
        let exposed = measured.iter().sum::<f64>() / measured.len() as f64;
        let rate = self.secs_per_element?;
        let (mut hidden, mut bytes, mut count) = (0.0, 0usize, 0);
        for &n in numels {
            if hidden >= exposed || bytes + n * device_bytes_per_element > budget {
                break;
            }
            hidden += n as f64 * rate;
            bytes += n * device_bytes_per_element;
            count += 1;
        }
        Some(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_speculation_follows_the_clip_history_and_the_slack() {
        let mut p = Policy::new(Speculation::Auto);
        assert!(p.should_speculate(0, 1000), "a new session speculates");
        for _ in 0..HISTORY {
            p.decided(false);
        }
        assert!(!p.should_speculate(0, 1000), "clipped every step");
        for _ in 0..HISTORY / 2 {
            p.decided(true);
        }
        assert!(p.should_speculate(0, 1000), "unchanged in half of the recent steps");
        p.pass_measured(1000, Duration::from_millis(1));
        let t0 = Instant::now();
        p.completed(0, t0);
        p.completed(1, t0 + Duration::from_millis(5));
        p.step_called(t0 + Duration::from_millis(5), 0.0);
        assert!(p.should_speculate(0, 1000), "5 ms of slack for 1 ms of work");
        assert!(!p.should_speculate(1, 1000), "its gradient came with step()");
        assert!(!Policy::new(Speculation::Off).should_speculate(0, 1));
    }

    #[test]
    fn split_covers_the_exposed_time_within_the_budget() {
        let mut p = Policy::new(Speculation::Auto);
        p.pass_measured(1000, Duration::from_millis(1)); // 1 µs per element
        for wait in [9.0, 0.0025, 0.0035] {
            p.step_called(Instant::now(), wait);
        }
        // 3 ms exposed (the first step excluded): two sub-groups of 2000 elements hide 4 ms.
        assert_eq!(p.split(&[2000, 2000, 2000], 16, usize::MAX), Some(2));
        assert_eq!(p.split(&[2000, 2000, 2000], 16, 2000 * 16), Some(1), "the budget caps it");
        assert_eq!(Policy::new(Speculation::Auto).split(&[1], 16, 1), None, "not measured yet");
    }
}
