//! Decisions made from measurements of earlier steps: whether a sub-group speculates
//! (`Speculation::Auto`) and how many first sub-groups to keep on the device (the automatic
//! split).
//!
//! Speculation. A speculative step pays when the step's final factor equals the factor it
//! was taken with (it is kept: no pass after backward) and costs a little when it does not
//! (a rescale after backward instead of an update, about as long). One that has not started
//! when the step is decided costs nothing: it is cancelled and folded into the final pass;
//! the CPU-Adam thread takes it only once its gradient has landed. So in `Auto` a sub-group
//! speculates when the factor stayed unchanged (not clipped, not skipped) in at least half
//! of the recent steps (the last [`HISTORY`], counted with one pseudo-step each way, so a
//! new session speculates).
//!
//! Split. After [`SPLIT_AFTER`] measured steps with every sub-group offloaded, the exposed
//! optimizer time `W` (mean `forward_wait_s` of those steps, the first excluded) is what the
//! next forward waited for. Sub-groups are finalized in forward order, so moving the first
//! `r` to the device takes their CPU passes (`numel × seconds per element`) off the front of
//! that queue: the split is the smallest `r` whose passes add up to `W`, within the device
//! budget. No exposed time: no split.

use std::collections::VecDeque;
use std::time::Duration;

use super::Speculation;

/// Recent steps whose factor changes are remembered.
pub(crate) const HISTORY: usize = 8;
/// Steps measured before the automatic split is chosen.
pub(crate) const SPLIT_AFTER: usize = 3;

pub(crate) struct Policy {
    mode: Speculation,
    /// Whether each recent step's final factor equalled its speculative one (newest last).
    unchanged: VecDeque<bool>,
    /// Seconds per element of a CPU update pass (exponentially averaged).
    secs_per_element: Option<f64>,
    /// `forward_wait_s` of every step so far.
    waits: Vec<f64>,
}

impl Policy {
    pub(crate) fn new(mode: Speculation) -> Policy {
        Policy { mode, unchanged: VecDeque::new(), secs_per_element: None, waits: Vec::new() }
    }

    /// `step()` was called; the previous step's exposed optimizer time was `forward_wait_s`.
    pub(crate) fn step_called(&mut self, forward_wait_s: f64) {
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

    pub(crate) fn should_speculate(&self) -> bool {
        match self.mode {
            Speculation::Off => false,
            Speculation::On => true,
            Speculation::Auto => {
                let same = self.unchanged.iter().filter(|&&u| u).count();
                2 * (same + 1) >= self.unchanged.len() + 2
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
    fn auto_speculation_follows_the_clip_history() {
        let mut p = Policy::new(Speculation::Auto);
        assert!(p.should_speculate(), "a new session speculates");
        for _ in 0..HISTORY {
            p.decided(false);
        }
        assert!(!p.should_speculate(), "clipped every step");
        for _ in 0..HISTORY / 2 {
            p.decided(true);
        }
        assert!(p.should_speculate(), "unchanged in half of the recent steps");
        assert!(!Policy::new(Speculation::Off).should_speculate());
        assert!(Policy::new(Speculation::On).should_speculate());
    }

    #[test]
    fn split_covers_the_exposed_time_within_the_budget() {
        let mut p = Policy::new(Speculation::Auto);
        p.pass_measured(1000, Duration::from_millis(1)); // 1 µs per element
        for wait in [9.0, 0.0025, 0.0035] {
            p.step_called(wait);
        }
        // 3 ms exposed (the first step excluded): two sub-groups of 2000 elements hide 4 ms.
        assert_eq!(p.split(&[2000, 2000, 2000], 16, usize::MAX), Some(2));
        assert_eq!(p.split(&[2000, 2000, 2000], 16, 2000 * 16), Some(1), "the budget caps it");
        assert_eq!(Policy::new(Speculation::Auto).split(&[1], 16, 1), None, "not measured yet");
    }
}
