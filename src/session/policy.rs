//! Decisions made from measurements of earlier steps: whether a sub-group speculates
//! (`Speculation::Auto`), whether a step's final passes may leave the state for later, and
//! how many first sub-groups to keep on the device (the automatic split, within the automatic
//! budget of `auto_budget.rs`).
//!
//! Speculation. A speculative step pays when the step's final factor equals the factor it
//! was taken with (it is kept: no pass after backward) and costs a little when it does not
//! (a rescale after backward instead of an update, about as long; for a copy written ahead,
//! the copy pass it wasted, 16 of an update's 28 bytes per element). One that has not started
//! when the step is decided costs nothing: it is cancelled and folded into the final pass;
//! the CPU-Adam thread takes it only once its gradient has landed. So in `Auto` a sub-group
//! speculates when the factor stayed unchanged (not clipped, not skipped) in at least half
//! of the recent steps (the last [`HISTORY`], counted with one pseudo-step each way, so a
//! new session speculates), or where the last [`REGIME`] steps all left it unchanged; where
//! they all changed it, it does not. So a run that starts or stops clipping wastes or misses
//! at most two speculative steps, not half the history's.
//!
//! Copy written ahead. Where a sub-group's step cannot be undone (bf16 moments), its
//! speculative pass writes the weights' copy alone, and the master weights and moments follow
//! in a state pass: it pays where the CPU-Adam thread has time for that pass during the
//! backward. Where it has none (the previous step's state passes fill the backward), the
//! speculative passes are cancelled at the decision, and planning them costs: every final
//! pass then writes the copy first and its state after (30 bytes a parameter), where a step
//! that did not speculate chooses one pass for part of the sub-groups ([`StateAfter`]). So in
//! `Auto`, after [`REGIME`] steps in which fewer than an eighth of the planned copy-ahead
//! passes had begun by the decision, none is planned, and one step in [`HISTORY`] tries
//! again. A copy written ahead fixes no bits (the kept copy and its state pass write what one
//! update writes; a rescaled or skipped step is taken from the master weights), so this
//! choice may follow timings; the whole update's speculation follows the factor history
//! alone.
//!
//! A device-placed sub-group decides like a host-placed one (the decision fixes the bits,
//! and placement may follow timings), but in `Auto` its speculative step waits for the
//! decision: on the GPU a step run beside the backward takes the GPU's memory bandwidth
//! from it (each launch fills the GPU), so it hides nothing, and one taken after the
//! decision writes the model's parameter in the same pass, where a step taken ahead needs a
//! publication pass of its own (6 more bytes per element). `On` queues it at hand-off.
//!
//! State after the copy. A final pass with a device to publish to can write the weights'
//! low-precision copy alone, publish it, and write the master weights and moments in a pass
//! of its own: the next forward waits for a pass that reads what an update reads (14 bytes
//! per element with a bf16 gradient) and writes 2 bytes instead of 14, and the CPU moves 42
//! bytes per element in all instead of 28. That pays when the CPU-Adam thread has idle time
//! for the extra pass before the next step's work: always in a step that did not speculate
//! (its passes all run after backward, and the next ones only after the next backward), and
//! in one that did when the thread was busy for at most [`STATE_AFTER_BUSY`] of the previous
//! step period. Where the CPU is about as busy as the GPU, the state passes would delay the
//! next step's speculative passes by more than they save. In a step that did not speculate
//! the copy goes first for a prefix of the sub-groups in forward order, all of them unless
//! the CPU-Adam thread is measured to be the step's bottleneck ([`StateAfter`]).
//!
//! Split. Every [`SPLIT_AFTER`] measured steps, the exposed optimizer time `W` (mean
//! `forward_wait_s` of those steps, the first after a change of the split excluded) is what
//! the next forward waited for. Sub-groups are finalized in forward order, so moving the
//! next `r` sub-groups to the device takes their CPU passes (`numel × seconds per element`)
//! off the front of that queue: the split grows by the fewest whose passes add up to `W`,
//! within the device budget. It only grows: it follows the regime to where the optimizer
//! hides (a run that starts clipping, speculation turning off), and a split that hides
//! the optimizer already measures no exposed time (below 1 % of the step period). Where every
//! step measured was clipped (or skipped), no final pass hides behind a backward, and the
//! split takes all the budget holds at once: the defaults settle within the warm-up steps
//! instead of a few rounds later.
//!
//! Automatic budget: `auto_budget.rs`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::auto_budget::AutoBudget;
use super::state_after::StateAfter;
use super::types::Speculation;
use crate::error::{Error, Result};

/// Recent steps whose factor changes are remembered.
pub(crate) const HISTORY: usize = 8;
/// The last steps that, all alike, decide speculation on their own.
const REGIME: usize = 2;
/// Steps measured before the automatic split is chosen, and again before it grows.
pub(crate) const SPLIT_AFTER: usize = 3;
/// Exposed optimizer time below this fraction of the step period is not worth a split.
const EXPOSED_NEGLIGIBLE: f64 = 0.01;
/// A step that speculated defers its state when the CPU-Adam thread was busy for at most
/// this fraction of the previous step period.
const STATE_AFTER_BUSY: f64 = 0.5;
/// Steps decided, while copy-ahead speculation is paused, before one tries it again.
const COPY_AHEAD_RETRY: usize = HISTORY;
/// A step in which fewer than this fraction of its planned copy-ahead passes had begun by the
/// decision counts towards pausing them: where a few begin, they still take the copy pass of
/// their sub-groups off the forward's wait.
const COPY_AHEAD_BEGUN_MIN: f64 = 0.125;

/// Whether copy-ahead speculative passes began before their steps' decisions (module doc,
/// "Copy written ahead").
#[derive(Clone, Copy, Debug, Default)]
struct CopyAhead {
    /// Consecutive steps that planned copy-ahead passes and had begun fewer than
    /// [`COPY_AHEAD_BEGUN_MIN`] of them by the decision; [`REGIME`] of them pause it.
    stalled: usize,
    /// Steps decided since the last that planned any, while paused.
    paused_for: usize,
}

pub(crate) struct Policy {
    mode: Speculation,
    /// Whether each recent step's final factor equalled its speculative one (newest last).
    unchanged: VecDeque<bool>,
    /// Seconds per element of a CPU update pass (exponentially averaged).
    secs_per_element: Option<f64>,
    /// `forward_wait_s` and host period (seconds since the previous `step()`) of each step
    /// since the split last changed (the last [`SPLIT_AFTER`] at most).
    waits: Vec<(f64, f64)>,
    last_step: Option<Instant>,
    /// Seconds the CPU-Adam thread spent on jobs since the last `step()`.
    busy_s: f64,
    /// Fraction of the previous step period the CPU-Adam thread was busy.
    busy_fraction: Option<f64>,
    /// First sub-groups on the device.
    placed: usize,
    /// The automatic budget, once measured.
    auto_budget: Option<AutoBudget>,
    /// The most free device memory the automatic budget may count on (the caller's).
    memory_limit: Option<usize>,
    state_after: StateAfter,
    copy_ahead: CopyAhead,
}

impl Policy {
    pub(crate) fn new(mode: Speculation) -> Policy {
        Policy {
            mode,
            unchanged: VecDeque::new(),
            secs_per_element: None,
            waits: Vec::new(),
            last_step: None,
            busy_s: 0.0,
            busy_fraction: None,
            placed: 0,
            auto_budget: None,
            memory_limit: None,
            state_after: StateAfter::default(),
            copy_ahead: CopyAhead::default(),
        }
    }

    /// `step()` was called; the previous step's exposed optimizer time was `forward_wait_s`.
    pub(crate) fn step_called(&mut self, forward_wait_s: f64) {
        self.step_called_at(Instant::now(), forward_wait_s);
    }

    fn step_called_at(&mut self, now: Instant, forward_wait_s: f64) {
        let period = self.last_step.map_or(0.0, |t| (now - t).as_secs_f64());
        self.last_step = Some(now);
        self.busy_fraction = (period > 0.0).then(|| self.busy_s / period);
        if period > 0.0 {
            self.state_after.measured(period, self.busy_s, forward_wait_s);
        }
        self.busy_s = 0.0;
        // Without an automatic split nothing consumes them.
        if self.waits.len() == SPLIT_AFTER {
            self.waits.remove(0);
        }
        self.waits.push((forward_wait_s, period));
    }

    /// The CPU-Adam thread spent `took` on one job.
    pub(crate) fn job_ran(&mut self, took: Duration) {
        self.busy_s += took.as_secs_f64();
    }

    /// A step was decided: how many elements of its final passes, a prefix in forward order,
    /// may write the master weights and moments after publishing the weights' copy (`None`:
    /// all of them).
    pub(crate) fn state_after_limit(&mut self, speculated: bool) -> Option<usize> {
        let limit = self.state_after.step_decided(speculated);
        match speculated {
            false => limit,
            true if self.busy_fraction.is_some_and(|f| f <= STATE_AFTER_BUSY) => None,
            true => Some(0),
        }
    }

    /// A final pass left `elements` for a state pass after publication.
    pub(crate) fn state_deferred(&mut self, elements: usize) {
        self.state_after.deferred(elements);
    }

    pub(crate) fn state_pass_measured(&mut self, elements: usize, took: Duration) {
        self.state_after.state_pass_measured(elements, took.as_secs_f64());
    }

    /// Fixes [`Policy::state_after_limit`] for the steps that do not speculate.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn force_state_after(&mut self, limit: Option<usize>) {
        self.state_after.force(limit);
    }

    pub(crate) fn decided(&mut self, unchanged: bool) {
        if self.unchanged.len() == HISTORY {
            self.unchanged.pop_front();
        }
        self.unchanged.push_back(unchanged);
    }

    /// The factor history `Auto` decides from, oldest first: `1` for a step whose factor was
    /// unchanged, `0` for one that was not (a checkpoint keeps it).
    pub(crate) fn history(&self) -> String {
        self.unchanged.iter().map(|&u| if u { '1' } else { '0' }).collect()
    }

    pub(crate) fn restore_history(&mut self, history: &str) -> Result<()> {
        self.unchanged = parse_history(history)?;
        Ok(())
    }

    /// [`Policy::history`] as bits (bit `i`: the `i`-th step, oldest first) and a count.
    pub(crate) fn history_bits(&self) -> (u32, u32) {
        let bits = self.unchanged.iter().enumerate().fold(0u32, |acc, (i, &u)| acc | u32::from(u) << i);
        (bits, self.unchanged.len() as u32)
    }

    /// Restores [`Policy::history_bits`]; refuses more steps than [`HISTORY`] or a bit beyond
    /// them, changing nothing.
    pub(crate) fn restore_history_bits(&mut self, bits: u32, steps: u32) -> Result<()> {
        if steps as usize > HISTORY || bits >> steps != 0 {
            return Err(Error::invalid(format!(
                "speculation history {bits:#x} of {steps} steps: at most {HISTORY} steps, and no bit beyond them"
            )));
        }
        self.unchanged = (0..steps).map(|i| bits >> i & 1 == 1).collect();
        Ok(())
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
                if let Some(&last) = self.unchanged.back()
                    && self.unchanged.len() >= REGIME
                    && self.unchanged.iter().rev().take(REGIME).all(|&u| u == last)
                {
                    // Clipping began or ended: follow it now, not once half the history turned.
                    return last;
                }
                let same = self.unchanged.iter().filter(|&&u| u).count();
                2 * (same + 1) >= self.unchanged.len() + 2
            }
        }
    }

    /// Whether a sub-group whose speculative pass would write the weights' copy alone
    /// ([`SpecKind::CopyAhead`](super::subgroup::SpecKind::CopyAhead)) plans one, where
    /// [`Policy::should_speculate`] says speculation pays: not in `Auto` while such passes
    /// have not begun before the decision (module doc, "Copy written ahead"), but for one step
    /// in [`COPY_AHEAD_RETRY`].
    pub(crate) fn should_copy_ahead(&self) -> bool {
        let c = self.copy_ahead;
        self.mode != Speculation::Auto || c.stalled < REGIME || c.paused_for >= COPY_AHEAD_RETRY
    }

    /// A step was decided that had planned `planned` copy-ahead passes, `begun` of which had
    /// begun (the others were cancelled).
    pub(crate) fn copy_ahead_decided(&mut self, planned: usize, begun: usize) {
        let c = &mut self.copy_ahead;
        if planned == 0 {
            if c.stalled >= REGIME {
                c.paused_for += 1;
            }
        } else if begun as f64 >= COPY_AHEAD_BEGUN_MIN * planned as f64 {
            *c = CopyAhead::default();
        } else {
            c.stalled += 1;
            c.paused_for = 0;
        }
    }

    /// Whether a device-placed sub-group's speculative step is queued on the device at
    /// hand-off (`On`) or recorded and taken by its final pass, with its resolution, after
    /// the decision (`Auto`): the same bits either way.
    pub(crate) fn device_steps_ahead(&self) -> bool {
        self.mode == Speculation::On
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
        // A step clipped every recent time hides no final pass behind the backward: whatever the
        // split leaves on the host is stepped after the decision, so it takes all that fits at
        // once rather than growing by what the first measurement saw (the defaults settle in
        // the warm-up steps instead of a few rounds later).
        let exposed = if self.clipped_throughout() { f64::INFINITY } else { exposed };
        let bytes_of = |n: usize| n.saturating_mul(device_bytes_per_element);
        let mut bytes =
            numels[..self.placed.min(numels.len())].iter().fold(0usize, |b, &n| b.saturating_add(bytes_of(n)));
        let (mut hidden, mut count) = (0.0, self.placed);
        for &n in &numels[count.min(numels.len())..] {
            if hidden >= exposed || bytes.saturating_add(bytes_of(n)) > budget {
                break;
            }
            hidden += n as f64 * rate;
            bytes += bytes_of(n);
            count += 1;
        }
        (count > self.placed).then(|| {
            self.placed = count;
            self.state_after.reset();
            count
        })
    }

    /// Whether every step the split measured changed the factor (clipped or skipped): no
    /// speculative step stood in them.
    fn clipped_throughout(&self) -> bool {
        self.unchanged.len() >= SPLIT_AFTER && self.unchanged.iter().rev().take(SPLIT_AFTER).all(|&u| !u)
    }

    pub(crate) fn auto_budget(&self) -> Option<AutoBudget> {
        self.auto_budget
    }

    /// The caller's limit on the free device memory the session counts on, if it gave one.
    pub(crate) fn device_memory_limit(&self) -> Option<usize> {
        self.memory_limit
    }

    pub(crate) fn limit_device_memory(&mut self, limit: Option<usize>) {
        self.memory_limit = limit;
    }

    /// The automatic budget for a device with `free` of `total` bytes free, within the
    /// caller's limit.
    pub(crate) fn measure_budget(&self, free: usize, total: usize) -> AutoBudget {
        AutoBudget::measured(free, total, self.memory_limit)
    }

    /// The automatic budget was chosen: the split places within it from now on.
    pub(crate) fn budget_chosen(&mut self, chosen: AutoBudget) {
        self.auto_budget = Some(chosen);
    }

    /// The device refused to place the split's next sub-group: the split ends at the
    /// `placed` first ones, and the automatic budget at the `bytes` they hold.
    pub(crate) fn placement_refused(&mut self, placed: usize, bytes: usize) {
        self.placed = placed;
        if let Some(b) = self.auto_budget.as_mut() {
            b.end_at(bytes);
        }
    }
}

/// A history as [`Policy::history`] writes it.
pub(crate) fn parse_history(history: &str) -> Result<VecDeque<bool>> {
    if history.len() > HISTORY || !history.bytes().all(|b| b == b'0' || b == b'1') {
        return Err(Error::invalid(format!(
            "speculation history {history:?}: expected at most {HISTORY} digits 0 or 1"
        )));
    }
    Ok(history.bytes().map(|b| b == b'1').collect())
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
        p.decided(false);
        assert!(p.should_speculate(), "mostly unchanged, one step clipped");
        p.decided(false);
        assert!(!p.should_speculate(), "clipping began: two steps clipped");
        for _ in 0..HISTORY {
            p.decided(false);
        }
        p.decided(true);
        assert!(!p.should_speculate(), "one unchanged step after clipping throughout");
        p.decided(true);
        assert!(p.should_speculate(), "clipping ended: two steps unchanged");
        let mut alternating = Policy::new(Speculation::Auto);
        for i in 0..HISTORY {
            alternating.decided(i % 2 == 0);
        }
        assert!(alternating.should_speculate(), "clipped every other step: half of them unchanged");
        assert!(!Policy::new(Speculation::Off).should_speculate());
        assert!(Policy::new(Speculation::On).should_speculate());
    }

    #[test]
    fn copy_ahead_pauses_where_it_does_not_run_ahead_and_tries_again() {
        let mut p = Policy::new(Speculation::Auto);
        assert!(p.should_copy_ahead(), "a new session writes copies ahead");
        p.copy_ahead_decided(16, 1);
        assert!(p.should_copy_ahead(), "one step that did not run ahead");
        p.copy_ahead_decided(16, 2);
        p.copy_ahead_decided(16, 1);
        assert!(p.should_copy_ahead(), "an eighth of them began: the count starts again");
        p.copy_ahead_decided(16, 1);
        assert!(!p.should_copy_ahead(), "two steps in a row began fewer than an eighth");
        for _ in 0..COPY_AHEAD_RETRY - 1 {
            p.copy_ahead_decided(0, 0);
            assert!(!p.should_copy_ahead());
        }
        p.copy_ahead_decided(0, 0);
        assert!(p.should_copy_ahead(), "one step in COPY_AHEAD_RETRY tries again");
        p.copy_ahead_decided(16, 1);
        assert!(!p.should_copy_ahead(), "the try did not run ahead: paused again");
        for _ in 0..COPY_AHEAD_RETRY {
            p.copy_ahead_decided(0, 0);
        }
        p.copy_ahead_decided(16, 2);
        assert!(p.should_copy_ahead(), "the try ran ahead: no longer paused");
        p.copy_ahead_decided(0, 0);
        assert!(p.should_copy_ahead(), "steps that planned none (clipped) change nothing");
        let mut on = Policy::new(Speculation::On);
        for _ in 0..REGIME {
            on.copy_ahead_decided(10, 0);
        }
        assert!(on.should_copy_ahead(), "`On` always speculates");
    }

    #[test]
    fn the_history_survives_a_round_trip() {
        let mut p = Policy::new(Speculation::Auto);
        for u in [true, false, false, true, false, false] {
            p.decided(u);
        }
        let mut q = Policy::new(Speculation::Auto);
        q.restore_history(&p.history()).unwrap();
        assert_eq!((q.history(), q.should_speculate()), ("100100".to_string(), p.should_speculate()));
        assert!(q.restore_history("102").is_err());
        assert_eq!(p.history_bits(), (0b001001, 6));
        q.restore_history_bits(0b001001, 6).unwrap();
        assert_eq!(q.history(), p.history());
        assert!(q.restore_history_bits(0b1000000, 6).is_err() && q.restore_history_bits(0, 9).is_err());
        assert!(q.restore_history(&"1".repeat(HISTORY + 1)).is_err());
    }

    #[test]
    fn state_waits_where_the_cpu_has_idle_time() {
        let mut p = Policy::new(Speculation::Auto);
        let start = Instant::now();
        assert_eq!(p.state_after_limit(false), None, "a step that did not speculate defers all");
        assert_eq!(p.state_after_limit(true), Some(0), "nothing measured yet");
        p.step_called_at(start, 0.0);
        p.job_ran(Duration::from_millis(40));
        p.step_called_at(start + Duration::from_millis(100), 0.0);
        assert_eq!(p.state_after_limit(true), None, "busy 40 % of the period");
        p.job_ran(Duration::from_millis(70));
        p.step_called_at(start + Duration::from_millis(200), 0.0);
        assert_eq!(p.state_after_limit(true), Some(0), "busy 70 % of the period");
        assert_eq!(p.state_after_limit(false), None);
    }

    /// A policy whose last steps left `waits` seconds exposed, with a CPU pass measured at a
    /// microsecond per element.
    fn measured(waits: &[f64]) -> Policy {
        let mut p = Policy::new(Speculation::Auto);
        p.pass_measured(1000, Duration::from_millis(1));
        for &wait in waits {
            p.step_called(wait);
        }
        p
    }

    /// Exposed time beyond what any split could hide.
    const ALL_EXPOSED: [f64; SPLIT_AFTER] = [1e9; SPLIT_AFTER];

    #[test]
    fn split_covers_the_exposed_time_within_the_budget() {
        // 3 ms exposed (the first step excluded): two sub-groups of 2000 elements hide 4 ms.
        assert_eq!(measured(&[9.0, 0.0025, 0.0035]).split(&[2000; 3], 16, usize::MAX), Some(2));
        assert_eq!(measured(&[9.0, 0.0025, 0.0035]).split(&[2000; 3], 16, 2000 * 16), Some(1), "the budget caps it");
        assert_eq!(Policy::new(Speculation::Auto).split(&[1], 16, 1), None, "not measured yet");
        assert_eq!(measured(&[9.0, 0.0, 0.0]).split(&[2000; 3], 16, usize::MAX), None, "nothing exposed");
    }

    const GIB: usize = 1 << 30;

    /// Clipped in every step measured: the first split takes everything the budget holds, however
    /// little time the first steps left exposed.
    #[test]
    fn clipping_every_step_places_all_that_fits_at_once() {
        let mut p = measured(&[9.0, 0.0025, 0.0035]);
        for _ in 0..SPLIT_AFTER {
            p.decided(false);
        }
        assert_eq!(p.split(&[2000; 5], 16, 4 * 2000 * 16), Some(4));
        let mut q = measured(&[9.0, 0.0025, 0.0035]);
        for unchanged in [false, true, false] {
            q.decided(unchanged);
        }
        assert_eq!(q.split(&[2000; 5], 16, 4 * 2000 * 16), Some(2), "one step kept its factor");
    }

    #[test]
    fn the_automatic_budget_is_the_free_memory_less_the_headroom() {
        // A caller's cap the device does not show: 24 GiB of a 141 GiB device, 15 GiB of it
        // held by the caller's allocator, 120 GiB free on the device.
        let mut p = Policy::new(Speculation::Auto);
        p.limit_device_memory(Some(9 * GIB));
        let b = p.measure_budget(120 * GIB, 141 * GIB);
        assert_eq!((b.free, b.headroom, b.budget), (9 * GIB, GIB, 8 * GIB), "the limit, less 1 GiB");
        assert_eq!(p.measure_budget(4 * GIB, 141 * GIB).budget, 3 * GIB, "the device's free memory is less");
        p.limit_device_memory(None);
        assert_eq!(p.measure_budget(120 * GIB, 141 * GIB), AutoBudget::measured(120 * GIB, 141 * GIB, None));
    }

    #[test]
    fn a_split_is_a_prefix_in_forward_order_within_the_budget() {
        assert_eq!(measured(&ALL_EXPOSED).split(&[1000, 1000, 500], 16, 2000 * 16), Some(2));
        assert_eq!(measured(&ALL_EXPOSED).split(&[1000, 1000, 500], 16, 2000 * 16 - 1), Some(1));
        assert_eq!(measured(&ALL_EXPOSED).split(&[1000, 1000, 500], 16, usize::MAX), Some(3));
        assert_eq!(measured(&ALL_EXPOSED).split(&[3000, 10], 16, 2000 * 16), None, "never a later one");
        assert_eq!(measured(&ALL_EXPOSED).split(&[], 16, usize::MAX), None);
        assert_eq!(
            measured(&ALL_EXPOSED).split(&[usize::MAX, 1], 16, usize::MAX - 1),
            None,
            "sizes that overflow do not fit"
        );
    }

    /// However much time is exposed, what the split places under the automatic budget fits in
    /// the free memory it measured, less the headroom; with time enough exposed it fills it.
    #[test]
    fn the_automatic_budget_never_exceeds_what_was_measured_free() {
        let sizes: [&[usize]; 4] = [&[1 << 28; 40], &[1 << 20, 1 << 30, 1 << 26], &[7_000_000; 300], &[]];
        for total in [16 * GIB, 80 * GIB, 141 * GIB] {
            for free in [0, GIB / 2, GIB, 3 * GIB + 12345, total / 2, total] {
                let b = AutoBudget::measured(free, total, None);
                assert!(b.budget + b.headroom <= free.max(b.headroom), "{b:?}");
                for numels in sizes {
                    for per_element in [12, 16, 20] {
                        let count = measured(&ALL_EXPOSED).split(numels, per_element, b.budget).unwrap_or(0);
                        let bytes: usize = numels[..count].iter().map(|n| n * per_element).sum();
                        assert!(bytes <= free.saturating_sub(b.headroom), "{b:?}: {count} placed, {bytes} bytes");
                        let next = numels.get(count).map(|n| n * per_element);
                        assert!(next.is_none_or(|n| bytes + n > b.budget), "{b:?}: the next one fits too");
                    }
                }
            }
        }
    }

    #[test]
    fn a_refused_placement_ends_the_split_and_the_automatic_budget() {
        let mut p = measured(&ALL_EXPOSED);
        let chosen = AutoBudget { free: 0, total: 0, limit: None, headroom: 0, budget: 4 * 1000 * 16 };
        p.budget_chosen(chosen);
        assert_eq!(p.auto_budget(), Some(chosen));
        assert_eq!(p.split(&[1000; 6], 16, chosen.budget), Some(4), "as much as the budget holds");
        p.placement_refused(1, 1000 * 16);
        let refused = p.auto_budget().unwrap();
        assert_eq!(refused.budget, 1000 * 16, "the budget ends at what was placed");
        for wait in ALL_EXPOSED {
            p.step_called(wait);
        }
        assert_eq!(p.split(&[1000; 6], 16, refused.budget), None, "nothing more is tried");
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
