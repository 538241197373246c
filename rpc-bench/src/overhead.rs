//! `overhead` and `trace-overhead`: what the wire protection, the failure detector and the
//! job's trace cost, each variant in fresh processes, variants alternated over rounds.

use std::time::Duration;

use anyhow::{bail, Result};
use rpc_core::{Agent, Config, WireProtection};
use serde_json::json;

use crate::calls::{echo_bench, latency, throughput};
use crate::variant::{protection_name, set_variant, trace_path, variant, Variant};
use crate::{cpu_seconds, cpu_seconds_here, emit, pair, raw_servers, runtime, stats};

/// What one group of `overhead` measured: the medians of its lines, by metric.
type Medians = std::collections::BTreeMap<String, f64>;

/// The CPU time both processes spend in `secs` seconds of idleness, in milliseconds per
/// second (heartbeats, timers, nothing else running).
fn idle_cpu(rt: &tokio::runtime::Runtime, agent: &Agent, secs: u64) -> Result<(f64, f64)> {
    let here = cpu_seconds_here();
    let peer = rt.block_on(agent.rpc_async(1u32, cpu_seconds, ()))?;
    std::thread::sleep(Duration::from_secs(secs));
    let here = cpu_seconds_here() - here;
    let peer = rt.block_on(agent.rpc_async(1u32, cpu_seconds, ()))? - peer;
    Ok((here * 1e3 / secs as f64, peer * 1e3 / secs as f64))
}

/// Measures one group of the current variant; emits its lines tagged with `tags`.
fn overhead_group(
    threads: usize,
    tags: &serde_json::Value,
    bulk: bool,
    idle: bool,
) -> Result<Medians> {
    let rt = runtime(threads)?;
    let (agent, _guard) = pair(&rt, threads)?;
    let (echo_port, _) = rt.block_on(agent.rpc_async(1u32, raw_servers, ()))?;
    let mut lines = latency(&rt, &agent, echo_port, threads > 0)?;
    let a = agent.clone();
    lines.push(rt.block_on(rt.spawn(async move { throughput(&a).await }))??);
    if bulk {
        for (name, bytes, iters) in [
            ("echo_1MiB_rtt_us", 1usize << 20, 200),
            ("echo_64MiB_rtt_us", 64 << 20, 12),
        ] {
            let a = agent.clone();
            lines.push(
                rt.block_on(rt.spawn(async move { echo_bench(&a, name, bytes, iters).await }))??,
            );
        }
    }
    if idle {
        let (here, peer) = idle_cpu(&rt, &agent, 3)?;
        lines.push(json!({ "metric": "idle_cpu_ms_per_s", "process": "bench", "median": here }));
        lines.push(json!({ "metric": "idle_cpu_ms_per_s", "process": "peer", "median": peer }));
    }
    let mut medians = Medians::new();
    for mut v in lines {
        let key = match v["process"].as_str() {
            Some(p) => format!("{}:{p}", v["metric"].as_str().unwrap_or("?")),
            None => v["metric"].as_str().unwrap_or("?").to_owned(),
        };
        if let Some(m) = v["median"].as_f64() {
            medians.insert(key, m);
        }
        if let (Some(o), Some(t)) = (v.as_object_mut(), tags.as_object()) {
            for (k, x) in t {
                o.insert(k.clone(), x.clone());
            }
        }
        emit(v);
    }
    let report = rt.block_on(agent.shutdown());
    if !report.is_clean() {
        bail!("shutdown not clean: {report:?}");
    }
    Ok(medians)
}

/// `overhead`: the wire protection's and the failure detector's cost, variants alternated
/// over `ROUNDS` rounds, each in a fresh group; then each variant's medians (over its rounds)
/// as ratios to its baseline's.
pub(crate) fn overhead(threads: usize, only_trace: bool) -> Result<()> {
    // The trace alone: more rounds, since each is short.
    let rounds = if only_trace { 6 } else { 3 };
    let base = variant();
    let protections = [
        WireProtection::Off,
        WireProtection::Mac,
        WireProtection::Encrypt,
    ];
    let detectors: [(&str, u64); 2] = [
        ("off", 0),
        (
            "on",
            Config::new()
                .heartbeat_interval
                .map_or(250, |d| d.as_millis() as u64),
        ),
    ];
    let mut by_protection: Vec<Vec<Medians>> = vec![Vec::new(); protections.len()];
    let mut by_detector: Vec<Vec<Medians>> = vec![Vec::new(); detectors.len()];
    let mut by_trace: Vec<Vec<Medians>> = vec![Vec::new(); 2];
    for round in 0..rounds {
        // Each order in turn: the second group of a round is often the slower one here.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let on = i == 1;
            set_variant(Variant { trace: on, ..base });
            let tags = json!({ "trace": on, "round": round });
            by_trace[i].push(overhead_group(threads, &tags, false, false)?);
            let _ = std::fs::remove_dir_all(rpc_core::trace::parts_dir(&trace_path()));
        }
        if only_trace {
            continue;
        }
        for (i, p) in protections.iter().enumerate() {
            set_variant(Variant {
                no_shm: true,
                protection: Some(*p),
                heartbeat_ms: base.heartbeat_ms,
                trace: false,
            });
            let tags = json!({
                "wire_protection": protection_name(Some(*p)),
                "bulk": "tcp",
                "round": round,
            });
            by_protection[i].push(overhead_group(threads, &tags, true, false)?);
        }
        for (i, (name, ms)) in detectors.iter().enumerate() {
            set_variant(Variant {
                heartbeat_ms: Some(*ms),
                ..base
            });
            let tags = json!({ "detector": name, "heartbeat_ms": ms, "round": round });
            by_detector[i].push(overhead_group(threads, &tags, false, true)?);
        }
    }
    set_variant(base);
    let merged = |runs: &[Medians]| -> Medians {
        let mut out = Medians::new();
        for key in runs
            .iter()
            .flat_map(|m| m.keys())
            .collect::<std::collections::BTreeSet<_>>()
        {
            let xs: Vec<f64> = runs.iter().filter_map(|m| m.get(key).copied()).collect();
            out.insert(key.clone(), stats(xs).median);
        }
        out
    };
    let ratios = |tags: serde_json::Value, m: &Medians, base: &Medians| {
        let mut v = tags;
        for (k, x) in m {
            if let Some(b) = base.get(k) {
                v[format!("{k}_ratio")] = json!(x / b);
                v[k.clone()] = json!(x);
            }
        }
        emit(v);
    };
    ratios(
        json!({
            "metric": "trace_cost",
            "trace": "on",
            "baseline": "off",
            "rounds": rounds,
        }),
        &merged(&by_trace[1]),
        &merged(&by_trace[0]),
    );
    if only_trace {
        return Ok(());
    }
    let off = merged(&by_protection[0]);
    for (i, p) in protections.iter().enumerate().skip(1) {
        ratios(
            json!({
                "metric": "wire_protection_cost",
                "wire_protection": protection_name(Some(*p)),
                "baseline": "off",
                "rounds": rounds,
            }),
            &merged(&by_protection[i]),
            &off,
        );
    }
    let no_detector = merged(&by_detector[0]);
    let with = merged(&by_detector[1]);
    ratios(
        json!({
            "metric": "failure_detector_cost",
            "detector": "on",
            "heartbeat_ms": detectors[1].1,
            "baseline": "off",
            "rounds": rounds,
        }),
        &with,
        &no_detector,
    );
    Ok(())
}
