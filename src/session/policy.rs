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
//! Split. Every [`SPLIT_AFTER`] measured steps, the exposed optimizer time `W` (mean
//! `forward_wait_s` of those steps, the first after a change of the split excluded) is what
//! the next forward waited for. Sub-groups are finalized in forward order, so moving the
//! next `r` sub-groups to the device takes their CPU passes (`numel × seconds per element`)
//! off the front of that queue: the split grows by the fewest whose passes add up to `W`,
//! within the device budget. It only grows: it follows the regime to where the optimizer
//! hides (a run that starts clipping, speculation turning off), and a split that hides
//! the optimizer already measures no exposed time (below 1 % of the step period).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::Speculation;

/// Recent steps whose factor changes are remembered.
pub(crate) const HISTORY: usize = 8;
/// Steps measured before the automatic split is chosen, and again before it grows.
pub(crate) const SPLIT_AFTER: usize = 3;
/// Exposed optimizer time below this fraction of the step period is not worth a split.
const EXPOSED_NEGLIGIBLE: f64 = 0.01;

pub(crate) struct Policy {
    mode: Speculation,
    /// Whether each recent step's final factor equalled its speculative one (newest last).
    unchanged: VecDeque<bool>,
    /// Seconds per element of a CPU update pass (exponentially averaged).
    secs_per_element: Option<f64>,
    /// `forward_wait_s` and host period (seconds since the previous `step()`) of each step
    /// since the split last changed.
    waits: Vec<(f64, f64)>,
    last_step: Option<Instant>,
    /// First sub-groups on the device.
    placed: usize,
}

impl Policy {
    pub(crate) fn new(mode: Speculation) -> Policy {
        Policy {
            mode,
            unchanged: VecDeque::new(),
            secs_per_element: None,
            waits: Vec::new(),
            last_step: None,
            placed: 0,
        }
    }

    /// `step()` was called; the previous step's exposed optimizer time was `forward_wait_s`.
    pub(crate) fn step_called(&mut self, forward_wait_s: f64) {
        let now = Instant::now();
        let period = self.last_step.map_or(0.0, |t| (now - t).as_secs_f64());
        self.last_step = Some(now);
        self.waits.push((forward_wait_s, period));
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
    /// place on the device from now on, when it should grow (`None`: leave it as it is).
    pub(crate) fn split(&mut self, numels: &[usize], device_bytes_per_element: usize, budget: usize) -> Option<usize> {
        if self.waits.len() < SPLIT_AFTER {
            return None;
        }
        let measured = &self.waits[1..];
        let exposed = measured.iter().map(|w| w.0).sum::<f64>() / measured.len() as f64;
        let period = measured.iter().map(|w| w.1).sum::<f64>() / measured.len() as f64;
        self.waits.clear();
        let rate = self.secs_per_element?;
        if exposed <= EXPOSED_NEGLIGIBLE * period {
            return None;
        }
        let mut bytes: usize =
            numels[..self.placed.min(numels.len())].iter().map(|n| n * device_bytes_per_element).sum();
        let (mut hidden, mut count) = (0.0, self.placed);
        for &n in &numels[count.min(numels.len())..] {
            if hidden >= exposed || bytes + n * device_bytes_per_element > budget {
                break;
            }
            hidden += n as f64 * rate;
            bytes += n * device_bytes_per_element;
            count += 1;
        }
        (count > self.placed).then(|| {
            self.placed = count;
            count
        })
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
        let measured = |waits: &[f64]| {
            let mut p = Policy::new(Speculation::Auto);
            p.pass_measured(1000, Duration::from_millis(1)); // 1 µs per element
            for &wait in waits {
                p.step_called(wait);
            }
            p
        };
        // 3 ms exposed (the first step excluded): two sub-groups of 2000 elements hide 4 ms.
        assert_eq!(measured(&[9.0, 0.0025, 0.0035]).split(&[2000; 3], 16, usize::MAX), Some(2));
        assert_eq!(measured(&[9.0, 0.0025, 0.0035]).split(&[2000; 3], 16, 2000 * 16), Some(1), "the budget caps it");
        assert_eq!(Policy::new(Speculation::Auto).split(&[1], 16, 1), None, "not measured yet");
        assert_eq!(measured(&[9.0, 0.0, 0.0]).split(&[2000; 3], 16, usize::MAX), None, "nothing exposed");
    }

    #[test]
    fn split_grows_while_time_stays_exposed() {
        let mut p = Policy::new(Speculation::Auto);
        p.pass_measured(1000, Duration::from_millis(1));
        for wait in [9.0, 0.0015, 0.0015] {
            p.step_called(wait);
        }
        assert_eq!(p.split(&[1000; 6], 16, usize::MAX), Some(2));
        for wait in [0.5, 0.0025, 0.0025] {
            p.step_called(wait);
        }
        assert_eq!(
            p.split(&[1000; 6], 16, 4 * 1000 * 16),
            Some(4),
            "grows by what is still exposed, within the budget"
        );
        for wait in [0.5, 0.0025, 0.0025] {
            p.step_called(wait);
        }
        assert_eq!(p.split(&[1000; 6], 16, 4 * 1000 * 16), None, "the budget is spent");
    }
}
