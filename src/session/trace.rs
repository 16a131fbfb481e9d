//! A timeline of what a session did, in the Chrome trace event format (readable by
//! Perfetto and chrome://tracing): gradient hand-offs, speculative steps, sums of squares,
//! the decision, each sub-group's finalization (kept, rescale, rollback, redo, step),
//! publication, and the waits of the caller and of the CPU-Adam thread.

use std::io::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::error::{Error, Result, Status};

/// Which timeline lane an event belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// The caller's (training) thread.
    Caller = 1,
    /// The session's CPU-Adam thread.
    CpuAdam = 2,
}

struct Event {
    name: String,
    lane: Lane,
    start_us: f64,
    dur_us: f64,
    args: String,
}

pub(crate) struct Tracer {
    enabled: AtomicBool,
    origin: Instant,
    events: Mutex<Vec<Event>>,
}

/// A span being timed; records itself when finished (or dropped).
pub(crate) struct Span<'a> {
    tracer: &'a Tracer,
    name: Option<String>,
    lane: Lane,
    start: Instant,
    args: String,
}

impl Span<'_> {
    pub(crate) fn arg(mut self, key: &str, value: impl std::fmt::Display) -> Self {
        if self.name.is_some() {
            if !self.args.is_empty() {
                self.args.push(',');
            }
            self.args.push_str(&format!("\"{key}\":\"{}\"", escape(&value.to_string())));
        }
        self
    }
}

impl Drop for Span<'_> {
    fn drop(&mut self) {
        if let Some(name) = self.name.take() {
            let t = self.tracer;
            let start_us = self.start.duration_since(t.origin).as_secs_f64() * 1e6;
            let dur_us = self.start.elapsed().as_secs_f64() * 1e6;
            let event = Event { name, lane: self.lane, start_us, dur_us, args: std::mem::take(&mut self.args) };
            t.events.lock().unwrap().push(event);
        }
    }
}

/// A JSON string body: quotes, backslashes and every control character escaped.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

impl Tracer {
    pub(crate) fn new() -> Tracer {
        Tracer { enabled: AtomicBool::new(false), origin: Instant::now(), events: Mutex::new(Vec::new()) }
    }

    /// Starts (clearing what was recorded) or stops recording.
    pub(crate) fn set_enabled(&self, on: bool) {
        if on {
            self.events.lock().unwrap().clear();
        }
        self.enabled.store(on, Ordering::Release);
    }

    /// A span that records only while tracing is on (a cheap no-op otherwise).
    pub(crate) fn span(&self, lane: Lane, name: impl FnOnce() -> String) -> Span<'_> {
        let on = self.enabled.load(Ordering::Acquire);
        Span { tracer: self, name: on.then(name), lane, start: Instant::now(), args: String::new() }
    }

    /// Records a point event (a decision worth seeing on the timeline).
    pub(crate) fn instant(&self, lane: Lane, name: impl FnOnce() -> String) {
        if self.enabled.load(Ordering::Acquire) {
            let start_us = self.origin.elapsed().as_secs_f64() * 1e6;
            let event = Event { name: name(), lane, start_us, dur_us: 0.0, args: String::new() };
            self.events.lock().unwrap().push(event);
        }
    }

    pub(crate) fn write(&self, path: &std::path::Path) -> Result<()> {
        let events = self.events.lock().unwrap();
        let io = |e: std::io::Error| Error::new(Status::Io, format!("cannot write trace {}: {e}", path.display()));
        let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
        let mut write = || -> std::io::Result<()> {
            writeln!(out, "{{\"displayTimeUnit\":\"ms\",\"traceEvents\":[")?;
            for (lane, label) in [(Lane::Caller, "caller thread"), (Lane::CpuAdam, "CPU-Adam thread")] {
                writeln!(
                    out,
                    "{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":{},\"args\":{{\"name\":\"{label}\"}}}},",
                    lane as u32
                )?;
            }
            for (i, e) in events.iter().enumerate() {
                let comma = if i + 1 < events.len() { "," } else { "" };
                writeln!(
                    out,
                    "{{\"name\":\"{}\",\"ph\":\"X\",\"pid\":1,\"tid\":{},\"ts\":{:.3},\"dur\":{:.3},\"args\":{{{}}}}}{comma}",
                    escape(&e.name),
                    e.lane as u32,
                    e.start_us,
                    e.dur_us,
                    e.args
                )?;
            }
            writeln!(out, "]}}")?;
            out.flush()
        };
        write().map_err(io)
    }
}
