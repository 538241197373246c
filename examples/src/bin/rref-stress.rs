//! A seeded random program over remote references across worker processes.
//!
//! `cargo run --release -p examples --bin rref-stress -- --workers 4 --ops 20000 --seed S
//! [--jitter-us N]` starts the workers on 127.0.0.1 (this process is rank 0 and drives the
//! program), runs `--ops` random operations: create (`remote`), share (owner→user, user→owner,
//! user→user; in arguments, in results, nested in structs), read (`to_here`), method call,
//! drop. Every value carries its id and a payload derived from it, checked on every read.
//! Then everything is dropped, the workers wait for quiescence, and one JSON line reports
//! `ops`, `values_created`, `values_deleted`, `owner_values_left`, `user_refs_left`,
//! `pending_left`, `use_after_delete`, `wrong_values`. Correct: every created value deleted,
//! nothing left, both error counts zero. The exit status is non-zero otherwise.
//!
//! `--kill-rank R --kill-at K` kills worker R (SIGKILL) before operation K: once the driver's
//! failure detector has declared it failed, the handles it held and the handles of values it
//! owned are forgotten (the latter dropped by their holders), and the program goes on among
//! the survivors. The counters are then the survivors': every value they own must still be
//! deleted once nothing live refers to it (the references the killed worker held are released
//! by their owners), and `lost_handles` says how many handles went with it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rpc_core::{remote, Agent, BoxError, CallContext, Registry};
use rref::RRef;
use serde::{Deserialize, Serialize};

static CREATED: AtomicU64 = AtomicU64::new(0);
static DELETED: AtomicU64 = AtomicU64::new(0);

/// Counts an original value made by a constructor; copies carry none.
struct Original;
impl Drop for Original {
    fn drop(&mut self) {
        DELETED.fetch_add(1, Ordering::Relaxed);
    }
}

/// A value that can be checked: its payload is a function of its id.
#[derive(Serialize, Deserialize)]
struct Val {
    id: u64,
    payload: Vec<u64>,
    /// Held for its `Drop` (counts deletions of originals).
    #[serde(skip)]
    #[allow(dead_code)]
    original: Option<Original>,
}

impl Clone for Val {
    fn clone(&self) -> Self {
        Self {
            id: self.id,
            payload: self.payload.clone(),
            original: None,
        }
    }
}

fn payload_of(id: u64) -> Vec<u64> {
    (0..(id % 5 + 1)).map(|i| id.rotate_left(7) ^ i).collect()
}

/// Outcome of a checked read.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
enum Check {
    Ok,
    Wrong,
    Missing,
}

fn check(v: Result<Val, rref::RRefError>, expect: u64) -> Check {
    match v {
        Ok(v) if v.id == expect && v.payload == payload_of(expect) => Check::Ok,
        Ok(_) => Check::Wrong,
        Err(e) => {
            eprintln!(
                "read of value {expect} failed: {}",
                rpc_core::error_chain(&e)
            );
            Check::Missing
        }
    }
}

/// Constructor.
#[remote]
async fn make_val(_ctx: CallContext, id: u64) -> Result<Val, BoxError> {
    CREATED.fetch_add(1, Ordering::Relaxed);
    Ok(Val {
        id,
        payload: payload_of(id),
        original: Some(Original),
    })
}

/// Method: the value's id, read on the owner.
#[remote]
async fn val_id(_ctx: CallContext, this: RRef<Val>) -> Result<u64, BoxError> {
    let v = this.local_value().await?;
    let g = v.lock().await;
    if g.payload != payload_of(g.id) {
        return Err("corrupt payload".into());
    }
    Ok(g.id)
}

/// This process's handles, by handle id.
fn handles() -> &'static Mutex<HashMap<u64, RRef<Val>>> {
    static H: OnceLock<Mutex<HashMap<u64, RRef<Val>>>> = OnceLock::new();
    H.get_or_init(Default::default)
}

fn get(hid: u64) -> Result<RRef<Val>, BoxError> {
    handles()
        .lock()
        .unwrap()
        .get(&hid)
        .cloned()
        .ok_or_else(|| format!("no handle {hid} here").into())
}

/// Create a value on `owner`, keep the handle as `hid`.
#[remote]
async fn op_create(ctx: CallContext, hid: u64, owner: u32, id: u64) -> Result<(), BoxError> {
    let r = rref::remote(ctx.agent(), owner, make_val, (id,))?;
    handles().lock().unwrap().insert(hid, r);
    Ok(())
}

/// Receive handles (in arguments, possibly several nested in a struct).
#[derive(Serialize, Deserialize)]
struct Parcel {
    hids: Vec<u64>,
    refs: Vec<RRef<Val>>,
}

#[remote]
async fn accept(_ctx: CallContext, p: Parcel) -> Result<(), BoxError> {
    let mut h = handles().lock().unwrap();
    for (hid, r) in p.hids.into_iter().zip(p.refs) {
        h.insert(hid, r);
    }
    Ok(())
}

/// Send handles `hids` to worker `to`, where they become `new_hids`.
#[remote]
async fn op_share(
    ctx: CallContext,
    hids: Vec<u64>,
    to: u32,
    new_hids: Vec<u64>,
) -> Result<(), BoxError> {
    let refs = hids
        .iter()
        .map(|h| get(*h))
        .collect::<Result<Vec<_>, _>>()?;
    ctx.agent()
        .rpc_async(
            to,
            accept,
            (Parcel {
                hids: new_hids,
                refs,
            },),
        )
        .await?;
    Ok(())
}

/// Hand out handle `hid` (a reference in a result).
#[remote]
async fn hand_over(_ctx: CallContext, hid: u64) -> Result<RRef<Val>, BoxError> {
    get(hid)
}

/// Fetch handle `hid` from worker `from`; keep it as `new_hid`.
#[remote]
async fn op_fetch(ctx: CallContext, from: u32, hid: u64, new_hid: u64) -> Result<(), BoxError> {
    let r = ctx.agent().rpc_async(from, hand_over, (hid,)).await?;
    handles().lock().unwrap().insert(new_hid, r);
    Ok(())
}

/// Read handle `hid` here and check it holds value `expect`.
#[remote]
async fn op_read(_ctx: CallContext, hid: u64, expect: u64) -> Result<Check, BoxError> {
    let r = get(hid)?;
    Ok(check(r.to_here().await, expect))
}

/// Call a method on the owner through handle `hid`.
#[remote]
async fn op_method(_ctx: CallContext, hid: u64, expect: u64) -> Result<Check, BoxError> {
    let r = get(hid)?;
    Ok(match r.rpc_async(val_id, ()).await {
        Ok(id) if id == expect => Check::Ok,
        Ok(_) => Check::Wrong,
        Err(e) => {
            eprintln!(
                "method on value {expect} failed: {}",
                rpc_core::error_chain(&e)
            );
            Check::Missing
        }
    })
}

/// Drop handle `hid`.
#[remote]
async fn op_drop(_ctx: CallContext, hid: u64) -> Result<(), BoxError> {
    let r = handles().lock().unwrap().remove(&hid);
    drop(r);
    Ok(())
}

/// Drop every handle of this process.
#[remote]
async fn op_drop_all(_ctx: CallContext) -> Result<usize, BoxError> {
    let all: Vec<_> = handles().lock().unwrap().drain().collect();
    Ok(all.len())
}

/// Counters: (created, deleted, owner values, user refs, pending children + confirmations +
/// messages in flight).
#[remote]
async fn stats(ctx: CallContext) -> Result<(u64, u64, usize, usize, usize), BoxError> {
    let d = rref::debug_info(ctx.agent());
    Ok((
        CREATED.load(Ordering::Relaxed),
        DELETED.load(Ordering::Relaxed),
        d.owner_values,
        d.user_refs,
        d.pending_children + d.pending_confirmations + d.messages_in_flight,
    ))
}

/// Sets this worker's protocol jitter.
#[remote]
async fn set_jitter(ctx: CallContext, us: u64) -> Result<(), BoxError> {
    rref::set_message_jitter(ctx.agent(), Duration::from_micros(us));
    Ok(())
}

fn registry() -> Result<Registry> {
    let b = Registry::builder()
        .register(make_val)?
        .register(val_id)?
        .register(op_create)?
        .register(accept)?
        .register(op_share)?
        .register(hand_over)?
        .register(op_fetch)?
        .register(op_read)?
        .register(op_method)?
        .register(op_drop)?
        .register(op_drop_all)?
        .register(stats)?
        .register(set_jitter)?;
    Ok(rref::install(b)?.build())
}

struct Args {
    workers: u32,
    ops: u64,
    seed: u64,
    jitter_us: u64,
    /// `(rank, before operation)`.
    kill: Option<(u32, u64)>,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        workers: 4,
        ops: 20_000,
        seed: 1,
        jitter_us: 0,
        kill: None,
    };
    let (mut kill_rank, mut kill_at) = (None, None);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<u64> {
            let v = it.next().with_context(|| format!("{name} needs a value"))?;
            v.parse()
                .with_context(|| format!("{name} {v:?} is not a number"))
        };
        match flag.as_str() {
            "--workers" => a.workers = value("--workers")? as u32,
            "--ops" => a.ops = value("--ops")?,
            "--seed" => a.seed = value("--seed")?,
            "--jitter-us" => a.jitter_us = value("--jitter-us")?,
            "--kill-rank" => kill_rank = Some(value("--kill-rank")? as u32),
            "--kill-at" => kill_at = Some(value("--kill-at")?),
            "-h" | "--help" => {
                println!(
                    "rref-stress: random remote-reference traffic among worker processes (create, \
fork, fetch, drop; optional message jitter and a killed worker), then a check that every \
value was released everywhere.\n\nusage: rref-stress [--workers N] [--ops N] [--seed S] \
[--jitter-us N] [--kill-rank R --kill-at K]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown flag {other:?} (try --help)"),
        }
    }
    if a.workers < 2 {
        bail!("--workers must be at least 2");
    }
    a.kill = match (kill_rank, kill_at) {
        (None, None) => None,
        (Some(r), Some(k)) if (1..a.workers).contains(&r) => Some((r, k)),
        (Some(r), Some(_)) => bail!("--kill-rank {r} must name a worker, 1..{}", a.workers),
        _ => bail!("--kill-rank and --kill-at go together"),
    };
    if a.kill.is_some() && a.workers < 3 {
        bail!("--kill-rank needs --workers 3 or more (two survivors besides the driver's rank)");
    }
    Ok(a)
}

fn main() -> Result<()> {
    examples::init_tracing();
    let rt = examples::runtime()?;
    if examples::is_worker() {
        return rt.block_on(examples::serve_until_shutdown(
            registry()?,
            Duration::from_secs(120),
        ));
    }
    let args = parse_args()?;
    let mut workers = examples::Workers::spawn(args.workers)?;
    let summary = rt.block_on(async {
        let cfg = workers.rank0_config("driver", Duration::from_secs(120));
        let agent = rpc_core::init(cfg, registry()?).await?;
        let summary = drive(&agent, &args, &mut workers).await;
        let report = agent.shutdown().await;
        rref::clear_owned(&agent);
        let summary = summary?;
        anyhow::ensure!(report.is_clean(), "driver shutdown: {report:?}");
        Ok::<_, anyhow::Error>(summary)
    })?;
    if args.kill.is_some() {
        // The survivors report the lost worker in their exit status; only their exit counts.
        workers.wait_all(Duration::from_secs(60))?;
    } else {
        workers.wait_success(Duration::from_secs(60))?;
    }
    println!("{summary}");
    let ok = summary["values_created"] == summary["values_deleted"]
        && summary["owner_values_left"] == 0
        && summary["user_refs_left"] == 0
        && summary["pending_left"] == 0
        && summary["use_after_delete"] == 0
        && summary["wrong_values"] == 0;
    if !ok {
        bail!("the protocol leaked or lost values (see the JSON line)");
    }
    Ok(())
}

/// Kills worker `victim`, waits for the driver to declare it failed, and forgets (dropping
/// where they live) the handles that went with it; returns how many.
async fn kill_worker(
    agent: &Agent,
    workers: &mut examples::Workers,
    victim: u32,
    held: &mut Vec<(u64, u32, u64)>,
    owner_of: &HashMap<u64, u32>,
) -> Result<usize> {
    workers.kill(victim)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !agent.failed_workers().iter().any(|f| f.rank == victim) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "worker {victim} was killed but not declared failed within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let before = held.len();
    let mut kept = Vec::with_capacity(held.len());
    for h in held.drain(..) {
        let (hid, by, val) = h;
        if by == victim {
            continue; // gone with its holder
        }
        if owner_of.get(&val) == Some(&victim) {
            // The value is gone; its holder drops the reference (nothing to tell the owner).
            agent.rpc_async(by, op_drop, (hid,)).await?;
            continue;
        }
        kept.push(h);
    }
    *held = kept;
    Ok(before - held.len())
}

async fn drive(
    agent: &Agent,
    args: &Args,
    workers: &mut examples::Workers,
) -> Result<serde_json::Value> {
    let n = args.workers;
    for w in 0..n {
        agent.rpc_async(w, set_jitter, (args.jitter_us,)).await?;
    }
    // The workers still running (all but a killed one).
    let mut live: Vec<u32> = (0..n).collect();
    let mut owner_of: HashMap<u64, u32> = HashMap::new();
    let mut lost_handles = 0;
    let mut seed = args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut rnd = move |k: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % k
    };
    // hid -> (holder, value id)
    let mut held: Vec<(u64, u32, u64)> = Vec::new();
    let (mut next_hid, mut next_val) = (1u64, 1u64);
    let (mut wrong, mut missing) = (0u64, 0u64);
    let mut counts: HashMap<&str, u64> = HashMap::new();
    let start = Instant::now();
    for op in 0..args.ops {
        if let Some((victim, _)) = args.kill.filter(|k| k.1 == op) {
            lost_handles = kill_worker(agent, workers, victim, &mut held, &owner_of).await?;
            live.retain(|&w| w != victim);
        }
        let m = live.len() as u64;
        let choice = if held.is_empty() { 0 } else { rnd(100) };
        let kind = match choice {
            0..=19 => "create",
            20..=39 => "share",
            40..=49 => "fetch",
            50..=64 => "read",
            65..=74 => "method",
            _ => "drop",
        };
        *counts.entry(kind).or_default() += 1;
        match kind {
            "create" => {
                let (by, owner) = (live[rnd(m) as usize], live[rnd(m) as usize]);
                agent
                    .rpc_async(by, op_create, (next_hid, owner, next_val))
                    .await?;
                owner_of.insert(next_val, owner);
                held.push((next_hid, by, next_val));
                next_hid += 1;
                next_val += 1;
            }
            "share" => {
                // One to three handles of one holder, nested in a struct, to any worker.
                let (_, by, _) = held[rnd(held.len() as u64) as usize];
                let mine: Vec<_> = held.iter().filter(|h| h.1 == by).cloned().collect();
                let k = 1 + rnd(3.min(mine.len() as u64)) as usize;
                let picked: Vec<_> = (0..k)
                    .map(|_| mine[rnd(mine.len() as u64) as usize])
                    .collect();
                let to = live[rnd(m) as usize];
                let new: Vec<u64> = (0..k as u64).map(|i| next_hid + i).collect();
                next_hid += k as u64;
                agent
                    .rpc_async(
                        by,
                        op_share,
                        (picked.iter().map(|p| p.0).collect(), to, new.clone()),
                    )
                    .await?;
                for (p, h) in picked.iter().zip(new) {
                    held.push((h, to, p.2));
                }
            }
            "fetch" => {
                let (hid, from, val) = held[rnd(held.len() as u64) as usize];
                let by = live[rnd(m) as usize];
                agent.rpc_async(by, op_fetch, (from, hid, next_hid)).await?;
                held.push((next_hid, by, val));
                next_hid += 1;
            }
            "read" | "method" => {
                let (hid, by, val) = held[rnd(held.len() as u64) as usize];
                let c = if kind == "read" {
                    agent.rpc_async(by, op_read, (hid, val)).await?
                } else {
                    agent.rpc_async(by, op_method, (hid, val)).await?
                };
                match c {
                    Check::Ok => {}
                    Check::Wrong => wrong += 1,
                    Check::Missing => missing += 1,
                }
            }
            _ => {
                let i = rnd(held.len() as u64) as usize;
                let (hid, by, _) = held.swap_remove(i);
                agent.rpc_async(by, op_drop, (hid,)).await?;
            }
        }
    }
    let program_s = start.elapsed().as_secs_f64();
    for &w in &live {
        agent.rpc_async(w, op_drop_all, ()).await?;
    }
    // Quiescence: every worker idle and every created value deleted (bounded wait).
    let deadline = Instant::now() + Duration::from_secs(120);
    let totals = loop {
        let mut t = (0u64, 0u64, 0usize, 0usize, 0usize);
        for &w in &live {
            let s = agent.rpc_async(w, stats, ()).await?;
            t = (t.0 + s.0, t.1 + s.1, t.2 + s.2, t.3 + s.3, t.4 + s.4);
        }
        if (t.0 == t.1 && t.2 == 0 && t.3 == 0 && t.4 == 0) || Instant::now() > deadline {
            break t;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    Ok(serde_json::json!({
        "ops": args.ops,
        "workers": n,
        "seed": args.seed,
        "jitter_us": args.jitter_us,
        "op_counts": counts,
        "program_s": program_s,
        "values_created": totals.0,
        "values_deleted": totals.1,
        "owner_values_left": totals.2,
        "user_refs_left": totals.3,
        "pending_left": totals.4,
        "use_after_delete": missing,
        "wrong_values": wrong,
        "killed": args.kill.map(|k| k.0),
        "lost_handles": lost_handles,
    }))
}
