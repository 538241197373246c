//! Each rank's offset from rank 0's clock, estimated over the group's own connections the NTP
//! way (TR-4): a call at local time `t0` returns rank 0's time `r`, its reply arrives at `t2`;
//! rank 0's clock read `r` somewhere in `[t0, t2]`, so `offset = r - (t0 + t2) / 2` is off by at
//! most `(t2 - t0) / 2`. Of several samples, the one with the shortest round trip wins.
//!
//! The clock is `CLOCK_MONOTONIC`: it does not jump with the wall clock, and a time namespace
//! can shift it (which the tests use to inject an offset).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::BoxError;
use crate::registry::RemoteFn;
use crate::state::{Agent, CallContext};

/// The trace's clock: the CPU's counter (a few nanoseconds a read, through `quanta`), mapped
/// onto `CLOCK_MONOTONIC` at an anchor read when the process first traces.
struct Ticks {
    clock: quanta::Clock,
    anchor_raw: u64,
    anchor_ns: u64,
}

static TICKS: std::sync::OnceLock<Ticks> = std::sync::OnceLock::new();

fn ticks_clock() -> &'static Ticks {
    TICKS.get_or_init(|| {
        let clock = quanta::Clock::new();
        let anchor_raw = clock.raw();
        Ticks {
            clock,
            anchor_raw,
            anchor_ns: monotonic_ns(),
        }
    })
}

/// `CLOCK_MONOTONIC`, in nanoseconds.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// A raw reading of the trace's clock (convert with [`ticks_to_ns`]).
pub(crate) fn ticks() -> u64 {
    ticks_clock().clock.raw()
}

/// A raw reading in nanoseconds of `CLOCK_MONOTONIC`'s time scale.
pub(crate) fn ticks_to_ns(t: u64) -> u64 {
    let c = ticks_clock();
    c.anchor_ns + c.clock.delta_as_nanos(c.anchor_raw, t)
}

/// This process's trace clock now, in nanoseconds.
pub(crate) fn now_ns() -> u64 {
    ticks_to_ns(ticks())
}

/// How far a rank's clock is from rank 0's, as estimated (TR-4): rank 0's time for local time
/// `t` is `t + offset_ns + drift_ppm * (t - at_ns) / 1e6`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClockEstimate {
    /// The offset at local time `at_ns`, nanoseconds.
    pub offset_ns: i64,
    /// The local time the offset was measured at.
    pub at_ns: u64,
    /// How fast the offset changes (parts per million), from the first and last probes.
    pub drift_ppm: f64,
    /// The best probe's half round trip, nanoseconds: each probe's offset is within this of
    /// the truth (`u64::MAX`: rank 0's clock was never read).
    pub error_bound_ns: u64,
    /// Round trips measured.
    pub samples: u32,
}

impl ClockEstimate {
    /// Rank 0's own: exact.
    pub(crate) const REFERENCE: Self = Self {
        offset_ns: 0,
        at_ns: 0,
        drift_ppm: 0.0,
        error_bound_ns: 0,
        samples: 0,
    };

    /// No estimate: local time as it is, with no bound.
    pub(crate) const UNKNOWN: Self = Self {
        offset_ns: 0,
        at_ns: 0,
        drift_ppm: 0.0,
        error_bound_ns: u64::MAX,
        samples: 0,
    };

    /// Local time `t` on rank 0's clock, in nanoseconds.
    pub fn to_reference(&self, t: u64) -> i128 {
        let drift = self.drift_ppm * (t as f64 - self.at_ns as f64) / 1e6;
        t as i128 + i128::from(self.offset_ns) + drift as i128
    }
}

/// One probe window's best sample.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at: u64,
    offset: i64,
    bound: u64,
}

/// The probes so far: the first window's best and the latest window's best.
#[derive(Debug, Default)]
pub(crate) struct ClockState {
    first: Option<Sample>,
    last: Option<Sample>,
    samples: u32,
    pub(super) reference: bool,
}

impl ClockState {
    /// The estimate from the probes so far.
    pub(crate) fn estimate(&self) -> ClockEstimate {
        if self.reference {
            return ClockEstimate::REFERENCE;
        }
        let Some(first) = self.first else {
            return ClockEstimate::UNKNOWN;
        };
        let last = self.last.unwrap_or(first);
        let span = last.at.saturating_sub(first.at);
        let drift_ppm = if span >= 1_000_000_000 {
            (last.offset - first.offset) as f64 / span as f64 * 1e6
        } else {
            0.0
        };
        ClockEstimate {
            offset_ns: first.offset,
            at_ns: first.at,
            drift_ppm,
            error_bound_ns: first.bound.max(last.bound),
            samples: self.samples,
        }
    }

    fn add(&mut self, s: Sample, n: u32) {
        self.samples += n;
        if self.first.is_none() {
            self.first = Some(s);
        } else {
            self.last = Some(s);
        }
    }
}

/// Internal: this worker's clock, for a peer's estimate.
pub(crate) struct TraceClock;

impl RemoteFn for TraceClock {
    const NAME: &'static str = "rpc_core::trace_clock";
    type Args = ();
    type Output = u64;
    async fn call(_ctx: CallContext, (): ()) -> Result<u64, BoxError> {
        Ok(now_ns())
    }
}

/// Probes rank 0's clock `n` times, each bounded by `timeout`: the sample with the shortest
/// round trip, or the last error.
async fn probe(agent: &Agent, n: u32, timeout: Duration) -> Result<Sample, crate::RpcError> {
    let mut best: Option<Sample> = None;
    let mut last_err = None;
    for _ in 0..n.max(1) {
        let t0 = now_ns();
        match agent.rpc_async_timeout(0u32, TraceClock, (), timeout).await {
            Ok(r) => {
                let t2 = now_ns();
                let rtt = t2.saturating_sub(t0);
                let mid = t0 + rtt / 2;
                let s = Sample {
                    at: mid,
                    offset: (i128::from(r) - i128::from(mid)) as i64,
                    bound: rtt.div_ceil(2),
                };
                if best.is_none_or(|b| s.bound < b.bound) {
                    best = Some(s);
                }
            }
            Err(e) => last_err = Some(e),
        }
    }
    best.ok_or_else(|| last_err.expect("a failed probe left its error"))
}

/// This worker's offset from rank 0's clock over `samples` round trips, each bounded by
/// `timeout`; rank 0 itself is the reference. An error when no round trip succeeded.
pub async fn estimate_offset(
    agent: &Agent,
    samples: u32,
    timeout: Duration,
) -> Result<ClockEstimate, crate::RpcError> {
    if agent.rank() == 0 {
        return Ok(ClockEstimate::REFERENCE);
    }
    let s = probe(agent, samples, timeout).await?;
    let mut st = ClockState::default();
    st.add(s, samples.max(1));
    Ok(st.estimate())
}

/// Probes per window, and the time between windows.
const WINDOW: u32 = 8;
const EVERY: Duration = Duration::from_secs(5);

/// Keeps `agent`'s clock estimate (TR-4) while it lives: a window of probes at once and every
/// 5 s, so that a part written at shutdown needs no network and a long job's drift is
/// measured. Rank 0 is the reference and probes nothing.
pub(crate) fn keep_in_sync(agent: &Agent) {
    let tracer = agent.tracer();
    let Some(ring) = tracer.ring().cloned() else {
        return;
    };
    if agent.rank() == 0 {
        ring.clock
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .reference = true;
        return;
    }
    let weak = crate::ext::AgentExt::downgrade(agent);
    let stop = agent.inner.life.stop.clone();
    agent.runtime().spawn(async move {
        loop {
            let Some(agent) = weak.upgrade() else { return };
            if let Ok(s) = probe(&agent, WINDOW, Duration::from_secs(1)).await {
                ring.clock
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .add(s, WINDOW);
            }
            drop(agent);
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(EVERY) => {}
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The trace clock follows CLOCK_MONOTONIC (within 1 ms over 50 ms).
    #[test]
    fn the_trace_clock_follows_the_monotonic_clock() {
        let (a, m) = (now_ns(), monotonic_ns());
        std::thread::sleep(Duration::from_millis(50));
        let (b, n) = (now_ns(), monotonic_ns());
        assert!(a.abs_diff(m) < 1_000_000, "{a} {m}");
        assert!(b.abs_diff(n) < 1_000_000, "{b} {n}");
    }
}
