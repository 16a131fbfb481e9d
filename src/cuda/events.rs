//! CUDA events from a pool: ordering events (between streams, and for the host to wait on)
//! and timing events (the GPU's idle time at ticket waits). An [`Event`] goes back to its
//! pool when dropped, on every path; the pool's events are destroyed with the transport.

use std::sync::{Arc, Mutex};

use super::driver::{self, CUevent, CUstream, Raw};
use crate::error::Result;

#[derive(Default)]
pub(crate) struct EventPool {
    ordering: Mutex<Vec<Raw<CUevent>>>,
    timing: Mutex<Vec<Raw<CUevent>>>,
}

impl EventPool {
    fn free(&self, timing: bool) -> &Mutex<Vec<Raw<CUevent>>> {
        if timing { &self.timing } else { &self.ordering }
    }

    /// An ordering event recorded on `stream`.
    pub(crate) fn record(self: &Arc<Self>, stream: CUstream) -> Result<Event> {
        self.take(false)?.recorded(stream)
    }

    /// A timing event recorded on `stream`.
    pub(crate) fn record_timing(self: &Arc<Self>, stream: CUstream) -> Result<Event> {
        self.take(true)?.recorded(stream)
    }

    fn take(self: &Arc<Self>, timing: bool) -> Result<Event> {
        let free = self.free(timing).lock().unwrap().pop();
        let raw = match free {
            Some(e) => e,
            None => Raw(driver::event_create(timing)?),
        };
        Ok(Event { raw, timing, pool: Arc::clone(self) })
    }

    /// Destroys the free events: the transport is going away and every event is back.
    pub(crate) fn destroy_free(&self) {
        for timing in [false, true] {
            for e in std::mem::take(&mut *self.free(timing).lock().unwrap()) {
                driver::event_destroy(e.0);
            }
        }
    }
}

/// An event taken from an [`EventPool`], given back when dropped. Once it has been recorded
/// and waited for (by a stream or the host) it may go back at once: a later record does not
/// change what was waited for.
pub(crate) struct Event {
    raw: Raw<CUevent>,
    timing: bool,
    pool: Arc<EventPool>,
}

impl Event {
    fn recorded(self, stream: CUstream) -> Result<Event> {
        driver::event_record(self.raw.0, stream)?;
        Ok(self)
    }

    /// Makes `stream` wait for the work queued before this event.
    pub(crate) fn wait_in(&self, stream: CUstream) -> Result<()> {
        driver::stream_wait_event(stream, self.raw.0)
    }

    /// Whether the work before this event is done (`Ok(false)`: not yet).
    pub(crate) fn done(&self) -> Result<bool> {
        driver::event_done(self.raw.0)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        self.pool.free(self.timing).lock().unwrap().push(self.raw);
    }
}

/// Waits on the host for `events` (stopping at the first failure) and gives them back.
pub(crate) fn synchronize_all(events: Vec<Event>) -> Result<()> {
    events.iter().try_for_each(|e| driver::event_synchronize(e.raw.0))
}

/// Timing event pairs around the GPU-side ticket waits not yet accounted.
#[derive(Default)]
pub(crate) struct WaitTimes(Vec<(Event, Event)>);

impl WaitTimes {
    pub(crate) fn push(&mut self, before: Event, after: Event) {
        self.0.push((before, after));
    }

    /// Seconds between the pairs that have completed, which go back to the pool; the others
    /// stay for a later call.
    pub(crate) fn take_elapsed_s(&mut self) -> f64 {
        let mut total = 0.0;
        self.0.retain(|(before, after)| match after.done() {
            Ok(false) => true,
            done => {
                if done.is_ok() {
                    total += driver::event_elapsed_ms(before.raw.0, after.raw.0).map_or(0.0, |ms| ms as f64 * 1e-3);
                }
                false
            }
        });
        total
    }
}
