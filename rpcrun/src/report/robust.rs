//! Any file that parses as a trace is reported, checked and drawn without a panic or a hang:
//! random traces (phases, categories, ranks, times far apart or negative, negative lengths,
//! flows that link nothing, step numbers past `u64`), each through every `rpctrace` command.
//! A window 1e300 us wide once kept `svg` drawing ticks forever.

use std::time::Duration;

use serde_json::{json, Value};

use super::{report, svg, validate, Trace, TraceFile};

/// A small deterministic generator (xorshift), so a failure names its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn pick<'a, T>(&mut self, from: &'a [T]) -> &'a T {
        &from[(self.next() % from.len() as u64) as usize]
    }
}

/// A random trace of up to 300 events.
fn random_trace(seed: u64) -> Value {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let n = *r.pick(&[0, 1, 5, 40, 300]);
    let times = [0.0, 1.5, -1e6, 1e6, 1e300, -1e300, 37.0, 1e12];
    let events: Vec<Value> = (0..n)
        .map(|_| {
            let ph = *r.pick(&["X", "X", "X", "M", "s", "f", "i"]);
            let mut e = json!({
                "ph": ph,
                "name": r.pick(&["step", "forward", "process_name", "thread_name", "a"]),
                "cat": r.pick(&["step", "call", "serve", "compute", "collective", "pipeline"]),
                "pid": r.pick(&[0u64, 1, 2, 3, 1 << 40, u64::MAX]),
                "tid": r.pick(&[1u64, 9000]),
            });
            if r.next() % 10 != 0 {
                e["ts"] = json!(r.pick(&times) + (r.next() % 100) as f64);
            }
            if ph == "X" && r.next() % 20 != 0 {
                e["dur"] = json!(*r.pick(&[0.0, -5.0, 10.0, 1e308, 2500.0]));
            }
            let mut args = json!({});
            if r.next() % 2 == 0 {
                args["flow"] = json!(*r.pick(&[1u64, 2, 3, u64::MAX]));
            }
            if r.next() % 3 == 0 {
                let details = [
                    "step 3",
                    "trainer 1 step 2",
                    "step ",
                    "step 99999999999999999999",
                ];
                args["detail"] = json!(r.pick(&details));
            }
            if ph == "M" {
                args["name"] = json!("w");
            }
            e["args"] = args;
            e
        })
        .collect();
    let other = r
        .pick(&[
            json!({}),
            json!({"rpc_trace": {"missing_ranks": [1], "clock_error_bound_ns": 5}}),
            json!({"rpc_trace": {"unaligned_ranks": [0, 1],
                "missing_by_start": [{"restart": 1, "ranks": [2]}]}}),
            json!({"rpc_trace": {"clock": {"error_bound_ns": u64::MAX}, "rank": 1}}),
        ])
        .clone();
    json!({"traceEvents": events, "otherData": other})
}

#[test]
fn random_traces_are_reported_checked_and_drawn() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for seed in 0..300u64 {
            let v = random_trace(seed);
            let f = TraceFile::from_value(&v).expect("a trace");
            if let Ok(t) = Trace::from_file(&f) {
                let r = report(&t);
                let _ = (r.text(), serde_json::to_string(&r));
            }
            let _ = validate(&f, 0.0);
            for (first, steps) in [(0, 3), (2, 1), (1000, 0)] {
                let _ = svg(&f, first, steps);
            }
            let _ = tx.send(seed);
        }
    });
    let mut done = 0;
    while done < 300 {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(_) => done += 1,
            Err(e) => {
                panic!("the trace of seed {done} did not finish within 60 s, or panicked: {e}")
            }
        }
    }
}
