//! Checks a trace against the Trace Event Format's rules for the phases this framework writes,
//! and against its own invariants: every call made whose callee traced links to exactly one
//! served span of the same function on another rank (TR-3), which lies inside the caller's
//! span on the aligned clock, within the clocks' error bound (TR-4), unless one of the two
//! ranks never read rank 0's clock (`unaligned_ranks`).

use std::collections::HashMap;

use serde::Serialize;
use serde_json::Value;

use super::file::TraceFile;

/// What a valid trace holds.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Validated {
    /// Events of every phase.
    pub events: usize,
    /// Calls made with a served span on the callee.
    pub linked_calls: usize,
    /// Calls made whose callee's part has no served span (its part missing, or the call
    /// never arrived).
    pub unlinked_calls: usize,
}

/// Checks `f` (see the module docs); `slack_us` is added to the clocks' error bound when
/// checking that a callee's span is inside its caller's.
pub fn validate(f: &TraceFile<'_>, slack_us: f64) -> Result<Validated, String> {
    let bound_us = f
        .rpc_trace("/clock_error_bound_ns")
        .and_then(Value::as_f64)
        .unwrap_or(0.0)
        / 1000.0;
    let unaligned = super::model::unaligned_ranks(f);
    let mut spans: HashMap<(&str, u64), (f64, f64, u64, &str)> = HashMap::new();
    let mut arrows: HashMap<(&str, u64), usize> = HashMap::new();
    for (i, e) in f.events.iter().enumerate() {
        let ph = &*e.ph;
        if ph.is_empty() {
            return Err(format!("event {i}: no ph"));
        }
        let bad = |what: &str| format!("event {i} ({ph}): {what}: {e:?}");
        let pid = e.pid.ok_or_else(|| bad("no pid"))?;
        let num = |v: Option<f64>, k: &str| v.ok_or_else(|| bad(k));
        match ph {
            "M" => {
                e.args.as_ref().ok_or_else(|| bad("no args"))?;
            }
            "X" => {
                let (ts, dur) = (num(e.ts, "ts")?, num(e.dur, "dur")?);
                e.tid.ok_or_else(|| bad("no tid"))?;
                if dur < 0.0 {
                    return Err(bad("negative dur"));
                }
                if let Some(id) = e.flow() {
                    if (spans.insert((&e.cat, id), (ts, ts + dur, pid, &e.name))).is_some() {
                        return Err(bad("a second span of this flow"));
                    }
                }
            }
            "i" => {
                num(e.ts, "ts")?;
                e.s.as_ref().ok_or_else(|| bad("no s"))?;
            }
            "s" | "f" => {
                num(e.ts, "ts")?;
                let id = e.id.ok_or_else(|| bad("no id"))?;
                if ph == "f" && e.bp.as_deref() != Some("e") {
                    return Err(bad("a flow's end binds to its enclosing slice (bp: e)"));
                }
                *arrows.entry((ph, id)).or_default() += 1;
            }
            other => return Err(bad(&format!("unexpected phase {other}"))),
        }
    }
    let mut out = Validated {
        events: f.events.len(),
        ..Validated::default()
    };
    for (&(cat, id), &(ts, end, pid, name)) in &spans {
        if cat != "call" {
            continue;
        }
        let Some(&(sts, send, spid, sname)) = spans.get(&("serve", id)) else {
            out.unlinked_calls += 1;
            continue;
        };
        let slack = bound_us + slack_us;
        let aligned = !unaligned.contains(&(pid as u32)) && !unaligned.contains(&(spid as u32));
        if sname != name || spid == pid {
            return Err(format!(
                "flow {id}: call {name} on {pid} served as {sname} on {spid}"
            ));
        }
        if aligned && (sts < ts - slack || send > end + slack) {
            return Err(format!(
                "flow {id} ({name}): the callee's span {sts:.1}..{send:.1} us on rank {spid} is \
                 outside its caller's {ts:.1}..{end:.1} us on rank {pid} (slack {slack:.1} us)"
            ));
        }
        if arrows.get(&("s", id)) != Some(&1) || arrows.get(&("f", id)) != Some(&1) {
            return Err(format!("flow {id} ({name}): its arrow's ends are missing"));
        }
        out.linked_calls += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    /// A call served "outside" its caller is an error on aligned clocks, and cannot be checked
    /// when the callee never read rank 0's clock.
    #[test]
    fn nesting_is_checked_only_between_aligned_ranks() {
        let trace = |unaligned: &[u32]| {
            let x = |pid: u32, cat: &str, ts: f64| {
                json!({"ph": "X", "pid": pid, "tid": 1, "name": "f", "cat": cat, "ts": ts,
                       "dur": 10.0, "args": {"flow": 7}})
            };
            let arrow = |ph: &str| json!({"ph": ph, "bp": "e", "id": 7, "pid": 0, "ts": 0.0});
            json!({"traceEvents": [x(0, "call", 0.0), x(1, "serve", 5e6), arrow("s"),
                                   arrow("f")],
                   "otherData": {"rpc_trace": {"clock_error_bound_ns": 1000,
                                               "unaligned_ranks": unaligned}}})
        };
        let (aligned, one_unaligned) = (trace(&[]), trace(&[1]));
        let file = |v| super::TraceFile::from_value(v).unwrap();
        let err = super::validate(&file(&aligned), 0.0).unwrap_err();
        assert!(err.contains("outside its caller's"), "{err}");
        let ok = super::validate(&file(&one_unaligned), 0.0).unwrap();
        assert_eq!((ok.linked_calls, ok.unlinked_calls), (1, 0));
    }
}
