//! A trace drawn as an SVG timeline (`rpctrace svg`): one row per worker and track, a bar per
//! span coloured by category, a line per call from the caller's span to the callee's, a time
//! axis. For the docs and for a quick look without a trace viewer.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use super::file::{Event, TraceFile};
use super::steps::{pair, step_number, StepSpan};

const WIDTH: f64 = 1000.0;
const LABEL: f64 = 190.0;
const ROW: f64 = 16.0;
const TOP: f64 = 24.0;

fn colour(cat: &str) -> &'static str {
    match cat {
        "call" => "#6baed6",
        "serve" => "#fd8d3c",
        "transfer" => "#9e9ac8",
        "compute" => "#31a354",
        "collective" => "#e6550d",
        "optimizer" => "#756bb1",
        "pipeline" => "#74c476",
        "checkpoint" => "#636363",
        "step" => "#bdbdbd",
        _ => "#969696",
    }
}

/// The window to draw: `steps` steps from the `first`-th (0-based), or the whole trace if it
/// has no `step` span. The step spans of several ranks are paired as the report pairs them
/// (`steps.rs`: the replicas of data parallelism each record theirs).
fn window(events: &[Event<'_>], first: usize, steps: usize) -> (f64, f64) {
    let spans: Vec<StepSpan> = (events.iter())
        .filter(|e| e.ph == "X" && e.cat == "step")
        .filter_map(|e| {
            let (ts, dur) = (e.ts?, e.dur?);
            Some(StepSpan {
                rank: e.pid.unwrap_or(0),
                start: ts,
                end: ts + dur,
                number: e.detail().and_then(step_number),
            })
        })
        .collect();
    let paired = pair(&spans);
    if paired.is_empty() {
        let ts = events.iter().filter_map(|e| e.ts);
        let (lo, hi) = ts.fold((f64::MAX, f64::MIN), |(a, b), t| (a.min(t), b.max(t)));
        return (lo, hi.max(lo + 1.0));
    }
    let a = first.min(paired.len() - 1);
    let b = (a + steps.max(1) - 1).min(paired.len() - 1);
    let lo = (paired[a].iter()).fold(f64::MAX, |m, &i| m.min(spans[i].start));
    let hi = (paired[a..=b].iter().flatten()).fold(f64::MIN, |m, &i| m.max(spans[i].end));
    (lo, hi.max(lo + 1.0))
}

/// Draws `steps` steps of the trace `f` from its `first`-th step.
pub fn svg(f: &TraceFile<'_>, first: usize, steps: usize) -> String {
    let events = &f.events;
    let (lo, hi) = window(events, first, steps);
    let x = |t: f64| LABEL + (t - lo) / (hi - lo) * WIDTH;
    let visible = |e: &Event<'_>| {
        let (ts, dur) = (e.ts.unwrap_or(0.0), e.dur.unwrap_or(0.0));
        ts <= hi && ts + dur >= lo
    };
    let mut names: HashMap<(u64, u64), String> = HashMap::new();
    let mut procs: HashMap<u64, String> = HashMap::new();
    let key = |e: &Event<'_>| (e.pid.unwrap_or(0), e.tid.unwrap_or(0));
    for e in events.iter().filter(|e| e.ph == "M") {
        match (&*e.name, e.arg_name()) {
            ("process_name", Some(n)) => drop(procs.insert(e.pid.unwrap_or(0), n.to_owned())),
            ("thread_name", Some(n)) => {
                names.insert(key(e), n.to_owned());
            }
            _ => {}
        }
    }
    let mut rows: BTreeMap<(u64, u64), usize> = BTreeMap::new();
    for e in events.iter().filter(|e| e.ph == "X" && visible(e)) {
        rows.insert(key(e), 0);
    }
    for (i, r) in rows.values_mut().enumerate() {
        *r = i;
    }
    let y = |key: (u64, u64)| rows.get(&key).map(|&i| TOP + i as f64 * ROW);
    let height = TOP + rows.len() as f64 * ROW + 30.0;
    let mut o = String::new();
    let _ = writeln!(
        o,
        concat!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" "#,
            r#"font-family="sans-serif" font-size="10">"#
        ),
        LABEL + WIDTH + 10.0,
        height = height
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (&(pid, tid), &i) in &rows {
        let label = format!(
            "{} {}",
            procs.get(&pid).map_or("?", String::as_str),
            names.get(&(pid, tid)).map_or("", String::as_str)
        );
        let yy = TOP + i as f64 * ROW;
        let _ = writeln!(
            o,
            r#"<text x="4" y="{}">{}</text>"#,
            yy + 11.0,
            escape(&label)
        );
        let _ = writeln!(
            o,
            r##"<line x1="{LABEL}" x2="{}" y1="{}" y2="{}" stroke="#eeeeee"/>"##,
            LABEL + WIDTH,
            yy + ROW,
            yy + ROW
        );
    }
    for e in events.iter().filter(|e| e.ph == "X" && visible(e)) {
        let Some(yy) = y(key(e)) else { continue };
        let (ts, dur) = (e.ts.unwrap_or(0.0), e.dur.unwrap_or(0.0));
        let (x0, x1) = (x(ts.max(lo)), x((ts + dur).min(hi)));
        let (cat, name) = (&*e.cat, &*e.name);
        let _ = writeln!(
            o,
            concat!(
                r#"<rect x="{x0:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}">"#,
                r#"<title>{} ({cat}) {:.3} ms</title></rect>"#
            ),
            yy + 2.0,
            (x1 - x0).max(0.5),
            ROW - 4.0,
            colour(cat),
            escape(name),
            dur / 1000.0,
            x0 = x0,
            cat = cat
        );
    }
    // Calls: from the caller's start to the callee's.
    let mut starts: HashMap<u64, (f64, (u64, u64))> = HashMap::new();
    for e in events.iter().filter(|e| e.ph == "s") {
        if let (Some(id), Some(ts)) = (e.id, e.ts) {
            starts.insert(id, (ts, key(e)));
        }
    }
    for e in events.iter().filter(|e| e.ph == "f") {
        let (Some(id), Some(ts)) = (e.id, e.ts) else {
            continue;
        };
        let Some(&(ts0, from)) = starts.get(&id) else {
            continue;
        };
        if ts0 < lo || ts > hi {
            continue;
        }
        if let (Some(y0), Some(y1)) = (y(from), y(key(e))) {
            let _ = writeln!(
                o,
                concat!(
                    r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" "#,
                    r##"stroke="#444444" stroke-width="0.6" opacity="0.6"/>"##
                ),
                x(ts0),
                y0 + ROW / 2.0,
                x(ts),
                y1 + ROW / 2.0
            );
        }
    }
    // The axis: time from the window's start, at most a dozen ticks.
    let span_ms = (hi - lo) / 1000.0;
    let step = tick(span_ms);
    let base = height - 22.0;
    let ticks = if step > 0.0 {
        (span_ms / step) as usize
    } else {
        0
    };
    for i in 0..=ticks.min(MAX_TICKS) {
        let t = i as f64 * step;
        let xx = x(lo + t * 1000.0);
        let _ = writeln!(
            o,
            r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="{TOP}" y2="{base}" stroke="#dddddd"/>"##
        );
        let _ = writeln!(
            o,
            r#"<text x="{xx:.1}" y="{}" text-anchor="middle">{}</text>"#,
            base + 12.0,
            tick_label(t, step)
        );
    }
    let mut lx = LABEL;
    for cat in [
        "step",
        "call",
        "serve",
        "transfer",
        "compute",
        "collective",
        "optimizer",
        "pipeline",
        "checkpoint",
    ] {
        let _ = writeln!(
            o,
            concat!(
                r#"<rect x="{lx}" y="4" width="10" height="10" fill="{}"/>"#,
                r#"<text x="{}" y="13">{cat}</text>"#
            ),
            colour(cat),
            lx + 13.0,
            lx = lx,
            cat = cat
        );
        lx += 75.0;
    }
    o.push_str("</svg>\n");
    o
}

/// The most ticks the axis has.
const MAX_TICKS: usize = 12;

/// The axis's tick for a window `span_ms` wide: 1, 2 or 5 times a power of ten, the smallest
/// with at most [`MAX_TICKS`] ticks past the first (0 for an empty or unbounded window).
fn tick(span_ms: f64) -> f64 {
    if !(span_ms.is_finite() && span_ms > 0.0) {
        return 0.0;
    }
    let least = span_ms / MAX_TICKS as f64;
    let power = 10f64.powf(least.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&s| s >= least)
        .unwrap_or(10.0 * power)
}

/// A tick's label: milliseconds with the tick's precision, seconds from 1 s ticks on.
fn tick_label(t_ms: f64, step_ms: f64) -> String {
    match step_ms {
        s if s >= 1000.0 && t_ms < 1e12 => format!("{:.0} s", t_ms / 1000.0),
        s if s >= 1000.0 => format!("{:.1e} s", t_ms / 1000.0),
        s if s >= 1.0 => format!("{t_ms:.0} ms"),
        s => {
            let places = (-s.log10().floor()).clamp(0.0, 9.0) as usize;
            format!("{t_ms:.places$} ms")
        }
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two replicas that each record their steps: two steps drawn are both replicas' first
    /// two (the window took the first two step spans by start, both of step 0, and left
    /// step 1 out).
    #[test]
    fn the_window_counts_the_replicas_steps_together() {
        let mut events = Vec::new();
        for r in 0..2 {
            for k in 0..3 {
                let t0 = 100.0 * f64::from(k);
                events.push(serde_json::json!({"ph": "X", "cat": "step", "name": "step",
                    "pid": r, "tid": 1, "ts": t0, "dur": 90.0}));
                events.push(serde_json::json!({"ph": "X", "cat": "compute",
                    "name": format!("work-{k}"), "pid": r, "tid": 2, "ts": t0 + 10.0,
                    "dur": 50.0}));
            }
        }
        let v = serde_json::json!({ "traceEvents": events });
        let f = TraceFile::from_value(&v).unwrap();
        let picture = svg(&f, 0, 2);
        assert!(
            picture.contains("work-0") && picture.contains("work-1"),
            "{picture}"
        );
        assert!(!picture.contains("work-2"), "{picture}");
        assert!(svg(&f, 2, 5).contains("work-2"));
    }

    /// The axis has a dozen ticks or fewer whatever the window's width: two ranks on their
    /// own clocks, 30 days apart (processes started on hosts booted a month apart, never
    /// aligned), in a trace without steps. The axis stopped growing its tick at 1000 ms:
    /// 2.6 million ticks, a 300 MB picture; with a wider window it never ended.
    #[test]
    fn the_axis_has_a_dozen_ticks_whatever_the_width() {
        for apart_us in [30.0 * 86_400e6, 1e300, 0.3, 0.0] {
            let events: Vec<_> = [0.0, apart_us]
                .into_iter()
                .enumerate()
                .map(|(r, ts)| {
                    serde_json::json!({"ph": "X", "cat": "compute", "name": "work",
                        "pid": r, "tid": 1, "ts": ts, "dur": 10.0})
                })
                .collect();
            let v = serde_json::json!({ "traceEvents": events });
            let picture = svg(&TraceFile::from_value(&v).unwrap(), 0, 3);
            let ticks = picture.matches(r##"stroke="#dddddd""##).count();
            assert!((1..=13).contains(&ticks), "{apart_us}: {ticks} ticks");
            assert!(!picture.contains("00000000000"), "{picture}");
        }
    }
}
